"""Replay re-runs the policies over a recorded event log: the recorded fixed-width policies
reproduce every decision, an edited decision is found with both values, a counterfactual policy
is compared decision by decision, decisions that saw feedback newer than round n-2 are
reported, and ``adaspec replay`` says all of it with its exit status.

The recorded run is synthetic: fixed policies (depth d = w, G = the tier covering B * (d + 1)),
a batch size B that varies by round so G varies, and round n-2 retiring just before the
decisions of round n, as the two-slot pipeline does. Its header carries the effective config of
a launch whose geometry its events respect (width 3, request buckets 1, 2, 4), since replay
checks the log as one run of that launch before replaying it.
"""

import json
from pathlib import Path

import pytest
from cost_tables import depth_bundle
from logged_runs import stages, with_requests

from adaspec.cli.replay import run as main
from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.config.effective import load_config
from adaspec.errors import EventLogError, ReplayMismatch
from adaspec.policies.base import (
    BudgetContext,
    DepthContext,
    DepthPolicy,
    PolicyStatistics,
    RoundFeedback,
    covering_rows,
)
from adaspec.policies.bundles import CostBundle
from adaspec.policies.depth import AdaptiveDepth
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.registry import make_depth_policy
from adaspec.runtime.events.log import EventLogWriter, LogHeader, read_event_log
from adaspec.runtime.events.replay import replay
from adaspec.runtime.events.types import (
    BudgetDecided,
    DepthDecided,
    Event,
    RoundRetired,
    RoundSubmitted,
)

MODELS = {"target": "target-id", "draft": "dspark-id"}  # checkpoint identities
CONTEXT_LIMIT = 4096  # the depth bundle prices contexts up to it
WIDTH = 3  # w
LEGAL_ROWS = (4, 8, 16)  # legal G; B * (w + 1) is 4, 8, 12 or 16, so each is chosen
NUM_ROUNDS = 10
LAUNCH = {"speculative_algorithm": "DSpark", "num_speculative_tokens": WIDTH,
          "max_seqs_per_batch": 4}  # request buckets 1, 2, 4; bucket 4's legal G are TIERS


def num_reqs(round: int) -> int:
    return 1 + round % 4  # B


def feedback(round: int) -> RoundFeedback:
    batch = num_reqs(round)
    return RoundFeedback(round=round, num_reqs=batch, num_reqs_bucket=4, width=WIDTH,
                         depth=WIDTH, num_rows=covering(round), verify_lengths=(WIDTH,) * batch,
                         num_accepted=tuple((round + i) % (WIDTH + 1) for i in range(batch)),
                         confidences=((0.9, 0.5, 0.25),) * batch, request_ids=request_ids(round))


def budget_context(round: int) -> BudgetContext:
    return BudgetContext(round=round, num_reqs=num_reqs(round), num_reqs_bucket=4, width=WIDTH,
                         depth=WIDTH, legal_rows=LEGAL_ROWS, retired_through=max(round - 2, -1),
                         request_ids=request_ids(round), max_kv_length=64)


def request_ids(round: int) -> tuple[int, ...]:
    return tuple(range(num_reqs(round)))


def covering(round: int) -> int:
    return covering_rows(budget_context(round), WIDTH)


def round_events(round: int) -> list[Event]:
    """The events of one round, from its decisions to its last stage (retirement is later)."""
    slot = round % 2
    context = DepthContext(round=round, num_reqs=num_reqs(round), num_reqs_bucket=4,
                           width=WIDTH, retired_through=max(round - 2, -1), max_kv_length=64)
    rows = covering(round)
    return [DepthDecided(round=round, slot=slot, context=context, depth=WIDTH),
            BudgetDecided(round=round, slot=slot, context=budget_context(round), num_rows=rows,
                          bound_rows=rows),
            RoundSubmitted(round=round, slot=slot, request_ids=request_ids(round),
                           num_reqs_bucket=4), *stages(round)]


def retired(round: int) -> RoundRetired:
    return RoundRetired(round=round, slot=round % 2, feedback=feedback(round))


def recorded_run() -> list[Event]:
    """Round n-2 retires, then round n is decided and submitted; the last two retire at the end."""
    events: list[Event] = []
    for round in range(NUM_ROUNDS):
        if round >= 2:
            events.append(retired(round - 2))
        events += round_events(round)
    events += [retired(NUM_ROUNDS - 2), retired(NUM_ROUNDS - 1)]
    # Prompts of 55 tokens: with the prefill's token and two rounds in flight of w + 1
    # positions, the 64 every round prices (a bound the delivered tokens only raise).
    return with_requests(events, max(map(num_reqs, range(NUM_ROUNDS))), lambda id: 55)


