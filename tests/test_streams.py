"""Device streams run the stages of a round in submission order without the host waiting, and
report each item's end on the asyncio loop; the retire copy is the round's only device-to-host
transfer and never aliases the slot's buffers.

Ordering is controlled with threading.Event gates, never with sleeps: a work item blocked on a
closed gate provably has not finished.
"""

import asyncio
import contextlib
import importlib.util
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
import pytest_asyncio
import torch
from cuda_marks import needs_cuda

from adaspec.errors import ConfigError, DeviceUnavailable, StreamClosed
from adaspec.runtime.devices.retire import enqueue_retire, retire_copy
from adaspec.runtime.devices.streams import (
    CPU_STREAM_ENV,
    DeviceStream,
    LoopStream,
    TorchStream,
    WorkerStream,
    cpu_stream_kind,
    open_stream,
)

T = TypeVar("T")

GATE_TIMEOUT_S = 30.0
"""How long a gated work item waits before failing its completion, so a broken test fails
instead of hanging."""



class Gates:
    """threading.Events that work items block on; all are opened before a stream is closed,
    since close() drains and would otherwise wait on a blocked item forever."""

    def __init__(self) -> None:
        self._made: list[threading.Event] = []

    def new(self) -> threading.Event:
        gate = threading.Event()
        self._made.append(gate)
        return gate

    def open_all(self) -> None:
        for gate in self._made:
            gate.set()


def after(gate: threading.Event, value: T) -> Callable[[], T]:
    """Work that returns ``value`` once ``gate`` is open."""
    def work() -> T:
        if not gate.wait(GATE_TIMEOUT_S):
            raise AssertionError("the test never opened the gate")
        return value
    return work


def recording(ran: list[int], index: int) -> Callable[[], int]:
    def work() -> int:
        ran.append(index)
        return index
    return work


@pytest.fixture
def gates() -> Iterator[Gates]:
    made = Gates()
    yield made
    made.open_all()


async def opened_stream(device: str, gates: Gates) -> AsyncIterator[DeviceStream]:
    """A stream that is closed after the test, with every gate opened first so it drains."""
    opened = open_stream(device, asyncio.get_running_loop())
    yield opened
    gates.open_all()
    opened.close()


@pytest_asyncio.fixture
async def stream(gates: Gates) -> AsyncIterator[DeviceStream]:
    """The worker stream: gated work blocks its own thread, never the loop's."""
    async for opened in opened_stream("cpu", gates):
        yield opened


@pytest_asyncio.fixture(params=["worker", "loop"])
async def cpu_stream(request: pytest.FixtureRequest, gates: Gates,
                     monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[DeviceStream]:
    """Either cpu stream, for the rules both keep (no gates: loop work runs on the loop)."""
    monkeypatch.setenv(CPU_STREAM_ENV, request.param)
    async for opened in opened_stream("cpu", gates):
        yield opened


@pytest_asyncio.fixture
async def cuda_stream(gates: Gates) -> AsyncIterator[DeviceStream]:
    async for opened in opened_stream("cuda", gates):
        yield opened


@pytest_asyncio.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What the running loop's exception handler receives during the test."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    yield reported
    loop.set_exception_handler(None)


# ---- cpu stream -------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("setting", "kind"), [(None, LoopStream), ("loop", LoopStream),
                                               (" worker ", WorkerStream)])
async def test_open_stream_cpu_is_the_loop_stream_unless_the_worker_is_asked_for(
        setting: str | None, kind: type, monkeypatch: pytest.MonkeyPatch) -> None:
    if setting is None:
        monkeypatch.delenv(CPU_STREAM_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_STREAM_ENV, setting)
    opened = open_stream("cpu", asyncio.get_running_loop())
    try:
        assert isinstance(opened, kind)
        assert opened.device == torch.device("cpu")
    finally:
        opened.close()


@pytest.mark.parametrize("raw", ["threads", "", "Loop", "worker2"])
def test_an_unknown_cpu_stream_is_refused_in_one_line(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"^{CPU_STREAM_ENV}=.*: expected loop .* or "
                                          "worker") as caught:
        cpu_stream_kind({CPU_STREAM_ENV: raw})
    assert "\n" not in str(caught.value)


