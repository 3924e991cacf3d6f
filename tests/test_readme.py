"""The README stays true: CI runs exactly the test command it shows, and every command and
snippet in it runs as written (the slow ones are checked to parse, or run on a smaller grid).

Every shell command of the README, in a fenced block or inline, must have an entry here
(``FENCED`` or ``INLINE``), so a command added or edited in the README without a check fails.
Commands run in a fresh temporary folder, with this checkout first on ``PYTHONPATH``.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

TINY_GRID = {"request_buckets": [1, 2], "warmup_steps": 2, "window_steps": 3,
             "windows_per_point": 2}
"""A calibration grid small enough to run in seconds, in place of calibrate's full grid."""


def readme_commands() -> list[str]:
    """The fenced shell blocks before the first section: the two commands of the top."""
    top = README.split("\n## ", 1)[0]
    return re.findall(r"```(?:sh|bash)\n(.+?)\n```", top, flags=re.S)


def fenced_commands() -> list[str]:
    """Every command of every fenced shell block, continuation lines joined, comments
    dropped."""
    commands = []
    for block in re.findall(r"```(?:sh|bash)\n(.+?)\n```", README, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r" {2,}", " ", command).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def inline_commands() -> list[str]:
    """Inline code outside fenced blocks that reads as a command line."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose)
            if re.match(r"(adaspec|python|pip|bash) ", span)]


def succeeds(command: str | list[str], cwd: Path) -> str:
    """Standard output of a command line (run by bash) or an argument list that exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    shell = isinstance(command, str)
    done = subprocess.run(command, shell=shell, executable="/bin/bash" if shell else None,
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    return done.stdout


# The two commands of the top. The install cannot run inside the tests; CI runs the second
# line itself (below), and tests/test_bench.py runs `adaspec bench --quick` and checks its
# table.
TOP = {readme_commands()[0], readme_commands()[1]}

CONFIG = ("adaspec config --speculative_algorithm=DSpark --num_speculative_tokens=7 "
          "--enable_adaptive_target_verify=true")
GENERATE = ('adaspec generate --speculative_algorithm=DSpark --num_speculative_tokens=5 '
            '--prompt "ROMEO." --max_tokens 64 --temperature 0')
CALIBRATE = ("adaspec calibrate --speculative_algorithm=DSpark --num_speculative_tokens=5 "
             "--enable_adaptive_target_verify=true "
             "--adaptive_target_verify_cost_table_output=costs.json")
REUSE = ('adaspec generate --speculative_algorithm=DSpark --num_speculative_tokens=5 '
         '--enable_adaptive_target_verify=true --adaptive_target_verify_cost_table=costs.json '
         '--prompt "ROMEO." --max_tokens 64 --temperature 0 --event_log run.jsonl')
REPLAY = "adaspec replay run.jsonl"
SIMULATE = ("adaspec simulate --workload run.jsonl --policy fixed:5 --policy adaptive-verify "
            "--policy oracle")
COSTS = (CALIBRATE, REUSE, REPLAY, SIMULATE)
LEFT_BEHIND = {"costs.json", "run.jsonl"}
"""The files the README's commands write in the folder they run in."""


def check_config(out: str) -> None:
    settings = json.loads(out)["launch"]["settings"]
    assert settings["num_speculative_tokens"] == 7
    assert settings["enable_adaptive_target_verify"] is True


def check_generate(out: str) -> None:
    assert "ROMEO." in out
    assert "tokens/s" in out
    assert "AL" in out


def check_models(out: str) -> None:
    assert "dspark" in out
    assert "mtp" in out


def check_states(out: str) -> None:
    assert out.lstrip().startswith("stateDiagram")
    for state in ("draft", "consensus", "pack", "verify", "sample", "commit", "retire"):
        assert state in out


SHORT: dict[str, Callable[[str], None]] = {
    CONFIG: check_config,
    GENERATE: check_generate,
    "adaspec models": check_models,
    "adaspec states --diagram": check_states,
}
"""Commands that take seconds: run as written, each with a property of its output."""

RANKS_BY_HAND = ("for rank in 0 1; do adaspec generate --nnodes=2 --node_rank=$rank "
                 "--master_node_addr=127.0.0.1:29500 --speculative_algorithm=MTP "
                 "--num_speculative_tokens=3 --prompt \"ROMEO.\" --max_tokens 32 --temperature 0 "
                 "& pid[$rank]=$!; done; wait ${pid[0]} && wait ${pid[1]}")
RANKS_BY_TORCHRUN = ("torchrun --nproc-per-node=2 -m adaspec generate "
                     "--speculative_algorithm=MTP --num_speculative_tokens=3 "
                     "--prompt \"ROMEO.\" --max_tokens 32 --temperature 0")
RANKS = (RANKS_BY_HAND, RANKS_BY_TORCHRUN)
SPEC_DP2 = next(command for command in fenced_commands()
                if command.startswith("for rank in 0 1 2 3; do adaspec generate --nnodes=4 "))
"""The specification's DP=2 line on four ranks: tests/test_data_parallel.py runs its launch
flags on four ranks (on a small calibration grid); here each rank's line must parse."""

SERVE = "adaspec serve --speculative_algorithm=DSpark --num_speculative_tokens=5"
CURL = ("curl -s http://127.0.0.1:8000/v1/completions -d '{\"model\": \"builtin:target\", "
        "\"prompt\": \"ROMEO.\", \"max_tokens\": 32, \"temperature\": 0}'")
BENCH_URL = "adaspec bench --url http://127.0.0.1:8000 --quick"
SERVING = (SERVE, CURL, BENCH_URL)

HF_INSTALL = 'python -m pip install -e ".[hf]" torch==2.13.0'
HF_GENERATE = ("adaspec generate --model=/path/to/target --draft_model=/path/to/draft "
               "--speculative_algorithm=MTP --num_speculative_tokens=3 --prompt \"Once upon a "
               "time\" --max_tokens 64 --temperature 0")

FENCED = TOP | set(SHORT) | set(COSTS) | set(RANKS) | {SPEC_DP2} | set(SERVING) | {
    HF_INSTALL, HF_GENERATE}

INLINE = {
    "adaspec bench": "help",  # the full bench: eleven minutes; its --help must parse
    "adaspec COMMAND --help": "every command",
    "adaspec config FLAGS": "placeholder: the config line of More commands runs",
    "adaspec config --rules": "run",
    "adaspec replay": "name: the Costs and calibration block runs it",
    "adaspec replay run.rank0.jsonl --across run.rank1.jsonl":
        "tests/test_ranks.py runs it on two ranks' logs",
    "adaspec simulate": "name: the Costs and calibration block runs it",
    "python -m pip install -e .": "install",
    'python -m pip install -e ".[npu]"': "install",
    "python examples/own_model.py": "tests/test_examples.py runs it",
    "python benchmarks/serve_overhead.py": "a benchmark: the README quotes its figure",
    "adaspec serve": "name: the Serving block runs it",
    "adaspec bench --url URL": "placeholder: the Serving block runs it on a URL",
    "adaspec bench --quick": "the main command: tests/test_bench.py runs it",
    "bash benchmarks/device_check.sh": "test_the_device_check_says_there_is_no_cuda_here",
    "bash benchmarks/device_wheels.sh": "a download from PyPI for the device machine",
}


def test_readme_top_shows_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)


