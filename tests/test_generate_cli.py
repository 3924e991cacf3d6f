"""`adaspec generate`, `adaspec states` and `adaspec replay` as scripts use them."""

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaspec import cli
from adaspec.cli.generate import file_lines
from adaspec.runtime.trace import read_trace

LAUNCH = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
          "--max_seqs_per_batch=4"]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert cli.run(["generate", *argv, "--json"]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def test_json_results_come_in_prompt_order_with_text_tokens_and_acceptance(
        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["ROMEO.\nBut soft", "Enter Hamlet", "O"]
    argv = [*LAUNCH, *(arg for p in prompts for arg in ("--prompt", p)),
            "--max_tokens", "12", "--temperature", "0"]
    spec = run_json(argv, capsys)
    plain = run_json(["--speculative_algorithm=none", *argv[3:]], capsys)
    results = spec["results"]
    assert isinstance(results, list)
    assert [r["prompt"] for r in results] == prompts
    for row in results:
        assert len(row["token_ids"]) == 12
        assert row["text"] == bytes(row["token_ids"]).decode("utf-8", "replace")
        assert row["mean_acceptance_length"] >= 1.0
        assert row["drafted_verified"] >= row["drafted_accepted"] >= 0
    # Greedy speculative text equals the target alone.
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in plain["results"]]
    assert "residual or bonus" in str(spec["acceptance_length"])
    assert spec["tokens"] == 36
    assert isinstance(spec["seconds"], float)
    assert spec["tokens_per_second"] == pytest.approx(36 / spec["seconds"], rel=0.01)


def test_a_trace_to_stderr_creates_no_file_named_dash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """'-' is stderr, not a path: checking it as a new file once created ./- (two ranks
    starting in one folder raced on it), and refused a folder holding a file of that name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_text("kept")
    assert cli.run(["generate", "--prompt=abc", "--max_tokens=4", "--temperature=0",
                    "--trace=-"]) == 0, capsys.readouterr().err
    assert '"event": "transition"' in capsys.readouterr().err
    assert (tmp_path / "-").read_text() == "kept"


def test_text_output_ends_with_the_decode_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["generate", *LAUNCH, "--prompt", "Enter", "--max_tokens", "6",
                    "--temperature", "0"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"6 tokens in \d+\.\d{3} s: \d+\.\d tokens/s \(from the first submit "
                        r"to the last result; start-up not counted\)", last)


def test_prompts_file_one_per_line_and_a_sampling_run(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("First line\nSecond line\n")
    document = run_json([*LAUNCH, "--prompts_file", str(prompts), "--max_tokens=5",
                         "--temperature=0.8", "--top_k=20", "--top_p=0.9", "--seed=3"],
                        capsys)
    results = document["results"]
    assert isinstance(results, list)
    assert [r["prompt"] for r in results] == ["First line", "Second line"]
    again = run_json([*LAUNCH, "--prompts_file", str(prompts), "--max_tokens=5",
                      "--temperature=0.8", "--top_k=20", "--top_p=0.9", "--seed=3"], capsys)
    assert again["results"] == document["results"]  # seeded: the same draws


def test_event_log_and_trace_flags_write_files_that_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, trace = tmp_path / "events.jsonl", tmp_path / "trace.jsonl"
    run_json([*LAUNCH, "--prompt", "ROMEO.", "--max_tokens=20", "--temperature=0",
              f"--event_log={log}", f"--trace={trace}"], capsys)
    lines = read_trace(str(trace))
    assert lines
    assert {"round", "slot", "from", "to", "cause", "decision", "elapsed_ms"} <= set(lines[0])
    assert cli.run(["replay", str(log), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_decisions"] > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt", "x", "--temperature=0"], "--max_tokens: required"),
    (["--prompt", "x", "--max_tokens=4"], "--temperature: required"),
    (["--max_tokens=4", "--temperature=0"], "--prompt: expected one or more --prompt TEXT"),
    (["--prompt", "x", "--max_tokens=four", "--temperature=0"],
     "--max_tokens=four: expected an integer"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=-1"],
     "--temperature=-1: expected 0 (greedy) or a number in 1e-05..100"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--top_k=5"],
     "--top_k=5: filters sampled requests only; expected a positive --temperature with it"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=same.jsonl",
      "--trace=same.jsonl"], "--trace=same.jsonl: expected a file of its own; --event_log "
                             "names it too"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=1e-320"],
     "--temperature=1e-320: expected 0 (greedy) or a number in 1e-05..100"),
    # Below the smallest double it reads as 0.0: refused, never decoded greedily.
    (["--prompt", "x", "--max_tokens=4", "--temperature=1e-400"],
     "--temperature=1e-400: a nonzero number below the smallest double; expected 0 (greedy) "
     "or a number in 1e-05..100"),
    # The range offered is the field's own: top_p has no 0.
    (["--prompt", "x", "--max_tokens=4", "--temperature=1", "--top_p=1e-400"],
     "--top_p=1e-400: a nonzero number below the smallest double; expected a number in "
     "(0, 1]"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=1", "--top_k=1e30"],
     "--top_k=1e30: expected an integer in 0..2147483647 (0: off)"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=1", "--top_p=nan"],
     "--top_p=nan: expected a number in (0, 1]"),
    # Text that is no number is refused with the range, not as "not a str".
    (["--prompt", "x", "--max_tokens=4", "--temperature=nan"],
     "--temperature=nan: expected 0 (greedy) or a number in 1e-05..100"),
    (["--prompt", "x", "--max_tokens=0", "--temperature=0"],
     "--max_tokens=0: expected an integer in 1.."),
    # Integers are read as every integer flag reads them: int() alone takes these too.
    (["--prompt", "x", "--max_tokens=\u0665", "--temperature=0"],
     "--max_tokens=\u0665: expected an integer"),
    (["--prompt", "x", "--max_tokens=1_0", "--temperature=0"],
     "--max_tokens=1_0: expected an integer"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--seed=\u0663"],
     "--seed=\u0663: expected an integer"),
    # /proc passes the permission check and still creates no file: found before loading.
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=/proc/x.jsonl"],
     "--event_log=/proc/x.jsonl: expected a file this process can create"),
    # ADASPEC_TRACE's switches: before, --trace=1 wrote a file named 1, --trace=off one named
    # off; an output flag wrote files named 0, - or ~.
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--trace=1"],
     "--trace=1: expected a file path; --trace=- traces to standard error (as ADASPEC_TRACE=1 "
     "does), and no --trace is off (./1 names a file so)"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--trace=Off"],
     "--trace=Off: expected a file path; --trace=- traces to standard error"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=false"],
     "--event_log=false: expected a file path, not a switch, a stream or a home folder "
     "(./false names a file so)"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=0"],
     "--event_log=0: expected a file path, not a switch"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=~"],
     "--event_log=~: expected a file path, not a switch"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--event_log=-"],
     "--event_log=-: expected a file path: replay reads an event log back from its file, so "
     "none is written to a stream ('-' sends the state trace to stderr)"),
    # What every request of this launch would be refused for is named as the flag, at once.
    (["--prompt", "x", "--max_tokens=4", "--temperature=0.5",
      "--enable_unified_mtp_graph=true"],
     "--temperature=0.5: expected 0: --enable_unified_mtp_graph=true captures greedy rounds "
     "only"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--num_speculative_tokens=9"],
     "--num_speculative_tokens"),
    (["--prompts_file", "/nonexistent/p.txt", "--max_tokens=4", "--temperature=0"],
     "--prompts_file=/nonexistent/p.txt: expected an existing UTF-8 text file"),
    (["--prompt", "x", "--max_tokens=4", "--temperature=0", "--model=/models/x"],
     "--draft_model: required with --model=/models/x"),
    # The context (1024) holds the prompt and max_tokens, or nothing loads.
    (["--prompt", "x" * 1020, "--max_tokens=5", "--temperature=0"],
     "--max_tokens=5: expected at most 4: the context limit 1024 less the 1020 tokens of "
     "--prompt=xxx"),
    (["--prompt", "x" * 1024, "--max_tokens=1", "--temperature=0"],
     "tokens; expected at most 1023 (the context limit 1024, and the first generated token "
     "needs a position)"),
])
def test_bad_generate_lines_exit_2_with_one_line(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "adaspec", "generate", *LAUNCH[:2], *argv],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("adaspec generate: error: ")
    assert message in lines[0]


def test_a_trace_variable_on_the_event_log_is_named_by_the_flag(tmp_path: Path) -> None:
    """Before, the runtime's start caught it and named the option: "event_log names it
    too", where the user gave --event_log."""
    done = subprocess.run([sys.executable, "-m", "adaspec", "generate", *LAUNCH[:2],
                           "--prompt", "x", "--max_tokens=4", "--temperature=0",
                           "--event_log=./same.jsonl"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "ADASPEC_TRACE": "same.jsonl"})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "adaspec generate: error: ADASPEC_TRACE=same.jsonl: expected a file of its own; "
        "--event_log names it too\n"))
    assert list(tmp_path.iterdir()) == []


