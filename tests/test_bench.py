"""adaspec bench: every arm through the real runtime on the reference models, the figures
consistent with what ran, the greedy outputs compared across arms, clear refusals before
anything runs, and the README's main command printing its table."""

import asyncio
import io
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import TINY_CALIBRATION

from adaspec import cli
from adaspec.bench.run import (
    SAMPLED,
    BenchPlan,
    KindCounts,
    RunRecord,
    pass_order,
    plan_arms,
    run_bench,
    shipped_prompts,
    timed,
)
from adaspec.bench.statistics import (
    ArmEntry,
    best_fixed_bounds,
    compare_outputs,
    fixed_within_noise,
    margin,
    noise,
    output_reference,
    paired_ratios,
    percentile,
    steady_fixed,
    summarise,
    verdict,
)
from adaspec.cli.bench import (
    CpuTicks,
    _print_kinds,
    busy_warning,
    cpu_times,
    others_share,
    print_table,
    steal_share,
)
from adaspec.config import SamplingParams, load_config
from adaspec.models import load_reference_models
from adaspec.runtime.engine import Runtime
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A small bench: DSpark width 5, plain / none / fixed:2 / fixed:5 / adaptive-verify,
    levels 1 and 2, two passes, event logs written."""
    folder = tmp_path_factory.mktemp("bench")
    calibration = folder / "tiny.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    logs = folder / "logs"
    logs.mkdir()
    settings = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
                "adaptive_target_verify_calibration": str(calibration)}
    arms, skipped = plan_arms(settings, widths=(2, 5), names=None, quick=False,
                              levels=(1, 2), scratch=folder)
    plan = BenchPlan(arms=arms, levels=(1, 2), prompts=shipped_prompts(),
                     requests={1: 2, 2: 3}, max_tokens=10, passes=2, event_log_dir=str(logs),
                     skipped=skipped)
    records = asyncio.run(run_bench(plan, models=load_reference_models,
                                    calibration_progress=lambda _: None))
    return {"plan": plan, "records": records, "summary": summarise(plan, records),
            "logs": logs}


def entry(summary: dict[str, object], arm: str, level: int) -> dict[str, object]:
    arms = summary["arms"]
    assert isinstance(arms, list)
    return next(e for e in arms if e["arm"] == arm and e["concurrency"] == level)


def test_every_arm_runs_every_level_in_every_pass(report: dict[str, object]) -> None:
    records = report["records"]
    assert isinstance(records, list)
    names = ["plain", "none", "fixed:2", "fixed:5", "adaptive-verify"]
    assert [a.name for a in report["plan"].arms] == names  # type: ignore[attr-defined]
    assert len(records) == 5 * 2 * 2
    # The arm order reverses and rotates between passes, so no arm always runs first.
    firsts = [r.arm for r in records if r.level == 1][::5]
    assert firsts == ["plain", "fixed:5"]
    summary = report["summary"]
    assert isinstance(summary, dict)
    assert [s["arm"] for s in summary["skipped_arms"]] == ["adaptive-depth"]
    assert "MTP" in summary["skipped_arms"][0]["why"]


def test_pass_orders_put_every_arm_first_and_on_both_sides_of_its_neighbours() -> None:
    names = ["none", "fixed:1", "fixed:2", "fixed:3", "fixed:4", "fixed:5", "adaptive"]
    orders = [pass_order(names, number) for number in range(6)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert len({order[0] for order in orders}) == 6  # six passes, six different first arms
    for a, b in zip(names, names[1:], strict=False):
        sides = {order.index(a) < order.index(b) for order in orders}
        assert sides == {True, False}, (a, b)


def test_noise_follows_the_per_pass_ratios() -> None:
    assert noise([1.0]) == 0.0
    ratios = [0.9, 1.1, 1.0, 1.0]
    logs = [math.log(r) for r in ratios]
    assert noise(ratios) == pytest.approx(
        2 * statistics.geometric_mean(ratios) * statistics.stdev(logs) / 2)
    # A pass caught by a stall widens it: no verdict rests on that pass.
    assert noise([1.0, 1.01, 0.99, 1.0, 1.02, 0.6]) > 3 * noise([1.0, 1.01, 0.99, 1.0, 1.02])


def test_two_passes_that_disagree_are_not_outvoted_by_four_that_agree() -> None:
    # Ratios of one run of 2026-11-30 (adaptive verify against fixed:3 and fixed:5 at
    # concurrency 16): four passes near 0.94 against fixed:3, two at 1.14 and 1.24. A
    # median's absolute deviation is 0.01 there and called it ``below``; the passes do not
    # support that.
    against = {"fixed:3": [0.928, 1.241, 1.143, 0.931, 0.931, 0.948],
               "fixed:5": [1.024, 1.048, 1.069, 0.976, 1.019, 1.029]}
    low, high = best_fixed_bounds(against)
    assert low < 1 < high
    assert verdict((low, high)) == "within noise"


def test_a_pass_that_measured_nothing_is_left_out_of_the_ratios() -> None:
    mine = [RunRecord("a", 1, 0, seconds=2.0, tokens=100), RunRecord("a", 1, 1, seconds=1.0),
            RunRecord("a", 1, 2, seconds=1.0, tokens=90)]
    theirs = [RunRecord("b", 1, 0, seconds=1.0, tokens=100),
              RunRecord("b", 1, 1, seconds=1.0, tokens=80), RunRecord("b", 1, 2, seconds=1.0)]
    assert paired_ratios(mine, theirs) == [0.5]


def test_bounds_on_the_ratio_to_the_best_fixed_width_use_every_fixed_width() -> None:
    assert best_fixed_bounds({}) == (1.0, 1.0)
    # One pass: no noise, so the bounds are the smallest ratio.
    assert best_fixed_bounds({"fixed:3": [0.95], "fixed:4": [1.02]}) == \
        pytest.approx((0.95, 0.95))
    # Margins: Student's t at 2.5 % one-sided, split over the comparisons, with passes - 1
    # degrees of freedom (t tables: 2.571 for 5 df, 4.032 at 0.5 %, 4.177 for 3 df at 1.25 %).
    assert margin(6, 1) == pytest.approx(2.571, abs=1e-3)
    assert margin(6, 5) == pytest.approx(4.032, abs=1e-3)
    assert margin(4, 2) == pytest.approx(4.177, abs=1e-3)
    assert margin(1, 3) == 0.0
    ratios = [0.9, 1.1, 1.0, 1.0]
    logs = [math.log(r) for r in ratios]
    centre, se = statistics.fmean(logs), statistics.stdev(logs) / 2
    low, high = best_fixed_bounds({"fixed:4": ratios, "fixed:3": [1.4] * 4})
    assert low == pytest.approx(math.exp(centre - margin(4, 2) * se))
    assert high == pytest.approx(math.exp(centre + margin(4, 2) * se))
    # A clear loss to any one fixed width is a loss to the best, whichever came out on top.
    assert verdict(best_fixed_bounds({"fixed:4": [1.1] * 4, "fixed:5": [0.8] * 4})) == "below"
    assert verdict((0.95, 1.02)) == "within noise"
    assert verdict((1.01, 1.05)) == "beats"
    assert verdict((0.90, 0.98)) == "below"
    assert verdict((1.0, 1.0)) == "within noise"
    assert verdict(None) is None


def judged(arm: str, versus_best_fixed: str) -> ArmEntry:
    """An arm's entry with only its verdict against the best fixed width filled in."""
    return ArmEntry(arm=arm, concurrency=1, tokens_per_second=1.0, pass_tokens_per_second=[],
                    tokens_per_cpu_second=None, aggregate_tokens_per_second=1.0, tpot_ms={},
                    mean_acceptance_length=None, acceptance_rate=None, position_acceptance=[],
                    mean_rows_per_round=None, tokens=0, seconds=0.0, rounds=0, by_kind={},
                    versus_best_fixed=versus_best_fixed)