@pytest.mark.asyncio
async def test_work_runs_in_submission_order(cpu_stream: DeviceStream) -> None:
    ran: list[int] = []
    completions = [cpu_stream.enqueue(recording(ran, index)) for index in range(20)]
    assert [await completion for completion in completions] == list(range(20))
    assert ran == list(range(20))


@pytest.mark.asyncio
async def test_loop_stream_work_runs_on_the_loop_thread_one_callback_per_item() -> None:
    loop = asyncio.get_running_loop()
    stream = LoopStream(loop)
    ran: list[str] = []
    try:
        first = stream.enqueue(lambda: ran.append("work 0") or threading.current_thread())
        second = stream.enqueue(lambda: ran.append("work 1"))
        # Enqueueing ran nothing: the host goes on before the work, as with any stream.
        assert ran == []
        assert not first.done()
        loop.call_soon(ran.append, "other callback")
        assert await first is threading.current_thread()
        await second
    finally:
        stream.close()
    # Another callback ready before the second item ran between the two items.
    assert ran == ["work 0", "other callback", "work 1"]


@pytest.mark.asyncio
async def test_loop_stream_runs_with_its_threads_and_gives_the_count_back_at_close() -> None:
    caller = torch.get_num_threads()
    stream = LoopStream(asyncio.get_running_loop(), threads=1)
    try:
        weight = torch.ones(3, requires_grad=True)
        inside = await stream.enqueue(lambda: (torch.get_num_threads(),
                                               (weight * 2).requires_grad))
    finally:
        stream.close()
    assert inside == (1, False)
    assert torch.get_num_threads() == caller


@pytest.mark.asyncio
async def test_loop_stream_close_inside_work_lets_the_scheduled_items_run() -> None:
    stream = LoopStream(asyncio.get_running_loop())
    ran: list[int] = []

    def close_then_return() -> str:
        stream.close()
        return "closed"

    completions = [stream.enqueue(close_then_return)]
    completions += [stream.enqueue(recording(ran, index)) for index in (1, 2)]
    assert [await completion for completion in completions] == ["closed", 1, 2]
    assert ran == [1, 2]
    with pytest.raises(StreamClosed):
        stream.enqueue(lambda: 3)


@pytest.mark.asyncio
async def test_loop_stream_close_from_another_thread_returns_once_everything_ran() -> None:
    stream = LoopStream(asyncio.get_running_loop())
    ran: list[int] = []
    completions = [stream.enqueue(recording(ran, index)) for index in range(3)]
    await asyncio.to_thread(stream.close)  # the loop stays free to run the drain meanwhile
    assert ran == [0, 1, 2]
    assert [completion.future.result() for completion in completions] == [0, 1, 2]


@pytest.mark.asyncio
async def test_loop_stream_close_inside_work_then_outside_drains_the_rest() -> None:
    stream = LoopStream(asyncio.get_running_loop())
    ran: list[int] = []
    stream.enqueue(stream.close)
    completions = [stream.enqueue(recording(ran, index)) for index in (1, 2)]
    await asyncio.sleep(0)  # one loop pass: the closing item runs, the others stay queued
    stream.close()
    assert ran == [1, 2]
    assert [await completion for completion in completions] == [1, 2]


@pytest.mark.asyncio
async def test_loop_stream_follows_the_loop_threads_own_count_unless_one_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    caller = torch.get_num_threads()
    monkeypatch.delenv("ADASPEC_CPU_THREADS", raising=False)
    following = LoopStream(asyncio.get_running_loop())
    monkeypatch.setenv("ADASPEC_CPU_THREADS", "1")
    pinned = LoopStream(asyncio.get_running_loop())
    try:
        torch.set_num_threads(caller + 1)  # an embedder changes its own setting later
        assert await following.enqueue(torch.get_num_threads) == caller + 1
        assert await pinned.enqueue(torch.get_num_threads) == 1
        assert torch.get_num_threads() == caller + 1
    finally:
        torch.set_num_threads(caller)
        following.close()
        pinned.close()


