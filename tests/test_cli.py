"""`adaspec config`: JSON on stdout and exit 0 when valid; exit 2, empty stdout and exactly one
line on stderr (no traceback) when not."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gloo_job import PROCESS_LIMIT_S, peer_environment

from adaspec import cli
from adaspec.cli import run
from adaspec.config import RULES
from adaspec.config.rules import CROSS_CHECKS

ATV = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=7",
       "--enable_adaptive_target_verify=true"]


def adaspec(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaspec", *args], capture_output=True,
                          text=True, check=False, cwd=cwd, timeout=120)


def test_valid_launch_prints_every_setting_with_sources() -> None:
    done = adaspec("config", *ATV)
    assert (done.returncode, done.stderr) == (0, "")
    document = json.loads(done.stdout)
    settings, sources = document["launch"]["settings"], document["launch"]["sources"]
    assert set(settings) == set(sources)
    assert settings["num_speculative_tokens"] == 7
    assert sources["num_speculative_tokens"] == "flag"
    assert settings["dp_size"] == 1
    assert sources["dp_size"] == "default"
    assert settings["python_graph_backend"] == "eager_buckets"
    assert sources["python_graph_backend"] == "derived"
    assert document["adaspec_version"] == "0.1.0"
    assert document["adaptive_target_verify"]["calibration"]["source"] == "default"


@pytest.mark.parametrize("args", [
    ["config", "--speculative_algorithm=DSpark", "--num_speculative_tokens=6",
     "--enable_adaptive_target_verify=true"],
    ["config", "--enable_adaptive_spec_prune=true"],
    ["config", "--dp_size"],
    ["config", "--adaptive_target_verify_calibration=/nonexistent/x.json", *ATV],
    ["frobnicate"],
])
def test_invalid_input_exits_2_with_one_line_and_nothing_on_stdout(args: list[str]) -> None:
    done = adaspec(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.endswith("\n")
    assert "Traceback" not in done.stderr


def test_error_line_names_flag_value_and_expectation(tmp_path: Path) -> None:
    calibration = tmp_path / "dspark.json"
    calibration.write_text('{"draft_width": 5}')
    done = adaspec("config", *ATV, f"--adaptive_target_verify_calibration={calibration}")
    assert done.stderr == (
        f"adaspec config: error: --adaptive_target_verify_calibration={calibration}: "
        f"draft_width=5: expected 7, the --num_speculative_tokens of this launch (costs of "
        f"different widths must not be mixed)\n")


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["config", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--enable_adaptive_target_verify={true,false} (default false)" in text
    assert "--device={cpu,cuda,npu} (default cpu)" in text


def test_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--version"]) == 0
    assert capsys.readouterr().out == "adaspec 0.1.0\n"
    assert run(["--help"]) == 0
    assert "config" in capsys.readouterr().out


@pytest.mark.parametrize("extra", ["extra", "--bogus"])
def test_version_refuses_extra_arguments(extra: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--version", extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"adaspec --version: error: argument={extra}: expected nothing "
                            "after --version\n")


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("ADASPEC_CPU_THREADS", "0", "expected an integer in 1..1024"),
    ("ADASPEC_CPU_STREAM", "gpu", "expected loop (device work on the event loop's thread) or "
                                  "worker"),
    ("ADASPEC_TRACE", "{existing}", "expected a file that does not exist yet"),
])
def test_config_refuses_an_environment_variable_the_start_would_refuse(
        variable: str, value: str, expected: str, tmp_path: Path) -> None:
    # Before, config passed them and every command that starts a runtime refused them.
    existing = tmp_path / "trace.jsonl"
    existing.write_text("")
    value = value.format(existing=existing)
    done = subprocess.run([sys.executable, "-m", "adaspec", "config"], capture_output=True,
                          text=True, check=False, timeout=120,
                          env={**os.environ, variable: value})
    lines = done.stderr.splitlines()
    assert (done.returncode, done.stdout, len(lines)) == (2, "", 1), done.stderr
    assert lines[0].startswith(f"adaspec config: error: {variable}={value}: {expected}")
    # The cpu stream's settings are read on --device=cpu only.
    if variable != "ADASPEC_TRACE":
        other = subprocess.run([sys.executable, "-m", "adaspec", "config", "--device=cuda"],
                               capture_output=True, text=True, check=False, timeout=120,
                               env={**os.environ, variable: value})
        assert (other.returncode, other.stderr) == (0, "")


def test_a_trace_on_the_cost_table_output_and_a_bench_trace_file_are_refused_up_front(
        tmp_path: Path) -> None:
    """Before, config passed the first and calibrate refused it after the whole grid; bench
    ran its first arm, whose runtime created the trace, and then refused the second's."""
    table = tmp_path / "c.json"
    environment = {**os.environ, "ADASPEC_TRACE": str(table)}
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "config", *ATV,
         f"--adaptive_target_verify_cost_table_output={table}"],
        capture_output=True, text=True, check=False, timeout=120, env=environment)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        f"adaspec config: error: ADASPEC_TRACE={table}: expected a file of its own; "
        "--adaptive_target_verify_cost_table_output names it too\n"))
    bench = subprocess.run(
        [sys.executable, "-m", "adaspec", "bench", "--quick", "--arms=none,fixed:1"],
        capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
        env={**os.environ, "ADASPEC_TRACE": "t.jsonl"})
    assert (bench.returncode, bench.stdout, bench.stderr) == (2, "", (
        "adaspec bench: error: ADASPEC_TRACE=t.jsonl: names a file, which one runtime writes; "
        "bench starts one for every arm and pass: expected it unset, 0, or 1 (the trace on "
        "standard error)\n"))
    assert sorted(os.listdir(tmp_path)) == []


