"""Every request ends whatever happens to the caller of ``stop`` or to the round loop, and a
broken event subscriber neither fails requests nor stops serving."""

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import TINY_CALIBRATION, config, decode, lossless_prompts

from adaspec.config import SamplingParams
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.runtime.engine import Runtime, RuntimeOptions, RuntimeStopped
from adaspec.runtime.events.types import Event, RequestFinished, RoundRetired
from adaspec.runtime.requests import RequestFailed, RequestResult

PROMPTS = lossless_prompts()[:6]
REPO = Path(__file__).resolve().parents[1]
TOKENS = 40


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


def greedy(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=TOKENS) for _ in range(count)]


@pytest.fixture(scope="module")
def target_only(models: ReferenceModels) -> list[tuple[int, ...]]:
    return [r.token_ids for r in decode(config("none", 0, 4), PROMPTS, greedy(len(PROMPTS)),
                                        models)]


HANG = 120.0
"""Seconds after which a request still waiting fails the test instead of hanging the suite
(the tests themselves never wait that long: every request here ends within seconds)."""


async def outcomes(handles: list[Any]) -> list[RequestResult | BaseException]:
    every = asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
    return list(await asyncio.wait_for(every, HANG))


def test_a_cancelled_stop_still_ends_every_request_and_a_second_stop_waits_for_it(
        models: ReferenceModels, target_only: list[tuple[int, ...]]) -> None:
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    async def run() -> tuple[list[Any], bool, bool]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(6), strict=True)]
        first = asyncio.ensure_future(runtime.stop())
        for _ in range(3):  # let the first stop begin its shutdown
            await asyncio.sleep(0)
        first.cancel()  # what wait_for does to it on a timeout (0.05 s in the report)
        with pytest.raises(asyncio.CancelledError):
            await first
        still_running = not all(h.done for h in handles)
        await runtime.stop()  # waits for the shutdown the first one began
        ended = all(h.done for h in handles)
        return await outcomes(handles), still_running, ended

    results, still_running, ended = asyncio.run(run())
    assert still_running  # the cancel came while requests were decoding
    assert ended
    assert [r.token_ids for r in results if isinstance(r, RequestResult)] == target_only


def test_a_cancelled_round_loop_fails_every_request_in_one_line(
        models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    async def run() -> list[Any]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(6), strict=True)]
        await handles[0].__aiter__().__anext__()  # decoding has begun
        assert runtime._task is not None
        runtime._task.cancel()  # as when the event loop shuts down under a running runtime
        results = await outcomes(handles)
        await runtime.stop()  # releases the stream and files all the same
        assert runtime._stream is None
        return results

    results = asyncio.run(run())
    failed = [r for r in results if isinstance(r, RequestFailed)]
    assert failed  # the requests that were still decoding or waiting
    assert all(isinstance(r, RequestFailed | RequestResult) for r in results)
    for error in failed:
        assert str(error).endswith("runtime stopped: its loop was interrupted "
                                   "(CancelledError)")
        assert "\n" not in str(error)


INTERRUPTED_RUN = """
import asyncio, json, sys
from adaspec.config import SamplingParams, load_config
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.events.types import RequestFinished

runtime = Runtime(load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": 3,
                               "max_seqs_per_batch": 2}),
                  options=RuntimeOptions(event_log=sys.argv[1]))
handles = []

def interrupted(event):
    if isinstance(event, RequestFinished) and event.reason == "failed":
        raise KeyboardInterrupt

async def run():
    await runtime.start()
    runtime.bus.subscribe(interrupted)
    handles.extend(runtime.submit(list(b"ROMEO. " * (i + 1)),
                                  SamplingParams(temperature=0.0, max_tokens=40))
                   for i in range(6))
    await handles[0].__aiter__().__anext__()  # decoding has begun
    runtime._task.cancel()  # the loop fails every request, and the subscriber interrupts
    await asyncio.sleep(60)

try:
    asyncio.run(run())
except KeyboardInterrupt:
    print("interrupted")
print("ended", sum(h.done for h in handles), "active", len(runtime._pipeline.active))
asyncio.run(runtime.stop())
print("stopped")
"""


def test_an_interrupt_while_failing_requests_leaves_none_of_them_active(
        tmp_path: Path) -> None:
    """A subscriber's KeyboardInterrupt reaches the caller after every request has ended
    and left the batch, and a later stop closes the event log instead of raising the
    interrupt again. A process of its own: the interrupt unwinds asyncio.run as Ctrl-C
    does, leaving its half-finished tasks to that process."""
    log = tmp_path / "run.jsonl"
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_RUN, str(log)], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG)
    assert done.stdout.splitlines() == ["interrupted", "ended 6 active 0", "stopped"], \
        done.stderr[-2000:]
    finished = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()
                if '"request_finished"' in line]
    assert sorted(event["request_id"] for event in finished) == list(range(6))


