"""Misuse of the embedding API is refused at the call, in one line naming the argument or the
option, the value and what is expected: never a raw AttributeError from deep inside, never an
option accepted only to fail every request later."""

import asyncio
import functools
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from runtime_helpers import TINY_CALIBRATION, config, first_failure

from adaspec.config import SamplingParams, load_config
from adaspec.errors import ConfigError, DeviceLayerError, InvalidRequest
from adaspec.models import load_reference_models
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.runtime.engine import Runtime, RuntimeOptions, RuntimeStopped, WrongLoop
from adaspec.runtime.events.clock import VirtualClock
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay_file
from adaspec.runtime.events.types import RequestArrived, RequestFinished, RoundSubmitted
from adaspec.runtime.requests import RequestFailed


class Policy:
    """A policy with the protocol's members and nothing else."""

    name = "minimal"

    def decide(self, context: Any) -> int:
        return 1

    def observe(self, feedback: Any) -> None:
        """Nothing to learn."""

    def statistics(self) -> Any:
        return None

    def settings(self) -> dict[str, object]:
        return {}


class NoObserve:
    name = "half"

    def decide(self, context: Any) -> int:
        return 1


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("event_log", 7, "expected a file path (a str or os.PathLike) or None"),
    ("event_log", b"/tmp/log.jsonl", "expected a file path (a str or os.PathLike) or None"),
    ("trace", ["/tmp/t.jsonl"], "expected a file path (a str or os.PathLike) or None"),
    # '-' is the trace's stderr; an event log is for replay, so it is always a file.
    ("event_log", "-", "expected a file path: replay reads an event log back from its file"),
    ("trace", "", "expected a file path, or None for no trace"),
    ("event_log", "", "expected a file path, or None for no event log"),
    ("clock", "x", "expected a Clock (adaspec.runtime.events.clock: now() returns seconds) "
                   "or None; it has no now"),
    ("clock", VirtualClock, "got a class: pass an instance"),
    ("stage_hook", 5, "expected a callable, called with (round, stage), or None"),
    ("calibration_progress", 3, "expected a callable, called with (measured point), or None"),
    ("depth_policy", "fixed", "expected a DepthPolicy (adaspec.policies.base) or None; it has "
                              "no name"),
    ("depth_policy", NoObserve(), "it has no observe"),
    ("budget_policy", 3, "expected a BudgetPolicy (adaspec.policies.base) or None"),
    ("budget_policy", FullBudget, "got a class: pass an instance"),
])
def test_runtime_options_of_the_wrong_kind_are_refused_naming_the_option(
        option: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        RuntimeOptions(**{option: value})  # type: ignore[arg-type]
    message = str(raised.value)
    assert message.startswith(f"RuntimeOptions.{option}=")
    assert expected in message
    assert "\n" not in message


async def async_hook(round: int, stage: str) -> None:
    raise RuntimeError("never runs: nobody awaits it")


class Named(Policy):
    """A policy of the protocol under any name, with any settings."""

    def __init__(self, name: object, settings: object = None) -> None:
        self.name = name  # type: ignore[assignment]
        self._settings = {} if settings is None else settings

    def settings(self) -> Any:
        return self._settings


class RaisingSettings(Named):
    def settings(self) -> Any:
        raise RuntimeError("boom")


class SubFixed(FixedDepth):
    def decide(self, context: Any) -> int:
        return 1


class AsyncCall:
    async def __call__(self, round: int, stage: str) -> None:
        """Never awaited by the runtime."""


@pytest.mark.parametrize(("option", "value", "message"), [
    ("stage_hook", async_hook, "RuntimeOptions.stage_hook=<function async_hook at "),
    ("depth_policy", Named("fixed"), "RuntimeOptions.depth_policy.name=fixed: is a built-in "
                                     "policy's name; expected another, so that a replay does "
                                     "not rebuild the built-in one in this policy's place"),
    ("budget_policy", Named(5), "RuntimeOptions.budget_policy.name=5: expected a non-empty str"),
    ("budget_policy", Named("mine", {"x": float("nan")}),
     "RuntimeOptions.budget_policy.settings()['x']=nan: expected a str key and a JSON value"),
    ("depth_policy", Named("mine", {"x": object()}),
     "RuntimeOptions.depth_policy.settings()['x']=<object"),
    # JSON would hold these otherwise than the policy returned them.
    ("depth_policy", Named("mine", {"x": {1: 2}}), "RuntimeOptions.depth_policy.settings()"
                                                   "['x']={1: 2}: expected a str key"),
    ("depth_policy", Named("mine", {"x": (1, 2)}), "RuntimeOptions.depth_policy.settings()"
                                                   "['x']=(1, 2): expected a str key"),
    ("budget_policy", RaisingSettings("mine"), "RuntimeOptions.budget_policy.settings(): "
                                               "raised RuntimeError: boom; expected a dict"),
    # A subclass of a built-in policy decides otherwise under its name.
    ("depth_policy", SubFixed(), "RuntimeOptions.depth_policy.name=fixed: is a built-in "
                                 "policy's name"),
    ("stage_hook", functools.partial(AsyncCall()), "RuntimeOptions.stage_hook="),
])
def test_an_option_the_runtime_could_not_run_or_record_is_refused_naming_it(
        option: str, value: object, message: str) -> None:
    """An async hook would never run; an own policy named like a built-in one would be
    rebuilt as that one by a replay; settings an event log cannot hold would fail the start
    with the JSON encoder's words."""
    with pytest.raises(ConfigError) as raised:
        RuntimeOptions(**{option: value})  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_runtime_options_take_path_likes_and_protocol_objects(tmp_path: Path) -> None:
    options = RuntimeOptions(event_log=tmp_path / "run.jsonl",  # type: ignore[arg-type]
                             trace=tmp_path / "trace.jsonl",  # type: ignore[arg-type]
                             clock=VirtualClock(), stage_hook=lambda _round, _stage: None,
                             depth_policy=FixedDepth(), budget_policy=Policy(),
                             calibration_progress=print)
    assert options.event_log == os.fspath(tmp_path / "run.jsonl")
    assert options.trace == os.fspath(tmp_path / "trace.jsonl")


@pytest.mark.parametrize(("launch", "option", "message"), [
    ({"speculative_algorithm": "none"}, "depth_policy",
     "RuntimeOptions.depth_policy=fixed: expected None with speculative_algorithm=none: that "
     "launch drafts nothing, so there is no draft depth or verify width to decide"),
    ({"speculative_algorithm": "none"}, "budget_policy",
     "RuntimeOptions.budget_policy=full: expected None with speculative_algorithm=none"),
    ({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
      "enable_unified_mtp_graph": True}, "depth_policy",
     "RuntimeOptions.depth_policy=fixed: expected None with enable_unified_mtp_graph=true: a "
     "unified graph runs each round at the depth it was prepared for"),
])
def test_an_own_policy_the_launch_cannot_follow_is_refused_at_construction(
        launch: dict[str, object], option: str, message: str) -> None:
    """Before, the runtime started and every request failed at round 0 ("chose depth 1;
    expected an integer 1..0", "this unified binding was prepared for ... depth 3"), or a
    budget policy was asked and never followed."""
    policy = FixedDepth() if option == "depth_policy" else FullBudget()
    options = RuntimeOptions(**{option: policy})  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as raised:
        Runtime(load_config(launch), options=options)
    assert str(raised.value).startswith(message)


class UnreadableSeconds(float):
    """A fake reading: a float whose own conversion to float is broken."""

    def __float__(self) -> float:
        raise TypeError("no float for you")


class ReadingClock:
    """A fake clock that reads out ``readings`` one by one (the last one for ever after)."""

    def __init__(self, *readings: object) -> None:
        self.readings = list(readings)

    def now(self) -> object:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


@pytest.mark.parametrize(("reading", "expected"), [
    (float("nan"), "a finite number"), (float("inf"), "a finite number"),
    (float("-inf"), "a finite number"), (10**400, "a finite number"),
    ("1.0", "a real number; it returned a str"), (None, "a real number; it returned a NoneType"),
    (True, "a real number; it returned a bool"),
    (UnreadableSeconds(1.0), "a real number; float() of its UnreadableSeconds raised "
                             "TypeError: no float for you"),
])
def test_a_clock_that_reads_no_seconds_fails_the_start_naming_it(reading: object,
                                                                  expected: str) -> None:
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(clock=ReadingClock(reading)))
    with pytest.raises(ConfigError, match=r"^RuntimeOptions\.clock(=.*)?: expected now\(\) "
                                          rf"to return seconds as {re.escape(expected)}$"):
        asyncio.run(runtime.start())