@pytest.mark.asyncio
async def test_loop_streams_keep_their_own_thread_counts_whatever_order_they_close_in() -> None:
    caller = torch.get_num_threads()
    loop = asyncio.get_running_loop()
    first, second = LoopStream(loop, threads=1), LoopStream(loop, threads=caller + 1)
    try:
        assert await first.enqueue(torch.get_num_threads) == 1
        assert torch.get_num_threads() == caller  # between items the loop's own count holds
        first.close()
        assert await second.enqueue(torch.get_num_threads) == caller + 1
    finally:
        first.close()
        second.close()
    assert torch.get_num_threads() == caller


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_loop_stream_interrupted_work_still_resolves_its_completion(
        interrupt: type[BaseException]) -> None:
    caller = torch.get_num_threads()
    loop = asyncio.new_event_loop()
    try:
        stream = LoopStream(loop, threads=1)

        def interrupted() -> None:
            raise interrupt()

        stopped = stream.enqueue(interrupted)
        later = stream.enqueue(lambda: 5)
        with pytest.raises(interrupt):
            loop.run_until_complete(stopped.future)
        assert torch.get_num_threads() == caller
        with pytest.raises(RuntimeError, match=f"^stream work interrupted by "
                                               f"{interrupt.__name__}$"):
            stopped.future.result()
        assert loop.run_until_complete(later.future) == 5
        stream.close()
    finally:
        loop.close()


@pytest.mark.asyncio
async def test_loop_stream_cancellation_inside_work_fails_only_that_item() -> None:
    stream = LoopStream(asyncio.get_running_loop())

    def cancelled() -> None:
        raise asyncio.CancelledError()

    try:
        with pytest.raises(RuntimeError, match="interrupted by CancelledError"):
            await stream.enqueue(cancelled)
        assert await stream.enqueue(lambda: 6) == 6
    finally:
        stream.close()


@pytest.mark.asyncio
async def test_loop_stream_close_reports_a_raising_callback_and_drains_the_rest(
        loop_errors: list[dict[str, Any]]) -> None:
    stream = LoopStream(asyncio.get_running_loop())
    ran: list[int] = []

    def broken(_: "asyncio.Future[None]") -> None:
        raise RuntimeError("observer bug")

    stream.enqueue(lambda: None, on_done=broken)
    stream.enqueue(recording(ran, 1))
    stream.close()
    assert ran == [1]
    assert [str(context.get("exception")) for context in loop_errors] == ["observer bug"]


@pytest.mark.asyncio
async def test_loop_stream_raising_callback_does_not_strand_later_items(
        loop_errors: list[dict[str, Any]]) -> None:
    stream = LoopStream(asyncio.get_running_loop())

    def broken(_: "asyncio.Future[int]") -> None:
        raise ValueError("observer bug")

    try:
        stream.enqueue(lambda: 1, on_done=broken)
        assert await stream.enqueue(lambda: 2) == 2
    finally:
        stream.close()
    assert [str(context.get("exception")) for context in loop_errors] == ["observer bug"]


@pytest.mark.asyncio
async def test_completions_resolve_in_submission_order(stream: DeviceStream,
                                                       gates: Gates) -> None:
    gate = gates.new()
    completions = [stream.enqueue(after(gate, 0))]
    completions += [stream.enqueue(lambda index=index: index) for index in range(1, 5)]
    resolved: list[int] = []
    for index, completion in enumerate(completions):
        completion.future.add_done_callback(lambda _, index=index: resolved.append(index))
    gate.set()
    await completions[-1]
    assert resolved == [0, 1, 2, 3, 4]


@pytest.mark.asyncio
async def test_enqueue_returns_before_the_work_finishes(stream: DeviceStream,
                                                        gates: Gates) -> None:
    gate = gates.new()
    completion = stream.enqueue(after(gate, "verified"))
    # Reaching this line with the gate still closed is the point: the host did not wait.
    assert not gate.is_set()
    assert not completion.done()
    gate.set()
    assert await completion == "verified"


@pytest.mark.asyncio
async def test_an_error_surfaces_on_its_own_completion_and_later_work_still_runs(
        cpu_stream: DeviceStream) -> None:
    def failing() -> int:
        raise ValueError("sample stage failed")

    failed = cpu_stream.enqueue(failing)
    later = cpu_stream.enqueue(lambda: 7)
    with pytest.raises(ValueError, match="^sample stage failed$"):
        await failed
    assert await later == 7


