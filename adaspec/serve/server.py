"""``adaspec serve``'s lifecycle: listen, start the runtime, serve, drain, stop.

The socket opens first, so ``/health`` answers "starting" while the models load, the graphs
are prepared and the costs calibrated. SIGTERM or SIGINT drains: new requests get 503, those in
flight run to their end, then the server closes and the runtime stops; a second signal cancels
what is still in flight, and after a grace cuts the answers no client reads. A runtime fault
ends the server with the fault's one line.
"""

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import structlog
from aiohttp import web

from adaspec.errors import AdaspecError, ConfigError, printable
from adaspec.models.tokenizer import Tokenizer
from adaspec.runtime.engine import Runtime
from adaspec.runtime.events.outputs import ObserverFile
from adaspec.serve.app import DRAINING, FAILED, READY, CompletionServer, ServeSettings

SHUTDOWN_GRACE_S = 2.0
PORT_ERRORS = (errno.EADDRINUSE, errno.EACCES)
"""Listen errors that are the port's; any other is the host's (not an address of this host)."""


class ServeFailed(AdaspecError):
    """The runtime stopped under the server (a fault while serving)."""


def json_logger(stream: TextIO | None) -> Any:
    """One JSON object per line on ``stream``: the lifecycle and one line per request. A
    stream that is closed, full, or whose reader went away drops the lines, not the answers
    (the exit status still says how the server ended)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(ObserverFile(stream, owned=False)),  # type: ignore[arg-type]
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,  # a bug's traceback, in its line
                    structlog.processors.JSONRenderer()])


class OneLine(logging.Handler):
    """aiohttp's own reports (a malformed request line, a bad Content-Length) as one JSON
    line each, without the traceback it would print for what a client sent."""

    def __init__(self, log: Any) -> None:
        super().__init__(logging.INFO)
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage().strip().splitlines()
        self._log.warning("http_error", message=message[0] if message else "",
                          error=None if error is None else one_line(error))


def one_line(error: BaseException) -> str:
    """An error as one short line: aiohttp's reasons come on lines after the first."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return printable(text if len(text) <= 300 else text[:299] + "\u2026")