class SwitchingClock:
    """A fake clock that counts up until ``bad`` is set, then reads ``bad_reading`` (or
    raises it, when it is an exception)."""

    def __init__(self, bad_reading: object) -> None:
        self.time, self.bad, self.bad_reading = 100.0, False, bad_reading

    def now(self) -> object:
        if not self.bad:
            self.time += 0.001
            return self.time
        if isinstance(self.bad_reading, Exception):
            raise self.bad_reading
        return self.bad_reading


@pytest.mark.parametrize(("bad", "words"), [
    (10**400, "expected now() to return seconds as a finite number"),
    (RuntimeError("clock broke"), "now() raised RuntimeError: clock broke"),
    (1.0, "expected now() never to go back"),
    (UnreadableSeconds(200.0), "float() of its UnreadableSeconds raised TypeError"),
])
@pytest.mark.parametrize("when", ["round", "cancel"])
def test_a_clock_failing_mid_run_ends_every_request_and_stop_returns(
        bad: object, words: str, when: str) -> None:
    """Whatever was being stamped (a round, a cancellation) completes on the last good
    reading; the round loop then fails every request naming the clock."""
    clock = SwitchingClock(bad)
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(clock=clock))
    outcomes: list[str] = []

    async def run() -> None:
        await runtime.start()
        handles = [runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                  max_tokens=200))
                   for _ in range(2)]

        def on_event(event: object) -> None:
            if isinstance(event, RoundSubmitted) and not clock.bad:
                clock.bad = True
                if when == "cancel":
                    runtime.cancel(handles[0].request_id)

        runtime.subscribe(on_event)
        for handle in handles:
            try:
                outcomes.append((await handle.result()).finish_reason)
            except RequestFailed as failed:
                outcomes.append(str(failed))
        await runtime.stop()

    asyncio.run(asyncio.wait_for(run(), 120))
    if when == "cancel":
        assert outcomes[0] == "cancelled"
    assert words in outcomes[-1]
    assert "RuntimeOptions.clock" in outcomes[-1]