def write_run(path: Path, events: list[Event] | None = None) -> Path:
    head = LogHeader.of_run(config=load_config(LAUNCH).as_dict(), cost_table=None, models=MODELS,
                            context_limit=CONTEXT_LIMIT,
                            seed=0, lag=2, depth_policy=FixedDepth(),
                            budget_policy=FullBudget())
    with EventLogWriter(path, head) as writer:
        for event in recorded_run() if events is None else events:
            writer.write(event)
    return path


def edit_record(path: Path, kind: str, round: int, **changes: object) -> None:
    """Change fields of the ``kind`` event of ``round`` in the file, by hand."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for index, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        if record["kind"] == kind and record["round"] == round:
            for key, value in changes.items():
                target = record["context"] if key == "retired_through" else record
                target[key] = value
            lines[index] = json.dumps(record) + "\n"
    path.write_text("".join(lines), encoding="utf-8")


def line_of(path: Path, kind: str, round: int) -> int:
    """The 1-based file line of the ``kind`` event of ``round``."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        record = json.loads(line)
        if record.get("kind") == kind and record["round"] == round:
            return number
    raise AssertionError(f"no {kind} event of round {round}")


class CappedBudget:
    """Counterfactual budget policy: the covering tier, but never more than ``cap`` rows."""

    name = "capped"

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def decide(self, context: BudgetContext) -> int:
        allowed = [rows for rows in context.legal_rows if rows <= self.cap]
        return min(covering_rows(context, context.depth), allowed[-1])

    def observe(self, feedback: RoundFeedback) -> None:
        pass

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, 0, 0)

    def settings(self) -> dict[str, object]:
        return {"cap": self.cap}