def test_a_standard_output_that_cannot_spell_the_text_escapes_it() -> None:
    """Before, PYTHONIOENCODING=ascii made generate's text output (and simulate's table) end
    in a UnicodeEncodeError traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "generate", "--prompt=Caf\u00e9", "--max_tokens=1",
         "--temperature=0"], capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.splitlines()[1].startswith("Caf\\xe9")


def test_installed_console_script_runs_config() -> None:
    script = shutil.which("adaspec")
    if script is None:
        pytest.skip("the adaspec console script is not on PATH (package not installed)")
    done = subprocess.run([script, "config"], capture_output=True, text=True, check=False,
                          timeout=120)
    assert done.returncode == 0
    assert json.loads(done.stdout)["execution"]["mode"] == "no speculation"


def test_rules_listing_shows_every_rule_with_its_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["config", "--rules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(RULES) + len(CROSS_CHECKS)
    assert lines[-1] == ("always -> builtin: names exist and the built-in draft matches the "
                         "algorithm.")
    assert lines[0] == (
        "--enable_adaptive_draft_step=true -> --enable_adaptive_target_verify=false   "
        "[Adaptive Speculation: at most one of the two adaptive controls may be on]")


@pytest.mark.parametrize(("argv", "line"), [
    (["generate", "--prompt", "--max_tokens", "5", "--temperature", "0"],
     "adaspec generate: error: --prompt: expected a value (--prompt TEXT, or --prompt=TEXT for "
     "a value that starts with --)"),
    (["bench", "--concurrency", "--quick"],
     "adaspec bench: error: --concurrency: expected a value (--concurrency LIST, or "
     "--concurrency=LIST for a value that starts with --)"),
    (["bench", "--concurency=1"],
     "adaspec bench: error: --concurency=1: unknown flag; did you mean --concurrency?"),
    (["models", "--jsn"], "adaspec models: error: --jsn: unknown flag; did you mean --json?"),
    (["bench", "--num_speculative_token=3"],
     "adaspec bench: error: --num_speculative_token=3: unknown flag; did you mean "
     "--num_speculative_tokens?"),
])
def test_a_flag_without_its_value_or_misspelled_is_named_itself(
        argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", line + "\n")


def test_a_value_that_starts_with_dashes_is_given_with_an_equals_sign(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["generate", "--prompt=--max_tokens", "--max_tokens", "2",
                    "--temperature", "0"]) == 0
    assert "--max_tokens" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_stops_on_ctrl_c_with_one_line_and_status_130(
        command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # adaspec generate is interrupted for real in test_generate_cli; here, the dispatch.
    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt  # what Python raises on SIGINT, wherever the command is

    monkeypatch.setitem(cli.COMMANDS, command, interrupted)
    assert run([command]) == 130
    assert capsys.readouterr() == ("", f"adaspec {command}: interrupted\n")


LEAVING = """
import atexit, sys, threading
from adaspec.cli.main import _exit
atexit.register(lambda: print("teardown", flush=True))
if sys.argv[1] == "left":  # a thread still waiting, as on a store that never answered
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print("said", end="")
_exit(5)
"""


@pytest.mark.parametrize(("threads", "output"), [("none", "saidteardown\n"), ("left", "said")])
def test_a_command_that_leaves_a_waiting_thread_exits_with_its_status_and_output_but_no_teardown(
        threads: str, output: str) -> None:
    """A thread returning from torch's C++ while the interpreter tears down aborts the
    process (status 134): with a daemon thread left, the command ends without that teardown,
    its output flushed and its status kept."""
    done = subprocess.run([sys.executable, "-c", LEAVING, threads], capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (5, output, "")


SIGNALLED_COMMAND = """
import asyncio, sys
from adaspec.cli import interrupts