def test_fixed_widths_the_run_cannot_tell_from_the_best_are_named() -> None:
    entries = [judged("none", "below"), judged("fixed:3", "within noise"),
               judged("fixed:4", "within noise"),  # the best itself
               judged("fixed:5", "below"), judged("adaptive-verify", "within noise")]
    assert fixed_within_noise(entries) == ["fixed:3", "fixed:4"]
    # One width within noise of the best everywhere: the best does not change beyond noise.
    assert steady_fixed([["fixed:3", "fixed:4"], ["fixed:4", "fixed:5"], ["fixed:4"]]) \
        == ["fixed:4"]
    # Sets that share no width: the best fixed width changes with concurrency.
    assert steady_fixed([["fixed:2", "fixed:3"], ["fixed:4", "fixed:5"]]) == []
    assert steady_fixed([]) == []


def test_the_report_says_whether_the_best_fixed_width_changes_with_concurrency(
        report: dict[str, object]) -> None:
    summary = report["summary"]
    assert isinstance(summary, dict)
    levels = summary["levels"]
    assert [level["concurrency"] for level in levels] == [1, 2]
    for level in levels:
        assert level["best_fixed"] in level["fixed_within_noise"]
        assert level["best_fixed"] == entry(summary, "fixed:5", level["concurrency"])[
            "best_fixed"]
    for e in summary["arms"]:
        # Geometric means: an arm's speedup over the best is the ratio of their tokens/s, up
        # to the rounding of the speedup (4 decimals) and of both rates (2 decimals each).
        best = entry(summary, e["best_fixed"], e["concurrency"])
        ratio = e["tokens_per_second"] / best["tokens_per_second"]
        rounding = 5e-5 + ratio * 0.005 * (1 / e["tokens_per_second"]
                                           + 1 / best["tokens_per_second"])
        assert e["speedup_vs_best_fixed"] == pytest.approx(ratio, abs=rounding)
        low, high = e["versus_best_fixed_bounds"]
        assert low <= high
        if e["arm"].startswith("fixed:"):  # no fixed width beats the best fixed width
            assert high <= 1.0
            assert e["versus_best_fixed"] != "beats"
    steady = summary["fixed_within_noise_at_every_level"]
    assert summary["best_fixed_changes_with_concurrency"] == (not steady)
    assert all(arm in level["fixed_within_noise"] for arm in steady for level in levels)