class Unusual(BaseException):
    """Raised on purpose: a BaseException that is neither Ctrl-C nor SystemExit."""


@pytest.mark.asyncio
async def test_worker_stream_delivers_a_base_exception_as_an_error_and_serves_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_STREAM_ENV, "worker")
    stream = open_stream("cpu", asyncio.get_running_loop())

    def unusual() -> None:
        raise Unusual("not an Exception")

    failed = stream.enqueue(unusual)
    later = stream.enqueue(lambda: 7)
    with pytest.raises(RuntimeError, match="^stream work interrupted by Unusual$"):
        await failed
    assert await later == 7  # the worker thread lived on
    stream.close()


@pytest.mark.asyncio
async def test_stop_iteration_from_work_is_delivered_as_an_error(
        cpu_stream: DeviceStream) -> None:
    def exhausted() -> int:
        return next(iter(()))

    with pytest.raises(RuntimeError, match="StopIteration") as info:
        await cpu_stream.enqueue(exhausted)
    assert isinstance(info.value.__cause__, StopIteration)


@pytest.mark.asyncio
async def test_a_cancelled_completion_is_skipped_and_the_stream_carries_on(
        stream: DeviceStream, gates: Gates, loop_errors: list[dict[str, Any]]) -> None:
    gate = gates.new()
    cancelled = stream.enqueue(after(gate, 0))
    later = stream.enqueue(lambda: 1)
    cancelled.future.cancel()
    gate.set()
    assert await later == 1
    assert cancelled.future.cancelled()
    assert loop_errors == []  # settling a cancelled future would have raised InvalidStateError


@pytest.mark.asyncio
async def test_close_drains_the_work_enqueued_before_it(cpu_stream: DeviceStream) -> None:
    ran: list[int] = []
    completions = [cpu_stream.enqueue(recording(ran, index)) for index in range(5)]
    cpu_stream.close()
    assert ran == [0, 1, 2, 3, 4]  # close() returned, so the stream got through all of it
    assert [await completion for completion in completions] == [0, 1, 2, 3, 4]


@pytest.mark.asyncio
async def test_close_while_work_is_queued_still_runs_that_work(stream: DeviceStream,
                                                               gates: Gates) -> None:
    gate = gates.new()
    ran: list[int] = []

    def close_then_return() -> str:
        after(gate, None)()
        stream.close()  # items 1 and 2 are provably still queued behind this one
        return "closed"

    completions = [stream.enqueue(close_then_return)]
    completions += [stream.enqueue(recording(ran, index)) for index in (1, 2)]
    gate.set()
    assert [await completion for completion in completions] == ["closed", 1, 2]
    assert ran == [1, 2]


@pytest.mark.asyncio
async def test_close_is_idempotent_and_joins_the_worker(stream: DeviceStream) -> None:
    assert await stream.enqueue(lambda: 1) == 1
    stream.close()
    stream.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("adaspec-cpu-")] == []


@pytest.mark.asyncio
async def test_enqueue_after_close_raises(cpu_stream: DeviceStream) -> None:
    cpu_stream.close()
    cpu_stream.close()
    with pytest.raises(StreamClosed, match=r"^the cpu stream is closed; no work can be enqueued"):
        cpu_stream.enqueue(lambda: 1)


# ---- opening streams on devices this host lacks -----------------------------------------


@pytest.mark.asyncio
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here")
async def test_open_stream_npu_without_torch_npu_is_refused_naming_the_flag() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^--device=npu: torch_npu cannot be imported"):
        open_stream("npu", asyncio.get_running_loop())


@pytest.mark.asyncio
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
async def test_open_stream_cuda_without_a_gpu_is_refused_naming_the_flag() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^--device=cuda: no CUDA device is visible"):
        open_stream("cuda", asyncio.get_running_loop())


@pytest.mark.asyncio
async def test_open_stream_unknown_device_is_refused() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^--device=tpu: expected one of cpu\|cuda\|npu"):
        open_stream("tpu", asyncio.get_running_loop())


# ---- retire copy ------------------------------------------------------------------------


def feedback_of_a_round() -> dict[str, torch.Tensor]:
    return {"num_accepted": torch.tensor([3, 0, 5]),
            "confidences": torch.tensor([[0.9, 0.5], [0.2, 0.1], [0.8, 0.7]])}