interrupts.install("adaspec test")


async def main():
    print("waiting", flush=True)
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        print("cancelled", flush=True)
        if sys.argv[1] == "stuck":  # a shutdown that never ends: only a second signal ends it
            await asyncio.Event().wait()
        raise

try:
    interrupts.run(main())
except KeyboardInterrupt:
    print(interrupts.stopped_line("adaspec test"), file=sys.stderr)
    sys.exit(interrupts.status())
"""


def _end(process: subprocess.Popen[str]) -> None:
    """Kill a process a test left running (it failed before the process ended)."""
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.mark.parametrize(("ctrl_c", "signals", "shutdown", "status", "said"), [
    # A job a script starts in the background ignores Ctrl-C; SIGTERM cancels it all the same.
    (signal.SIG_IGN, [signal.SIGTERM], "ends", 143, "terminated"),
    (signal.SIG_DFL, [signal.SIGINT], "ends", 130, "interrupted"),
    # The first signal decides the status; the second ends a stuck shutdown at once.
    (signal.SIG_DFL, [signal.SIGINT, signal.SIGTERM], "stuck", 130, "interrupted"),
    (signal.SIG_DFL, [signal.SIGTERM, signal.SIGINT], "stuck", 143, "terminated"),
])
def test_the_first_signal_cancels_the_main_task_and_decides_the_status(
        ctrl_c: Any, signals: list[int], shutdown: str, status: int, said: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_COMMAND, shutdown], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=peer_environment(),
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, ctrl_c))
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "waiting\n"
        process.send_signal(signals[0])
        assert process.stdout.readline() == "cancelled\n"
        for number in signals[1:]:
            process.send_signal(number)
        out, err = process.communicate(timeout=PROCESS_LIMIT_S)
    finally:
        _end(process)
    assert (process.returncode, out, err) == (status, "", f"adaspec test: {said}\n")


EXITING = """
import signal, sys
from adaspec.cli.main import _exit_at_interrupt

signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a job a script starts in the background
_exit_at_interrupt(0)
print("exiting", flush=True)
sys.stdin.readline()  # the test signals, then lets it go on
print("ignored", flush=True)
"""


def test_an_inherited_ignored_ctrl_c_stays_ignored_while_adaspec_exits() -> None:
    process = subprocess.Popen([sys.executable, "-c", EXITING], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=peer_environment())
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "exiting\n"
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate("\n", timeout=PROCESS_LIMIT_S)
    finally:
        _end(process)
    assert (process.returncode, out) == (0, "ignored\n")


SIGNALLED_AT_TEARDOWN = """
import os, signal, sys