def test_a_subscriber_cancels_a_request_as_it_arrives(tmp_path: Path) -> None:
    """The request is queued before its arrival is published, so a subscriber reacting to
    it finds it by id; the log records the arrival, then the cancel, and replays."""
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(event_log=log))

    def on_arrival(event: object) -> None:
        if isinstance(event, RequestArrived) and event.request_id == 0:
            runtime.cancel(event.request_id)

    async def run() -> list[tuple[str, int]]:
        await runtime.start()
        runtime.subscribe(on_arrival)
        handles = [runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                  max_tokens=8))
                   for _ in range(2)]
        results = [await handle.result() for handle in handles]
        await runtime.stop()
        return [(r.finish_reason, len(r.token_ids)) for r in results]

    assert asyncio.run(asyncio.wait_for(run(), 120)) == [("cancelled", 0), ("length", 8)]
    assert replay_file(str(log)).ok


def test_a_cancel_while_a_round_is_retired_waits_for_the_round(tmp_path: Path) -> None:
    """Request 0's finish makes a subscriber cancel request 1, which the same round ended
    too (same prompt, same budget): it keeps its own reason, and request 2, which the
    round did not end, is cancelled after the round's retirement; the log replays."""
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("MTP", 3, 4), options=RuntimeOptions(event_log=log))
    ids: list[int] = []

    def on_finish(event: object) -> None:
        if isinstance(event, RequestFinished) and event.request_id == ids[0]:
            runtime.cancel(ids[1])
            runtime.cancel(ids[2])

    async def run() -> list[tuple[str, int]]:
        await runtime.start()
        runtime.subscribe(on_finish)
        handles = [runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                  max_tokens=budget))
                   for budget in (12, 12, 40)]
        ids.extend(handle.request_id for handle in handles)
        results = [await handle.result() for handle in handles]
        await runtime.stop()
        return [(r.finish_reason, len(r.token_ids)) for r in results]

    outcomes = asyncio.run(asyncio.wait_for(run(), 120))
    assert outcomes[:2] == [("length", 12), ("length", 12)]
    assert outcomes[2][0] == "cancelled"
    assert 12 <= outcomes[2][1] < 40
    assert replay_file(str(log)).ok


