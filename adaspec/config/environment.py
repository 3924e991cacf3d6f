"""The environment variables a launch reads, checked without torch so that ``adaspec config``
refuses what the launch itself would refuse.

``ADASPEC_CPU_STREAM`` and ``ADASPEC_CPU_THREADS`` pick the cpu stream and its torch
intra-op threads (``runtime/devices/streams.py`` applies them); ``ADASPEC_TRACE`` sends the
state trace to standard error or to a file (``runtime/trace.py``)."""

import os
from collections.abc import Mapping

from adaspec.config.launch import LaunchConfig, integer_text
from adaspec.config.paths import SWITCH_OFF, SWITCH_ON, check_own_files, new_file
from adaspec.errors import ConfigError

CPU_THREADS_ENV = "ADASPEC_CPU_THREADS"
"""Environment variable that sets the cpu stream's torch intra-op threads."""

CPU_STREAM_ENV = "ADASPEC_CPU_STREAM"
"""Environment variable that picks the cpu stream: ``loop`` (default) or ``worker``."""

CPU_STREAMS = ("loop", "worker")

MAX_CPU_THREADS = 1024

TRACE_ENV = "ADASPEC_TRACE"
"""Environment variable that turns the state trace on when no ``trace`` option is given."""

STDERR = "-"
"""The trace path that means standard error."""

_SWITCHES = {**dict.fromkeys(SWITCH_ON, STDERR), **dict.fromkeys((*SWITCH_OFF, ""), None)}


def cpu_stream_kind(environ: Mapping[str, str] | None = None) -> str:
    """``ADASPEC_CPU_STREAM`` (``loop`` when unset), or ``ConfigError`` naming the variable."""
    raw = (os.environ if environ is None else environ).get(CPU_STREAM_ENV, "loop")
    if raw.strip() not in CPU_STREAMS:
        raise ConfigError(CPU_STREAM_ENV, raw, "expected loop (device work on the event "
                          "loop's thread) or worker (on a thread of its own)")
    return raw.strip()


def checked_threads(setting: str, raw: object) -> int:
    """``raw`` as a thread count in 1..``MAX_CPU_THREADS``, or ``ConfigError`` naming
    ``setting``."""
    value = None if isinstance(raw, bool) else integer_text(str(raw))
    if value is None or not 1 <= value <= MAX_CPU_THREADS:
        raise ConfigError(setting, raw, f"expected an integer in 1..{MAX_CPU_THREADS} (torch "
                          "intra-op threads of the cpu stream)")
    return value


def trace_destination(value: str | None) -> str | None:
    """Where the ``ADASPEC_TRACE`` environment variable sends the trace: None (off) for
    unset, empty, 0, false, no or off; standard error (``-``) for 1, true, yes or on, which
    read as switches rather than file names; any other value is a file path."""
    if value is None:
        return None
    return _SWITCHES.get(value.strip().lower(), value)


def rank_file(path: str, world_size: int, rank: int) -> str:
    """With several ranks on one launch line, each writes its own file: ``run.jsonl``
    becomes ``run.rank1.jsonl`` on rank 1."""
    if world_size == 1 or path == STDERR:
        return path
    root, suffix = os.path.splitext(path)
    return f"{root}.rank{rank}{suffix}"


def trace_file(launch: LaunchConfig) -> str | None:
    """The file ``ADASPEC_TRACE`` names for this rank of ``launch`` (None: unset, off, or
    standard error)."""
    trace = trace_destination(os.environ.get(TRACE_ENV))
    if trace is None or trace == STDERR:
        return None
    return rank_file(trace, launch.world_size, launch.node_rank)


def check_environment(launch: LaunchConfig) -> None:
    """Refuse, naming the variable, what the launch's start would refuse: a cpu stream or
    thread count out of range (on ``--device=cpu``), a trace file that could not be created
    or that the launch's cost-table output names too."""
    if launch.device == "cpu":
        cpu_stream_kind()
        raw = os.environ.get(CPU_THREADS_ENV)
        if raw is not None:
            checked_threads(CPU_THREADS_ENV, raw)
    trace = trace_file(launch)
    if trace is not None:
        new_file(TRACE_ENV, trace)
        check_own_files([("--adaptive_target_verify_cost_table_output",
                          launch.adaptive_target_verify_cost_table_output), (TRACE_ENV, trace)])
