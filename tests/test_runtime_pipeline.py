"""The round runtime's rules: lag n-2, at most two rounds in flight, hooks in declared order,
failures that lose and duplicate nothing, cancellation, refused requests, the state trace."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import CyclingDepth, config, decode, lossless_prompts, max_tokens_of

from adaspec import cli
from adaspec.config import SamplingParams
from adaspec.errors import InvalidRequest, UnsupportedRequest
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.policies.base import (
    BudgetContext,
    DepthContext,
    PolicyStatistics,
    RoundFeedback,
    covering_rows,
)
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.events.clock import VirtualClock
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay
from adaspec.runtime.events.types import BudgetDecided, RoundRetired, RoundSubmitted
from adaspec.runtime.pipeline import Pipeline
from adaspec.runtime.requests import RequestFailed
from adaspec.runtime.states import RoundState
from adaspec.runtime.trace import capture_trace, read_trace

PROMPTS = lossless_prompts()[:12]


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


def greedy(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i)) for i in range(count)]


@pytest.fixture(scope="module")
def target_only(models: ReferenceModels) -> list[tuple[int, ...]]:
    return [r.token_ids for r in decode(config("none", 0, 4), PROMPTS, greedy(len(PROMPTS)),
                                        models)]


class RecordingDepthPolicy:
    """A fixed-depth policy that records, at every decision, which rounds it had observed."""

    name = "recording"

    def __init__(self) -> None:
        self.observed: list[int] = []
        self.decisions: list[tuple[DepthContext, tuple[int, ...]]] = []

    def decide(self, context: DepthContext) -> int:
        self.decisions.append((context, tuple(self.observed)))
        return context.width

    def observe(self, feedback: RoundFeedback) -> None:
        self.observed.append(feedback.round)

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, len(self.decisions), len(self.observed))

    def settings(self) -> dict[str, object]:
        return {}


@pytest.mark.parametrize(("overlap", "lag"), [(True, 2), (False, 1)])
def test_decisions_for_round_n_see_feedback_through_round_n_minus_lag_only(
        models: ReferenceModels, overlap: bool, lag: int) -> None:
    policy = RecordingDepthPolicy()
    launch = config("DSpark", 3, 4, enable_schedule_overlap=overlap)
    decode(launch, PROMPTS, greedy(len(PROMPTS)), models,
           options=RuntimeOptions(depth_policy=policy))
    assert len(policy.decisions) > 10
    for context, seen in policy.decisions:
        newest = max(seen, default=-1)
        assert all(r <= context.round - lag for r in seen)  # never round n-1 for round n
        assert newest == context.retired_through
        if context.round >= lag:
            assert newest == context.round - lag  # and the feedback is as fresh as allowed


@pytest.mark.parametrize(("overlap", "in_flight"), [(True, 2), (False, 1)])
def test_at_most_two_rounds_are_in_flight(models: ReferenceModels, overlap: bool,
                                          in_flight: int) -> None:
    launch = config("MTP", 2, 4, enable_schedule_overlap=overlap)
    runtime = Runtime(launch, models=models)

    async def run() -> Any:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(12), strict=True)]
        for handle in handles:
            await handle.result()
        await runtime.stop()
        return runtime.statistics()

    stats = asyncio.run(run())
    assert stats.max_rounds_in_flight == in_flight
    assert stats.rounds_retired == stats.rounds_submitted


def test_hooks_fire_in_declared_order_through_every_state(models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 2, 4), models=models)
    calls: list[tuple[str, int, str]] = []
    runtime.hooks.on_transition(lambda s, a, b, t: calls.append(("first", s.round_index, t)))
    runtime.hooks.on_enter(RoundState.RETIRED,
                           lambda s, a, b, t: calls.append(("retired", s.round_index, t)))
    runtime.hooks.on_transition(lambda s, a, b, t: calls.append(("second", s.round_index, t)))

    async def run() -> None:
        await runtime.start()
        await runtime.submit(list(PROMPTS[0]), SamplingParams(temperature=0.0,
                                                               max_tokens=8)).result()
        await runtime.stop()

    asyncio.run(run())
    round0 = [(name, trigger) for name, number, trigger in calls if number == 0]
    triggers = [f"{stage}_done" for stage in
                ("draft", "consensus", "pack", "verify", "sample", "commit", "retire")]
    expected = []
    for trigger in triggers:
        expected += [("first", trigger)]
        if trigger == "retire_done":
            expected += [("retired", trigger)]
        expected += [("second", trigger)]
    assert round0 == expected


class InjectedFault(Exception):
    """Raised on purpose by the fault-injection stage hook."""


def fault_at(round_index: int, stage: str) -> Any:
    def hook(number: int, name: str) -> None:
        if (number, name) == (round_index, stage):
            raise InjectedFault(f"injected in round {number} {name}")
    return hook


@pytest.mark.parametrize("stage", ["draft", "verify", "commit", "retire"])
def test_a_failed_stage_fails_its_requests_and_the_runtime_keeps_serving(
        models: ReferenceModels, target_only: list[tuple[int, ...]], stage: str,
        tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("DSpark", 3, 4), models=models,
                      options=RuntimeOptions(stage_hook=fault_at(2, stage), event_log=str(log)))

    async def run() -> tuple[list[Any], list[Any]]:
        await runtime.start()
        first = [runtime.submit(list(p), q) for p, q in zip(PROMPTS[:4], greedy(4),
                                                             strict=True)]
        outcomes = await asyncio.gather(*(h.result() for h in first), return_exceptions=True)
        later = [runtime.submit(list(p), q)
                 for p, q in zip(PROMPTS[4:], greedy(12)[4:], strict=True)]
        results = [await h.result() for h in later]
        await runtime.stop()
        return outcomes, results

    outcomes, later = asyncio.run(run())
    failed = [o for o in outcomes if isinstance(o, RequestFailed)]
    assert failed, "round 2 held these requests"
    assert all(f"round 2 failed in {stage}: InjectedFault" in str(o) for o in failed)
    for index, outcome in enumerate(outcomes):
        if not isinstance(outcome, BaseException):  # finished before round 2: intact
            assert outcome.token_ids == target_only[index]
    # Later requests decode exactly, so nothing was left inconsistent, lost or duplicated.
    assert [r.token_ids for r in later] == target_only[4:]
    stats = runtime.statistics()
    assert stats.rounds_failed == 1
    assert stats.requests_failed == len(failed)
    # Its log passes every check of a run: the failure names the stage after those that
    # completed, the failed requests hold what was delivered before.
    header, events = read_event_log(log)
    assert replay(header, events, path=str(log)).all_matched


@pytest.mark.parametrize(("stage", "pipelined"), [("consensus", True), ("pack", True),
                                                  ("sample", True), ("pack", False)])
def test_a_failing_stage_ends_its_round_there_and_is_named_in_the_failure(
        models: ReferenceModels, stage: str, pipelined: bool) -> None:
    seen: list[tuple[int, str]] = []

    def hook(number: int, name: str) -> None:
        seen.append((number, name))
        fault_at(1, stage)(number, name)

    runtime = Runtime(config("DSpark", 3, 2, enable_task_pipeline=pipelined), models=models,
                      options=RuntimeOptions(stage_hook=hook))

    async def run() -> list[Any]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS[:2], greedy(2),
                                                              strict=True)]
        outcomes = await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)
        await runtime.stop()
        return outcomes

    outcomes = asyncio.run(run())
    assert all(isinstance(o, RequestFailed) and f"round 1 failed in {stage}: InjectedFault"
               in str(o) for o in outcomes)
    stages = ["draft", "consensus", "pack", "verify", "sample", "commit", "retire"]
    # Round 1 ran up to the failing stage and no further; round 0 ran every stage in order.
    assert [name for number, name in seen if number == 1] == \
        stages[:stages.index(stage) + 1]
    assert [name for number, name in seen if number == 0] == stages


def test_a_hook_raising_cancelled_error_or_a_multi_line_stage_error_fails_one_round_in_one_line(
        models: ReferenceModels, target_only: list[tuple[int, ...]]) -> None:
    def hook(states: Any, source: Any, target: Any, trigger: str) -> None:
        if states.round_index == 1 and target is RoundState.VERIFY:
            raise asyncio.CancelledError("a hook cancelled")

    def stage_hook(number: int, name: str) -> None:
        if (number, name) == (4, "verify"):
            raise RuntimeError("device fault\nsecond line of the device's report")

    runtime = Runtime(config("DSpark", 3, 1), models=models,
                      options=RuntimeOptions(stage_hook=stage_hook))
    runtime.hooks.on_enter(RoundState.VERIFY, hook)

    async def run() -> list[Any]:
        await runtime.start()
        outcomes = []
        for prompt in PROMPTS[:3]:  # one request at a time: round 1 and round 4 fail
            handle = runtime.submit(list(prompt), SamplingParams(temperature=0.0, max_tokens=200))
            outcomes.append(await asyncio.gather(handle.result(), return_exceptions=True))
        later = await runtime.submit(list(PROMPTS[3]), greedy(4)[3]).result()
        await runtime.stop()
        return [*outcomes, later]

    first, second, third, later = asyncio.run(run())
    assert isinstance(first[0], RequestFailed)
    assert "round 1 failed in pack: CancelledError: a hook cancelled" in str(first[0])
    failures = [o[0] for o in (second, third) if isinstance(o[0], RequestFailed)]
    assert len(failures) == 1
    assert str(failures[0]).endswith("failed in verify: RuntimeError: device fault")
    assert later.token_ids == target_only[3]
    assert runtime.statistics().rounds_failed == 2


def test_cancelling_between_rounds_ends_the_request_and_frees_its_slot(
        models: ReferenceModels, target_only: list[tuple[int, ...]]) -> None:
    runtime = Runtime(config("MTP", 3, 2), models=models)

    async def run() -> tuple[list[Any], list[Any], int]:
        await runtime.start()
        cancelled = []
        for prompt in PROMPTS[:6]:  # more requests than KV slots (4), one after another
            handle = runtime.submit(list(prompt), SamplingParams(temperature=0.0,
                                                                 max_tokens=200))
            await handle.__aiter__().__anext__()
            handle.cancel()
            cancelled.append(await handle.result())
        later = [await runtime.submit(list(p), q).result()
                 for p, q in zip(PROMPTS[6:], greedy(12)[6:], strict=True)]
        await runtime.stop()
        assert runtime._pipeline is not None
        return cancelled, later, runtime._pipeline.kv_slots.num_free

    cancelled, later, free = asyncio.run(run())
    assert [r.finish_reason for r in cancelled] == ["cancelled"] * 6
    assert all(len(r.token_ids) < 200 for r in cancelled)
    assert [r.token_ids for r in later] == target_only[6:]
    assert free == 4  # every KV slot is back


def test_requests_the_launch_cannot_honour_are_refused_before_execution(
        models: ReferenceModels, dspark5_batch4_costs: str) -> None:
    runtime = Runtime(config("DSpark", 5, 4, enable_adaptive_target_verify=True,
                             adaptive_target_verify_cost_table=dspark5_batch4_costs),
                      models=models)

    async def run() -> None:
        await runtime.start()
        with pytest.raises(UnsupportedRequest, match="request field temperature: required"):
            runtime.submit([65, 66], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequest, match=r"request field prompt=1024 tokens: expected "
                                                 r"1\.\.1023 tokens"):
            runtime.submit([65] * 1024, SamplingParams(temperature=0.0, max_tokens=4))
        with pytest.raises(InvalidRequest, match=r"request field prompt\[1\]=300: expected a "
                                                 r"token id in 0\.\.255"):
            runtime.submit([65, 300], SamplingParams(temperature=0.0, max_tokens=4))
        with pytest.raises(InvalidRequest, match="request field top_k=3: filters sampled "
                                                 "requests only"):
            runtime.submit([65, 66], SamplingParams(temperature=0.0, top_k=3, max_tokens=4))
        # Nothing of them ran; the runtime still serves.
        result = await runtime.submit([65, 66], SamplingParams(temperature=0.0,
                                                                max_tokens=4)).result()
        assert len(result.token_ids) == 4
        await runtime.stop()

    asyncio.run(run())


def test_the_state_trace_has_one_line_per_transition_with_decisions(
        models: ReferenceModels) -> None:
    clock = VirtualClock()
    runtime = Runtime(config("DSpark", 3, 4), models=models,
                      options=RuntimeOptions(clock=clock))

    async def run() -> list[dict[str, Any]]:
        await runtime.start()
        with capture_trace(runtime) as lines:
            await runtime.submit(list(PROMPTS[1]), SamplingParams(temperature=0.0,
                                                                   max_tokens=9)).result()
        await runtime.stop()
        return lines

    lines = asyncio.run(run())
    rounds = sorted({line["round"] for line in lines})
    assert len(lines) == 7 * len(rounds)
    first = [line for line in lines if line["round"] == rounds[0]]
    assert [line["to"] for line in first] == ["consensus", "pack", "verify", "sample",
                                              "commit", "retire", "retired"]
    assert first[0]["decision"] == {"depth": 3}
    assert first[2]["decision"] == {"G": 4, "bound_G": 4}  # B=1: 1 * (3 + 1) rows
    assert {line["slot"] for line in lines} <= {0, 1}
    assert all(line["elapsed_ms"] == 0.0 for line in lines)  # the virtual clock stood still


@pytest.mark.parametrize("launch", [
    {"enable_unified_mtp_graph": True},
    {"enable_task_pipeline": False},
    {"enable_graph": False},
])
def test_execution_modes_decode_the_same_tokens(models: ReferenceModels,
                                                target_only: list[tuple[int, ...]],
                                                launch: dict[str, Any]) -> None:
    results = decode(config("DSpark", 5, 4, **launch), PROMPTS, greedy(len(PROMPTS)), models)
    assert [r.token_ids for r in results] == target_only


def test_budget_policies_get_every_legal_tier(models: ReferenceModels) -> None:
    seen: list[BudgetContext] = []

    class RecordingBudget:
        name = "recording-budget"

        def decide(self, context: BudgetContext) -> int:
            seen.append(context)
            return covering_rows(context, context.depth)

        def observe(self, feedback: RoundFeedback) -> None:
            """Nothing to learn."""

        def statistics(self) -> PolicyStatistics:
            return PolicyStatistics(self.name, len(seen), 0)

        def settings(self) -> dict[str, object]:
            return {}

    decode(config("DSpark", 5, 8), PROMPTS[:8], greedy(8), models, wave=8,
           options=RuntimeOptions(budget_policy=RecordingBudget()))
    assert seen[0].num_reqs == 8
    assert seen[0].legal_rows == (8, 12, 16, 24, 32, 48)  # Draft5, Bcap 8: every legal G


class AnchorsOnly:
    """A budget policy that verifies no draft: the smallest legal G (Bcap rows)."""

    name = "anchors-only"

    def decide(self, context: BudgetContext) -> int:
        return context.legal_rows[0]

    def observe(self, feedback: RoundFeedback) -> None:
        """Nothing to learn."""

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, 0, 0)

    def settings(self) -> dict[str, object]:
        return {}


@pytest.mark.parametrize("launch", [{}, {"enable_unified_mtp_graph": True}],
                         ids=["split", "unified"])
def test_an_own_budget_policy_is_verified_as_picked_on_a_fixed_width_launch(
        models: ReferenceModels, target_only: list[tuple[int, ...]],
        launch: dict[str, Any]) -> None:
    """Before, such a launch prepared full width only and every pick fell back to it unsaid:
    the policy chose to verify nothing and each round verified all three drafts."""
    results = decode(config("MTP", 3, 1, enable_graph=True, **launch), PROMPTS[:3], greedy(3),
                     models, options=RuntimeOptions(budget_policy=AnchorsOnly()))
    assert [r.verified for r in results] == [0, 0, 0]
    assert [r.token_ids for r in results] == target_only[:3]


def test_an_own_depth_policys_shallow_rounds_verify_the_rows_they_cover(
        models: ReferenceModels, target_only: list[tuple[int, ...]], tmp_path: Path) -> None:
    """Before, such a launch prepared full width only: a round of depth 1 decided G = 2B
    and ran 4B rows, the fallback seen only as the log's bound_rows."""
    log = tmp_path / "run.jsonl"
    results = decode(config("MTP", 3, 4, enable_graph=True), PROMPTS[:4], greedy(4), models,
                     options=RuntimeOptions(depth_policy=CyclingDepth(), event_log=str(log)))
    assert [r.token_ids for r in results] == target_only[:4]
    _, events = read_event_log(str(log))
    decided = [e for e in events if isinstance(e, BudgetDecided)]
    assert {e.context.depth for e in decided} == {1, 2, 3}
    assert [e.bound_rows for e in decided] == [e.num_rows for e in decided]


