"""Device streams: where the round runtime enqueues the device work of prefills and rounds.

The runtime enqueues the stages of a round (draft, consensus, pack, verify, sample, commit,
retire) without the host waiting in between, by default as one work item that runs them back
to back; the only host wait is the retirement of round n-2. A stream runs work items in
submission order and reports each one's end as a ``Completion``: an awaitable resolved on the
runtime's asyncio loop once the device has finished that work, not merely once it was
launched.

- cpu (default, ``LoopStream``): the "device" is the event loop's own thread. Each work item
  runs as one loop callback, in order, with that thread's torch intra-op threads (torch's
  default: one per physical core); work is finished when the function has returned. On a
  cpu the host and the "device" share the same cores, so a second thread buys no overlap,
  only a fight: the loop's work preempts an OpenMP worker mid-kernel and every parallel
  region waits for it at its barrier, and each stage pays a thread handoff.
- cpu with ``ADASPEC_CPU_STREAM=worker`` (``WorkerStream``): one worker thread runs the items,
  for an embedder whose loop must stay responsive while a kernel runs; its intra-op threads
  leave one core to the loop (``cpu_threads``).
- cuda / npu: a launcher thread runs each item under the stream and records an event after
  it, so launches run ahead of the device; a waiter thread synchronizes those events in order
  and only then resolves the completions.

An exception raised by a work item goes into its completion and the stream carries on: the
failure handler of the round decides what happens next, not the stream. Work whose completion
was cancelled still runs, since later work (a stage enqueued on its own, the next round) may
depend on it.

Work items run under ``torch.no_grad`` on every device: a model an engine plugs in must not
build autograd graphs while it serves, whether or not its methods say so themselves.
"""

import asyncio
import collections
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from adaspec.availability import require_device
from adaspec.config.environment import (  # noqa: F401  # re-exported: the stream's settings
    CPU_STREAM_ENV,
    CPU_STREAMS,
    CPU_THREADS_ENV,
    MAX_CPU_THREADS,
    checked_threads,
    cpu_stream_kind,
)
from adaspec.errors import StreamClosed

T = TypeVar("T")

OnDone = Callable[["asyncio.Future[Any]"], None]
"""Called on the loop right after a completion resolves (no extra scheduling hop), before
later completions; the runtime moves a round's state from it."""


@dataclass(frozen=True, slots=True)
class Completion(Generic[T]):
    """The end of one work item: ``value = await completion`` once the device has finished it.

    The future belongs to the loop the stream was opened with; await it on that loop only.
    It holds the work's return value, or the exception the work (or the device) raised.
    """

    future: asyncio.Future[T]

    def __await__(self) -> Generator[Any, None, T]:
        return self.future.__await__()

    def done(self) -> bool:
        """Whether the completion has been resolved on the loop (a result, an error, or cancel)."""
        return self.future.done()


