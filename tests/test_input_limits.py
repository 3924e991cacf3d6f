"""Sizes beyond what an input could mean are refused in one line naming the setting, never
with a traceback, never accepted and never read without end: integers of thousands of digits,
integers past any float, counts of zero, cost-table samples at shapes their own launch never
captured, files that read without end. A cost table that cannot be written whole leaves no
truncated file behind."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cost_tables import SETTINGS, bundle, saved

from adaspec import cli
from adaspec.cli.flags import sampling_flag
from adaspec.cli.serve import _integer as serve_integer
from adaspec.config import load_config
from adaspec.config.builtin import builtin_checkpoints
from adaspec.config.environment import checked_threads
from adaspec.config.flags import parse_argv
from adaspec.config.launch import integer_text
from adaspec.errors import ConfigError
from adaspec.policies.bundles import load_bundle
from adaspec.policies.workloads import synthetic

HUGE = "9" * 5000  # past Python's 4300-digit limit of int(str)


def test_a_launch_flag_of_thousands_of_digits_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["config", f"--max_seqs_per_batch={HUGE}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("adaspec config: error: --max_seqs_per_batch=999")
    assert err.endswith("expected an integer of at most 4300 digits\n")


@pytest.mark.parametrize(("argv", "words"), [
    (["config", "--port=9999999999999999999999"],
     "--port=9999999999999999999999: expected an integer in 1..65535"),
    (["generate", "--prompt=a", "--temperature=0", "--max_tokens=2",
      "--seed=99999999999999999999999"],
     "--seed=99999999999999999999999: expected an integer in 0..1099511627775"),
    (["generate", "--prompt=a", "--temperature=0", "--max_tokens=99999999999999999999"],
     "--max_tokens=99999999999999999999: expected an integer in 1..1048576"),
])
def test_an_integer_flag_of_many_digits_is_refused_by_its_range(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, past 18 digits the line gave the digit count, not what the flag takes."""
    assert cli.run(argv) == 2
    assert capsys.readouterr().err == f"adaspec {argv[0]}: error: {words}\n"


@pytest.mark.parametrize("zeros", [20, 4400])  # past int()'s 4300 digits too (round 33)
def test_leading_zeros_do_not_count_against_an_integer_flags_digits(
        zeros: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["config", f"--max_seqs_per_batch={'0' * zeros}16"]) == 0
    assert '"max_seqs_per_batch": 16,' in capsys.readouterr().out


def test_every_integer_a_user_types_is_read_alike() -> None:
    """Before, these cut at 18 (or 8) characters and called a zero-padded 5 out of range."""
    padded = "0" * 30 + "5"
    assert sampling_flag("top_k", padded) == 5
    assert serve_integer("max_queued_requests", padded, 1024, 1, 65536) == 5
    assert checked_threads("ADASPEC_CPU_THREADS", padded) == 5
    with pytest.raises(ConfigError, match=r"expected an integer in 0\.\.2147483647 \(0: off\)$"):
        sampling_flag("top_k", "9" * 5000)
    assert integer_text(" -007 ") == -7
    assert integer_text("1_0") is integer_text("\u0665") is integer_text("") is None