def test_the_rows_by_kind_show_no_tok_s_that_is_the_runs_own() -> None:
    # Before, each kind's row showed its tokens over the run's whole time: with each prompt
    # sent once at each temperature the kinds' tokens are equal, so every kind read the
    # same figure, half the run's tok/s, as if it were the kind's speed.
    def kind(tpot: float) -> dict[str, object]:
        return {"requests": 2, "tokens": 48, "tokens_per_second": 141.7,
                "tpot_ms": {"mean": tpot, "p50": tpot, "p90": tpot},
                "mean_acceptance_length": 1.0, "acceptance_rate": None}

    lines: list[str] = []
    _print_kinds([{"arm": "none", "by_kind": {"greedy": kind(2.43), "sampled": kind(2.63)}}],
                 lines.append)
    header, rows = lines[1].split(), lines[2:]
    assert "tok/s" not in header
    assert "TPOT" in header
    assert [row.split()[:4] for row in rows] == [["none", "greedy", "2", "2.43"],
                                                 ["none", "sampled", "2", "2.63"]]
    assert not any("141.7" in line for line in lines)


def test_the_share_of_cpu_time_stolen_or_taken_by_others_is_reported() -> None:
    assert steal_share(CpuTicks(10, 100, 1000), CpuTicks(60, 600, 2000)) == 0.05
    assert steal_share(None, CpuTicks(60, 600, 2000)) is None
    # No time passed: no share.
    assert steal_share(CpuTicks(10, 100, 1000), CpuTicks(10, 100, 1000)) is None
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    # 500 busy ticks, of which this process took 2 s: the rest went elsewhere.
    share = others_share(CpuTicks(0, 100, 1000), CpuTicks(0, 600, 2000), 2.0)
    assert share == round(max(0, 500 - 2 * ticks_per_second) / 1000, 4)
    assert others_share(CpuTicks(0, 100, 1000), CpuTicks(0, 600, 2000), 1e6) == 0.0
    # The host's steal is reported on its own, not as other processes' time.
    assert others_share(CpuTicks(10, 100, 1000), CpuTicks(60, 600, 2000), 0.0) == 0.45
    ticks = cpu_times()
    if Path("/proc/stat").exists():
        assert ticks is not None
        assert 0 <= ticks.stolen <= ticks.busy <= ticks.total