class SignalsAtTeardown:  # the fault: a signal as the interpreter unloads its modules
    def __del__(self):
        os.kill(os.getpid(), signal.SIG{name})

sys.argv = ["adaspec", "config"]
from adaspec.cli.main import main
late = SignalsAtTeardown()
main()
"""


@pytest.mark.parametrize("name", ["INT", "TERM"])
def test_a_signal_while_the_interpreter_unloads_keeps_the_decided_status(name: str) -> None:
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AT_TEARDOWN.format(name=name)],
                          capture_output=True, text=True, env=peer_environment(),
                          timeout=PROCESS_LIMIT_S)
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["launch"]["settings"]["model"] == "builtin:target"


INTERRUPTED_AS_IT_LOADS = """
import importlib, os, signal, sys

loads = importlib.import_module

def swallowing(name):  # the fault: Ctrl-C as a library that swallows it loads (torch's C++)
    importlib.import_module = loads  # once
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs between these steps
            pass
    except KeyboardInterrupt:
        pass
    return loads(name)

importlib.import_module = swallowing
sys.argv = ["adaspec", "config"]
from adaspec.cli.main import main
main()
"""


def test_ctrl_c_while_the_command_loads_stops_it_even_where_a_library_swallows_it() -> None:
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_AS_IT_LOADS], capture_output=True,
                          text=True, env=peer_environment(), timeout=PROCESS_LIMIT_S)
    assert (done.returncode, done.stdout, done.stderr) == (
        130, "", "adaspec config: interrupted\n")


SWALLOWED_BEFORE_THE_LOOP = """
import os, signal
from adaspec.cli import interrupts

interrupts.install("adaspec test")
try:  # the fault: a library swallows the interrupt before the command's loop starts
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(1000):
        pass
except KeyboardInterrupt:
    pass

async def work():
    print("ran", flush=True)

try:
    interrupts.run(work())
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_loop_started_after_a_swallowed_interrupt_runs_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", SWALLOWED_BEFORE_THE_LOOP], capture_output=True,
                          text=True, env=peer_environment(), timeout=PROCESS_LIMIT_S)
    assert (done.returncode, done.stdout, done.stderr) == (0, "interrupted\n", "")


A_LONG_WORK_ITEM = """
import time
from adaspec.cli import interrupts

interrupts.install("adaspec test")

async def work():  # the fault: device work that holds the loop's thread (a graph prewarm)
    print("busy", flush=True)
    until = time.monotonic() + 60
    while time.monotonic() < until:
        if interrupts.came():
            print("signalled", flush=True)
            while time.monotonic() < until:
                pass
    print("gave up", flush=True)

interrupts.run(work())
"""


def test_a_second_signal_ends_a_command_whose_loop_is_busy_at_once() -> None:
    """Before, the signals reached the command only as loop callbacks: a long work item on
    the loop's thread held both (two SIGTERMs during generate's graph preparation ended it
    seconds later)."""
    process = subprocess.Popen([sys.executable, "-c", A_LONG_WORK_ITEM], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=peer_environment())
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "busy\n"
        process.send_signal(signal.SIGTERM)
        assert process.stdout.readline() == "signalled\n"
        process.send_signal(signal.SIGTERM)
        out, errors = process.communicate(timeout=PROCESS_LIMIT_S)
    finally:
        _end(process)
    assert (process.returncode, out, errors) == (143, "", "adaspec test: terminated\n")