def test_an_interpreter_that_reads_fewer_digits_is_held_to_its_own_limit(
        capsys: pytest.CaptureFixture[str]) -> None:
    """PYTHONINTMAXSTRDIGITS=640: an integer past it could be neither read nor shown."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert cli.run(["config", f"--port={'9' * 700}"]) == 2
    finally:
        sys.set_int_max_str_digits(before)
    assert capsys.readouterr().err.endswith("...: expected an integer of at most 640 digits\n")


def test_a_policy_width_of_thousands_of_digits_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload, table = tmp_path / "w.jsonl", tmp_path / "costs.json"
    workload.write_text("\n".join(synthetic("high", rounds=10).as_lines()))
    bundle().save(str(table))
    for width in (HUGE, "²"):
        assert cli.run(["simulate", "--workload", str(workload), "--cost_table", str(table),
                        "--policy", f"fixed:{width}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.endswith("expected fixed:K with K in 1..5\n")


def _with(change: dict[str, object], where: str = "settings") -> dict[str, object]:
    data = json.loads(bundle().to_json())
    if where == "settings":
        data["settings"] = {**SETTINGS, **change}
    else:
        data["profiles"][0]["table"].update(change)
    return data


@pytest.mark.parametrize(("data", "message"), [
    (_with({"bias": int("9" * 400)}, "table"),
     r"profiles\[0\]\.table\.bias=9{117}\.\.\.: expected a finite number$"),
    (_with({"bias": 1e308 * 10}, "table"), r"table\.bias=inf: expected a finite number$"),
    (_with({"window_steps": 0}), r"settings\.window_steps=0: expected an integer in "
                                 r"1\.\.1000000$"),
    (_with({"token_seed": "x"}), r"settings\.token_seed=x: expected an integer in "
                                 r"0\.\.9223372036854775807, got a string$"),
    (_with({"warmup_steps": -1}), r"settings\.warmup_steps=-1: expected an integer in "),
])
def test_a_saved_table_with_numbers_no_calibration_takes_is_refused(
        tmp_path: Path, data: dict[str, object], message: str) -> None:
    path, data = saved(tmp_path, data)
    with pytest.raises(ConfigError, match=message):
        load_bundle(path, data)


def test_a_saved_sample_at_a_shape_the_launch_never_captured_is_refused(
        tmp_path: Path) -> None:
    data = json.loads(bundle().to_json())
    data["profiles"][0]["samples"][0][1] = 3  # G=3 is no tier of bucket 1 (1, 2, 4, 6)
    path, data = saved(tmp_path, data)
    with pytest.raises(ConfigError, match=r"profiles\[0\]\.samples\[0\]=\[1, 3, 0\.0051\]: "
                                          r"expected \[Bcap, G or depth, seconds\] at a shape "
                                          r"of the compatibility"):
        load_bundle(path, data)


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="Linux /proc only")
def test_a_file_that_reads_without_end_is_refused_with_its_bound(
        capsys: pytest.CaptureFixture[str]) -> None:
    # /proc/self/pagemap passes for an empty regular file and reads gigabytes without a newline.
    assert cli.run(["replay", "/proc/self/pagemap"]) == 2
    assert capsys.readouterr().err == (
        "adaspec replay: error: event log /proc/self/pagemap, line 1: longer than 64 MiB; "
        "expected one JSON object per line\n")


def test_a_cost_table_that_cannot_be_written_whole_leaves_no_file(tmp_path: Path) -> None:
    # A real fault: a file-size limit on a child process, under which the kernel refuses
    # writes past 512 bytes (a cost table is a few KB).
    script = (
        "import resource, signal, sys\n"
        "from cost_tables import bundle\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))\n"
        "from adaspec.errors import ConfigError\n"
        "try:\n"
        "    bundle().save(sys.argv[1])\n"
        "except ConfigError as error:\n"
        "    print(error)\n")
    path = tmp_path / "costs.json"
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert done.stdout == (f"--adaptive_target_verify_cost_table_output={path}: cannot write "
                           "the cost table (File too large); nothing was kept\n")
    assert not path.exists()


ATV = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
       "--enable_adaptive_target_verify=true"]
ATV_2 = [*ATV, "--max_seqs_per_batch=2"]
"""The launch the test tables were calibrated for (buckets 1 and 2)."""


def test_config_checks_a_saved_tables_contents_and_launch_fields(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before, config only checked that the file held a JSON object: both passed, exit 0.
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps(_with({"window_steps": 0})))
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={damaged}"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec config: error: --adaptive_target_verify_cost_table={damaged}: "
        "settings.window_steps=0: expected an integer in 1..1000000\n")
    other = tmp_path / "width7.json"
    data = json.loads(bundle().to_json())
    data["compatibility"]["draft_width"] = 7
    data["settings"]["draft_width"] = 7
    other.write_text(json.dumps(data))
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={other}"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec config: error: --adaptive_target_verify_cost_table={other}: draft_width is 7 "
        "in the saved table but 5 in this launch; calibrate this launch (drop the flag) or "
        "give a table saved by a matching one\n")
    # The built-in models' identities and context limit come from their model card.
    launch = load_config(parse_argv(ATV_2)).launch
    known = builtin_checkpoints(launch)
    assert known is not None
    identities, context_limit = known
    good = tmp_path / "good.json"
    dataclasses.replace(bundle(), compatibility={**bundle().compatibility,
                                                 **identities}).save(str(good))
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={good}"]) == 0
    capsys.readouterr()
    # The geometry follows from the flags: a launch preparing other buckets is refused here,
    # as its start would refuse it.
    assert cli.run(["config", *ATV, f"--adaptive_target_verify_cost_table={good}"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec config: error: --adaptive_target_verify_cost_table={good}: request_buckets "
        "is [1, 2] in the saved table but [1, 2, 4, 8, 16] in this launch; calibrate this "
        "launch (drop the flag) or give a table saved by a matching one\n")
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={other}"]) == 2
    foreign = tmp_path / "foreign.json"
    bundle().save(str(foreign))  # measured on models whose identity is "target-id"
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={foreign}"]) == 2
    assert "target is target-id in the saved table but " in capsys.readouterr().err
    beyond = tmp_path / "beyond.json"
    data = json.loads(good.read_text())
    data["profiles"][0]["context"]["max_kv_length"] = 4096
    data["settings"]["contexts"][0]["max_kv_length"] = 4096
    beyond.write_text(json.dumps(data))
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={beyond}"]) == 2
    assert capsys.readouterr().err.endswith(
        f"profiles[0].context.max_kv_length=4096: expected at most the model's context limit "
        f"{context_limit}\n")
    # A legacy table records no coverage: it prices every length, past no context limit.
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({**bundle().profiles[0].table.as_dict(), "draft_width": 5}))
    assert cli.run(["config", *ATV_2, f"--adaptive_target_verify_cost_table={legacy}"]) == 0


@pytest.mark.parametrize(("buckets", "rows"), [
    ([0, 2], [[1, 2, 4, 6], [2, 4, 6, 8, 12]]),
    ([1, 1], [[1, 2, 4, 6], [2, 4, 6, 8, 12]]),
    ([2, 1], [[1, 2, 4, 6], [2, 4, 6, 8, 12]]),
    ([1, 2], [[6, 4, 2, 1], [2, 4, 6, 8, 12]]),
    ([1, 2], [[1, 1, 2, 4], [2, 4, 6, 8, 12]]),
])
def test_a_saved_compatibility_with_buckets_or_tiers_no_launch_captures_is_refused(
        tmp_path: Path, buckets: list[int], rows: list[list[int]]) -> None:
    # Before, any list of integers passed: a table no launch could have saved was accepted.
    data = json.loads(bundle().to_json())
    data["compatibility"].update(request_buckets=buckets, target_rows=rows)
    path, data = saved(tmp_path, data)
    with pytest.raises(ConfigError, match=r"compatibility\.(request_buckets|target_rows)=.*: "
                                          r"expected .*strictly increasing"):
        load_bundle(path, data)