@pytest.mark.parametrize("reading", [np.float32(3.5), np.int64(3), np.float64(3.5), 3])
def test_a_clock_reading_any_real_number_type_serves(reading: object) -> None:
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(clock=ReadingClock(reading)))

    async def run() -> int:
        await runtime.start()
        try:
            result = await runtime.submit(list(b"RO"), SamplingParams(temperature=0.0,
                                                                      max_tokens=4)).result()
        finally:
            await runtime.stop()
        return len(result.token_ids)

    assert asyncio.run(run()) == 4


def test_a_clock_that_goes_back_fails_the_request_naming_it_and_writes_no_bad_log(
        tmp_path: Path) -> None:
    """Before, its times went to the event log, which replay then refused."""
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(
        clock=ReadingClock(5.0, 5.0, 4.0), event_log=str(log)))

    assert "RuntimeOptions.clock=4.0: expected now() never to go back; it read 5.0 before" \
        in first_failure(runtime, 8)
    _, events = read_event_log(str(log))  # every event stamped with a good reading
    assert events
    assert all(event.time == 5.0 for event in events)


def test_a_runtime_is_built_from_an_effective_config_and_options_not_dicts() -> None:
    with pytest.raises(ConfigError, match=r"^Runtime\(config\)=.*: expected an EffectiveConfig; "
                                          r"build one with adaspec\.config\.load_config"):
        Runtime({"speculative_algorithm": "MTP"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^Runtime\(options\)=\{'seed': 1\}: expected a "
                                          r"RuntimeOptions or None; build one with "
                                          r"RuntimeOptions\("):
        Runtime(config("MTP", 2, 2), options={"seed": 1})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^Runtime\(collectives\)=x: expected a Collectives "
                                          r".*; it has no tp_rank$"):
        Runtime(config("MTP", 2, 2), collectives="x")  # type: ignore[arg-type]