class DeviceStream(Protocol):
    """An in-order queue of device work with completions delivered on an asyncio loop.

    ``enqueue`` is called from the loop's thread and returns at once; work items run in
    submission order and their completions resolve in that same order. ``close`` drains:
    it blocks its caller until every item enqueued before it has run, its outcome has been
    handed to the loop, and the stream's threads have exited; it cancels nothing. It is
    idempotent, and ``enqueue`` after it raises ``StreamClosed``.
    """

    device: torch.device

    def enqueue(self, work: Callable[[], T],
                on_done: "Callable[[asyncio.Future[T]], None] | None" = None
                ) -> Completion[T]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What a work item produced: its value, or the error to deliver instead."""

    value: object = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Item:
    work: Callable[[], object]
    future: asyncio.Future[Any]
    on_done: OnDone | None = None


def cpu_threads(environ: Mapping[str, str] | None = None, stream: str | None = None) -> int:
    """Intra-op threads of the cpu stream: ``ADASPEC_CPU_THREADS`` when set; else, for the
    loop stream, the count torch already uses on the calling thread (by default one per
    physical core), and for the worker stream the cores this process may run on less one
    (at least one), leaving a core to the event loop. ``stream`` is ``loop`` or ``worker``
    (default: the one ``ADASPEC_CPU_STREAM`` picks): threads that share their cores with the
    loop wait on it at every parallel region (docs/runtime.md, "The CPU stream", has the
    measurement). Raises ``ConfigError`` naming a variable for a value out of range."""
    environ = os.environ if environ is None else environ
    kind = cpu_stream_kind(environ)  # checked whichever stream is asked about
    raw = environ.get(CPU_THREADS_ENV)
    if raw is not None:
        return checked_threads(CPU_THREADS_ENV, raw)
    if (stream or kind) == "worker":
        return max(1, available_cores() - 1)
    return torch.get_num_threads()


def share_cores(local_ranks: int) -> int | None:
    """Ranks on one host split its cores: each takes an equal share as its torch intra-op
    threads (threads that outnumber the cores spin against each other at every parallel
    region and a collective waits for the slowest). ``ADASPEC_CPU_THREADS`` still wins.
    Returns the count set, or None when nothing changed."""
    if local_ranks <= 1 or CPU_THREADS_ENV in os.environ:
        return None
    threads = max(1, available_cores() // local_ranks)
    torch.set_num_threads(threads)
    return threads


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _call(work: Callable[[], object]) -> _Outcome:
    try:
        with torch.no_grad():
            return _Outcome(value=work())
    except StopIteration as error:
        # A future refuses StopIteration (it would end the awaiting coroutine silently).
        wrapped = RuntimeError(f"stream work raised StopIteration: {error!r}")
        wrapped.__cause__ = error
        return _Outcome(error=wrapped)
    except Exception as error:
        return _Outcome(error=error)


def _call_on_thread(work: Callable[[], object]) -> _Outcome:
    """``_call`` for a stream's own thread, which has nobody to hand a ``BaseException``
    (a custom one, ``GeneratorExit``) to: the work's completion gets an error naming it and
    the thread serves on, where a dead thread would leave every completion waiting."""
    try:
        return _call(work)
    except BaseException as error:
        return _Outcome(error=RuntimeError(f"stream work interrupted by {type(error).__name__}"))


def _settle(future: asyncio.Future[Any], outcome: _Outcome) -> None:
    """Runs on the loop's thread, so checking for cancellation here cannot race with it."""
    if future.cancelled():
        return
    if outcome.error is None:
        future.set_result(outcome.value)
    else:
        future.set_exception(outcome.error)


class _QueueStream:
    """The submission side both streams share: a FIFO queue of work, a closed flag, the
    threads that serve it, and delivery of outcomes to the loop."""

    def __init__(self, device: torch.device, loop: asyncio.AbstractEventLoop) -> None:
        self.device = device
        self._loop = loop
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outbox_lock = threading.Lock()
        self._outbox: list[tuple[asyncio.Future[Any], _Outcome, OnDone | None]] = []
        self._delivery_scheduled = False
        self._closed = False
        self._threads: tuple[threading.Thread, ...] = ()

    def _start(self, serve: dict[str, Callable[[], None]]) -> None:
        self._threads = tuple(
            threading.Thread(target=target, name=f"adaspec-{self.device}-{role}", daemon=True)
            for role, target in serve.items())
        for thread in self._threads:
            thread.start()

    def enqueue(self, work: Callable[[], T],
                on_done: "Callable[[asyncio.Future[T]], None] | None" = None) -> Completion[T]:
        """Queue ``work`` behind everything enqueued so far and return without waiting.

        Call it from the loop's thread: the completion's future belongs to that loop.
        """
        # The lock orders this against close(): no item can land behind the stop sentinel.
        with self._lock:
            if self._closed:
                raise StreamClosed(self.device)
            future: asyncio.Future[T] = self._loop.create_future()
            self._queue.put(_Item(work, future, on_done))
        return Completion(future)

    def close(self) -> None:
        """Drain: let every item enqueued so far run and resolve, then join the threads.

        Draining rather than cancelling keeps the work whole: a round's later stages, or the
        round behind it, were enqueued with it and must not be dropped halfway (the runtime's
        failure handler, not the stream, decides what a round's outcome is).
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)
        for thread in self._threads:
            # Closing from inside a work item must not join the thread it runs on.
            if thread is not threading.current_thread():
                thread.join()

    def _post(self, future: asyncio.Future[Any], outcome: _Outcome,
              on_done: OnDone | None) -> None:
        """Hand an outcome to the loop. Outcomes that arrive while a delivery is already
        scheduled join it, so items finishing back to back (a prefill and a round) wake the
        loop once instead of once each; delivery keeps submission order."""
        with self._outbox_lock:
            self._outbox.append((future, outcome, on_done))
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        # A closed loop has nobody left to await the completion: dropping it is correct.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._outbox_lock:
            ready, self._outbox = self._outbox, []
            self._delivery_scheduled = False
        for future, outcome, _ in ready:
            _settle(future, outcome)
        # Every completion is settled before any callback runs, so a raising callback cannot
        # leave a later completion unresolved; the first error surfaces after all ran.
        first_error: Exception | None = None
        for future, _, on_done in ready:
            if on_done is None or future.cancelled():
                continue
            try:
                on_done(future)
            except Exception as error:
                first_error = first_error or error
        if first_error is not None:
            raise first_error


class WorkerStream(_QueueStream):
    """The cpu stream: one daemon worker thread runs the work items in order.

    A completion resolves when its function has returned, which on the cpu is when the
    work is finished.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int | None = None) -> None:
        super().__init__(torch.device("cpu"), loop)
        self.threads = cpu_threads(stream="worker") if threads is None \
            else checked_threads("threads", threads)
        # torch keeps a process-wide default beside each thread's own count, and setting the
        # worker's count changes that default too: the caller's is restored once the worker
        # holds its own, so threads started later (and the caller) keep what they had.
        caller_threads = torch.get_num_threads()
        self._ready = threading.Event()
        self._start({"worker": self._serve})
        self._ready.wait()
        torch.set_num_threads(caller_threads)

    def _serve(self) -> None:
        torch.get_num_threads()  # this thread's own pool exists before its count is set
        torch.set_num_threads(self.threads)
        self._ready.set()
        while (item := self._queue.get()) is not None:
            self._post(item.future, _call_on_thread(item.work), item.on_done)


