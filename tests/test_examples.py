"""The worked examples run as written: an engine's own model plugged in through the protocols
decodes through the runtime exactly as the same model does alone."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_own_model_example_decodes_exactly_in_under_200_lines(tmp_path: Path) -> None:
    example = ROOT / "examples" / "own_model.py"
    assert len(example.read_text().splitlines()) < 200
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "greedy outputs identical to the target alone: True"
    acceptance = float(lines[-2].split()[2])
    assert 1.0 < acceptance <= 4.0  # width 3: at most three drafts and the bonus token
    assert list(tmp_path.iterdir()) == []


def test_the_own_model_example_refuses_arguments_it_would_ignore(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "own_model.py"),
                           "--max_tokens", "5"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "own_model.py: error: it takes no arguments; got --max_tokens 5\n")