def test_a_recorded_run_replays_identically_and_an_edited_log_diverges_at_its_round(
        models: ReferenceModels, tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 5, 4), PROMPTS, greedy(len(PROMPTS)), models,
           options=RuntimeOptions(event_log=str(log)))
    header, events = read_event_log(str(log))
    report = replay(header, events)
    assert report.ok
    assert report.num_decisions == 2 * report.num_rounds > 20
    lines = log.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    index = next(i for i, r in enumerate(records)
                 if r.get("kind") == "budget_decided" and r["round"] == 5)
    record = records[index]
    record["num_rows"] = next(g for g in record["context"]["legal_rows"]
                              if g != record["num_rows"])
    lines[index] = json.dumps(record)
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    diverged = replay(*read_event_log(str(edited)))
    assert diverged.first_divergence is not None
    assert (diverged.first_divergence.round, diverged.first_divergence.decision) == (5, "budget")
    assert cli.run(["replay", str(log)]) == 0
    assert cli.run(["replay", str(edited)]) == 1


def test_the_trace_is_off_by_default_and_on_with_the_environment_variable(
        models: ReferenceModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=5)]
    off = Runtime(config("DSpark", 2, 1), models=models)
    assert asyncio.run(_hook_count(off, params)) == 0
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("ADASPEC_TRACE", str(path))
    on = Runtime(config("DSpark", 2, 1), models=models)
    assert asyncio.run(_hook_count(on, params)) == 1
    lines = read_trace(str(path))
    assert [line["to"] for line in lines[:7]] == ["consensus", "pack", "verify", "sample",
                                                  "commit", "retire", "retired"]


