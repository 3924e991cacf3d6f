"""The README's two commands stay true: CI runs exactly the test command it shows."""

import re
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