class LoopStream:
    """The default cpu stream: every work item runs on the event loop's thread, as one loop
    callback of its own, so other callbacks (the host's next round, a new request) interleave
    between items while the order of items and of their completions stays the submission
    order. A round is one item by default: the loop answers between rounds, not between
    their stages.

    Without ``ADASPEC_CPU_THREADS`` (or ``threads``) the items run with the loop thread's own
    torch thread count and nothing is switched. With one, each item runs with that count and
    the loop thread's own is put back after it, so code sharing the thread between items (a
    plain loop, a second runtime) keeps its setting. An item that raises a ``BaseException``
    (Ctrl-C, ``SystemExit``) still resolves its completion with an error naming it before
    the exception goes on, so nothing waits for it forever. ``close`` drains: on the loop's
    thread it runs whatever is still queued at once (from inside a work item it only refuses
    new work, since the items behind the running one are already scheduled); from another
    thread it hands the drain to the loop and waits for it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int | None = None) -> None:
        self.device = torch.device("cpu")
        if threads is not None:
            self.threads: int | None = checked_threads("threads", threads)
        elif CPU_THREADS_ENV in os.environ:
            self.threads = cpu_threads(stream="loop")
        else:
            self.threads = None  # the loop thread's own count, whatever it is when work runs
        self._loop = loop
        self._pending: collections.deque[_Item] = collections.deque()
        self._scheduled = False
        self._running = False
        self._closed = False

    def enqueue(self, work: Callable[[], T],
                on_done: "Callable[[asyncio.Future[T]], None] | None" = None) -> Completion[T]:
        """Queue ``work`` behind everything enqueued so far and return without running it."""
        if self._closed:
            raise StreamClosed(self.device)
        future: asyncio.Future[T] = self._loop.create_future()
        self._pending.append(_Item(work, future, on_done))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run_next)
        return Completion(future)

    def close(self) -> None:
        """Refuse new work and drain (see the class). From another thread it waits while the
        loop runs; a loop thread blocked on that very thread would wait forever, as with any
        drain that needs the loop."""
        self._closed = True
        if self._on_loop_thread() or not self._loop.is_running():
            if not self._running:
                self._drain()
            return
        drained = threading.Event()

        def drain_on_loop() -> None:
            try:
                if not self._running:
                    self._drain()
            finally:
                drained.set()

        try:
            self._loop.call_soon_threadsafe(drain_on_loop)
        except RuntimeError:  # the loop closed meanwhile: nobody is left to run the items
            return
        # Waits only while the loop can still run the drain; a loop that stops first has
        # nobody left to hand the outcomes to.
        while not drained.wait(0.05) and self._loop.is_running():
            pass

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _drain(self) -> None:
        while self._pending:
            self._run_one()

    def _run_next(self) -> None:
        self._scheduled = False
        if not self._pending:
            return  # close() ran the items first
        if len(self._pending) > 1:
            # Scheduled before the item runs, so a raising item cannot strand the rest.
            self._scheduled = True
            self._loop.call_soon(self._run_next)
        self._run_one()

    def _run_one(self) -> None:
        item = self._pending.popleft()
        caller_threads, threads = torch.get_num_threads(), self.threads
        switch = threads is not None and caller_threads != threads
        if threads is not None and switch:
            torch.set_num_threads(threads)
        self._running = True
        try:
            outcome = _call(item.work)
        except BaseException as error:  # Ctrl-C, SystemExit, a cancellation inside the work
            self._deliver(item, _Outcome(error=RuntimeError(
                f"stream work interrupted by {type(error).__name__}")))
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise  # the process is being told to stop: let it
            return
        finally:
            self._running = False
            if switch:
                torch.set_num_threads(caller_threads)
        self._deliver(item, outcome)

    def _deliver(self, item: _Item, outcome: _Outcome) -> None:
        try:
            _settle(item.future, outcome)
        except RuntimeError:  # a closed loop has nobody left to await the completion
            return
        if item.on_done is None or item.future.cancelled():
            return
        try:
            item.on_done(item.future)
        except Exception as error:
            self._loop.call_exception_handler({
                "message": "a cpu stream completion callback raised", "exception": error})


@dataclass(frozen=True, slots=True)
class _Launched:
    """An item whose launches are queued on the device, and the event recorded after them
    (None when recording it failed; the outcome then carries that error)."""

    future: asyncio.Future[Any]
    on_done: OnDone | None
    outcome: _Outcome
    event: Any  # torch.cuda.Event or torch.npu.Event, or None


class TorchStream(_QueueStream):
    """The cuda or npu stream: a launcher thread and a waiter thread around one device stream.

    The launcher runs each item under ``with <torch.cuda|torch.npu>.stream(stream)`` and
    records an event after it; the item's host code returns as soon as its kernels are
    queued, so the launcher runs ahead of the device. The waiter synchronizes the events in
    order and only then resolves each completion, so a value is never seen before the
    device has produced it. An item that raised still gets its event: whatever it launched
    before failing has finished by the time its error is delivered.

    Only work on this stream is ordered: a tensor written on another stream (the default one,
    say) must be synchronized with before work here reads it.
    """

    def __init__(self, kind: str, loop: asyncio.AbstractEventLoop) -> None:
        # torch.npu exists only once torch_npu was imported, which require_device has done.
        self._mod: Any = getattr(torch, kind)
        super().__init__(torch.device(kind, self._mod.current_device()), loop)
        self.stream: Any = self._mod.Stream(device=self.device)
        self._launched: queue.SimpleQueue[_Launched | None] = queue.SimpleQueue()
        self._start({"launcher": self._launch_all, "waiter": self._wait_all})

    def _launch_all(self) -> None:
        while (item := self._queue.get()) is not None:
            with self._mod.stream(self.stream):
                outcome = _call_on_thread(item.work)
                recorded = _call_on_thread(self._recorded_event)
            self._launched.put(_Launched(item.future, item.on_done,
                                         _first_error(outcome, recorded),
                                         recorded.value))
        self._launched.put(None)

    def _recorded_event(self) -> Any:
        event = self._mod.Event()
        event.record(self.stream)
        return event

    def _wait_all(self) -> None:
        # Events are waited for in launch order, so completions resolve in submission order.
        while (launched := self._launched.get()) is not None:
            outcome = launched.outcome
            if launched.event is not None:
                outcome = _first_error(outcome, _call(launched.event.synchronize))
            self._post(launched.future, outcome, launched.on_done)


def _first_error(outcome: _Outcome, then: _Outcome) -> _Outcome:
    """The work's own error wins; a later device error replaces only a value."""
    return outcome if outcome.error is not None or then.error is None else then


def open_stream(device: str, loop: asyncio.AbstractEventLoop) -> DeviceStream:
    """Open the stream of ``--device`` (cpu, cuda or npu) delivering completions on ``loop``.

    Raises ``DeviceUnavailable`` naming ``--device`` when the device cannot be used here.
    """
    require_device(device)
    if device != "cpu":
        return TorchStream(device, loop)
    if cpu_stream_kind() == "worker":
        return WorkerStream(loop)
    return LoopStream(loop)