def test_misused_requests_cancels_and_unsubscribes_are_refused_in_one_line() -> None:
    runtime = Runtime(config("MTP", 2, 2), models=load_reference_models())

    async def run() -> None:
        await runtime.start()
        try:
            for params in (None, {"max_tokens": 2}, "greedy"):
                with pytest.raises(InvalidRequest) as raised:
                    runtime.submit([1, 2], params)  # type: ignore[arg-type]
                assert str(raised.value).startswith("request field params=")
                assert str(raised.value).endswith(
                    ": expected a SamplingParams; build one with SamplingParams(...) or "
                    "SamplingParams.from_request(fields)")
            for request_id in ("x", None, 1.5, True):
                with pytest.raises(TypeError, match=r"^cancel\(request_id=.*\): expected an "
                                                    r"int request id"):
                    runtime.cancel(request_id)  # type: ignore[arg-type]
            for request_id in (0, -1, 12345):  # ids no submit gave: a caller's slip, said
                with pytest.raises(ValueError, match=rf"^cancel\(request_id={request_id}\): no "
                                                     r"request has that id; nothing was "
                                                     r"submitted yet$"):
                    runtime.cancel(request_id)
            with pytest.raises(ValueError, match=r"^unsubscribe\(.*\): that handler was not "
                                                 r"subscribed"):
                runtime.unsubscribe(lambda event: None)
            handle = runtime.submit([1, 2], SamplingParams(temperature=0, max_tokens=2))
            assert len((await asyncio.wait_for(handle.result(), 60)).token_ids) == 2
            runtime.cancel(np.int64(0))  # type: ignore[arg-type]  # ended: left alone
            with pytest.raises(ValueError, match=r"^cancel\(request_id=1\): no request has "
                                                 r"that id; expected one submit gave \(0\.\.0\)$"):
                runtime.cancel(np.int64(1))  # type: ignore[arg-type]  # numpy ints are ids too
        finally:
            await runtime.stop()

    asyncio.run(run())


EXPECTED_PROMPT = ("expected the prompt's token ids in order: a list or tuple of ints, bytes, "
                   "or a 1-d integer array")


@pytest.mark.parametrize(("prompt", "shown"), [
    ({65: 1, 66: 2}, "dict"),  # its keys would be taken, in whatever order
    ({65, 66}, "set"),  # no order at all
    ((token for token in [65]), "generator"),
    (None, "NoneType"),
    ("RO", "str"),
    (np.array(65), "ndarray of 0 dimensions and dtype int64"),
    (torch.tensor([[65, 66]]), "Tensor of 2 dimensions and dtype torch.int64"),
    (np.array([65.0]), "ndarray of 1 dimensions and dtype float64"),
    (torch.empty(3, dtype=torch.int64, device="meta"), "Tensor on the meta device"),
    ([65, 66.0], "66.0"),  # named by its index, as below
])
def test_a_prompt_that_is_no_ordered_sequence_of_ints_is_refused_naming_it(
        prompt: object, shown: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    runtime = Runtime(config("MTP", 2, 2), models=load_reference_models())

    async def run() -> None:
        await runtime.start()
        try:
            with pytest.raises(InvalidRequest) as raised:
                runtime.submit(prompt, params)  # type: ignore[arg-type]
            field = "prompt[1]" if shown == "66.0" else "prompt"
            assert str(raised.value).startswith(f"request field {field}={shown}: "
                                                f"{EXPECTED_PROMPT}")
        finally:
            await runtime.stop()

    asyncio.run(run())


def test_integer_arrays_and_bytes_are_prompts_of_their_ids() -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    runtime = Runtime(config("MTP", 2, 4), models=load_reference_models())

    async def run() -> list[tuple[int, ...]]:
        await runtime.start()
        try:
            handles = [runtime.submit(prompt, params) for prompt in (
                list(b"ROMEO."), b"ROMEO.", np.frombuffer(b"ROMEO.", np.uint8),
                torch.tensor(list(b"ROMEO.")), [np.int64(t) for t in b"ROMEO."])]
            return [(await handle.result()).token_ids for handle in handles]
        finally:
            await runtime.stop()

    outputs = asyncio.run(run())
    assert all(output == outputs[0] for output in outputs)


def test_an_event_log_and_a_trace_on_one_path_are_refused_before_the_models_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("ADASPEC_TRACE", str(path))
    runtime = Runtime(config("MTP", 2, 2), options=RuntimeOptions(event_log=str(path)),
                      models=load_reference_models())
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    assert str(raised.value) == (f"ADASPEC_TRACE={path}: expected a file of its own; "
                                 "event_log names it too")
    assert not path.exists()


@pytest.mark.parametrize("other", ["a link to the log's folder", "the cost-table output"])
def test_a_trace_that_is_another_outputs_file_by_another_name_is_refused_before_the_models_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: str) -> None:
    """Before, a link was compared by its spelling: the trace was refused only when opened,
    after the models loaded and the event log was created; a trace on the cost-table output
    made the bundle's save fail after the whole calibration."""
    folder = tmp_path / "d"
    folder.mkdir()
    (tmp_path / "l").symlink_to(folder)
    log, table = folder / "run.jsonl", folder / "table.json"
    launch: dict[str, object] = {}
    if other == "the cost-table output":
        calibration = tmp_path / "tiny.json"
        calibration.write_text(json.dumps(TINY_CALIBRATION))
        launch = {"enable_adaptive_target_verify": True,
                  "adaptive_target_verify_calibration": str(calibration),
                  "adaptive_target_verify_cost_table_output": str(table)}
        trace, named = tmp_path / "l" / "table.json", "adaptive_target_verify_cost_table_output"
    else:
        trace, named = tmp_path / "l" / "run.jsonl", "event_log"
    monkeypatch.setenv("ADASPEC_TRACE", str(trace))
    runtime = Runtime(config("DSpark", 5, 2, **launch),
                      options=RuntimeOptions(event_log=str(log)), models=load_reference_models())
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    assert str(raised.value) == (f"ADASPEC_TRACE={trace}: expected a file of its own; "
                                 f"{named} names it too")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize(("device", "shown"), [(1, "1"), (None, "None"), ("tpu", "tpu")])
