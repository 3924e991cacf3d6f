"""Offline evaluation: the simulator follows the runtime's lag, tier and allocation rules,
and on synthetic workloads with known regimes adaptive verify is never worse than the best
fixed width chosen in hindsight, beats it when conditions change, and stays near the oracle."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from cost_tables import bundle, depth_bundle
from runtime_helpers import config, decode

from adaspec import cli
from adaspec.config import SamplingParams
from adaspec.errors import ConfigError
from adaspec.policies.base import BudgetContext, DepthContext, RoundFeedback
from adaspec.policies.bundles import CostBundle
from adaspec.policies.depth import bundle_pricing
from adaspec.policies.simulate import (
    Workload,
    WorkloadRequest,
    WorkloadRound,
    allocate,
    parse_workload,
    simulate,
)
from adaspec.policies.verify import AdaptiveVerify
from adaspec.policies.workloads import shaped_tables, synthetic
from adaspec.runtime.devices.allocation import allocate_prefixes
from adaspec.runtime.engine import RuntimeOptions

KINDS = ("high", "low", "step", "drift", "alternating")
CHANGING = ("step", "drift", "alternating")
POLICIES = ("fixed:1", "fixed:2", "fixed:3", "fixed:4", "fixed:5", "adaptive-verify", "oracle")


TABLES = shaped_tables()


def rates(table: CostBundle, kind: str) -> dict[str, float]:
    workload = synthetic(kind, rounds=800, batch=8, seed=11)
    return {p: simulate(p, workload, table).tokens_per_second for p in POLICIES}


@pytest.mark.parametrize("table_name", list(TABLES))
def test_adaptive_verify_against_the_best_fixed_width_and_the_oracle(table_name: str) -> None:
    for kind in KINDS:
        rate = rates(TABLES[table_name], kind)
        best = max(v for p, v in rate.items() if p.startswith("fixed:"))
        adaptive = rate["adaptive-verify"]
        assert adaptive >= 0.98 * best, (kind, adaptive / best)
        assert adaptive >= 0.9 * rate["oracle"], (kind, adaptive / rate["oracle"])
        assert rate["oracle"] >= max(rate.values()) - 1e-9  # an upper bound indeed
        if kind in CHANGING and table_name != "nearly free":
            assert adaptive > 1.05 * best, (kind, adaptive / best)


def test_nearly_free_rows_are_all_verified_and_a_saturated_table_trims() -> None:
    workload = synthetic("high", rounds=300, batch=8)
    free = simulate("adaptive-verify", workload, TABLES["nearly free"])
    assert {rows for _, rows in free.decisions[2:]} == {48}
    low = synthetic("low", rounds=300, batch=8)
    saturated = simulate("adaptive-verify", low, TABLES["saturated"])
    assert saturated.rows / saturated.rounds < 16


def test_allocation_equals_the_device_kernel() -> None:
    rng = random.Random(5)
    for _ in range(200):
        num_reqs, width = rng.randint(1, 6), rng.randint(1, 6)
        # Quantised confidences make equal survivals (and so the tie-break) common.
        confidences = [[rng.choice((0.0, 0.25, 0.5, 0.75, 1.0)) for _ in range(width)]
                       for _ in range(num_reqs)]
        rows = rng.randint(num_reqs, num_reqs * (width + 1))
        survivals = [[float(v) for v in torch.tensor(row, dtype=torch.float64).cumprod(0)]
                     for row in confidences]
        device = allocate_prefixes(torch.tensor(confidences), rows,
                                   torch.full((num_reqs,), width),
                                   torch.ones(num_reqs, dtype=torch.bool))
        assert allocate(survivals, rows) == device.tolist()


class Witness(AdaptiveVerify):
    """Records which rounds it had observed when it decided each round."""

    def __init__(self) -> None:
        super().__init__(TABLES["staircase"])
        self.seen: list[int] = []
        self.at_decision: dict[int, int] = {}

    def observe(self, feedback: RoundFeedback) -> None:
        super().observe(feedback)
        self.seen.append(feedback.round)

    def decide(self, context: BudgetContext) -> int:
        self.at_decision[context.round] = max(self.seen, default=-1)
        return super().decide(context)


def test_decisions_see_feedback_through_round_n_minus_2_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    witness = Witness()
    monkeypatch.setattr("adaspec.policies.simulate.AdaptiveVerify", lambda costs: witness)
    simulate("adaptive-verify", synthetic("step", rounds=50), TABLES["staircase"])
    assert witness.at_decision == {n: n - 2 if n >= 2 else -1 for n in range(50)}


def with_request_field(lines: list[str], line: int, request: int, field: str,
                       value: object) -> list[str]:
    """The workload's lines up to ``line``, that line with one request's field changed."""
    bad = json.loads(lines[line])
    bad["requests"][request][field] = value
    return [*lines[:line], json.dumps(bad)]


def test_a_workload_file_round_trips_and_bad_lines_name_file_line_and_field(
        tmp_path: Path) -> None:
    workload = synthetic("drift", rounds=20)
    assert parse_workload(workload.as_lines(), "w.jsonl") == workload
    lines = workload.as_lines()
    with pytest.raises(ConfigError, match=r"--workload=w\.jsonl:4, requests\[1\]: accepted=9: "
                                          r"expected an integer in 0\.\.5"):
        parse_workload(with_request_field(lines, 3, 1, "accepted", 9), "w.jsonl")
    with pytest.raises(ConfigError, match=r"--workload=w\.jsonl:1: expected a first line"):
        parse_workload(lines[1:], "w.jsonl")
    # A confidence a double cannot hold is no confidence of 0.
    tiny = lines[:2] + [lines[2].replace(lines[2][lines[2].index("[", lines[2].index(
        "confidences")) + 1:].split(",")[0], "1e-400", 1)] + lines[3:]
    with pytest.raises(ConfigError, match=r"--workload=w\.jsonl:3: requests\[0\]\."
                                          r"confidences\[0\]: 1e-400 is a nonzero number "
                                          r"below the smallest double; expected 0 or a number "
                                          r"a double can hold$"):
        parse_workload(tiny, "w.jsonl")


@pytest.mark.parametrize(("line", "field", "value", "message"), [
    (2, "kv_length", 10**30, "--workload=w.jsonl:2: kv_length=1000000000000000000000000000000: "
     f"expected an integer in 1..{1 << 24}"),
    (2, "kv_length", 0, f"--workload=w.jsonl:2: kv_length=0: expected an integer in 1..{1 << 24}"),
    # Optional means absent; null is not a way to leave it out (the schema refuses it too).
    (2, "kv_length", None,
     f"--workload=w.jsonl:2: kv_length=null: expected an integer in 1..{1 << 24}"),
    (3, "id", 10**30, "--workload=w.jsonl:3, requests[0]: id=1000000000000000000000000000000: "
     f"expected an integer in 0..{2**63 - 1}"),
])
def test_workload_lengths_and_ids_past_their_range_are_refused(
        line: int, field: str, value: int | None, message: str) -> None:
    lines = synthetic("drift", rounds=3).as_lines()
    bad = json.loads(lines[line - 1])
    if field == "id":
        bad["requests"][0]["id"] = value
    else:
        bad[field] = value
    lines[line - 1] = json.dumps(bad)
    with pytest.raises(ConfigError) as raised:
        parse_workload(lines, "w.jsonl")
    assert str(raised.value) == message


@pytest.mark.parametrize(("change", "message"), [
    ({"censored": True, "accepted": 5}, "censored=true with accepted=5: expected accepted < 5"),
    ({"confidences": [0.5, 1.01, 0.5, 0.5, 0.5]},
     "confidences=[0.5, 1.01, 0.5, 0.5, 0.5]: expected 5 numbers in 0..1"),
    # Every value as JSON writes it: true, not True; "3" quoted, never read as the integer 3.
    ({"confidences": [0.5, True, 0.5, 0.5, 0.5]},
     "confidences=[0.5, true, 0.5, 0.5, 0.5]: expected 5 numbers in 0..1"),
    ({"id": False}, f"id=false: expected an integer in 0..{2**63 - 1}"),
    ({"id": "3"}, f'id="3": expected an integer in 0..{2**63 - 1}'),
    ({"accepted": "3"}, 'accepted="3": expected an integer in 0..5'),
    ({"accepted": None}, "accepted=null: expected an integer in 0..5"),
    ({"shard": True}, "shard=true: expected an integer in 0..0"),
    ({"censored": "yes"}, 'censored="yes": expected true or false'),
])
def test_a_workload_request_no_run_could_record_is_refused_showing_its_values(
        change: dict[str, object], message: str) -> None:
    lines = synthetic("drift", rounds=3).as_lines()
    bad = json.loads(lines[2])
    bad["requests"][0].update(change)
    with pytest.raises(ConfigError) as raised:
        parse_workload([*lines[:2], json.dumps(bad)], "w.jsonl")
    assert str(raised.value).startswith(f"--workload=w.jsonl:3, requests[0]: {message}")


def test_rounds_past_the_tables_kv_intervals_are_counted_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = synthetic("step", rounds=20)
    # The staircase table covers KV 1..4096: five rounds lie past it.
    rounds = tuple(dataclasses.replace(rnd, kv_length=5000 if n % 4 == 0 else 100)
                   for n, rnd in enumerate(base.rounds))
    workload, table = tmp_path / "long.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(dataclasses.replace(base, rounds=rounds).as_lines()) + "\n")
    TABLES["staircase"].save(str(table))
    argv = ["simulate", "--workload", str(workload), f"--cost_table={table}",
            "--policy", "fixed:5"]
    assert cli.run(argv) == 0
    assert ("5 of 20 rounds have a KV length outside the cost table's intervals (1..4096); "
            "their time is predicted from the nearest interval") in capsys.readouterr().out
    assert cli.run([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rounds_outside_kv_intervals"], report["kv_intervals"]) == (5, "1..4096")
    workload.write_text("\n".join(base.as_lines()) + "\n")  # no kv_length: the table's own
    assert cli.run(argv) == 0
    assert "outside the cost table's intervals" not in capsys.readouterr().out


@pytest.mark.parametrize(("change", "message"), [
    ({"widht": 5}, "widht: not a header field; expected dp_size, format, name, version, width"),
    ({"version": True}, "version=true: expected 1"),
    ({"version": "1"}, 'version="1": expected 1'),
    ({"name": 5}, "name=5: expected a string"),
    ({"name": None}, "name=null: expected a string"),
    # Before: width=True and dp_size=True, Python's spelling.
    ({"width": True}, "width=true: expected an integer in 1..64"),
    ({"width": "5"}, 'width="5": expected an integer in 1..64'),
    ({"dp_size": True}, "dp_size=true: expected an integer in 1..1024"),
    ({"dp_size": 2.0}, "dp_size=2.0: expected an integer in 1..1024"),
])
def test_a_bad_workload_header_key_is_refused_naming_it(change: dict[str, object],
                                                        message: str) -> None:
    lines = synthetic("drift", rounds=2).as_lines()
    header = {**json.loads(lines[0]), **change}
    with pytest.raises(ConfigError) as raised:
        parse_workload([json.dumps(header), *lines[1:]], "w.jsonl")
    assert str(raised.value) == f"--workload=w.jsonl:1: {message}"


@pytest.mark.parametrize(("key", "message"), [
    ("version", "version: missing; expected 1"),  # before: version=null, a value it lacks
    ("width", "width: missing; expected an integer in 1..64"),
])
def test_a_workload_header_without_a_required_key_says_it_is_missing(
        key: str, message: str) -> None:
    lines = synthetic("drift", rounds=2).as_lines()
    header = json.loads(lines[0])
    del header[key]
    with pytest.raises(ConfigError) as raised:
        parse_workload([json.dumps(header), *lines[1:]], "w.jsonl")
    assert str(raised.value) == f"--workload=w.jsonl:1: {message}"


def test_a_header_after_blank_lines_is_named_by_its_own_line() -> None:
    """Blank lines are skipped before the header as between rounds; before, a fault of a
    header on line 3 was named as line 1's."""
    lines = synthetic("drift", rounds=2).as_lines()
    assert parse_workload(["", " ", *lines], "w.jsonl") == parse_workload(lines, "w.jsonl")
    header = {**json.loads(lines[0]), "width": 0}
    with pytest.raises(ConfigError) as raised:
        parse_workload(["", " ", json.dumps(header), *lines[1:]], "w.jsonl")
    assert str(raised.value) == "--workload=w.jsonl:3: width=0: expected an integer in 1..64"


