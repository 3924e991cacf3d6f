"""Hostile command lines end in one line on stderr and exit 2 before anything runs, never in a
traceback or a hang: checkpoint paths the commands cannot run, file names the system refuses,
FIFOs, prompts that are not UTF-8, a device this process cannot use; and a standard output
that cannot take the output ends quietly or in one line."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec import cli

GENERATE = ["--prompt", "ROMEO.", "--max_tokens=4", "--temperature=0"]
ATV = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
       "--enable_adaptive_target_verify=true"]
LONG = "a" * 5000  # longer than any file name a file system takes (ENAMETOOLONG)


def adaspec(*argv: str | bytes, stdout: int = subprocess.PIPE
            ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "adaspec", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, check=False, timeout=120)


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model load in the process fails the test: a refusal must come before it."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("models were loaded before the command line was refused")
    monkeypatch.setattr("adaspec.models.checkpoint.load_models", refuse)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command line run in this process (exit 2, nothing on stdout)."""
    assert cli.run(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"adaspec {argv[0]}: error: ")
    return captured.err.rstrip("\n")


# --- checkpoint paths -----------------------------------------------------------------------
NOT_A_CHECKPOINT = "expected a directory holding a Hugging Face causal LM"


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--model=/models/t", *GENERATE],
     f"--model=/models/t: {NOT_A_CHECKPOINT}"),
    (["generate", "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
      "--draft_model=/models/d", *GENERATE],
     "--draft_model=/models/d: a drafter checkpoint drafts for a target checkpoint"),
    (["bench", "--model=/models/t"], "--draft_model: required with --model=/models/t"),
    (["bench", "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
      "--model=/models/t", "--draft_model=/models/d"], f"--model=/models/t: {NOT_A_CHECKPOINT}"),
    (["bench", "--draft_model=/models/d"],
     "--draft_model=/models/d: a drafter checkpoint drafts for a target checkpoint"),
    (["models", "--model=/models/t"],
     "--model=/models/t: expected one of builtin:target, builtin:target-large"),
    # A checkpoint target is never given a built-in draft in its place.
    (["config", "--model=/models/t", "--speculative_algorithm=DSpark",
      "--num_speculative_tokens=5"], "--draft_model: required with --model=/models/t"),
    (["generate", "--model=/models/t", "--speculative_algorithm=DSpark",
      "--num_speculative_tokens=5", *GENERATE], "--draft_model: required with --model=/models/t"),
])
def test_checkpoint_paths_are_refused_not_replaced_by_the_builtin_models(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refused(argv, capsys)


@pytest.mark.usefixtures("no_model_loads")
def test_calibrate_refuses_a_path_that_is_no_checkpoint(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["calibrate", "--model=/models/t", "--draft_model=/models/d", *ATV,
            f"--adaptive_target_verify_cost_table_output={tmp_path / 't.json'}"]
    assert refused(argv, capsys).endswith("--speculative_algorithm=DSpark: a Hugging Face "
                                          "checkpoint drafts MTP-style (a second causal LM, or "
                                          "the target itself); expected MTP or none")
    argv = [arg.replace("DSpark", "MTP") for arg in argv]
    assert f"--model=/models/t: {NOT_A_CHECKPOINT}" in refused(argv, capsys)
    assert not (tmp_path / "t.json").exists()


# --- file names the system refuses ------------------------------------------------------------


@pytest.mark.parametrize("flag", [
    "adaptive_target_verify_calibration", "adaptive_target_verify_cost_table",
    "adaptive_target_verify_cost_table_output"])
def test_config_refuses_an_overlong_file_name_in_one_short_line(flag: str) -> None:
    done = adaspec("config", "--speculative_algorithm=DSpark", "--num_speculative_tokens=7",
                   "--enable_adaptive_target_verify=true", f"--{flag}={LONG}")
    assert (done.returncode, done.stdout) == (2, b"")
    line = done.stderr.decode()
    assert line.count("\n") == 1
    assert line.startswith(f"adaspec config: error: --{flag}=aaaa")
    assert line.endswith("...: cannot be used as a file name (File name too long)\n")
    assert len(line) < 300  # the name is shortened in the message


def test_config_refuses_an_overlong_draft_step_file_name() -> None:
    done = adaspec("config", "--speculative_algorithm=MTP", "--num_speculative_tokens=5",
                   "--enable_adaptive_draft_step=true", f"--adaptive_draft_step_config={LONG}")
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode().endswith("...: cannot be used as a file name (File name too "
                                         "long)\n")


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("argv", [
    ["generate", *GENERATE, f"--event_log={LONG}"],
    ["generate", *GENERATE, f"--trace={LONG}"],
    ["generate", "--prompts_file", LONG, "--max_tokens=4", "--temperature=0"],
    ["bench", f"--event_log_dir={LONG}"],
    ["bench", f"--plot={LONG}.png"],
    ["calibrate", *ATV, f"--adaptive_target_verify_cost_table_output=/tmp/{LONG}/t.json"],
])
def test_commands_refuse_an_overlong_file_name_before_running(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(argv, capsys)
    assert line.endswith("...: cannot be used as a file name (File name too long)")
    assert len(line) < 300


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("flag", ["event_log", "trace"])
def test_generate_refuses_an_existing_output_before_loading_models(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = tmp_path / "out.jsonl"
    existing.write_text("kept\n")
    line = refused(["generate", *GENERATE, f"--{flag}={existing}"], capsys)
    assert line.endswith(f"--{flag}={existing}: expected a file that does not exist yet; "
                         "choose a new output file")
    assert existing.read_text() == "kept\n"


def test_a_fifo_as_prompts_file_is_refused_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    # A subprocess with a timeout: were the FIFO opened, the open would wait for a writer.
    done = adaspec("generate", "--prompts_file", str(fifo), "--max_tokens=4",
                   "--temperature=0")
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == (f"adaspec generate: error: --prompts_file={fifo}: expected "
                                    "a regular UTF-8 text file, got a FIFO\n")


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line() -> None:
    done = adaspec("generate", "--prompt", b"\xff\xfe", "--max_tokens=4", "--temperature=0")
    assert (done.returncode, done.stdout) == (2, b"")
    assert done.stderr.decode() == ("adaspec generate: error: --prompt='\\udcff\\udcfe': "
                                    "expected UTF-8 text\n")


# --- devices ------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None,
                    reason="torch_npu is installed here")
@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("argv", [
    ["generate", "--device=npu", *GENERATE],
    ["bench", "--device=npu"],
    ["calibrate", "--device=npu", *ATV, "--adaptive_target_verify_cost_table_output={new}"],
])
def test_npu_without_torch_npu_is_refused_in_one_line(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [arg.format(new=tmp_path / "t.json") for arg in argv]
    assert ": error: --device=npu: torch_npu cannot be imported" in refused(argv, capsys)


# --- standard output ------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["config"], ["config", "--rules"], ["--help"]])
def test_a_closed_stdout_ends_quietly(argv: list[str]) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader went away, as `adaspec config | head -c1` leaves it
    try:
        done = adaspec(*argv, stdout=write)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_stdout_is_one_line() -> None:
    with open("/dev/full", "wb") as full:
        done = adaspec("config", stdout=full.fileno())
    assert done.returncode == 2
    assert done.stderr.decode() == ("adaspec config: error: stdout: cannot write the output "
                                    "(No space left on device)\n")


@pytest.mark.parametrize("argv", [["config"], ["generate", *GENERATE]])
def test_a_stdout_closed_from_the_start_is_refused_before_running(argv: list[str]) -> None:
    # The shell closes descriptor 1 (`>&-`) before it starts the command.
    done = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "adaspec",
                           *argv], stderr=subprocess.PIPE, check=False, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode() == (f"adaspec {argv[0]}: error: stdout: closed; expected an "
                                    "open standard output (redirect it to /dev/null to discard "
                                    "the output)\n")