def test_a_busy_machine_gets_a_warning_line() -> None:
    assert busy_warning(0.02, (0.1, 0.3)) is None
    warning = busy_warning(0.35, (0.1, 0.3))
    assert warning is not None
    assert "35 % of the CPU time went to other processes" in warning
    loaded = busy_warning(None, (4 * (os.cpu_count() or 1), 1.0))
    assert loaded is not None
    assert "load average" in loaded


def test_figures_agree_with_what_ran(report: dict[str, object]) -> None:
    summary = report["summary"]
    assert isinstance(summary, dict)
    for level, requests in ((1, 2), (2, 3)):
        plain = entry(summary, "plain", level)
        assert plain["tokens"] == 2 * requests * 10
        assert plain["mean_acceptance_length"] == 1.0
        assert plain["speedup_vs_plain"] == 1.0
        # The plain loop makes one step per token after the first, one row per request.
        assert plain["rounds"] >= 2 * 9
        none = entry(summary, "none", level)
        assert none["tokens"] == 2 * requests * 10  # two passes, ten tokens each
        assert none["mean_acceptance_length"] == 1.0
        assert none["speedup_vs_none"] == 1.0
        assert none["position_acceptance"] == []
        fixed = entry(summary, "fixed:5", level)
        assert 1.0 < fixed["mean_acceptance_length"] <= 6.0
        assert 0.0 <= fixed["acceptance_rate"] <= 1.0
        shares = fixed["position_acceptance"]
        assert len(shares) == 5
        assert all(0.0 <= share <= 1.0 for share in shares)
        best = entry(summary, fixed["best_fixed"], level)
        assert best["speedup_vs_best_fixed"] == 1.0
        tpot = fixed["tpot_ms"]
        assert 0 < tpot["p50"] <= tpot["p90"]
    # B = 1 verifies one row without drafts and w + 1 = 6 rows at full width.
    assert entry(summary, "none", 1)["mean_rows_per_round"] == 1.0
    assert entry(summary, "plain", 1)["mean_rows_per_round"] == 1.0
    assert entry(summary, "plain", 1)["rounds"] == 2 * 2 * 9  # one request at a time
    speedup = entry(summary, "none", 1)["speedup_vs_plain"]
    assert speedup == pytest.approx(entry(summary, "none", 1)["tokens_per_second"]
                                    / entry(summary, "plain", 1)["tokens_per_second"], rel=1e-3)
    assert entry(summary, "fixed:5", 1)["mean_rows_per_round"] == 6.0
    assert entry(summary, "fixed:2", 1)["mean_rows_per_round"] == 3.0


def test_the_greedy_outputs_of_every_arm_are_identical(report: dict[str, object]) -> None:
    summary = report["summary"]
    assert isinstance(summary, dict)
    assert summary["greedy_outputs_identical"] is True
    assert summary["outputs_compared"] == 4 * 2 * (2 + 3)  # four arms against the plain loop


def test_a_differing_output_is_reported_with_its_place() -> None:
    # Fabricated records (the point of the test): one arm's third token differs.
    reference = RunRecord(arm="none", level=4, passed=1, outputs=[(1, 2, 3), (4, 5, 6)])
    other = RunRecord(arm="fixed:3", level=4, passed=1, outputs=[(1, 2, 3), (4, 5, 7)])
    assert compare_outputs([reference, other]) == [{
        "arm": "fixed:3", "reference": "none", "concurrency": 4, "pass": 1, "prompt": 1,
        "first_difference": 2}]


def test_without_the_target_alone_outputs_are_compared_with_the_first_arm() -> None:
    # Fabricated records (the point of the test): no plain or none arm ran.
    first = RunRecord(arm="fixed:1", level=1, passed=0, outputs=[(1, 2), (3, 4)])
    second = RunRecord(arm="fixed:2", level=1, passed=0, outputs=[(1, 2), (3, 5)])
    later = RunRecord(arm="fixed:2", level=1, passed=1, outputs=[(1, 2), (3, 4)])
    rotated = RunRecord(arm="fixed:1", level=1, passed=1, outputs=[(1, 2), (3, 4)])
    assert output_reference(["fixed:1", "fixed:2"]) == "fixed:1"
    assert output_reference(["fixed:1", "none", "plain"]) == "plain"
    assert compare_outputs([first, second, later, rotated]) == [{
        "arm": "fixed:2", "reference": "fixed:1", "concurrency": 1, "pass": 0, "prompt": 1,
        "first_difference": 1}]


