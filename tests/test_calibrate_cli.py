"""`adaspec calibrate` as scripts use it: progress on stderr, the bundle saved, a summary on
stdout, and one-line errors for a launch it cannot calibrate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import TINY_CALIBRATION

from adaspec import cli
from adaspec.cli.calibrate import progress_reporter
from adaspec.runtime.calibration import PointMeasured

LAUNCH = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
          "--max_seqs_per_batch=4", "--enable_adaptive_target_verify=true"]


def test_calibrate_saves_the_bundle_and_prints_a_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibration, output = tmp_path / "tiny.json", tmp_path / "costs.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    argv = [*LAUNCH, f"--adaptive_target_verify_calibration={calibration}",
            f"--adaptive_target_verify_cost_table_output={output}", "--json"]
    assert cli.run(["calibrate", *argv]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["output"] == str(output)
    assert report["source"] == f"calibrated at startup from {calibration}"
    (profile,) = report["profiles"]
    assert (profile["points"], profile["windows"], profile["model"]) == (9, 18, "additive")
    assert json.loads(output.read_text())["compatibility"]["draft_width"] == 5
    # stderr (not a terminal here): one JSON line per window, then the effective config.
    lines = [json.loads(line) for line in captured.err.splitlines()]
    assert [line["event"] for line in lines] == ["calibration_window"] * 18 + ["effective_config"]
    assert lines[-1]["costs"]["source"] == report["source"]
    # The same output again is refused before anything runs.
    assert cli.run(["calibrate", *argv]) == 2
    assert capsys.readouterr().err.strip().endswith("choose a new output file")


SIGNALLED_SAVE = """
import os, signal, sys
from adaspec.cli.main import main
from adaspec.policies.bundles import CostBundle

save, to_json = CostBundle.save, CostBundle.to_json

def save_then_interrupt(bundle, path):  # the injected fault: Ctrl-C as the save ends
    save(bundle, path)
    os.kill(os.getpid(), signal.SIGINT)

def interrupt_twice_while_writing(bundle):  # the injected fault: the file is open, empty
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # a second one ends the process at once
    return to_json(bundle)

if sys.argv[1] == "after":
    CostBundle.save = save_then_interrupt
else:
    CostBundle.to_json = interrupt_twice_while_writing
sys.argv = ["adaspec", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("command", [["calibrate"],
                                     ["generate", "--prompt=abc", "--max_tokens=4",
                                      "--temperature=0"]])
@pytest.mark.parametrize("when", ["after", "during"])
def test_a_signal_says_the_table_was_saved_only_once_it_is_whole(
        tmp_path: Path, command: list[str], when: str) -> None:
    """Before, the line said only "interrupted" with the whole table on disk, and a rerun with
    the same output was refused as an existing file: the table looked lost. A second signal
    while the file is written ends the process before the table is whole: no claim then."""
    calibration, output = tmp_path / "tiny.json", tmp_path / "costs.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_SAVE, when, *command, *LAUNCH,
         f"--adaptive_target_verify_calibration={calibration}",
         f"--adaptive_target_verify_cost_table_output={output}"],
        capture_output=True, text=True, timeout=600, check=False)
    said = f"adaspec {command[0]}: interrupted"
    if when == "after":
        said += f"; the cost table was saved whole to {output}"
        assert json.loads(output.read_text())["compatibility"]["draft_width"] == 5
    assert (done.returncode, done.stderr.splitlines()[-1], done.stdout) == (130, said, "")


@pytest.mark.parametrize(("argv", "message"), [
    (LAUNCH[:3], "--enable_adaptive_target_verify=false: expected true"),
    (LAUNCH, "--adaptive_target_verify_cost_table_output: required"),
])
def test_a_launch_calibrate_cannot_use_is_one_line_on_stderr(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["calibrate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert message in captured.err


@pytest.mark.parametrize(("name", "message"), [
    ("folder/", "expected a plain file path: printable, naming a file rather than a folder"),
    ("costs\n.json", "expected a plain file path"),
    ("/proc/self/costs.json", "expected a file in a writable directory; this process cannot "
                              "create files in /proc/self"),
    # Before, a calibration wrote its table to a file named "-" in the working folder.
    ("-", "expected a file path, not a switch, a stream or a home folder (./- names a file so)"),
])
def test_an_output_calibrate_could_not_write_is_refused_before_calibrating(
        name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    calibration = tmp_path / "tiny.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    output = name if name.startswith("/") or name == "-" else f"{tmp_path}/{name}"  # keeps a /
    assert cli.run(["calibrate", *LAUNCH, f"--adaptive_target_verify_calibration={calibration}",
                    f"--adaptive_target_verify_cost_table_output={output}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # One line and no calibration window on stderr: nothing was measured first.
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("adaspec calibrate: error: "
                                   "--adaptive_target_verify_cost_table_output=")
    assert message in captured.err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny.json"]


class Terminal:
    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        """Nothing buffered."""


def test_a_terminal_gets_one_bar_redrawn_in_place() -> None:
    terminal = Terminal()
    bar = progress_reporter(terminal)  # type: ignore[arg-type]
    for done in (1, 2):
        bar(PointMeasured(done, 2, 0, 0, 4, 8, 0.0125, 5))
    assert terminal.text.count("\r") == 2
    assert terminal.text.endswith("\n")
    assert "2/2 windows  Bcap=4 d=5 G=8 12.50 ms" in terminal.text