def loop_errors(log: Any) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """The loop's exception handler while serving: an OS error the loop meets on its own
    (out of file descriptors at ``accept``: the host's limit, not adaspec's bug) is one
    JSON line; anything else keeps asyncio's report, traceback and all."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError):
            message = str(context.get("message", "")).strip().splitlines()
            log.warning("loop_error", message=message[0] if message else "",
                        error=one_line(error))
            return
        loop.default_exception_handler(context)

    return handle


@contextmanager
def aiohttp_logs_as_lines(log: Any) -> Iterator[None]:
    logger = logging.getLogger("aiohttp.server")
    handler, propagate = OneLine(log), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


class Signals:
    """SIGTERM and SIGINT as events on the loop. The first asks for a drain (``drain``); one
    during the start abandons it. A second asks rank 0, once started, to end what is in
    flight (``now``); anywhere else it ends the process at once, after its log line, with the
    status a shell gives the first signal (128 + its number), as every command does: a
    follower's requests are rank 0's, and an abandoned start has none."""

    def __init__(self, log: Any, *, rank: int = 0) -> None:
        self.drain = asyncio.Event()
        self.now = asyncio.Event()
        self.starting = True  # until the start ended, or failed, or was abandoned
        self.started = False  # set once the runtime started: the drain then has work to do
        self._first: signal.Signals | None = None  # it gives the exit status, as in commands
        self._log = log
        self._rank = {"rank": rank} if rank else {}  # a follower's lines name it
        self._previous: dict[signal.Signals, Any] = {}  # the handlers install replaced

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = take_signals(loop, self._received)

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        give_back_signals(loop, self._previous)
        self._previous = {}

    def _received(self, number: signal.Signals) -> None:
        if self._first is not None:
            self._second(number, self._first)
            return
        self._first = number
        self.drain.set()
        if self.starting:
            self._log.info("stopping", **self._rank, signal=number.name,
                           reason="signalled during the start, which is abandoned")
        elif self.started and self._rank:  # rank 0 says so as its drain begins
            self._log.info("draining", **self._rank, signal=number.name,
                           until="rank 0 has drained its requests and stops this rank")

    def _second(self, number: signal.Signals, first: signal.Signals) -> None:
        if self.started and not self._rank:
            self.now.set()
            return
        self._log.info("stopped", **self._rank, signal=number.name,
                       reason=f"a second signal ends {'this rank' if self._rank else 'the server'}"
                              " at once")
        os._exit(128 + first)


async def serve_http(runtime: Runtime, tokenizer: Tokenizer, settings: ServeSettings, *,
                     host: str, port: int, log: Any) -> None:
    """Serve completions on ``host:port`` until a signal drains the server."""
    server = CompletionServer(runtime, tokenizer, settings, log)
    runner = app_runner(server)
    await runner.setup()
    loop = asyncio.get_running_loop()
    loop_handler = loop.get_exception_handler()
    loop.set_exception_handler(loop_errors(log))
    signals = Signals(log)
    signals.install(loop)
    try:
        with aiohttp_logs_as_lines(log):
            await _listen(runner, host, port)
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            log.info("listening", url=url, state=server.state)
            if await _start_unless_signalled(runtime, signals):
                server.state = READY
                runtime.subscribe(server.metrics.observe)
                log.info("ready", url=url, model=settings.model_name)
                await _serve_until_drained(runtime, server, signals, log)
    finally:
        await runner.cleanup()
        server.close()
        try:
            await runtime.stop()
        finally:  # a signal while the runtime stops (after a fault, a while) is the drain's
            signals.remove(loop)
            loop.set_exception_handler(loop_handler)
    if runtime.fault is not None:  # after the drain began (a rank lost): requests may have failed
        raise ServeFailed(f"the runtime faulted while draining or stopping: {runtime.fault}")
    log.info("stopped")


def app_runner(server: CompletionServer) -> web.AppRunner:
    """The server's aiohttp runner. Once drained, a handler still running waits for a body
    that is not coming: the close waits for it ``SHUTDOWN_GRACE_S``, not aiohttp's minute. A
    connection idle, or still sending a request's head, is closed after the read timeout
    (aiohttp's own keeps it an hour). The app decodes request bodies itself
    (``decoded_body``): aiohttp's own decoding would answer an encoding it lacks a library
    for in plain text before any handler runs."""
    return web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                         shutdown_timeout=SHUTDOWN_GRACE_S, auto_decompress=False,
                         keepalive_timeout=server.settings.read_timeout_s)


async def follow_front(runtime: Runtime, log: Any) -> None:
    """A rank behind rank 0: decode its requests until it stops this rank. A launcher such as
    torchrun signals every rank at once, so the first SIGTERM or SIGINT here only says so:
    rank 0 drains its requests, which need this rank, then stops it. A second signal ends the
    process at once (``Signals``); a signal during the start abandons it, as on rank 0. Its
    log begins with ``starting`` (the start waits for every rank), says ``ready`` once this
    rank's start is over (a signal before then abandons it) and ends with ``stopped``, as
    rank 0's does with ``listening``, ``ready`` and ``stopped``."""
    loop = asyncio.get_running_loop()
    rank = runtime.rank
    signals = Signals(log, rank=rank)
    signals.install(loop)
    try:
        log.info("starting", rank=rank, until="every rank has joined the start")
        if await _start_unless_signalled(runtime, signals):
            log.info("ready", rank=rank, until="rank 0 stops this rank")
            await runtime.serve()
    finally:
        try:
            await runtime.stop()
        finally:  # a second signal while this rank stops still ends it at once
            signals.remove(loop)
    log.info("stopped", rank=rank)


def take_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], object]
                 ) -> dict[signal.Signals, Any]:
    """Handle ``taken_signals`` on ``loop`` (``handler`` gets the number); the handlers they
    had, for ``give_back_signals``."""
    previous = {number: signal.getsignal(number) for number in taken_signals()}
    for number in previous:
        loop.add_signal_handler(number, handler, number)
    return previous