@pytest.mark.parametrize(("variable", "value", "threads"), [
    ("ADASPEC_CPU_THREADS", "0", None), ("ADASPEC_CPU_STREAM", "thread", None),
    ("ADASPEC_CPU_STREAM", "thread", "1")])
def test_a_bad_stream_setting_stops_a_plain_only_bench_before_it_runs(
        variable: str, value: str, threads: str | None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(variable, value)
    if threads is not None:  # a good thread count must not hide a bad stream
        monkeypatch.setenv("ADASPEC_CPU_THREADS", threads)
    argv = ["bench", "--arms", "plain", "--concurrency", "1", "--requests", "1",
            "--max_tokens", "2", "--passes", "1"]
    assert cli.run(argv) == 2  # plain alone runs no stream, but the setting is checked anyway
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"adaspec bench: error: {variable}={value}: expected")


def test_every_arm_writes_an_event_log_that_replays(report: dict[str, object]) -> None:
    logs = report["logs"]
    assert isinstance(logs, Path)
    assert sorted(p.name for p in logs.iterdir()) == [
        "adaptive-verify.jsonl", "fixed-2.jsonl", "fixed-5.jsonl", "none.jsonl"]
    header, events = read_event_log(logs / "adaptive-verify.jsonl")
    assert header.policies["budget"]["name"] == "adaptive-verify"
    replay(header, events).check()


def test_percentiles_interpolate_between_order_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert percentile([7.0], 0.9) == 7.0


def test_wait_idle_returns_once_every_round_has_retired() -> None:
    async def run() -> tuple[int, int]:
        runtime = Runtime(load_config({"speculative_algorithm": "DSpark",
                                       "num_speculative_tokens": 5}))
        await runtime.start()
        try:
            handles = [runtime.submit(list(p), SamplingParams(temperature=0, max_tokens=9))
                       for p in shipped_prompts()[:3]]
            for handle in handles:
                await handle.result()
            await runtime.wait_idle()
            stats = runtime.statistics()
            return stats.rounds_submitted, stats.rounds_retired
        finally:
            await runtime.stop()

    submitted, retired = asyncio.run(run())
    assert submitted == retired > 0