def test_a_workload_request_without_its_id_says_it_is_missing() -> None:
    lines = synthetic("drift", rounds=2).as_lines()
    bad = json.loads(lines[1])
    del bad["requests"][0]["id"]
    with pytest.raises(ConfigError) as raised:
        parse_workload([lines[0], json.dumps(bad)], "w.jsonl")
    assert str(raised.value) == (f"--workload=w.jsonl:2, requests[0]: id: missing; expected "
                                 f"an integer in 0..{2**63 - 1}")


def test_an_unnamed_one_round_workload_reads_as_such(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "workload : 1 rounds, width 5" (an empty name shown as nothing, "1 rounds").
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    base = dataclasses.replace(synthetic("high", rounds=1), name="")
    far = dataclasses.replace(base, rounds=tuple(dataclasses.replace(rnd, kv_length=5000)
                                                 for rnd in base.rounds))
    workload.write_text("\n".join(far.as_lines()) + "\n")
    TABLES["staircase"].save(str(table))
    assert cli.run(["simulate", f"--workload={workload}", f"--cost_table={table}",
                    "--policy", "fixed:5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"workload (unnamed): 1 round, width 5; costs from saved table {table}"
    assert ("1 of 1 round has a KV length outside the cost table's intervals (1..4096); its "
            "time is predicted from the nearest interval") in lines
    named = dataclasses.replace(base, name=" ")  # spaces alone are seen, quoted
    workload.write_text("\n".join(named.as_lines()) + "\n")
    assert cli.run(["simulate", f"--workload={workload}", f"--cost_table={table}",
                    "--policy", "fixed:5"]) == 0
    assert capsys.readouterr().out.startswith("workload ' ': 1 round, width 5;")


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "step.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(synthetic("step", rounds=200).as_lines()) + "\n")
    TABLES["staircase"].save(str(table))
    argv = ["simulate", "--workload", str(workload), f"--cost_table={table}",
            "--policy", "fixed:5", "--policy", "adaptive-verify", "--policy", "oracle"]
    assert cli.run(argv) == 0
    text = capsys.readouterr().out
    assert "adaptive-verify" in text
    assert "AL = accepted + 1" in text
    assert cli.run([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["best_fixed"] == "fixed:5"
    assert [p["policy"] for p in report["policies"]] == ["fixed:5", "adaptive-verify", "oracle"]
    assert report["policies"][2]["vs_oracle"] == 1.0
    assert "predicted from the cost table, not measured" in text


def test_cli_table_without_a_fixed_or_oracle_policy_shows_dashes_not_nan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "step.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(synthetic("step", rounds=50).as_lines()) + "\n")
    TABLES["staircase"].save(str(table))
    assert cli.run(["simulate", "--workload", str(workload), f"--cost_table={table}",
                    "--policy", "adaptive-verify"]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text
    row = next(line for line in text.splitlines() if line.startswith("adaptive-verify"))
    assert row.split()[-2:] == ["-", "-"]
    assert "vs best fixed: - (no fixed:K policy given)" in text


HOSTILE_NAME = "\x1b[31mred\nsecond line"


def test_control_characters_in_a_workload_name_are_shown_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    named = dataclasses.replace(synthetic("high", rounds=10), name=HOSTILE_NAME)
    workload.write_text("\n".join(named.as_lines()) + "\n")
    TABLES["staircase"].save(str(table))
    argv = ["simulate", "--workload", str(workload), "--cost_table", str(table)]
    assert cli.run([*argv, "--policy", "fixed:5"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("workload '\\x1b[31mred\\nsecond line': 10 rounds, width 5;")
    # An error names the file the workload came from.
    narrow = dataclasses.replace(synthetic("high", rounds=10, width=4), name=HOSTILE_NAME)
    workload.write_text("\n".join(narrow.as_lines()) + "\n")
    assert cli.run([*argv, "--policy", "fixed:3"]) == 2
    assert capsys.readouterr() == ("", f"adaspec simulate: error: --workload={workload}: width "
                                       "4 differs from the cost table's draft_width 5\n")
    with pytest.raises(ConfigError) as raised:
        synthetic(HOSTILE_NAME)
    assert str(raised.value) == ("workload='\\x1b[31mred\\nsecond line': expected one of "
                                 "high, low, step, drift, alternating")


@pytest.mark.parametrize("separator", ["\n", "\r\n"])
def test_a_workload_breaks_only_at_newlines_whatever_its_strings_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], separator: str) -> None:
    """JSON strings may hold U+2028, U+2029 and U+0085 as they are; they end no line."""
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    named = dataclasses.replace(synthetic("high", rounds=10), name="a\u2028b\x85c\u2029d")
    lines = [json.dumps(json.loads(line), ensure_ascii=False) for line in named.as_lines()]
    workload.write_text(separator.join(lines) + separator, encoding="utf-8", newline="")
    TABLES["staircase"].save(str(table))
    assert cli.run(["simulate", "--workload", str(workload), "--cost_table", str(table),
                    "--policy", "fixed:5"]) == 0, capsys.readouterr().err
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("workload 'a\\u2028b\\x85c\\u2029d': 10 rounds, width 5;"), first


def test_a_workload_whose_lines_end_in_a_carriage_return_alone_is_told_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    workload.write_text("\r".join(synthetic("high", rounds=3).as_lines()) + "\r",
                        encoding="utf-8", newline="")
    TABLES["staircase"].save(str(table))
    assert cli.run(["simulate", "--workload", str(workload), "--cost_table", str(table),
                    "--policy", "fixed:5"]) == 2
    assert capsys.readouterr().err.rstrip("\n").endswith(
        "; its lines end in a carriage return alone, where JSON Lines end each in a newline")


def test_cli_refuses_an_unknown_policy_before_running_any(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(synthetic("high", rounds=10).as_lines()))
    TABLES["staircase"].save(str(table))
    assert cli.run(["simulate", "--workload", str(workload), "--cost_table", str(table),
                    "--policy", "fixed:5", "--policy", "fixed:9"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "adaspec simulate: error: --policy=fixed:9: expected fixed:K with K " \
                           "in 1..5\n"


def test_the_documented_schema_accepts_written_workloads_and_rejects_bad_lines() -> None:
    import jsonschema

    root = Path(__file__).resolve().parents[1]
    schema = json.loads((root / "docs" / "workload.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    lines = synthetic("alternating", rounds=5).as_lines()
    for line in lines:
        validator.validate(json.loads(line))
    bad = json.loads(lines[1])
    bad["requests"][0]["accepted"] = -1
    assert not validator.is_valid(bad)
    assert not validator.is_valid({"format": "adaspec-workload", "version": 2, "width": 5})


# ---- DP shards --------------------------------------------------------------------------

DP_TABLES = shaped_tables(dp_size=2)


@pytest.mark.parametrize("kind", ["step", "alternating"])
def test_dp_shards_share_g_and_adaptive_verify_holds_its_bounds(kind: str) -> None:
    workload = synthetic(kind, rounds=600, batch=8, seed=3, dp_size=2)
    table = DP_TABLES["saturated"]
    rate = {p: simulate(p, workload, table).tokens_per_second for p in POLICIES}
    best = max(v for p, v in rate.items() if p.startswith("fixed:"))
    assert rate["adaptive-verify"] >= 0.98 * best
    assert rate["adaptive-verify"] >= 0.9 * rate["oracle"]
    result = simulate("adaptive-verify", workload, table)
    assert result.request_rounds == 600 * 16  # both shards' requests count, each once


def test_an_idle_shard_retires_nothing_and_rows_cover_one_shard_not_the_sum() -> None:
    base = synthetic("high", rounds=12, batch=4, seed=1, dp_size=2)
    # From round 6 on shard 1 is idle: the batch is shard 0's alone.
    rounds = tuple(rnd if n < 6 else type(rnd)(requests=tuple(
        r for r in rnd.requests if r.shard == 0)) for n, rnd in enumerate(base.rounds))
    workload = type(base)(width=5, rounds=rounds, name="idle", dp_size=2)
    assert parse_workload(workload.as_lines(), "w.jsonl") == workload
    result = simulate("fixed:5", workload, DP_TABLES["staircase"])
    assert result.request_rounds == 6 * 8 + 6 * 4
    # Full width covers one shard's 4 * 6 rows (tier 32), not both shards' 48.
    assert {rows for _, rows in result.decisions} == {32}


def test_dp_workloads_are_checked_against_the_header_and_the_table(tmp_path: Path) -> None:
    lines = synthetic("high", rounds=3, dp_size=2).as_lines()
    with pytest.raises(ConfigError, match=r"--workload=w\.jsonl:3, requests\[0\]: shard=2: "
                                          r"expected an integer in 0\.\.1"):
        parse_workload(with_request_field(lines, 2, 0, "shard", 2), "w.jsonl")
    with pytest.raises(ConfigError, match=r"dp_size 2 differs from the cost table's dp_size 1"):
        simulate("fixed:5", parse_workload(lines, "w.jsonl"), TABLES["staircase"])


def test_budget_policies_are_refused_on_a_table_priced_per_depth() -> None:
    staircase = TABLES["staircase"]
    per_depth = dataclasses.replace(staircase, profiles=tuple(
        dataclasses.replace(p, over="depth") for p in staircase.profiles))
    workload = synthetic("high", rounds=5)
    for spec in ("adaptive-verify", "oracle"):
        with pytest.raises(ConfigError, match=rf"--policy={spec}: needs a cost table priced "
                                              "over target rows G"):
            simulate(spec, workload, per_depth)
    assert simulate("fixed:3", workload, per_depth).rounds == 5


def depth_workload(num_reqs: int, kv_length: int, rounds: int = 300) -> Workload:
    """Rounds of ``num_reqs`` requests of a Draft3 launch whose prefix acceptance is 0.9,
    0.8 and 0.7 (accepted counts cycling through ten requests), all at one KV length."""
    accepted = (3, 3, 3, 3, 3, 3, 3, 2, 1, 0)
    return Workload(width=3, rounds=tuple(WorkloadRound(requests=tuple(
        WorkloadRequest(id=i, confidences=(0.9, 0.9, 0.9),
                        accepted=accepted[(n * num_reqs + i) % len(accepted)])
        for i in range(num_reqs)), kv_length=kv_length) for n in range(rounds)))


@pytest.mark.parametrize(("num_reqs", "kv_length", "settled"), [
    (4, 100, 2), (3, 100, 3), (4, 3000, 1), (3, 3000, 1)])
def test_simulate_prices_depths_as_the_runtime_does(num_reqs: int, kv_length: int,
                                                    settled: int) -> None:
    costs = depth_bundle()
    runtime = bundle_pricing(costs)
    context = DepthContext(round=0, num_reqs=num_reqs, num_reqs_bucket=4, width=3,
                           retired_through=-1, max_kv_length=kv_length)
    workload = depth_workload(num_reqs, kv_length, rounds=10)
    for depth in (1, 2, 3):
        result = simulate(f"fixed:{depth}", workload, costs)
        assert result.cost_ms / result.rounds == pytest.approx(runtime(context, depth))
    # The policy decides with the same prices: the batch's KV interval, the rows it verifies.
    decisions = simulate("adaptive-depth", depth_workload(num_reqs, kv_length),
                         costs).decisions[100:]
    depths = [depth for depth, _ in decisions]
    assert max(set(depths), key=depths.count) == settled


@pytest.mark.parametrize(("policies", "message"), [
    (["fixed:5", "fixed:5"], "--policy=fixed:5: given twice; name each policy once"),
    (["fixed:05"], "--policy=fixed:05: expected fixed:K with K in 1..5"),
])
def test_cli_refuses_a_policy_named_twice_or_spelled_two_ways(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], policies: list[str],
        message: str) -> None:
    # Before, both printed figures: two identical rows, and a row named fixed:05.
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(synthetic("high", rounds=10).as_lines()))
    TABLES["staircase"].save(str(table))
    argv = ["simulate", "--workload", str(workload), "--cost_table", str(table)]
    assert cli.run([*argv, *(f"--policy={policy}" for policy in policies)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"adaspec simulate: error: {message}\n"


def test_cli_refuses_depth_policies_on_a_dspark_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 3, 2), [b"ROMEO."], [SamplingParams(temperature=0.0, max_tokens=8)],
           options=RuntimeOptions(event_log=str(log)))
    assert cli.run(["simulate", "--workload", str(log), "--policy=adaptive-depth"]) == 2
    assert capsys.readouterr().err == ("adaspec simulate: error: --policy=adaptive-depth: "
                                       "chooses MTP draft depths; the event log records a "
                                       "DSpark run\n")


def test_depth_policies_are_refused_on_a_dspark_cost_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DSpark drafts its block at once: a depth policy would be priced as full width and
    shown as if it had chosen."""
    table = tmp_path / "dspark.json"
    bundle().save(str(table))
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(synthetic("high", rounds=3, batch=2).as_lines()) + "\n")
    for spec in ("adaptive-depth", "oracle-depth"):
        assert cli.run(["simulate", f"--workload={workload}", f"--cost_table={table}",
                        f"--policy={spec}"]) == 2
        assert capsys.readouterr().err == (f"adaspec simulate: error: --policy={spec}: "
                                           "chooses MTP draft depths; the cost table prices a "
                                           "DSpark run\n")
    assert cli.run(["simulate", f"--workload={workload}", f"--cost_table={table}",
                    "--policy=fixed:3"]) == 0


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_an_empty_workload_file_is_named_as_the_workload_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    assert cli.run(["simulate", f"--workload={empty}", "--policy=fixed:1"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec simulate: error: --workload={empty}: empty file; expected a workload (JSON "
        "lines, docs/workload.md) or an event log\n")


def test_a_workload_starting_with_a_byte_order_mark_is_named_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its first line is a workload header behind the mark: refusing the header would
    mislead."""
    path = tmp_path / "bom.jsonl"
    path.write_text("\ufeff" + json.dumps({"format": "adaspec-workload", "version": 1,
                                           "width": 5}) + "\n", encoding="utf-8")
    assert cli.run(["simulate", f"--workload={path}", "--policy=fixed:1"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec simulate: error: --workload={path}: starts with a byte-order mark; expected "
        "UTF-8 JSON lines without one\n")


@pytest.mark.parametrize(("header", "expected"), [
    ({"format": "x", "version": 1, "width": 5}, 'format="x": expected '),
    ({"requests": [], "kv_length": 8}, 'expected a first line that is a JSON object with '
                                       '"format": '),
    ([1, 2], 'expected a first line that is a JSON object with "format": '),
])
def test_a_file_of_neither_format_names_the_workload_flag_and_both_formats(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], header: object,
        expected: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(f"\n{json.dumps(header)}\n" + json.dumps({"requests": [], "kv_length": 8}))
    assert cli.run(["simulate", f"--workload={path}", "--policy=fixed:1"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec simulate: error: --workload={path}:2: {expected}\"adaspec-workload\" (a "
        'workload, docs/workload.md) or "adaspec-event-log" (an event log)\n')


HEADER = '{"format": "adaspec-workload", "version": 1, "width": 3}\n'


@pytest.mark.parametrize(("text", "line", "fault"), [
    ('{"format": "adaspec-event-log", "version": ' + "1" * 4301 + "}\n", 1,
     "invalid JSON: a number of more than 4300 digits; no value of the file is that long"),
    (HEADER + '{"kv_length": ' + "1" * 4301 + "}\n", 2,
     "invalid JSON: a number of more than 4300 digits; no value of the file is that long"),
    (HEADER + '\ufeff{"kv_length": 8}\n', 2, "expected one JSON object per line (a "
     "byte-order mark before the JSON; expected UTF-8 without one)"),
], ids=["header-digits", "round-digits", "round-bom"])
def test_a_line_json_reads_but_python_cannot_is_named_in_the_users_terms(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int,
        fault: str) -> None:
    """Objects all the same: before, the first line was called one that is no object, and a
    later one got json's advice to a programmer."""
    path = tmp_path / "w.jsonl"
    path.write_text(text, encoding="utf-8")
    assert cli.run(["simulate", f"--workload={path}", "--policy=fixed:1"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec simulate: error: --workload={path}:{line}: {fault}\n")


DEPTH_SETTINGS = {"window_size": 2, "update_interval": 1, "switch_min_gain": 0.0}


def adaptive_depth_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """The event log of an adaptive-depth run with ``DEPTH_SETTINGS``."""
    settings = DEPTH_SETTINGS
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"version": 1, "policy": settings, "calibration": {
        "request_buckets": [1, 2], "contexts": [
            {"prefill_tokens": 32, "min_kv_length": 1, "max_kv_length": 1024}],
        "warmup_steps": 1, "window_steps": 2, "windows_per_point": 1}}), encoding="utf-8")
    log = tmp_path / "run.jsonl"
    assert cli.run(["generate", "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                    "--enable_adaptive_draft_step=true", f"--adaptive_draft_step_config={steps}",
                    "--max_seqs_per_batch=2", "--prompt=ROMEO.", "--prompt=The king",
                    "--max_tokens=24", "--temperature=0", f"--event_log={log}"]) == 0
    capsys.readouterr()
    return log


def test_adaptive_depth_simulates_a_recorded_run_with_the_settings_it_recorded(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the defaults (20, 5, 0.05) ran in the recorded policy's place, unsaid."""
    settings = DEPTH_SETTINGS
    log = adaptive_depth_log(tmp_path, capsys)
    assert cli.run(["simulate", "--workload", str(log), "--policy=adaptive-depth",
                    "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adaptive_depth_settings"] == {**settings, "from": "the event log's header"}
    assert report["recorded_policies_not_the_launchs"] == []
    assert cli.run(["simulate", "--workload", str(log), "--policy=adaptive-depth"]) == 0
    assert "adaptive-depth settings: window_size=2, update_interval=1, switch_min_gain=0.0 " \
           "(from the event log's header)" in capsys.readouterr().out


@pytest.mark.parametrize("recorded", ["zzz", "fixed"])
def test_a_recorded_depth_policy_the_config_does_not_make_is_noted_and_its_settings_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], recorded: str) -> None:
    """An embedder's own depth policy (or an edited header): before, simulate ran adaptive
    depth at the defaults although the header's config holds the run's settings, and said
    nothing of the policy replay refuses to rebuild."""
    log = adaptive_depth_log(tmp_path, capsys)
    header, rest = log.read_text().split("\n", 1)
    edited = json.loads(header)
    edited["policies"]["depth"] = {"name": recorded, "settings": {}}
    log.write_text(json.dumps(edited) + "\n" + rest)
    assert cli.run(["simulate", "--workload", str(log), "--policy=adaptive-depth",
                    "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recorded_policies_not_the_launchs"] == ["depth"]
    assert report["adaptive_depth_settings"] == {
        **DEPTH_SETTINGS, "from": f"the event log's header config; the recorded depth policy "
                                  f"is {recorded}"}
    assert cli.run(["simulate", "--workload", str(log), "--policy=adaptive-depth"]) == 0
    assert "note: the recorded depth policy is not the one the header's config makes; an " \
           "embedder's own (RuntimeOptions) or an edited header" in capsys.readouterr().out


def test_recorded_adaptive_depth_settings_must_name_every_setting() -> None:
    """The runtime records all three: a header missing one would run it at a default
    while simulate says the header gave it."""
    from adaspec.policies.registry import make_depth_policy

    with pytest.raises(ConfigError, match=r"expected the keys window_size, update_interval, "
                                          r"switch_min_gain"):
        make_depth_policy("adaptive-depth", {"window_size": 20, "update_interval": 5},
                          depth_bundle())


def test_a_request_id_given_twice_in_a_round_is_named() -> None:
    lines = synthetic("drift", rounds=3).as_lines()
    bad = json.loads(lines[2])
    bad["requests"].append(dict(bad["requests"][0]))
    with pytest.raises(ConfigError) as raised:
        parse_workload([*lines[:2], json.dumps(bad)], "w.jsonl")
    assert str(raised.value) == (f"--workload=w.jsonl:3: request id "
                                 f"{bad['requests'][0]['id']} appears twice in shard 0's batch")
