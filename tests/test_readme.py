"""The README's two commands stay true: CI runs exactly the test command it shows; its
runtime example runs as written, twice in a row."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    top = text.split("\n## ", 1)[0]
    return re.findall(r"```(?:sh|bash)\n(.+?)\n```", top, flags=re.S)


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


def runtime_example() -> str:
    section = (ROOT / "README.md").read_text().split("\n## The runtime\n", 1)[1]
    found = re.search(r"```python\n(.+?)\n```", section, flags=re.S)
    assert found is not None
    return found.group(1)


def test_the_runtime_example_runs_twice_in_a_row_and_leaves_no_file(tmp_path: Path) -> None:
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", runtime_example()], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
        last = done.stdout.splitlines()[-1]
        assert last.startswith("acceptance length ")
        acceptance = float(last.split()[-1])
        assert 1.0 <= acceptance <= 4.0  # AL of MTP width 3 counts the bonus token
    assert list(tmp_path.iterdir()) == []
