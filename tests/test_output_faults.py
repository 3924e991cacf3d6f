"""An output the run was asked to write (the state trace, an event log) that the system stops
accepting ends that output, never the run: the decoded text is still printed, and the failure
is one line naming the setting and the file. Paths that could never be created are refused
before the models load.

Two kinds of fault: an injected one (``FullDiskFile``, a file whose writes fail as a full disk
does) for the writers alone, and a real one for whole commands, a file-size limit
(``RLIMIT_FSIZE``) set on the child process, under which the kernel refuses writes past it.
"""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from runtime_helpers import TINY_CALIBRATION

from adaspec.config import load_config
from adaspec.errors import ConfigError, OutputWriteError
from adaspec.runtime.engine import TRACE_ENV, Runtime, RuntimeOptions
from adaspec.runtime.events.clock import VirtualClock
from adaspec.runtime.events.log import EventLogWriter, LogHeader
from adaspec.runtime.events.outputs import ObserverFile
from adaspec.runtime.events.types import RequestArrived
from adaspec.runtime.states import RoundHooks, RoundMachine, RoundState
from adaspec.runtime.trace import StateTrace


class FullDiskFile:
    """Injected fault: a text file whose every write and flush fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        pass


def test_a_trace_that_cannot_write_stops_tracing_and_says_so_at_close() -> None:
    trace = StateTrace([structlog.processors.JSONRenderer()],
                       ObserverFile(FullDiskFile()),  # type: ignore[arg-type]
                       VirtualClock(), setting="ADASPEC_TRACE", path="-")
    states = RoundMachine(0, RoundHooks(), slot=0)
    for _ in range(3):  # the round's move is never refused because of the trace
        trace.hook(states, RoundState.DRAFT, RoundState.CONSENSUS, "drafted")
    with pytest.raises(OutputWriteError) as raised:
        trace.close()
    assert str(raised.value) == (
        "ADASPEC_TRACE=-: cannot write the state trace (No space left on device); what it "
        "holds is incomplete, the run went on without it")
    trace.close()  # said once


def test_an_event_log_that_cannot_write_drops_later_events_and_says_so_at_close(
        tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    writer = EventLogWriter(path, LogHeader(config={}, cost_table=None, models={},
                                            context_limit=2, seed=0, lag=2, policies={}))
    writer._file.close()
    writer._file = ObserverFile(FullDiskFile())  # type: ignore[arg-type]
    event = RequestArrived(time=0.0, request_id=0, num_prompt_tokens=1, sampling={})
    writer.write(event)  # refused by the disk: no exception into the publisher
    writer.write(event)
    with pytest.raises(OutputWriteError) as raised:
        writer.close()
    assert str(raised.value) == (
        f"event_log={path}: cannot write the event log (No space left on device); what it "
        "holds is incomplete, the run went on without it")


@pytest.mark.asyncio
async def test_a_trace_path_from_the_environment_is_refused_before_any_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "missing" / "trace.jsonl"))
    runtime = Runtime(load_config({}))
    with pytest.raises(ConfigError, match=r"^ADASPEC_TRACE=.*trace.jsonl: expected an existing "
                                          r"directory; create .*missing first$"):
        await runtime.start()


@pytest.mark.asyncio
async def test_an_event_log_that_exists_is_refused_before_any_model_loads(
        tmp_path: Path) -> None:
    existing = tmp_path / "run.jsonl"
    existing.write_text("evidence of another run\n")
    runtime = Runtime(load_config({}), options=RuntimeOptions(event_log=str(existing)))
    with pytest.raises(ConfigError, match="^event_log=.*run.jsonl: expected a file that does "
                                          "not exist yet"):
        await runtime.start()
    assert existing.read_text() == "evidence of another run\n"


def _small_files() -> None:
    # Runs in the child: writes past 2 KiB to any file fail with EFBIG instead of a signal.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def _generate(tmp_path: Path, *flags: str, env: dict[str, str] | None = None,
              **options: Any) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "adaspec", "generate", "--prompt", "ROMEO.",
               "--max_tokens", "48", "--temperature", "0", "--speculative_algorithm=DSpark",
               "--num_speculative_tokens=3", *flags]
    streams = options or {"capture_output": True}
    return subprocess.run(command, cwd=tmp_path, text=True, timeout=300, check=False,
                          preexec_fn=_small_files, env={**os.environ, **(env or {})},
                          **streams)


@pytest.mark.parametrize(("flag", "what"), [
    ("--event_log", "event log"), ("--trace", "state trace"), (TRACE_ENV, "state trace")])
def test_generate_prints_its_results_when_its_output_file_fills(
        tmp_path: Path, flag: str, what: str) -> None:
    path = tmp_path / "out.jsonl"
    # Named as the user gave it: the flag, or the environment variable.
    if flag == TRACE_ENV:
        done = _generate(tmp_path, env={TRACE_ENV: str(path)})
    else:
        done = _generate(tmp_path, f"{flag}={path}")
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"adaspec generate: error: {flag}={path}: cannot write the {what} (File too large); "
        "what it holds is incomplete, the run went on without it")
    assert "ROMEO." in done.stdout
    assert "tokens/s" in done.stdout
    assert path.stat().st_size <= 2048


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_trace_onto_a_full_standard_error_ends_the_trace_not_the_run(tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:  # every write to it fails with ENOSPC
        done = _generate(tmp_path, env={TRACE_ENV: "1"}, stderr=full, stdout=subprocess.PIPE)
    assert done.returncode == 2  # the failure could not be told, but its status is
    assert "ROMEO." in done.stdout
    assert "tokens/s" in done.stdout


def test_bench_prints_its_report_when_an_event_log_fills(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    command = [sys.executable, "-m", "adaspec", "bench", "--arms=none", "--concurrency=1",
               "--requests=1", "--max_tokens=200", "--passes=1", "--json",
               f"--event_log_dir={logs}"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False, preexec_fn=_small_files)
    assert done.returncode == 2
    assert json.loads(done.stdout)["arms"][0]["arm"] == "none"  # the report is not lost
    assert done.stderr.splitlines()[-1] == (
        f"adaspec bench: error: --event_log_dir={logs / 'none.jsonl'}: cannot write the event "
        "log (File too large); what it holds is incomplete, the run went on without it")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["config"], ["--version", "x"], ["frobnicate"]])
def test_both_standard_streams_full_still_exit_2(argv: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "adaspec", *argv], stdout=full,
                              stderr=full, timeout=120, check=False)
    assert done.returncode == 2  # was 1: the one-line report itself failed with a traceback


def _stderr_closed() -> None:
    os.close(2)


def _stderr_whose_reader_left() -> None:
    read, write = os.pipe()
    os.close(read)
    os.dup2(write, 2)  # Python ignores SIGPIPE: a write fails with EPIPE


def _stderr_full() -> None:
    os.dup2(os.open("/dev/full", os.O_WRONLY), 2)


def _calibrate_line(tmp_path: Path) -> list[str]:
    calibration = tmp_path / "tiny.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    return ["calibrate", "--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
            "--max_seqs_per_batch=4", "--enable_adaptive_target_verify=true",
            f"--adaptive_target_verify_calibration={calibration}",
            f"--adaptive_target_verify_cost_table_output={tmp_path / 'costs.json'}", "--json"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("stderr", [_stderr_closed, _stderr_whose_reader_left, _stderr_full])
@pytest.mark.parametrize("command", ["bench", "calibrate"])
def test_progress_lines_a_standard_error_cannot_take_are_dropped_not_the_run(
        stderr: Any, command: str, tmp_path: Path) -> None:
    argv = (["bench", "--quick", "--arms=none,fixed:1", "--concurrency=1", "--requests=1",
             "--max_tokens=4", "--json"] if command == "bench" else _calibrate_line(tmp_path))
    done = subprocess.run([sys.executable, "-m", "adaspec", *argv], cwd=tmp_path,
                          stdout=subprocess.PIPE, text=True, timeout=300, check=False,
                          preexec_fn=stderr)
    assert done.returncode == 0
    report = json.loads(done.stdout)
    if command == "bench":
        assert [arm["arm"] for arm in report["arms"]] == ["none", "fixed:1"]
    else:
        assert json.loads((tmp_path / "costs.json").read_text())["compatibility"]