def test_reference_models_on_a_device_that_is_no_device_are_refused_naming_it(
        device: object, shown: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_reference_models(device)  # type: ignore[arg-type]
    assert str(raised.value).startswith(f"device={shown}: expected a ")


def test_two_running_runtimes_never_share_model_objects() -> None:
    """A start reallocates the models' KV caches: a second runtime starting on the models of
    one that runs would corrupt its requests, so it is refused; once the first stopped, the
    models are free again."""
    models = load_reference_models()

    async def scenario() -> None:
        first = Runtime(config("MTP", 2, 2), models=models)
        second = Runtime(config("MTP", 2, 2), models=models)
        await first.start()
        try:
            with pytest.raises(ConfigError, match=r"^Runtime\(models=\.\.\.\)\.target="
                                                  r"ReferenceTarget: expected a model no other "
                                                  r"running runtime holds"):
                await second.start()
        finally:
            await first.stop()
        await second.start()  # free once the first stopped
        handle = second.submit(list(b"ROMEO."), SamplingParams(temperature=0, max_tokens=4))
        assert len((await handle.result()).token_ids) == 4
        await second.stop()

    asyncio.run(scenario())


def test_submit_cancel_and_stop_from_another_thread_are_refused_naming_the_loop() -> None:
    """Nothing would wake the runtime's loop for a request queued from a thread: refused. A
    stop() on another loop is refused too, and leaves the runtime to stop on its own."""
    async def scenario() -> list[str]:
        runtime = Runtime(config("none", 0, 2))
        await runtime.start()
        handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0, max_tokens=8))
        errors: list[str] = []

        def from_thread() -> None:
            for call in (lambda: runtime.submit(list(b"a"), SamplingParams(temperature=0,
                                                                           max_tokens=2)),
                         lambda: runtime.cancel(handle.request_id), handle.cancel):
                try:
                    call()
                except WrongLoop as error:
                    errors.append(str(error))
            try:
                asyncio.run(runtime.stop())  # a loop of the thread's own
            except WrongLoop as error:
                errors.append(str(error))

        await asyncio.to_thread(from_thread)
        assert len((await handle.result()).token_ids) == 8  # the thread's cancel did nothing
        await runtime.stop()
        assert runtime._stream is None
        return errors

    errors = asyncio.run(scenario())
    assert [e.split(" was called")[0] for e in errors] == ["submit()", "cancel()", "cancel()",
                                                          "stop()"]
    assert all(e.endswith("call it on that loop, for example through "
                          "loop.call_soon_threadsafe or asyncio.run_coroutine_threadsafe")
               for e in errors)