def test_the_trace_flag_wins_over_the_trace_variable(tmp_path: Path) -> None:
    """``--trace`` takes the variable's place, as --help and docs/runtime.md say: the
    variable is not read then, so its file is neither written nor checked (here it names an
    existing file, which it alone would be refused for)."""
    (tmp_path / "taken.jsonl").write_text("kept\n")
    done = subprocess.run([sys.executable, "-m", "adaspec", "generate", *LAUNCH[:2],
                           "--prompt", "x", "--max_tokens=4", "--temperature=0",
                           "--trace=flag.jsonl"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "ADASPEC_TRACE": "taken.jsonl"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "taken.jsonl").read_text() == "kept\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["flag.jsonl", "taken.jsonl"]
    assert '"to": "' in (tmp_path / "flag.jsonl").read_text()


@contextlib.contextmanager
def long_generate(trace: str, *flags: str, ctrl_c: Any = signal.SIG_DFL
                  ) -> Iterator[subprocess.Popen[str]]:
    """``adaspec generate`` of 1000 tokens, tracing to ``trace``, taking SIGINT as a
    terminal's Ctrl-C delivers it (a child started from a background job would otherwise
    inherit it ignored: ``ctrl_c=signal.SIG_IGN`` starts it so); killed if the test leaves it
    running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "adaspec", "generate", "--prompt", "ROMEO.", "--max_tokens=1000",
         "--temperature=0", f"--trace={trace}", *flags], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, ctrl_c))
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_a_prompts_file_with_a_byte_order_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbfROMEO.\n")
    done = subprocess.run([sys.executable, "-m", "adaspec", "generate", "--max_tokens=4",
                           "--temperature=0", f"--prompts_file={path}"],
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"adaspec generate: error: --prompts_file={path}: starts with a "
                           "byte-order mark; expected UTF-8 text without one\n")


def test_a_prompts_file_has_one_prompt_per_newline() -> None:
    # A form feed or a Unicode line separator is part of its prompt; CRLF reads as LF.
    assert file_lines("ROMEO.\x0cJULIET:\r\nb\u2028c\n") == ["ROMEO.\x0cJULIET:", "b\u2028c"]
    assert file_lines("a\n\nb") == ["a", "", "b"]  # an empty line is refused by its number


@pytest.mark.parametrize(("signal_number", "ctrl_c", "status", "said"), [
    (signal.SIGINT, signal.SIG_DFL, 130, "interrupted"),
    (signal.SIGTERM, signal.SIG_DFL, 143, "terminated"),
    # A job a script starts in the background ignores Ctrl-C: SIGTERM stops it all the same.
    (signal.SIGTERM, signal.SIG_IGN, 143, "terminated")])
def test_a_signal_stops_generate_with_one_line_and_a_log_that_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], signal_number: int, ctrl_c: Any,
        status: int, said: str) -> None:
    trace, log = tmp_path / "trace.jsonl", tmp_path / "events.jsonl"
    with long_generate(str(trace), f"--event_log={log}", ctrl_c=ctrl_c) as process:
        deadline = time.monotonic() + 300
        while not (trace.exists() and trace.stat().st_size > 0):  # its first round is traced
            assert time.monotonic() < deadline, "generate traced no round in 300 s"
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
            assert process.returncode is None, process.stderr.read()  # type: ignore[union-attr]
        process.send_signal(signal_number)
        out, err = process.communicate(timeout=300)
    assert (process.returncode, out, err) == (status, "", f"adaspec generate: {said}\n")
    # The request was ended, not decoded to its 1000 tokens (a round each) before the exit.
    rounds = {event["round"] for event in map(json.loads, trace.read_text().splitlines())}
    assert len(rounds) < 900
    # The event log was closed whole: its request ends cancelled, and it replays.
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["reason"] for e in events if e.get("kind") == "request_finished"] == ["cancelled"]
    assert cli.run(["replay", str(log)]) == 0, capsys.readouterr().err


def test_a_second_ctrl_c_while_generate_exits_keeps_one_line_and_status_130() -> None:
    with long_generate("-") as process:  # the trace on stderr
        assert process.stderr is not None
        first = process.stderr.readline()  # the trace's first line: it decodes
        assert first.startswith("{"), first
        process.send_signal(signal.SIGINT)
        for line in process.stderr:  # the rest of the trace, then the one line it ends with
            if not line.startswith("{"):
                break
        assert line == "adaspec generate: interrupted\n"
        process.send_signal(signal.SIGINT)  # while the interpreter exits
        out, rest = process.communicate(timeout=300)
    assert (process.returncode, out, rest) == (130, "", "")


def test_states_diagram_prints_the_declared_graph(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["states", "--diagram"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2")
    assert "retire --> retired: retire_done" in out
    assert cli.run(["states"]) == 0  # the diagram is all it prints
    assert capsys.readouterr().out == out
    assert cli.run(["states", "--json"]) == 2
    assert capsys.readouterr().err == ("adaspec states: error: --json: unknown flag; expected "
                                       "--diagram\n")


def test_adaspec_alone_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: adaspec COMMAND")
    assert all(f"\n  {command} " in out for command in cli.COMMANDS)