@pytest.mark.parametrize("bug", [RuntimeError("observer bug on finish"),
                                 asyncio.CancelledError(), GeneratorExit()])
def test_a_raising_subscriber_is_dropped_and_every_request_decodes_exactly(
        models: ReferenceModels, target_only: list[tuple[int, ...]],
        caplog: pytest.LogCaptureFixture, bug: BaseException) -> None:
    """A plain call cannot be cancelled by the loop: a subscriber raising CancelledError or
    GeneratorExit is as broken as one raising any other error."""
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    def on_finished(event: Event) -> None:
        if isinstance(event, RequestFinished):
            raise bug

    def on_retired(event: Event) -> None:
        if isinstance(event, RoundRetired):
            raise KeyError("observer bug on retire")

    async def run() -> tuple[list[Any], list[Any], int]:
        await runtime.start()
        runtime.subscribe(on_finished)
        runtime.subscribe(on_retired)
        first = [await runtime.submit(list(p), q).result()
                 for p, q in zip(PROMPTS[:3], greedy(3), strict=True)]
        later = await outcomes([runtime.submit(list(p), q)
                                for p, q in zip(PROMPTS[3:], greedy(3), strict=True)])
        await runtime.stop()
        assert runtime._pipeline is not None
        return first, later, runtime._pipeline.kv_slots.num_free

    with caplog.at_level(logging.ERROR, logger="adaspec.events"):
        first, later, free = asyncio.run(run())
    assert [r.token_ids for r in [*first, *later]] == target_only
    assert free == 4  # every KV slot is back
    assert set(runtime.bus.dropped) == {on_finished, on_retired}
    names = sorted(r.getMessage().split(" raised ")[0].rsplit(".", 1)[1]
                   for r in caplog.records)
    assert names == ["on_finished", "on_retired"]  # each logged once


def test_a_loop_cancelled_before_its_first_step_still_ends_every_request(
        models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    async def run() -> list[Any]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(6), strict=True)]
        assert runtime._task is not None
        runtime._task.cancel()  # no await in between: the loop never runs a step
        await runtime.stop()
        return await outcomes(handles)

    results = asyncio.run(run())
    assert all(isinstance(r, RequestFailed) for r in results)
    assert all(str(r).endswith("its loop was interrupted (CancelledError)") for r in results)


def test_start_is_refused_while_running_or_shutting_down_and_a_restart_opens_fresh_observers(
        models: ReferenceModels, target_only: list[tuple[int, ...]], tmp_path: Any) -> None:
    from adaspec.runtime.engine import RuntimeOptions, RuntimeStopped

    first, second = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    runtime = Runtime(config("DSpark", 3, 2), models=models,
                      options=RuntimeOptions(trace=str(first)))

    async def run() -> list[Any]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(6), strict=True)]
        with pytest.raises(RuntimeStopped, match="await stop\\(\\) before starting it again"):
            await runtime.start()  # would reset the KV caches under the requests
        stopping = asyncio.ensure_future(runtime.stop())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeStopped, match="still shutting down"):
            await runtime.start()
        await stopping
        results = await outcomes(handles)
        runtime.options = RuntimeOptions(trace=str(second))
        await runtime.start()  # a stopped runtime starts again
        results += await outcomes([runtime.submit(list(PROMPTS[0]), greedy(1)[0])])
        await runtime.stop()
        return results

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == [*target_only, target_only[0]]
    assert runtime.hooks.empty  # the first run's trace hook went with it
    assert len(second.read_text().splitlines()) < len(first.read_text().splitlines())


@pytest.mark.parametrize("yields", [0, 1, 2])
def test_a_stop_during_a_start_abandons_it_and_no_request_is_left_waiting(
        models: ReferenceModels, yields: int) -> None:
    # Before, the start went on after the stop had closed the stream: submit was accepted
    # and its request waited forever (or the start died on an AttributeError).
    async def race() -> None:
        runtime = Runtime(config("MTP", 3, 2), models=models)
        starting = asyncio.ensure_future(runtime.start())
        for _ in range(yields):
            await asyncio.sleep(0)
        started, stopped = await asyncio.gather(starting, runtime.stop(),
                                                return_exceptions=True)
        assert isinstance(started, RuntimeStopped)
        assert str(started).startswith("stop() was called while the runtime was starting")
        assert stopped is None
        with pytest.raises(RuntimeStopped):
            runtime.submit([1, 2], greedy(1)[0])
        await runtime.start()  # a start after it works
        result = await runtime.submit([1, 2], greedy(1)[0]).result()
        await runtime.stop()
        assert result.finish_reason == "length"

    asyncio.run(race())


