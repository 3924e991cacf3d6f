"""``adaspec serve``'s lifecycle: listen, start the runtime, serve, drain, stop.

The socket opens first, so ``/health`` answers "starting" while the models load, the graphs
are prepared and the costs calibrated. SIGTERM or SIGINT drains: new requests get 503, those in
flight run to their end, then the server closes and the runtime stops; a second signal cancels
what is still in flight. A runtime fault ends the server with the fault's one line.
"""

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

import structlog
from aiohttp import web

from adaspec.errors import AdaspecError, ConfigError
from adaspec.models.tokenizer import Tokenizer
from adaspec.runtime.engine import Runtime
from adaspec.serve.app import DRAINING, FAILED, READY, CompletionServer, ServeSettings


class ServeFailed(AdaspecError):
    """The runtime stopped under the server (a fault while serving)."""


def json_logger(stream: TextIO) -> Any:
    """One JSON object per line on ``stream``: the lifecycle and one line per request."""
    return structlog.wrap_logger(
        structlog.PrintLogger(stream),
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()])


class Signals:
    """SIGTERM and SIGINT as events on the loop: the first asks for a drain, the second for
    an end now."""

    def __init__(self) -> None:
        self.drain = asyncio.Event()
        self.now = asyncio.Event()
        self._installed: list[signal.Signals] = []

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, self._received)
            self._installed.append(number)

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        for number in self._installed:
            loop.remove_signal_handler(number)
        self._installed.clear()

    def _received(self) -> None:
        (self.now if self.drain.is_set() else self.drain).set()


async def serve_http(runtime: Runtime, tokenizer: Tokenizer, settings: ServeSettings, *,
                     host: str, port: int, log: Any,
                     on_ready: Callable[[], None] | None = None) -> None:
    """Serve completions on ``host:port`` until a signal drains the server."""
    server = CompletionServer(runtime, tokenizer, settings, log)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    signals = Signals()
    signals.install(loop)
    try:
        await _listen(runner, host, port)
        url = f"http://{host}:{port}"
        log.info("listening", url=url, state=server.state)
        if await _start_unless_signalled(runtime, signals.drain):
            server.state = READY
            runtime.subscribe(server.metrics.observe)
            log.info("ready", url=url, model=settings.model_name)
            if on_ready is not None:
                on_ready()
            await _serve_until_drained(runtime, server, signals, log)
    finally:
        await runner.cleanup()
        signals.remove(loop)
        await runtime.stop()
    log.info("stopped")


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ConfigError("--port", port, f"cannot listen on {host}:{port}: {reason}") from None


async def _start_unless_signalled(runtime: Runtime, drain: asyncio.Event) -> bool:
    """Start the runtime unless a signal comes first (False then: ``runtime.stop()``
    abandons the start). A failed start raises its own error."""
    started = asyncio.ensure_future(runtime.start())
    signalled = asyncio.ensure_future(drain.wait())
    done, _ = await asyncio.wait({started, signalled}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if started in done:
        started.result()
        return True
    started.cancel()
    await asyncio.gather(started, return_exceptions=True)
    return False


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
    log.info("draining", in_flight=server.queued)
    now = asyncio.ensure_future(signals.now.wait())
    drained = asyncio.ensure_future(server.drained.wait())
    await asyncio.wait({now, drained}, return_when=asyncio.FIRST_COMPLETED)
    if not drained.done():
        log.info("cancelling", in_flight=server.queued)
        server.cancel_all()
        await drained
    now.cancel()


def default_log() -> Any:
    return json_logger(sys.stderr)