def give_back_signals(loop: asyncio.AbstractEventLoop,
                      previous: dict[signal.Signals, Any]) -> None:
    """The signals back to the handlers they had: removing the loop's handler alone would
    leave the system's default, and a signal while the command winds down would kill it
    with nothing said."""
    for number, handler in previous.items():
        loop.remove_signal_handler(number)
        if handler is not None:  # None: one installed outside Python, which stays gone
            signal.signal(number, handler)


def taken_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM and SIGINT, less one the process inherited ignored (a job started in the
    background ignores Ctrl-C): that one stays ignored while serving too."""
    return tuple(number for number in (signal.SIGTERM, signal.SIGINT)
                 if signal.getsignal(number) != signal.SIG_IGN)


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    with _listen_errors(host, port):
        await web.TCPSite(runner, host, port, reuse_address=True).start()


def check_listenable(host: str, port: int) -> None:
    """Refuse, in the words of the server's own listen, a ``host:port`` it could not listen
    on: for a launch that loads its checkpoints before the server listens (seconds, for a
    large one), so a port in use is still refused before any model loads."""
    async def listen_and_close() -> None:
        with _listen_errors(host, port):
            server = await asyncio.get_running_loop().create_server(
                asyncio.Protocol, host, port, reuse_address=True)  # as aiohttp's site binds
        server.close()
        await server.wait_closed()

    asyncio.run(listen_and_close())


@contextmanager
def _listen_errors(host: str, port: int) -> Iterator[None]:
    try:
        yield
    except socket.gaierror as error:
        raise ConfigError("--host", host, f"cannot be resolved: {error.strerror}") from None
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        flag, value = ("--port", port) if error.errno in PORT_ERRORS else ("--host", host)
        raise ConfigError(flag, value, f"cannot listen on {host}:{port}: {reason}") from None


async def _start_unless_signalled(runtime: Runtime, signals: Signals) -> bool:
    """Start the runtime unless a signal comes first (False then: ``runtime.stop()``
    abandons the start, or stops one that ended as the signal came, which said it abandons
    it). A failed start raises its own error, unless a signal came: the start was abandoned,
    and a launcher signals every rank, so it may have failed for a rank that stopped. A
    signal once the start is over no longer says it abandons it."""
    try:
        started = asyncio.ensure_future(runtime.start())
        signalled = asyncio.ensure_future(signals.drain.wait())
        done, _ = await asyncio.wait({started, signalled},
                                     return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if started in done and not signals.drain.is_set():
            started.result()
            signals.started = True
            return True
        started.cancel()
        await asyncio.gather(started, return_exceptions=True)
        return False
    finally:
        signals.starting = False


async def _serve_until_drained(runtime: Runtime, server: CompletionServer, signals: Signals,
                               log: Any) -> None:
    ended = asyncio.ensure_future(runtime.ended())
    drain = asyncio.ensure_future(signals.drain.wait())
    await asyncio.wait({ended, drain}, return_when=asyncio.FIRST_COMPLETED)
    drain.cancel()
    if ended.done():
        error = ended.exception()
        if error is None:  # stopped by its embedder
            return
        server.state, server.failure = FAILED, str(error)
        raise ServeFailed(f"the runtime stopped while serving: {error}")
    ended.cancel()
    server.state = DRAINING
    log.info("draining", in_flight=len(server.in_flight))
    now = asyncio.ensure_future(signals.now.wait())
    drained = asyncio.ensure_future(server.drained.wait())
    await asyncio.wait({now, drained}, return_when=asyncio.FIRST_COMPLETED)
    if not drained.done():
        log.info("cancelling", in_flight=len(server.in_flight))
        server.cancel_all()
        await asyncio.wait({drained}, timeout=SHUTDOWN_GRACE_S)
    if not drained.done():  # their requests have ended: their clients read nothing
        log.info("cutting", in_flight=len(server.in_flight))
        server.cut_answers()
        await drained
    now.cancel()


def default_log() -> Any:
    return json_logger(sys.stderr)