def test_cli_json_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "bench.png"
    argv = ["bench", "--arms", "none,fixed:3", "--concurrency", "1,2", "--requests", "2",
            "--max_tokens", "6", "--passes", "1", "--speculative_algorithm=MTP",
            "--num_speculative_tokens=3"]
    assert cli.run([*argv, "--json", f"--plot={plot}"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(a["arm"], a["concurrency"]) for a in data["arms"]] == [
        ("none", 1), ("fixed:3", 1), ("none", 2), ("fixed:3", 2)]
    assert data["greedy_outputs_identical"] is True
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.run(argv) == 0
    table = capsys.readouterr().out
    assert "concurrency 2 (2 requests per pass; best fixed width: fixed:3)" in table
    assert "one pass: figures only, no verdict" in table
    assert "within noise" not in table
    assert data["verdicts"] is False
    assert data["best_fixed_changes_with_concurrency"] is None
    assert all(a["versus_best_fixed"] is None for a in data["arms"])
    assert "AL counts the residual or bonus token" in table
    assert "greedy outputs: identical in every arm (4 outputs compared" in table


def test_a_run_without_a_fixed_arm_says_so_and_shows_no_interval(tmp_path: Path) -> None:
    # Before: "best fixed width: None" and a row ending "- +-0.000 (-..-)", the noise and
    # range of a ratio that does not exist.
    arms, skipped = plan_arms({"speculative_algorithm": "MTP"}, widths=None,
                              names=("adaptive-verify",), quick=True, levels=(1,),
                              scratch=tmp_path, temperatures=(0.8,))
    plan = BenchPlan(arms=arms, levels=(1,), prompts=shipped_prompts(), requests={1: 2},
                     max_tokens=6, passes=1, skipped=skipped, temperatures=(0.8,))
    counts = KindCounts(requests=2, tokens=12, rounds=4, verified=8, accepted=4,
                        tpot_s=[0.01, 0.02])
    record = RunRecord("adaptive-verify", 1, 0, seconds=0.1, cpu_seconds=0.2, tokens=12,
                       tpot_s=[0.01, 0.02], outputs=[(1,) * 6, (2,) * 6],
                       temperatures=[0.8, 0.8], kinds={SAMPLED: counts}, rounds=4, rows=16,
                       request_rounds=4, verified=8, accepted=4, reached=[4, 4],
                       through=[3, 1])
    summary = summarise(plan, [record])
    summary.update(machine="test", seconds=0.0)  # what the command adds before printing
    out = io.StringIO()
    print_table(summary, out)
    table = out.getvalue()
    assert "None" not in table
    assert "(2 requests per pass; best fixed width: none (no fixed arm ran))" in table
    row = next(line for line in table.splitlines() if line.startswith("adaptive-verify "))
    assert row.split()[-3:] == ["-", "-", "-"]  # vs plain, vs none, vs best fixed
    assert "+-" not in row
    assert "(-..-)" not in row


@pytest.mark.parametrize(("flags", "message"), [
    (["--concurrency=0"], "--concurrency=0: expected an integer in 1..1024"),
    (["--concurrency=1,1"], "--concurrency=1,1: expected distinct values"),
    (["--passes=x"], "--passes=x: expected an integer in 1..100"),
    (["--quick=yes"], "--quick=yes: takes no value"),
    (["--arms=fixed:9"], "--arms=fixed:9: expected some of plain, none, fixed:1"),
    (["--widths=6"], "--widths=6: expected widths in 1..5"),
    (["--arms=plain", "--widths=2"], "--widths=2: expected no --widths: --arms=plain runs no "
                                     "fixed:K arm"),
    (["--speculative_algorithm=none"], "--speculative_algorithm=none: expected MTP or DSpark"),
    (["--requests=0"], "--requests=0: expected an integer in 1..100000"),
    (["--max_seqs_per_batch=4"], "--concurrency=16: expected at most "
                                 "--max_seqs_per_batch=4"),
    (["--acl_graph_decode_batch_size_limit=8"], "--concurrency=16: expected at most "
                                                "--acl_graph_decode_batch_size_limit=8: a round "
                                                "holds no more"),
    # The longest shipped prompt a quick run sends at concurrency 1 has 379 tokens.
    (["--quick", "--concurrency=1", "--requests=1", "--max_tokens=646"],
     "--max_tokens=646: expected at most 645: the context limit 1024 less the 379 tokens of "
     "the longest shipped prompt this run sends"),
    (["--nnodes=3", "--dp_size=2"], "--nnodes=3: expected a multiple of dp_size*cp_size=2"),
    (["--requests=2"], "--requests=2: expected at least the largest concurrency 16"),
    (["--plot=out.txt"], "--plot=out.txt: expected a .png file name"),
    (["--event_log_dir=/nonexistent/dir"], "--event_log_dir=/nonexistent/dir: expected an "
                                           "existing directory"),
    # A folder no file can be made in, named by the flag (it was the runtime's "event_log").
    (["--arms=none", "--event_log_dir=/proc/self"], "--event_log_dir=/proc/self/none.jsonl: "
                                                    "expected a file in a writable directory"),
    (["--model=/models/other"], "--draft_model: required with --model=/models/other"),
    (["--num_speculative_tokens=five"], "--num_speculative_tokens=five: expected an integer"),
    # An adaptive flag whose arm does not run would be ignored; its file is never read.
    (["--arms=fixed:2", "--adaptive_target_verify_cost_table=/nonexistent"],
     "--adaptive_target_verify_cost_table=/nonexistent: configures the adaptive-verify arm, "
     "which --arms=fixed:2 does not run; expected adaptive-verify in --arms, or no "
     "--adaptive_target_verify_cost_table"),
    (["--arms=none,adaptive-verify", "--enable_adaptive_draft_step=true"],
     "--enable_adaptive_draft_step=true: configures the adaptive-depth arm, which "
     "--arms=none,adaptive-verify does not run"),
    # An enable flag set false turns its arm off: not named, not configured.
    (["--speculative_algorithm=MTP", "--num_speculative_tokens=2", "--arms=adaptive-depth",
      "--enable_adaptive_draft_step=false"],
     "--enable_adaptive_draft_step=false: turns off the adaptive-depth arm, which "
     "--arms=adaptive-depth runs; expected true, or adaptive-depth left out of --arms"),
    (["--enable_adaptive_target_verify=false", "--adaptive_target_verify_cost_table=/x.json"],
     "--adaptive_target_verify_cost_table=/x.json: configures the adaptive-verify arm, which "
     "--enable_adaptive_target_verify=false turns off; expected one or the other"),
    # Outputs: logs only runtime arms write; no two outputs one file.
    (["--arms=plain", "--event_log_dir=/tmp"], "--event_log_dir=/tmp: expected an arm that "
                                               "writes an event log; plain runs outside the "
                                               "runtime"),
    (["--arms=adaptive-verify", "--adaptive_target_verify_cost_table_output=/tmp/adaspec-c.png",
      "--plot=/tmp/adaspec-c.png"],
     "--plot=/tmp/adaspec-c.png: expected a file of its own; "
     "--adaptive_target_verify_cost_table_output=/tmp/adaspec-c.png names /tmp/adaspec-c.png "
     "too"),
    # Without --arms, a file given for an adaptive arm asks for it: refused, not skipped.
    (["--adaptive_target_verify_cost_table=/nonexistent"],
     "--adaptive_target_verify_cost_table=/nonexistent: asks for the adaptive-verify arm, "
     "which this launch cannot run (--adaptive_target_verify_cost_table=/nonexistent: "),
])
def test_bad_flags_are_refused_in_one_line_before_anything_runs(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["bench", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"adaspec bench: error: {message}")
    assert captured.err.count("\n") == 1


def test_event_logs_are_checked_under_the_names_each_rank_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, the check looked for none.jsonl: the arm's runtime found the file only as it
    started (after the arms before it had run), and named its own "event_log"."""
    from rank_launch import free_port

    kept = tmp_path / "none.rank0.jsonl"
    kept.write_text("keep\n")
    assert cli.run(["bench", "--quick", "--arms=none", "--nnodes=2", "--node_rank=0",
                    f"--master_node_addr=127.0.0.1:{free_port()}", "--collective_timeout_s=20",
                    f"--event_log_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec bench: error: --event_log_dir={tmp_path}: none.rank0.jsonl exists already; "
        "expected a folder without this bench's logs\n")
    assert kept.read_text() == "keep\n"


def test_an_adaptive_arm_turned_off_by_its_flag_is_not_run(tmp_path: Path) -> None:
    arms, skipped = plan_arms({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                               "enable_adaptive_target_verify": "false"},
                              widths=(3,), names=None, quick=True, levels=(1,),
                              scratch=tmp_path)
    names = [arm.name for arm in arms] + [name for name, _ in skipped]
    assert "adaptive-verify" not in names
    assert "adaptive-depth" in names


def test_the_readme_main_command_prints_the_table() -> None:
    # The README's first command after the install: the quick run of the main job.
    done = subprocess.run([sys.executable, "-m", "adaspec", "bench", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for level in (1, 4, 16):
        assert f"concurrency {level} (" in out
    for arm in ("plain", "none", "fixed:1", "fixed:5", "adaptive-verify"):
        assert f"\n{arm} " in out
    assert "greedy outputs: identical in every arm" in out


def test_a_request_whose_tokens_all_came_in_one_chunk_has_no_tpot() -> None:
    """Its client read them late (here: only once the request had ended), so it saw no time
    between them: that is no TPOT of 0."""

    async def late() -> tuple[int, float | None]:
        runtime = Runtime(load_config({"speculative_algorithm": "MTP",
                                       "num_speculative_tokens": 3}))
        await runtime.start()
        try:
            handle = runtime.submit([65, 66, 67], SamplingParams(max_tokens=12, temperature=0))
            await handle.result()
            result, tpot = await timed(handle)
        finally:
            await runtime.stop()
        return len(result.token_ids), tpot

    assert asyncio.run(late()) == (12, None)


def test_a_figure_not_measured_keeps_its_column() -> None:
    from adaspec.cli.bench import _fmt

    assert [_fmt(None, "8.2f"), _fmt(4.375, "8.2f"), _fmt(None, ".2f")] == [
        "       -", "    4.38", "-"]