def test_waits_on_another_loop_are_refused_and_leave_the_runtimes_own_intact() -> None:
    """A handle's chunks and result, and wait_idle(), wait on the runtime's loop: awaited
    on another they would never wake, and would bind the request's events to that loop, so
    the runtime's own wait on them would fail. Each is refused naming the call."""
    async def scenario() -> list[str]:
        runtime = Runtime(config("none", 0, 2))
        await runtime.start()
        handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0, max_tokens=8))
        errors: list[str] = []

        async def wait(call: str) -> None:
            if call == "iterate":
                async for _ in handle:
                    pass
            elif call == "result":
                await handle.result()
            else:
                await runtime.wait_idle()

        def from_thread() -> None:
            for call in ("iterate", "result", "idle"):
                try:
                    # A loop of the thread's own; bounded, so a wait that is let through
                    # fails the test rather than hanging it.
                    asyncio.run(asyncio.wait_for(wait(call), 60))
                except WrongLoop as error:
                    errors.append(str(error))

        await asyncio.to_thread(from_thread)
        assert len((await handle.result()).token_ids) == 8
        await runtime.wait_idle()
        await runtime.stop()
        return errors

    errors = asyncio.run(scenario())
    assert [e.split(" was called")[0] for e in errors] == [
        "iterating a RequestHandle", "RequestHandle.result()", "wait_idle()"]


def test_a_runtime_whose_loop_asyncio_run_closed_stops_from_a_new_loop() -> None:
    """asyncio.run cancels the round loop as it closes its loop: nothing lives on that loop
    any more, so a stop() from the next loop is no wrong-loop call, and it ends the run."""
    runtime = Runtime(config("none", 0, 2))
    asyncio.run(runtime.start())

    async def submit() -> None:  # before the stop: the runtime says what happened to it
        runtime.submit(list(b"abc"), SamplingParams(temperature=0, max_tokens=5))

    with pytest.raises(RuntimeStopped, match=r"^the runtime's round loop was cancelled without "
                                             r"stop\(\) \(an event loop closed under it\?\): "
                                             r"await stop\(\), then start\(\) on the loop that "
                                             r"is to run it$"):
        asyncio.run(submit())
    asyncio.run(runtime.stop())
    assert runtime._stream is None
    assert runtime._task is None
    asyncio.run(runtime.start())  # and it starts again
    asyncio.run(runtime.stop())


def test_a_batch_never_outgrows_the_graph_batch_limit() -> None:
    """--acl_graph_decode_batch_size_limit below --max_seqs_per_batch: a round holds at most
    the largest prepared bucket and the other requests wait, instead of failing the runtime."""
    launch = config("DSpark", 3, 8, acl_graph_decode_batch_size_limit=3)
    assert launch.launch.decode_batch_limit == 3
    sizes: list[int] = []

    async def scenario() -> list[list[int]]:
        runtime = Runtime(launch)
        runtime.bus.subscribe(lambda event: sizes.append(len(event.request_ids))
                              if isinstance(event, RoundSubmitted) else None)
        await runtime.start()
        handles = [runtime.submit(list(prompt), SamplingParams(temperature=0, max_tokens=6))
                   for prompt in (b"A", b"B", b"C", b"D", b"E")]
        results = [list((await h.result()).token_ids) for h in handles]
        await runtime.stop()
        return results

    results = asyncio.run(scenario())
    assert [len(r) for r in results] == [6] * 5
    assert max(sizes) == 3


def test_load_config_takes_numpy_integers_as_the_ints_they_equal() -> None:
    launch = config("MTP", np.int64(3), np.int32(4)).launch  # type: ignore[arg-type]
    assert (launch.num_speculative_tokens, launch.max_seqs_per_batch) == (3, 4)
    assert type(launch.num_speculative_tokens) is int
    for wrong in (np.float64(3.0), True):
        with pytest.raises(ConfigError, match=r"^--num_speculative_tokens=.*: expected an "
                                              r"integer"):
            config("MTP", wrong, 4)  # type: ignore[arg-type]