def test_retire_copy_on_cpu_returns_copies_that_do_not_alias_the_slot_buffers() -> None:
    feedback = feedback_of_a_round()
    host = retire_copy(feedback)
    assert host.keys() == feedback.keys()
    for name, tensor in feedback.items():
        assert host[name].data_ptr() != tensor.data_ptr()
        tensor.fill_(-1)  # round n + 2 reuses the slot
    expected = feedback_of_a_round()
    for name in expected:
        assert torch.equal(host[name], expected[name])


@pytest.mark.asyncio
async def test_retire_reads_what_earlier_stages_wrote_without_a_host_wait(
        stream: DeviceStream, gates: Gates) -> None:
    gate = gates.new()
    num_accepted = torch.zeros(3, dtype=torch.int64)

    def commit() -> None:
        after(gate, None)()
        num_accepted.copy_(torch.tensor([3, 0, 5]))

    stream.enqueue(commit)
    retired = enqueue_retire(stream, {"num_accepted": num_accepted})
    gate.set()  # the retire copy was enqueued while commit had provably not run yet
    host = await retired
    num_accepted.fill_(-1)
    assert host["num_accepted"].tolist() == [3, 0, 5]


@pytest.mark.asyncio
async def test_enqueue_retire_snapshots_the_feedback_mapping(stream: DeviceStream,
                                                             gates: Gates) -> None:
    gate = gates.new()
    stream.enqueue(after(gate, None))
    feedback = feedback_of_a_round()
    retired = enqueue_retire(stream, feedback)
    feedback["num_accepted"] = torch.tensor([9, 9, 9])  # next round's buffers, rebound early
    del feedback["confidences"]
    gate.set()
    host = await retired
    assert host["num_accepted"].tolist() == [3, 0, 5]
    assert set(host) == {"num_accepted", "confidences"}


# ---- torch stream logic, on a scripted stand-in for torch.cuda ---------------------------


@dataclass
class ScriptedEvent:
    finished: threading.Event
    faulty: bool

    def record(self, stream: str) -> None:
        pass

    def synchronize(self) -> None:
        if not self.finished.wait(GATE_TIMEOUT_S):
            raise AssertionError("the test never let the device finish")
        if self.faulty:
            raise RuntimeError("device fault")


class ScriptedDevice:
    """Stands in for torch.cuda: a device that finishes the work before its i-th recorded
    event only when the test opens ``finished(i)``, so the launcher's lead is observable."""

    def __init__(self, gates: Gates, faults: frozenset[int] = frozenset()) -> None:
        self._gates = gates
        self._faults = faults  # events whose synchronize reports a device error
        self._finished: dict[int, threading.Event] = {}
        self._lock = threading.Lock()  # the test and the launcher both ask for gates
        self.num_events = 0
        self.in_stream = False

    def finished(self, index: int) -> threading.Event:
        with self._lock:
            if index not in self._finished:
                self._finished[index] = self._gates.new()
            return self._finished[index]

    def current_device(self) -> int:
        return 0

    def Stream(self, device: torch.device) -> str:  # mirrors torch.cuda.Stream
        return f"side stream on {device}"

    @contextlib.contextmanager
    def stream(self, stream: str) -> Iterator[None]:
        self.in_stream = True
        try:
            yield
        finally:
            self.in_stream = False

    def Event(self) -> ScriptedEvent:  # mirrors torch.cuda.Event; only the launcher calls it
        index = self.num_events
        self.num_events += 1
        return ScriptedEvent(self.finished(index), index in self._faults)


@contextlib.asynccontextmanager
async def scripted_stream(device: ScriptedDevice, gates: Gates,
                          monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TorchStream]:
    monkeypatch.setattr(torch, "cuda", device)
    opened = TorchStream("cuda", asyncio.get_running_loop())
    try:
        yield opened
    finally:
        gates.open_all()
        opened.close()


def launching(device: ScriptedDevice, index: int, last: threading.Event) -> Callable[[], int]:
    def work() -> int:
        assert device.in_stream
        if index == 0:
            raise ValueError("draft stage failed")
        if index == 3:
            last.set()
        return index
    return work