@pytest.mark.parametrize(("argv", "line"), [
    (["generate", "--bogus", "--max_tokens=3", "--temperature=0", "--prompt=x"],
     "adaspec generate: error: --bogus: unknown flag; see `adaspec generate --help` (its "
     "launch flags are those of `adaspec config --help`)"),
    (["generate", "--max_tokens=3", "--temperature=0", "--prompt=x", "--prompts_file=p.txt"],
     "adaspec generate: error: --prompts_file=p.txt: expected either --prompt TEXT (one or "
     "more) or --prompts_file FILE, not both"),
    (["bench", "--arms=adaptive-depth", "--quick"],
     "adaspec bench: error: --arms=adaptive-depth: this launch cannot run it: "
     "--speculative_algorithm=DSpark: --enable_adaptive_draft_step=true needs "
     "--speculative_algorithm=MTP"),
    (["--help", "bogus"], "adaspec --help: error: argument=bogus: expected one command name "
     "after --help: config, models, generate, serve, calibrate, bench, simulate, states, "
     "replay"),
    (["-h", "bogus", "bench"], "adaspec -h: error: argument=bogus: expected one command name "
     "after -h: config, models, generate, serve, calibrate, bench, simulate, states, replay"),
])
def test_a_refusal_names_what_the_user_gave(argv: list[str], line: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert run(argv) == 2
    assert capsys.readouterr().err == line + "\n"


def test_help_before_a_command_is_that_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--help", "bench"]) == 0
    assert capsys.readouterr().out.startswith("usage: adaspec bench ")


def test_a_request_ended_at_its_prefill_shows_no_acceptance_length(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["generate", "--prompt=hi", "--max_tokens=1", "--temperature=0"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "[0] no decode round (ended at its prefill), finish length")


SIGNALLED_IN_A_FINALIZER = """
import os, signal, sys

sys.argv = ["adaspec", "config"]
import adaspec.cli.main
commands = sys.modules["adaspec.cli.main"].COMMANDS
config = commands["config"]

class Finalized:  # the fault: a signal while a finalizer runs (an event loop's __del__)
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler raises in here, where Python cannot raise
            pass

def config_then_a_finalizer(argv):
    status = config(argv)
    Finalized()  # collected at once
    return status

commands["config"] = config_then_a_finalizer
sys.modules["adaspec.cli.main"].main()
"""


def test_a_signal_whose_interrupt_lands_in_a_finalizer_still_stops_the_command() -> None:
    done = subprocess.run([sys.executable, "-c", SIGNALLED_IN_A_FINALIZER],
                          capture_output=True, text=True, env=peer_environment(),
                          timeout=PROCESS_LIMIT_S)
    assert (done.returncode, done.stderr) == (143, "adaspec config: terminated\n")
    assert json.loads(done.stdout)["launch"]["settings"]["model"] == "builtin:target"


SIGNALLED_AS_THE_CLI_LOADS = """
import importlib.abc, os, runpy, signal, sys

SIGNALS = [getattr(signal, name) for name in sys.argv[1:]]

class Signalling(importlib.abc.MetaPathFinder):  # the fault: signals as adaspec.cli loads
    def find_spec(self, name, path, target=None):
        if name == "adaspec.cli.main":
            sys.meta_path.remove(self)
            for number in SIGNALS:
                os.kill(os.getpid(), number)
            for _ in range(1000):
                pass
        return None

sys.meta_path.insert(0, Signalling())
sys.argv = ["adaspec", "config"]
runpy.run_module("adaspec", run_name="__main__")
"""


@pytest.mark.parametrize("signals", [["SIGTERM"], ["SIGTERM", "SIGINT"]])
def test_sigterm_while_the_command_line_loads_is_one_line(signals: list[str]) -> None:
    # Two signals: the first one decides the status, the second ends the process at once.
    done = subprocess.run([sys.executable, "-c", SIGNALLED_AS_THE_CLI_LOADS, *signals],
                          capture_output=True, text=True, env=peer_environment(),
                          timeout=PROCESS_LIMIT_S)
    assert (done.returncode, done.stdout, done.stderr) == (143, "", "adaspec: terminated\n")
