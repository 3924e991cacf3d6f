"""adaspec bench with sampled requests: --temperature (one value or a mix) runs every arm's
requests at those temperatures through the real runtime, reports acceptance and speed per kind
of request (greedy, sampled), keeps the greedy token-equality verdict for the greedy part only,
refuses bad values and arms that cannot sample in one line before anything runs, and a plot
that cannot be written is one line naming --plot."""

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec import cli
from adaspec.bench.plain import plain_loop
from adaspec.bench.run import (
    GREEDY,
    PLAIN_IS_GREEDY,
    SAMPLED,
    BenchPlan,
    plan_arms,
    run_bench,
    shipped_prompts,
)
from adaspec.bench.statistics import summarise
from adaspec.cli.bench import print_table, write_plot
from adaspec.errors import ConfigError
from adaspec.models import load_reference_models

MTP3 = ["--speculative_algorithm=MTP", "--num_speculative_tokens=3"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """none and fixed:3 (MTP) at concurrency 2, four requests: two prompts, each once greedy
    and once at temperature 0.8."""
    settings = {"speculative_algorithm": "MTP", "num_speculative_tokens": 3}
    arms, skipped = plan_arms(settings, widths=None, names=("none", "fixed:3"), quick=True,
                              levels=(2,), scratch=tmp_path_factory.mktemp("bench"),
                              temperatures=(0.0, 0.8))
    plan = BenchPlan(arms=arms, levels=(2,), prompts=shipped_prompts(), requests={2: 4},
                     max_tokens=8, passes=1, skipped=skipped, temperatures=(0.0, 0.8))
    records = asyncio.run(run_bench(plan, models=load_reference_models))
    summary = summarise(plan, records)
    summary.update(machine="test", seconds=0.0)  # what the command adds before printing
    return {"plan": plan, "records": records, "summary": summary}


def test_a_mix_sends_each_prompt_once_at_each_temperature(mixed: dict[str, object]) -> None:
    plan = mixed["plan"]
    assert isinstance(plan, BenchPlan)
    first, second = shipped_prompts()[:2]
    assert plan.level_requests(2) == [(first, 0.0), (first, 0.8), (second, 0.0),
                                      (second, 0.8)]
    assert plan.kinds == (GREEDY, SAMPLED)
    assert plan.kind_requests(SAMPLED) == {"2": 2}


def test_a_mixed_run_splits_acceptance_and_speed_by_kind(mixed: dict[str, object]) -> None:
    summary = mixed["summary"]
    assert isinstance(summary, dict)
    by_arm = {e["arm"]: e for e in summary["arms"]}
    for arm in ("none", "fixed:3"):
        kinds = by_arm[arm]["by_kind"]
        assert list(kinds) == [GREEDY, SAMPLED]
        for kind in kinds.values():
            assert kind["requests"] == 2
            assert kind["tokens"] == 2 * 8
            assert kind["tpot_ms"]["mean"] > 0
    assert by_arm["none"]["by_kind"][SAMPLED]["mean_acceptance_length"] == 1.0
    assert by_arm["none"]["by_kind"][SAMPLED]["acceptance_rate"] is None  # nothing drafted
    for kind in by_arm["fixed:3"]["by_kind"].values():
        assert 1.0 <= kind["mean_acceptance_length"] <= 4.0
        assert 0.0 <= kind["acceptance_rate"] <= 1.0
    # The kinds' own counts add up to the runtime's counters for the whole run.
    for record in mixed["records"]:  # type: ignore[attr-defined]
        assert sum(k.accepted for k in record.kinds.values()) == record.accepted
        assert sum(k.verified for k in record.kinds.values()) == record.verified
        assert sum(k.rounds for k in record.kinds.values()) == record.request_rounds
    assert summary["settings"]["sampling"]["temperatures"] == [0.0, 0.8]


def test_the_greedy_verdict_holds_for_the_greedy_part_of_a_mixed_run(
        mixed: dict[str, object]) -> None:
    summary = mixed["summary"]
    assert isinstance(summary, dict)
    assert summary["greedy_outputs_identical"] is True
    assert summary["outputs_compared"] == 2  # fixed:3's two greedy outputs against none's
    assert summary["output_checks"][GREEDY].startswith("every arm's greedy outputs")
    assert "not compared token for token" in summary["output_checks"][SAMPLED]
    # The greedy requests decode as the target alone does, sampled neighbours or not.
    target = load_reference_models().target
    target.allocate(2)
    prompts = [list(p) for p in shipped_prompts()[:2]]
    alone = plain_loop(target, prompts, 8, 2).outputs
    records = mixed["records"]
    assert isinstance(records, list)
    for record in records:
        assert [record.outputs[0], record.outputs[2]] == list(alone)
    # The sampled requests did sample: some differ from the greedy output of their prompt.
    assert any(record.outputs[1] != alone[0] or record.outputs[3] != alone[1]
               for record in records)


def test_the_table_says_which_verdicts_apply(mixed: dict[str, object]) -> None:
    out = io.StringIO()
    print_table(mixed["summary"], out)  # type: ignore[arg-type]
    table = out.getvalue()
    assert "8 tokens per request, each prompt at temperatures 0 and 0.8;" in table
    assert "by kind of request" in table
    assert "\n  fixed:3          sampled      2 " in table
    assert "greedy outputs: identical in every arm (2 outputs compared" in table
    assert "sampled outputs: not compared token for token" in table
    assert "note: random draws come from each arm's runtime generator, seeded with 0" in table


def test_a_sampled_run_reports_each_arms_acceptance_for_sampled_requests(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--arms", "none,fixed:3", "--concurrency", "1", "--requests", "2",
            "--max_tokens", "6", "--passes", "1", *MTP3, "--temperature=0.8", "--top_k=40",
            "--json"]
    assert cli.run(argv) == 0  # no greedy request: no token-equality verdict to fail
    data = json.loads(capsys.readouterr().out)
    assert data["greedy_outputs_identical"] is None
    assert data["outputs_compared"] == 0
    assert data["output_checks"][GREEDY] is None
    assert data["settings"]["sampling"]["top_k"] == 40
    for entry in data["arms"]:
        assert list(entry["by_kind"]) == [SAMPLED]
        sampled = entry["by_kind"][SAMPLED]
        assert sampled["requests"] == 2
        # One kind: its figures are the arm's own.
        assert sampled["mean_acceptance_length"] == entry["mean_acceptance_length"]
        assert sampled["acceptance_rate"] == entry["acceptance_rate"]
        assert "tokens_per_second" not in sampled  # the kinds share the run's time
    fixed = next(e for e in data["arms"] if e["arm"] == "fixed:3")
    assert 1.0 <= fixed["by_kind"][SAMPLED]["mean_acceptance_length"] <= 4.0


def test_the_plain_loop_is_skipped_with_its_reason_when_requests_sample(
        tmp_path: Path) -> None:
    settings = {"speculative_algorithm": "MTP", "num_speculative_tokens": 3}

    def plan(temperatures: tuple[float, ...]) -> tuple[list[str], dict[str, str]]:
        arms, skipped = plan_arms(settings, widths=(3,), names=None, quick=True, levels=(1,),
                                  scratch=tmp_path, temperatures=temperatures)
        return [arm.name for arm in arms], dict(skipped)

    names, skipped = plan((0.0,))
    assert names[0] == "plain"
    assert "plain" not in skipped
    names, skipped = plan((0.0, 0.5))
    assert "plain" not in names
    assert skipped["plain"] == PLAIN_IS_GREEDY
    assert names == ["none", "fixed:3", "adaptive-depth"]  # the others run sampled requests


EXPECTED = ("expected 0 (greedy) or a number in 1e-05..100 (sampled), or a comma-separated "
            "mix of distinct ones such as 0,0.8")


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature=-0.5"], f"--temperature=-0.5: {EXPECTED}"),
    (["--temperature=nan"], f"--temperature=nan: {EXPECTED}"),
    (["--temperature=inf"], f"--temperature=inf: {EXPECTED}"),
    (["--temperature=1e999"], f"--temperature=1e999: {EXPECTED}"),
    (["--temperature=warm"], f"--temperature=warm: {EXPECTED}"),
    (["--temperature="], "--temperature='': expected a value (--temperature=T[,T...])"),
    (["--temperature=1e-320"], f"--temperature=1e-320: {EXPECTED}"),
    (["--temperature=0,,0.8"], f"--temperature=0,,0.8: {EXPECTED}"),
    (["--temperature=0.8,0.80"], "--temperature=0.8,0.80: expected distinct values"),
    (["--temperature=101"], f"--temperature=101: {EXPECTED}"),
    (["--top_k=40"], "--top_k=40: filters sampled requests only; expected a positive "
                     "--temperature"),
    (["--temperature=1", "--top_k=2.5"],
     "--top_k=2.5: expected an integer in 0..2147483647 (0: off)"),
    (["--temperature=1", "--top_p=0"], "--top_p=0: expected a number in (0, 1]"),
    (["--temperature=1", "--min_p=nan"], "--min_p=nan: expected a number in [0, 1]"),
    (["--temperature=0.8", "--arms=plain,none"],
     "--temperature=0.8: the plain arm, named in --arms, cannot run it: the plain loop "
     "decodes greedily only"),
    (["--temperature=0,0.8", *MTP3, "--enable_unified_mtp_graph=true"],
     "--temperature=0,0.8: the fixed:1 arm, a baseline of this launch, cannot run it: "
     "request field temperature=0.8: expected 0: --enable_unified_mtp_graph=true"),
    (["--plot=/dev/full"], "--plot=/dev/full: expected a .png file name"),
])
def test_bad_sampling_values_are_refused_in_one_line_before_anything_runs(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["bench", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"adaspec bench: error: {message}")
    assert captured.err.count("\n") == 1


def test_a_plot_file_that_appeared_during_the_run_is_not_overwritten(
        mixed: dict[str, object], tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    plot.write_bytes(b"someone else's")  # created after the path was checked new
    with pytest.raises(ConfigError) as refused:
        write_plot(mixed["summary"], str(plot))  # type: ignore[arg-type]
    assert str(refused.value) == (f"--plot={plot}: could not be written (it exists now); the "
                                  "report above is complete")
    assert plot.read_bytes() == b"someone else's"


def test_a_plot_that_fills_the_disk_is_one_line_naming_plot_and_leaves_no_file(
        mixed: dict[str, object], tmp_path: Path) -> None:
    # A real fault: a file-size limit on a child process, under which the kernel refuses
    # writes past 1 KiB (the PNG is tens of KB).
    summary, plot = tmp_path / "summary.json", tmp_path / "bench.png"
    summary.write_text(json.dumps(mixed["summary"]))
    script = ("import json, resource, signal, sys\n"
              "from adaspec.errors import ConfigError\n"
              "from adaspec.cli.bench import write_plot\n"
              "report = json.load(open(sys.argv[1]))\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
              "try:\n"
              "    write_plot(report, sys.argv[2])\n"
              "except ConfigError as error:\n"
              "    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script, str(summary), str(plot)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == (f"--plot={plot}: could not be written (File too large); the report "
                           "above is complete\n")
    assert not plot.exists()