@pytest.mark.asyncio
async def test_torch_stream_launches_ahead_and_resolves_in_order_after_the_device(
        gates: Gates, monkeypatch: pytest.MonkeyPatch) -> None:
    device = ScriptedDevice(gates, faults=frozenset({1}))
    async with scripted_stream(device, gates, monkeypatch) as stream:
        last_launched = threading.Event()
        completions = [stream.enqueue(launching(device, index, last_launched))
                       for index in range(4)]
        assert last_launched.wait(GATE_TIMEOUT_S)  # the host launched all four ...
        await asyncio.sleep(0)  # ... and the loop ran: had anything been posted, it is done
        assert not any(completion.done() for completion in completions)
        resolved: list[int] = []
        for index, completion in enumerate(completions):
            completion.future.add_done_callback(lambda _, index=index: resolved.append(index))
        for index in range(4):
            device.finished(index).set()
        with pytest.raises(ValueError, match="^draft stage failed$"):
            await completions[0]  # an item that raised still waited for its event
        with pytest.raises(RuntimeError, match="^device fault$"):
            await completions[1]
        assert [await completion for completion in completions[2:]] == [2, 3]
        await asyncio.sleep(0)  # awaiting a done future does not yield: let the callbacks run
        assert resolved == [0, 1, 2, 3]
        assert device.num_events == 4


# ---- cuda stream (skipped without a GPU) ------------------------------------------------


@needs_cuda
@pytest.mark.asyncio
async def test_cuda_stream_runs_in_order_and_resolves_after_the_device_finished(
        cuda_stream: DeviceStream) -> None:
    assert isinstance(cuda_stream, TorchStream)
    buffer = torch.zeros(1 << 20, device=cuda_stream.device)
    torch.cuda.synchronize()  # the zeros were written on the default stream

    def slow_add(value: float) -> Callable[[], torch.Tensor]:
        def work() -> torch.Tensor:
            torch.cuda._sleep(10_000_000)  # keeps the device busy long after the launch
            return buffer.add_(value)
        return work

    completions = [cuda_stream.enqueue(slow_add(float(step))) for step in range(1, 4)]
    resolved: list[int] = []
    for index, completion in enumerate(completions):
        completion.future.add_done_callback(lambda _, index=index: resolved.append(index))
    await completions[-1]
    assert cuda_stream.stream.query()  # the device had finished when the completion resolved
    assert resolved == [0, 1, 2]
    assert buffer[0].item() == 6.0


@needs_cuda
@pytest.mark.asyncio
async def test_cuda_stream_error_surfaces_and_later_work_runs(
        cuda_stream: DeviceStream) -> None:
    def failing() -> None:
        raise ValueError("verify stage failed")

    failed = cuda_stream.enqueue(failing)
    later = cuda_stream.enqueue(lambda: torch.ones(2, device=cuda_stream.device).sum())
    with pytest.raises(ValueError, match="^verify stage failed$"):
        await failed
    assert (await later).item() == 2.0


@needs_cuda
@pytest.mark.asyncio
async def test_cuda_retire_copies_into_pinned_host_memory(cuda_stream: DeviceStream) -> None:
    device_feedback = {name: t.to(cuda_stream.device)
                       for name, t in feedback_of_a_round().items()}
    torch.cuda.synchronize()  # copied on the default stream, read on the runtime's stream
    host = await enqueue_retire(cuda_stream, device_feedback)
    await cuda_stream.enqueue(lambda: [t.fill_(-1) for t in device_feedback.values()])
    expected = feedback_of_a_round()
    for name, tensor in host.items():
        assert tensor.device.type == "cpu"
        assert tensor.is_pinned()
        assert torch.equal(tensor, expected[name])


@pytest.mark.asyncio
async def test_on_done_runs_on_the_loop_right_after_each_completion_in_order(
        stream: DeviceStream) -> None:
    seen: list[tuple[int, bool]] = []
    loop_thread = threading.get_ident()

    def record(index: int) -> Callable[["asyncio.Future[int]"], None]:
        def on_done(future: "asyncio.Future[int]") -> None:
            assert threading.get_ident() == loop_thread
            seen.append((future.result(), future.done()))
        return on_done

    completions = [stream.enqueue(recording([], i), record(i)) for i in range(5)]
    assert await completions[-1] == 4
    assert seen == [(i, True) for i in range(5)]