def test_ci_runs_the_readme_test_command() -> None:
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def test_the_main_command_is_the_quick_bench() -> None:
    # tests/test_bench.py runs it and checks the table it prints.
    assert readme_commands()[0].endswith("&& adaspec bench --quick")


def test_main_command_installs_the_cpu_torch_pin() -> None:
    assert all("torch==2.13.0" in c for c in readme_commands())


def test_every_readme_command_has_a_check() -> None:
    assert set(fenced_commands()) == FENCED
    assert set(inline_commands()) == set(INLINE)


@pytest.mark.parametrize("command", sorted(SHORT))
def test_the_short_commands_run_as_written(command: str, tmp_path: Path) -> None:
    SHORT[command](succeeds(command, tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_calibrate_command_parses_as_written(tmp_path: Path) -> None:
    # Its full grid takes minutes; `adaspec config` checks the same launch line, files and
    # output path before anything would run.
    flags = CALIBRATE.removeprefix("adaspec calibrate ")
    out = json.loads(succeeds(f"adaspec config {flags}", tmp_path))
    assert out["adaptive_target_verify"]["cost_table_output"] == "costs.json"
    assert list(tmp_path.iterdir()) == []


def test_the_costs_block_runs_in_order(tmp_path: Path) -> None:
    """calibrate (on a small grid instead of the full one), then the other three lines of the
    block as written, on the bundle and the event log the lines before them wrote."""
    (tmp_path / "grid.json").write_text(json.dumps(TINY_GRID))
    succeeds(f"{CALIBRATE} --adaptive_target_verify_calibration=grid.json", tmp_path)
    bundle = json.loads((tmp_path / "costs.json").read_text())
    assert bundle["format"] == "adaspec-cost-table"
    check_generate(succeeds(REUSE, tmp_path))
    assert "decisions match" in succeeds(REPLAY, tmp_path)
    simulated = succeeds(SIMULATE, tmp_path)
    for policy in ("fixed:5", "adaptive-verify", "oracle"):
        assert policy in simulated
    assert "nan" not in simulated.split()
    assert {p.name for p in tmp_path.iterdir()} == LEFT_BEHIND | {"grid.json"}


@pytest.mark.parametrize("command", RANKS)
def test_both_ways_of_starting_two_ranks_run_as_written(command: str, tmp_path: Path) -> None:
    out = succeeds(command, tmp_path)
    assert out.count("ROMEO.") == 1  # rank 0 alone prints the result
    assert "tokens/s" in out
    assert list(tmp_path.iterdir()) == []


def test_the_specifications_dp2_line_parses_on_every_rank(tmp_path: Path) -> None:
    generate = SPEC_DP2.split("do adaspec generate ", 1)[1].split(" & pid", 1)[0]
    flags = generate.split(" --prompt ", 1)[0]
    from test_data_parallel import SPEC_DP2 as TESTED
    assert set(TESTED) <= set(flags.split())  # the test runs these very flags
    for rank in range(4):
        out = json.loads(succeeds(f"adaspec config {flags.replace('$rank', str(rank))}",
                                  tmp_path))
        settings = out["launch"]["settings"]
        assert (settings["node_rank"], settings["dp_size"], settings["nnodes"]) == (rank, 2, 4)
    assert list(tmp_path.iterdir()) == []


def test_the_serving_block_runs_as_written(tmp_path: Path) -> None:
    """The server as written (on the default port 8000), then the curl line and the bench
    against it, then a drain."""
    from serve_process import start_server

    served = start_server(program=(*shlex.split(SERVE.replace("adaspec", "-m adaspec", 1)),),
                          port=8000)
    try:
        answer = json.loads(succeeds(CURL, tmp_path))
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 32
        table = succeeds(BENCH_URL, tmp_path).splitlines()
        assert table[0].startswith("bench of http://127.0.0.1:8000 (model builtin:target)")
        assert [row.split()[:3] for row in table[2:]] == [["1", "4", "0"], ["4", "4", "0"],
                                                         ["16", "16", "0"]]
    finally:
        assert served.stop() == 0, served.other
    assert list(tmp_path.iterdir()) == []


def test_the_own_model_command_runs_on_checkpoints_built_here(tmp_path: Path) -> None:
    """The install is CI's own (the test extra holds transformers); the generate line runs
    as written, on tiny Llama checkpoints in place of /path/to/target and /path/to/draft."""
    pytest.importorskip("transformers")
    from test_hf_models import _save

    _save("llama", tmp_path / "target", 2, 0)
    _save("llama", tmp_path / "draft", 1, 1)
    command = HF_GENERATE.replace("/path/to/", str(tmp_path) + "/")
    out = succeeds(command, tmp_path)
    assert out.startswith("[0] AL ")
    assert "Once upon a time" in out
    assert "tokens/s" in out


def test_gitignore_holds_what_the_readme_commands_leave_behind() -> None:
    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for name in LEFT_BEHIND:
        assert any(fnmatch(name, pattern.lstrip("/")) for pattern in patterns), name


def test_the_inline_commands_hold(tmp_path: Path) -> None:
    assert "adaspec bench [LAUNCH FLAGS]" in succeeds("adaspec bench --help", tmp_path)
    assert "--enable_adaptive_target_verify" in succeeds("adaspec config --rules", tmp_path)
    listed = succeeds("adaspec --help", tmp_path)
    commands = re.findall(r"^  ([a-z]+) ", listed, flags=re.M)
    assert {"bench", "config", "generate", "calibrate", "simulate", "replay"} <= set(commands)
    for command in commands:
        assert f"adaspec {command}" in succeeds(f"adaspec {command} --help", tmp_path)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert {"npu", "test"} <= set(extras)
    assert (ROOT / "examples" / "own_model.py").is_file()


def test_the_device_check_says_there_is_no_cuda_here(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: the device check would run")
    script = ROOT / "benchmarks" / "device_check.sh"
    said = succeeds(f"PYTHON={sys.executable} bash {script} figures", tmp_path)
    assert said.startswith("device check: no CUDA device on this host")
    assert list(tmp_path.iterdir()) == []  # a relative folder is the caller's: not made
    missing = subprocess.run(["bash", str(script)], env={**os.environ, "PYTHON": "/nonexistent"},
                             capture_output=True, text=True, timeout=60, check=False)
    assert (missing.returncode, missing.stdout) == (1, "")
    assert missing.stderr == ("device check: /nonexistent cannot import torch; set PYTHON to "
                              "the interpreter\n")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.+?)\n```", README, flags=re.S)


def test_the_launch_snippet_runs(tmp_path: Path) -> None:
    snippet = python_blocks()[0]
    assert "check_request" in snippet
    succeeds([sys.executable, "-c", snippet], tmp_path)


def runtime_example() -> str:
    section = README.split("\n## The runtime\n", 1)[1]
    found = re.search(r"```python\n(.+?)\n```", section, flags=re.S)
    assert found is not None
    return found.group(1)


def test_the_runtime_example_runs_twice_in_a_row_and_leaves_no_file(tmp_path: Path) -> None:
    for _ in range(2):
        last = succeeds([sys.executable, "-c", runtime_example()], tmp_path).splitlines()[-1]
        assert last.startswith("acceptance length ")
        acceptance = float(last.split()[-1])
        assert 1.0 <= acceptance <= 4.0  # AL of MTP width 3 counts the bonus token
    assert list(tmp_path.iterdir()) == []


def test_every_python_snippet_is_run_above() -> None:
    assert len(python_blocks()) == 2
    assert python_blocks()[1] == runtime_example()