class WitnessDepth(FixedDepth):
    """The fixed depth policy, noting which retired rounds it had observed at each decision."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[int] = []
        self.seen_at_decision: dict[int, list[int]] = {}

    def observe(self, feedback: RoundFeedback) -> None:
        super().observe(feedback)
        self.observed.append(feedback.round)

    def decide(self, context: DepthContext) -> int:
        self.seen_at_decision[context.round] = list(self.observed)
        return super().decide(context)


def test_the_recorded_policies_reproduce_every_decision(tmp_path: Path) -> None:
    header, events = read_event_log(write_run(tmp_path / "run.jsonl"))
    report = replay(header, events)
    assert report.ok
    assert report.all_matched
    assert not report.counterfactual
    assert (report.num_rounds, report.num_decisions, report.num_observed) == (10, 20, 10)
    assert report.first_divergence is None
    assert report.first_lag_violation is None
    report.check()


def test_policies_observe_feedback_in_log_order_before_deciding(tmp_path: Path) -> None:
    header, events = read_event_log(write_run(tmp_path / "run.jsonl"))
    witness = WitnessDepth()
    replay(header, events, depth_policy=witness)
    assert witness.seen_at_decision[0] == witness.seen_at_decision[1] == []
    assert witness.seen_at_decision[5] == [0, 1, 2, 3]
    assert witness.observed == list(range(NUM_ROUNDS))


def test_an_edited_decision_is_found_with_both_values(tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.jsonl")
    assert covering(5) == 8
    edit_record(path, "budget_decided", 5, num_rows=16)
    report = replay(*read_event_log(path))
    assert not report.ok
    divergence = report.first_divergence
    assert divergence is not None
    assert (divergence.round, divergence.decision) == (5, "budget")
    assert (divergence.recorded, divergence.replayed) == (16, 8)
    assert report.num_divergences == 1
    line = line_of(path, "budget_decided", 5)
    assert divergence.event_index == line - 2
    with pytest.raises(ReplayMismatch, match=r"^replay of round 5 \(budget decision\): "
                       rf"recorded G=16, replayed G=8 \(event {line - 2}, log line {line}\)$"):
        report.check()


def test_a_counterfactual_policy_reports_the_first_round_it_decides_otherwise(
    tmp_path: Path,
) -> None:
    header, events = read_event_log(write_run(tmp_path / "run.jsonl"))
    report = replay(header, events, budget_policy=CappedBudget(cap=8))
    assert report.counterfactual
    assert report.budget_policy == {"name": "capped", "settings": {"cap": 8}}
    divergence = report.first_divergence
    assert divergence is not None
    # B = 3 in round 2 needs 12 rows: the covering tier is 16, the cap allows 8.
    assert (divergence.round, divergence.decision, divergence.recorded,
            divergence.replayed) == (2, "budget", 16, 8)
    assert report.num_divergences == sum(1 for n in range(NUM_ROUNDS) if covering(n) > 8)
    assert ('DIFFERS: 4 of 20 decisions differ from the log; first: round 2 budget decision: '
            'recorded G=16, replayed G=8') in report.format_text()
    assert 'counterfactual policies: depth fixed, budget capped {"cap": 8}' in (
        report.format_text())


def test_a_context_claiming_feedback_of_round_n_minus_1_violates_the_lag(tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.jsonl")
    edit_record(path, "depth_decided", 6, retired_through=5)
    report = replay(*read_event_log(path))
    assert report.all_matched
    assert not report.ok
    violation = report.first_lag_violation
    assert violation is not None
    assert (violation.round, violation.decision, violation.newest_feedback) == (6, "depth", 5)
    assert violation.from_context
    assert report.num_lag_violations == 1
    line = line_of(path, "depth_decided", 6)
    assert violation.describe() == (
        "round 6 depth decision: its context says feedback through round 5, but the lag "
        f"allows feedback of rounds <= 4 only (event {line - 2}, log line {line})")


def test_a_retirement_logged_before_the_decisions_it_must_not_reach_violates_the_lag(
    tmp_path: Path,
) -> None:
    events = recorded_run()
    early = events.index(retired(3))
    events.insert(events.index(round_events(4)[0]), events.pop(early))
    header, logged = read_event_log(write_run(tmp_path / "run.jsonl", events))
    report = replay(header, logged)
    violation = report.first_lag_violation
    assert violation is not None
    assert (violation.round, violation.decision, violation.newest_feedback) == (4, "depth", 3)
    assert not violation.from_context
    assert report.num_lag_violations == 2  # the depth and the budget decision of round 4
    assert "it came after the log retired round 3" in violation.describe()
    assert "LAG VIOLATED by 2 decisions; first: round 4 depth decision" in report.format_text()


def test_cli_exit_0_and_text_when_every_decision_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(write_run(tmp_path / "run.jsonl"))]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "replayed 20 decisions of 10 rounds with 10 retired rounds observed" in out
    assert "all 20 decisions match the log" in out


def test_cli_exit_1_names_the_round_and_both_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_run(tmp_path / "run.jsonl")
    edit_record(path, "budget_decided", 5, num_rows=16)
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    line = line_of(path, "budget_decided", 5)
    assert ("DIVERGED: 1 of 20 decisions differ from the log; first: round 5 budget "
            f"decision: recorded G=16, replayed G=8 (event {line - 2}, log line {line})") in out


def test_cli_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path / "run.jsonl")
    edit_record(path, "budget_decided", 7, num_rows=8)  # round 7 holds 4 requests: G 16
    assert main([str(path), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert (document["ok"], document["all_matched"], document["counterfactual"]) == (
        False, False, False)
    assert document["num_decisions"] == 20
    assert document["policies"]["depth"] == {"name": "fixed", "settings": {}}
    first = document["first_divergence"]
    assert {key: first[key] for key in ("round", "decision", "recorded", "replayed")} == {
        "round": 7, "decision": "budget", "recorded": 8, "replayed": 16}
    assert "recorded G=8, replayed G=16" in first["message"]
    assert document["first_lag_violation"] is None


def test_cli_bad_log_exit_2_with_one_line_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_run(tmp_path / "run.jsonl")
    path.write_bytes(path.read_bytes()[:-10])  # a crash cut the last line short
    assert main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"adaspec replay: error: event log {path}, line 119: invalid JSON")
    assert "Traceback" not in err


def test_cli_unknown_policy_in_the_header_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_run(tmp_path / "run.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[0] = lines[0].replace('"name":"full"', '"name":"oracle"')
    path.write_text("".join(lines), encoding="utf-8")
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == (
        f"adaspec replay: error: event log {path}, line 1: header policies: "
        "budget_policy=oracle: expected one of adaptive-verify, full\n")


@pytest.mark.parametrize(("argv", "message"), [
    ([], "LOG: expected exactly one event log path; usage: adaspec replay LOG "
         "[--across OTHER_LOG ...] [--json]"),
    (["a.jsonl", "b.jsonl"], "LOG=a.jsonl b.jsonl: expected exactly one event log path; "
                             "usage: adaspec replay LOG [--across OTHER_LOG ...] [--json]"),
    (["--yaml", "a.jsonl"], "--yaml: unknown flag; expected --json or --across"),
])
def test_cli_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == f"adaspec replay: error: {message}\n"


def test_cli_missing_log_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing.jsonl"
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == f"adaspec replay: error: event log {path}: no such file\n"


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith(
        "usage: adaspec replay LOG [--across OTHER_LOG ...] [--json]")


def test_reading_errors_are_event_log_errors(tmp_path: Path) -> None:
    with pytest.raises(EventLogError):
        read_event_log(tmp_path / "missing.jsonl")


ADS_LAUNCH = {"speculative_algorithm": "MTP", "num_speculative_tokens": WIDTH,
              "max_seqs_per_batch": 4, "enable_adaptive_draft_step": True}
ADS_POLICY = DraftStepPolicyConfig(window_size=4, update_interval=1, switch_min_gain=0.0)
ADS_LEGAL_ROWS = (4, 6, 8, 12, 16)  # bucket 4's legal G with adaptive draft steps


def adaptive_depth_run(costs: CostBundle, policy: DepthPolicy
                       ) -> tuple[LogHeader, list[Event]]:
    """The header and events of a run of adaptive draft depth on bucket 4: batches of three
    and four requests, short contexts for 20 rounds then long ones (the two intervals of
    ``depth_bundle``), decided by ``policy`` with round n-2's feedback retired just before
    round n, every round verifying all its drafts."""
    events: list[Event] = []
    depths: dict[int, tuple[int, int, int]] = {}  # round -> (B, depth, G)

    def retire(number: int) -> None:
        batch, depth, rows = depths[number]
        first = 0 if number < 20 else 4
        accepted = tuple(min(depth, (number + i) % (depth + 2)) for i in range(batch))
        feedback = RoundFeedback(round=number, num_reqs=batch, num_reqs_bucket=4, width=WIDTH,
                                 depth=depth, num_rows=rows, verify_lengths=(depth,) * batch,
                                 num_accepted=accepted, confidences=((0.9, 0.5, 0.25),) * batch,
                                 request_ids=tuple(range(first, first + batch)))
        policy.observe(feedback)
        events.append(RoundRetired(round=number, slot=number % 2, feedback=feedback))

    for number in range(40):
        if number >= 2:
            retire(number - 2)
        # Requests 0..3 (prompts of 91 tokens) then 4..7 (2991): the KV bound the runtime
        # prices grows a token a round, as request 0 (then 4) delivers at least that.
        first, batch = 0 if number < 20 else 4, 3 + (number // 5) % 2
        kv = 100 + number if number < 20 else 2980 + number
        ids = tuple(range(first, first + batch))
        context = DepthContext(round=number, num_reqs=batch, num_reqs_bucket=4, width=WIDTH,
                               retired_through=max(number - 2, -1), max_kv_length=kv)
        depth = policy.decide(context)
        budget = BudgetContext(round=number, num_reqs=batch, num_reqs_bucket=4, width=WIDTH,
                               depth=depth, legal_rows=ADS_LEGAL_ROWS,
                               retired_through=context.retired_through,
                               request_ids=ids, max_kv_length=kv)
        rows = covering_rows(budget, depth)
        depths[number] = (batch, depth, rows)
        events += [DepthDecided(round=number, slot=number % 2, context=context, depth=depth),
                   BudgetDecided(round=number, slot=number % 2, context=budget, num_rows=rows,
                                 bound_rows=rows),
                   RoundSubmitted(round=number, slot=number % 2,
                                  request_ids=ids, num_reqs_bucket=4),
                   *stages(number)]
    retire(38)
    retire(39)
    models = {role: costs.compatibility[role] for role in ("target", "draft")}
    return LogHeader.of_run(config=load_config(ADS_LAUNCH).as_dict(), cost_table=costs.as_dict(),
                            models=models, context_limit=CONTEXT_LIMIT, seed=0, lag=2,
                            depth_policy=policy, budget_policy=FullBudget()), with_requests(
                                events, 8, lambda id: 91 if id < 4 else 2991)


def test_adaptive_depth_decisions_priced_by_kv_length_and_rows_replay_as_recorded(
        tmp_path: Path) -> None:
    costs = depth_bundle()
    head, recorded = adaptive_depth_run(
        costs, make_depth_policy("adaptive-depth", ADS_POLICY.as_dict(), costs))
    path = tmp_path / "run.jsonl"
    with EventLogWriter(path, head) as writer:
        for event in recorded:
            writer.write(event)
    header, events = read_event_log(path)
    depths = [e.depth for e in events if isinstance(e, DepthDecided)]
    assert len(set(depths)) > 1  # the decisions depend on what the prices say
    assert main([str(path)]) == 0  # the header's table priced as the run priced it
    replay(header, events).check()
    # Priced as before, by the first depth profile at Bcap * (d + 1) rows, they would differ.
    first = AdaptiveDepth(ADS_POLICY, lambda context, depth:
                          costs.depth_cost_ms(context.num_reqs_bucket, depth))
    assert not replay(header, events, depth_policy=first).all_matched