def test_a_stop_while_the_bindings_are_prepared_waits_for_one_binding_not_all(
        models: ReferenceModels, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, every (Bcap, G) binding of a slot was prepared in one work item: a signal to
    # bench or serve during the start took effect 5 to 24 s later on a loaded 2-core machine.
    from adaspec.runtime.devices.buckets import BindingRegistry

    runtime = Runtime(config("DSpark", 5, 16, enable_adaptive_target_verify=True),
                      models=models)
    prepared: list[tuple[int, int]] = []
    prepare = BindingRegistry.prepare

    def prepare_then_stop(registry: BindingRegistry, pairs: Any) -> None:  # the fault
        pairs = list(pairs)
        prepare(registry, pairs)
        prepared.extend(pairs)
        if len(prepared) == len(pairs):  # the first work item: ask for a stop after it
            asyncio.get_running_loop().call_soon(asyncio.ensure_future, runtime.stop())

    monkeypatch.setattr(BindingRegistry, "prepare", prepare_then_stop)

    async def run() -> None:
        with pytest.raises(RuntimeStopped, match="^stop\\(\\) was called while"):
            await asyncio.wait_for(runtime.start(), HANG)

    asyncio.run(run())
    assert len(prepared) <= 2  # the one in hand, and one begun before the stop ran


def test_a_stop_during_calibration_leaves_no_task_pending_and_a_restart_decodes_exactly(
        models: ReferenceModels, target_only: list[tuple[int, ...]], tmp_path: Any) -> None:
    # Before, a stop that closed the stream as the calibration pipeline admitted requests
    # lost them (their prefill could not be enqueued, and the loop's fault found them
    # nowhere): the start waited forever, and its wait tasks were destroyed pending at exit.
    # A stop also returned while the abandoned start was still unwinding.
    calibration = tmp_path / "tiny.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    measured = asyncio.Event()
    runtime = Runtime(config("DSpark", 5, 2, enable_adaptive_target_verify=True,
                             adaptive_target_verify_calibration=str(calibration)),
                      models=models,
                      options=RuntimeOptions(calibration_progress=lambda _: measured.set()))

    async def abandon(yields: int | None) -> None:
        starting = asyncio.ensure_future(runtime.start())
        if yields is None:
            await measured.wait()  # in the middle of calibrating: one window measured
        for _ in range(yields or 0):
            await asyncio.sleep(0)
        await asyncio.wait_for(runtime.stop(), HANG)
        pending = [t for t in asyncio.all_tasks()
                   if t is not asyncio.current_task() and not t.done()]
        assert not pending, (yields, pending)  # the start and its calibration ended with it
        assert starting.done()
        with pytest.raises(RuntimeStopped, match="^stop\\(\\) was called while"):
            await starting

    async def run() -> list[Any]:
        for yields in [*range(8), None]:
            await abandon(yields)
        await runtime.start()  # the same runtime calibrates again and serves
        results = await outcomes([runtime.submit(list(p), q)
                                  for p, q in zip(PROMPTS[:2], greedy(2), strict=True)])
        await runtime.stop()
        return results

    results = asyncio.run(run())
    assert runtime.costs is not None
    assert [r.token_ids for r in results] == target_only[:2]


def test_a_prefill_that_cannot_be_enqueued_fails_its_requests_instead_of_losing_them(
        models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    async def run() -> list[Any]:
        await runtime.start()
        assert runtime._stream is not None
        runtime._stream.close()  # the stream now refuses work, as a broken device would
        results = await outcomes([runtime.submit(list(p), q)
                                  for p, q in zip(PROMPTS[:3], greedy(3), strict=True)])
        await runtime.stop()
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, RequestFailed) for r in results)
    assert all("runtime fault: StreamClosed" in str(r) for r in results)


def test_a_start_cancelled_during_calibration_leaves_no_task_pending(
        models: ReferenceModels, tmp_path: Any) -> None:
    # A caller's timeout (wait_for(start(), t)) cancels the start mid-window: the window's
    # wake-up task was left pending, destroyed at exit with a warning.
    calibration = tmp_path / "tiny.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    starting: list[asyncio.Future[None]] = []
    runtime = Runtime(config("DSpark", 5, 2, enable_adaptive_target_verify=True,
                             adaptive_target_verify_calibration=str(calibration)),
                      models=models,
                      options=RuntimeOptions(calibration_progress=lambda _: starting[0].cancel()))

    async def run() -> None:
        starting.append(asyncio.ensure_future(runtime.start()))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(starting[0], HANG)
        await asyncio.wait_for(runtime.stop(), HANG)
        pending = [t for t in asyncio.all_tasks()
                   if t is not asyncio.current_task() and not t.done()]
        assert not pending

    asyncio.run(run())