def test_models_of_a_runtime_left_unstopped_with_its_loop_are_free_again() -> None:
    models = load_reference_models()

    async def abandon() -> None:
        await Runtime(config("none", 0, 2), models=models).start()  # never stopped

    async def reuse() -> int:
        runtime = Runtime(config("none", 0, 2), models=models)
        await runtime.start()
        handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0, max_tokens=3))
        tokens = len((await handle.result()).token_ids)
        await runtime.stop()
        return tokens

    asyncio.run(abandon())
    assert asyncio.run(reuse()) == 3


class RaisingVerify:
    """The reference target with a verify that raises: an embedder's bug, faked because it is
    what the test is about."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def verify(self, rows: Any) -> Any:
        return 1 / 0


class RaisingStep(RaisingVerify):
    """The reference MTP head with a step that raises (an embedder's bug, faked likewise)."""

    def step(self, *args: Any) -> Any:
        return 1 / 0


@pytest.mark.parametrize(("raising", "what"), [("target", "the target's verify"),
                                               ("mtp", "the drafter's draft")])
def test_a_model_that_raises_at_start_is_named_in_one_line(raising: str, what: str) -> None:
    """Startup prepares the target's verify, the drafter's draft and packing of every
    bucket: the one that raised is named."""
    models = load_reference_models()
    runtime = Runtime(config("MTP", 3, 2), models=SimpleNamespace(
        target=RaisingVerify(models.target) if raising == "target" else models.target,
        mtp=RaisingStep(models.mtp) if raising == "mtp" else models.mtp, dspark=None))

    async def start() -> None:
        try:
            await runtime.start()
        finally:
            await runtime.stop()

    with pytest.raises(DeviceLayerError) as info:
        asyncio.run(start())
    assert str(info.value) == (f"preparing the graph bindings at start: {what} "
                               "raised ZeroDivisionError: division by zero")


class FloatBudget(Named):
    """A budget policy that picks the widest legal G, as a float."""

    def decide(self, context: Any) -> Any:
        return float(context.legal_rows[-1])


def test_a_budget_policy_choosing_a_non_integer_g_fails_naming_it() -> None:
    """4.0 or True would reach the event log and the device's shapes as such: a G is an
    integer, as a depth is."""
    runtime = Runtime(config("MTP", 3, 2), options=RuntimeOptions(
        budget_policy=FloatBudget("widest-float")))

    async def run() -> str:
        await runtime.start()
        handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0, max_tokens=8))
        try:
            await handle.result()
        except RequestFailed as failed:
            return str(failed)
        finally:
            await runtime.stop()
        return "decoded"

    message = asyncio.run(asyncio.wait_for(run(), 120))
    assert re.search(r"budget policy widest-float chose G=\d+\.0; expected one of the legal "
                     r"rows \[", message), message


def test_a_reader_cancelled_while_it_waits_leaves_the_other_readers_reading() -> None:
    """Readers of one handle wait on one future: cancelling one reader had cancelled that
    future, so another reader (or the next one started) ended with CancelledError while the
    request ran on."""
    runtime = Runtime(config("MTP", 3, 2))

    async def run() -> tuple[int, int]:
        await runtime.start()
        handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                max_tokens=60))

        async def listen() -> int:
            return sum([len(chunk) async for chunk in handle])

        leaving, staying = asyncio.ensure_future(listen()), asyncio.ensure_future(listen())
        await asyncio.sleep(0)  # both wait for the first chunk
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        got = await staying
        later = await listen()  # a reader started after the cancel reads everything too
        await runtime.stop()
        return got, later

    assert asyncio.run(asyncio.wait_for(run(), 120)) == (60, 60)