def hooks_with_trace_variable(value: str, models: ReferenceModels, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> int:
    """Hooks a short run registers with ADASPEC_TRACE set to ``value``; it writes no file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ADASPEC_TRACE", value)
    runtime = Runtime(config("DSpark", 2, 1), models=models)
    count = asyncio.run(_hook_count(runtime, [SamplingParams(temperature=0.0, max_tokens=5)]))
    assert list(tmp_path.iterdir()) == []
    return count


@pytest.mark.parametrize("value", ["1", "true", "ON", "-"])
def test_a_switch_in_the_trace_variable_traces_to_stderr_and_writes_no_file(
        models: ReferenceModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert hooks_with_trace_variable(value, models, tmp_path, monkeypatch) == 1
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()
             if line.startswith("{")]
    assert [line["to"] for line in lines[:7]] == ["consensus", "pack", "verify", "sample",
                                                  "commit", "retire", "retired"]


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_an_off_switch_in_the_trace_variable_traces_nothing(
        models: ReferenceModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        value: str) -> None:
    assert hooks_with_trace_variable(value, models, tmp_path, monkeypatch) == 0


async def _hook_count(runtime: Runtime, params: list[SamplingParams]) -> int:
    """Hooks registered while the runtime serves (stop() detaches its own)."""
    await runtime.start()
    await runtime.submit([65, 66, 67], params[0]).result()
    count = len(runtime.hooks._registered)
    await runtime.stop()
    return count


def test_a_hook_raising_inside_the_pipeline_fails_its_round_and_nothing_else(
        models: ReferenceModels, target_only: list[tuple[int, ...]]) -> None:
    runtime = Runtime(config("DSpark", 3, 4), models=models)

    def broken_hook(states: Any, source: RoundState, target: RoundState, trigger: str) -> None:
        if states.round_index == 2:
            raise InjectedFault("hook on entering verify")

    runtime.hooks.on_enter(RoundState.VERIFY, broken_hook)
    outcomes, later = asyncio.run(_first_and_later(runtime))
    failed = [o for o in outcomes if isinstance(o, RequestFailed)]
    assert failed
    assert all("round 2 failed in pack: InjectedFault: hook on entering verify" in str(o)
               for o in failed)
    assert [r.token_ids for r in later] == target_only[4:]


def test_a_failure_after_the_commit_wrote_the_slots_loses_and_duplicates_nothing(
        models: ReferenceModels, target_only: list[tuple[int, ...]]) -> None:
    runtime = Runtime(config("MTP", 3, 4), models=models)
    calls = {"count": 0}

    async def run() -> tuple[list[Any], list[Any]]:
        await runtime.start()
        assert runtime._pipeline is not None
        drafting = runtime._pipeline.ctx.drafting
        publish = drafting.after_commit

        def failing(*args: Any) -> None:
            calls["count"] += 1
            publish(*args)
            if calls["count"] == 3:  # the slot states are already written
                raise InjectedFault("after the commit wrote the slots")

        drafting.after_commit = failing  # type: ignore[method-assign]
        return await _run_first_and_later(runtime, started=True)

    outcomes, later = asyncio.run(run())
    assert any(isinstance(o, RequestFailed) for o in outcomes)
    for index, outcome in enumerate(outcomes):
        if not isinstance(outcome, BaseException):
            assert outcome.token_ids == target_only[index]
    assert [r.token_ids for r in later] == target_only[4:]


async def _first_and_later(runtime: Runtime) -> tuple[list[Any], list[Any]]:
    await runtime.start()
    return await _run_first_and_later(runtime, started=True)


async def _run_first_and_later(runtime: Runtime, started: bool) -> tuple[list[Any], list[Any]]:
    first = [runtime.submit(list(p), q) for p, q in zip(PROMPTS[:4], greedy(4), strict=True)]
    outcomes = await asyncio.gather(*(h.result() for h in first), return_exceptions=True)
    later = [runtime.submit(list(p), q) for p, q in zip(PROMPTS[4:], greedy(12)[4:],
                                                         strict=True)]
    results = [await h.result() for h in later]
    await runtime.stop()
    return list(outcomes), results


def test_two_consumers_of_one_handle_both_see_every_token(models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 3, 2), models=models)

    async def consume(handle: Any) -> list[int]:
        tokens: list[int] = []
        async for chunk in handle:
            tokens += chunk
        return tokens

    async def run() -> tuple[list[int], list[int], tuple[int, ...]]:
        await runtime.start()
        handle = runtime.submit(list(PROMPTS[0]), SamplingParams(temperature=0.0,
                                                                 max_tokens=20))
        first, second = await asyncio.gather(consume(handle), consume(handle))
        result = await handle.result()
        await runtime.stop()
        return first, second, result.token_ids

    first, second, tokens = asyncio.run(run())
    assert first == second == list(tokens)
    assert len(tokens) == 20


@pytest.mark.parametrize("overlap", [True, False])
def test_feedback_describes_exactly_the_live_requests_and_replays_at_either_lag(
        models: ReferenceModels, tmp_path: Path, overlap: bool) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 3, 4, enable_schedule_overlap=overlap), PROMPTS,
           greedy(len(PROMPTS)), models, options=RuntimeOptions(event_log=str(log)))
    header, events = read_event_log(str(log))
    feedbacks = [e.feedback for e in events if isinstance(e, RoundRetired)]
    assert feedbacks
    for feedback in feedbacks:
        assert feedback.num_reqs == len(feedback.verify_lengths) == len(feedback.num_accepted)
        assert len(feedback.confidences) == feedback.num_reqs
    assert replay(header, events).ok


def test_without_schedule_overlap_every_round_uses_slot_0(models: ReferenceModels) -> None:
    runtime = Runtime(config("DSpark", 2, 2, enable_schedule_overlap=False), models=models)
    kv_slots: set[tuple[int, int]] = set()
    runtime.hooks.on_transition(lambda s, a, b, t: kv_slots.add((s.round_index, s.slot)))
    asyncio.run(_hook_count(runtime, [SamplingParams(temperature=0.0, max_tokens=12)]))
    assert len(kv_slots) > 2
    assert {slot for _, slot in kv_slots} == {0}


def test_a_request_that_a_round_in_flight_must_end_is_left_out_of_later_rounds(
        models: ReferenceModels, target_only: list[tuple[int, ...]], tmp_path: Path) -> None:
    # Without drafts every live entry commits one token a round, so a request one token short
    # of its budget is ended by the round in flight that includes it; no later round carries
    # it as an entry that is no longer live, and a waiting request takes its room at once.
    log = tmp_path / "run.jsonl"
    results = decode(config("none", 0, 4), PROMPTS, greedy(len(PROMPTS)), models,
                     options=RuntimeOptions(event_log=str(log)))
    assert [r.token_ids for r in results] == target_only
    assert [r.rounds for r in results] == [len(r.token_ids) - 1 for r in results]
    _, events = read_event_log(str(log))
    submitted = {e.round: e.request_ids for e in events if isinstance(e, RoundSubmitted)}
    retired = [e.feedback for e in events if isinstance(e, RoundRetired)]
    assert len(retired) == len(submitted)
    for feedback in retired:
        assert feedback.request_ids == submitted[feedback.round]


def test_a_request_the_host_wrongly_expects_to_end_still_gets_every_token(
        models: ReferenceModels, target_only: list[tuple[int, ...]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Injected fault: the host believes every budget ends 3 tokens early, so it leaves
    # requests out of rounds that would not have ended them. Once the round it counted on
    # retires without ending a request, the request takes part in rounds again.
    admit = Pipeline._admit

    def admit_short(self: Pipeline) -> None:
        waiting = list(self.waiting)
        admit(self)
        for request in waiting:
            if request.end_length > 0:
                request.end_length -= 3

    monkeypatch.setattr(Pipeline, "_admit", admit_short)
    runtime = Runtime(config("none", 0, 4), models=models)

    async def run() -> list[tuple[int, ...]]:
        await runtime.start()
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, greedy(len(PROMPTS)),
                                                               strict=True)]
        results = [asyncio.ensure_future(h.result()) for h in handles]
        # A request left out for good would wait forever: give up on it (a failure, and no
        # stop that would wait for it) long after the run needs.
        _, waiting = await asyncio.wait(results, timeout=600)
        assert not waiting, f"{len(waiting)} requests never finished"
        assert runtime._pipeline is not None
        assert not runtime._pipeline.ending
        await runtime.stop()
        return [r.result().token_ids for r in results]

    assert asyncio.run(run()) == target_only


def test_a_request_its_prefill_ends_never_joins_a_round(models: ReferenceModels) -> None:
    # max_tokens=1: the prefill's token is its last, so no round may carry it (its row
    # would commit nothing); the runtime's batch room goes to the others.
    runtime = Runtime(config("MTP", 3, 4), models=models)
    submitted: list[tuple[int, ...]] = []

    async def run() -> list[Any]:
        await runtime.start()
        runtime.subscribe(lambda event: submitted.append(event.request_ids)
                          if isinstance(event, RoundSubmitted) else None)
        handles = [runtime.submit(list(prompt), SamplingParams(temperature=0.0, max_tokens=n))
                   for prompt, n in zip(PROMPTS[:4], (1, 8, 1, 8), strict=True)]
        results = [await handle.result() for handle in handles]
        await runtime.stop()
        return results

    results = asyncio.run(run())
    assert [len(r.token_ids) for r in results] == [1, 8, 1, 8]
    assert submitted
    prefill_only = {results[0].request_id, results[2].request_id}
    assert not any(prefill_only & set(ids) for ids in submitted)
