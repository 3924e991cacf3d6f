"""The ``adaspec`` command.

User errors (an ``AdaspecError``) end with exit status 2 and exactly one line on stderr that
names the flag or key, the value and what is expected; stdout stays empty. A standard output
that cannot take the output ends quietly when its reader went away (``adaspec config | head
-c1``: exit status 141, as a tool stopped by SIGPIPE) and with one line otherwise (a full
device: exit status 2). Ctrl-C (SIGINT) stops a command with one line on stderr, ``adaspec
COMMAND: interrupted``, and exit status 130 (128 + SIGINT, as a shell reports it); SIGTERM
stops it the same way, with ``adaspec COMMAND: terminated`` and exit status 143 (``serve``
drains at either, once it listens); the first signal decides which (``interrupts``). A
second signal, while the first is handled or adaspec exits, ends it at once with the status
already decided, and one while the interpreter unloads changes nothing. Anything else is a
bug in adaspec and keeps its traceback.
"""

import atexit
import contextlib
import importlib
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TextIO, cast

from adaspec import __version__
from adaspec.cli.interrupts import (
    INTERRUPTED,
    TERMINATED,
    came,
    held,
    install,
    say,
    status,
    stopped_line,
    tell_saved_table,
)
from adaspec.errors import AdaspecError, show_value

USAGE = """usage: adaspec COMMAND [FLAGS]

commands:
  bench     adaptive against fixed-width speculation on real requests (the main job)
  config    check a launch line and print its effective configuration as JSON
  models    identities, sizes and measured quality of the built-in reference models
  generate  decode prompts with the built-in models (speculative or target alone)
  serve     an OpenAI-compatible HTTP server (completions, streaming, metrics)
  calibrate measure and fit the costs of adaptive target verify, save the bundle
  simulate  evaluate policies offline on a workload (or an event log) and a cost bundle
  states    print the round state graph as a mermaid diagram
  replay    re-run the policies of a recorded event log and report the first divergence

adaspec COMMAND --help shows a command's flags; adaspec --version prints the version."""


def _subcommand(name: str) -> Callable[[Sequence[str]], int]:
    """The ``run`` of ``adaspec.cli.<name>``, imported when the command runs: a command loads
    only what it needs (torch and scipy take seconds, and make Ctrl-C at start slower)."""

    def run(argv: Sequence[str]) -> int:
        with held():  # torch loads here
            module = importlib.import_module(f"adaspec.cli.{name}")
        return module.run(argv)  # type: ignore[no-any-return]

    return run


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    name: _subcommand(name) for name in
    ("config", "models", "generate", "serve", "calibrate", "bench", "simulate", "states",
     "replay")}


def run(argv: Sequence[str]) -> int:
    """Dispatch one command line; returns the exit status."""
    if argv and argv[0] in ("-h", "--help") and len(argv) > 1:  # adaspec --help COMMAND
        wrong = argv[1] if argv[1] not in COMMANDS else next(iter(argv[2:]), None)
        if wrong is not None:
            _say(f"adaspec {argv[0]}: error: argument={show_value(wrong)}: expected one "
                 f"command name after {argv[0]}: {', '.join(COMMANDS)}")
            return 2
        argv = [argv[1], "--help"]
    if not argv or argv[0] in ("-h", "--help"):  # no command: say what there is
        print(USAGE)
        return 0
    if argv[0] == "--version":
        if len(argv) > 1:
            _say(f"adaspec --version: error: argument={show_value(argv[1])}: expected "
                 "nothing after --version")
            return 2
        print(f"adaspec {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        _say(f"adaspec: error: command={show_value(argv[0])}: unknown; expected one of "
             f"{', '.join(COMMANDS)}")
        return 2
    tell_saved_table(None)
    try:
        return command(argv[1:])
    except AdaspecError as error:
        _say(f"adaspec {argv[0]}: error: {error}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the command has stopped what it ran
        return _interrupted(f"adaspec {argv[0]}")


_process_exits_at_interrupt = False
"""Set by ``main``: the process then ends at once at the next signal after the first (a
``run`` inside another program leaves that program's signal handling alone)."""


_said_stopped = False
"""Set once ``_interrupted`` said how the command stopped."""


def _interrupted(command: str) -> int:
    """Say how ``command`` was stopped; returns its exit status."""
    global _said_stopped
    _said_stopped = True
    code = status()
    if _process_exits_at_interrupt:
        _exit_at_interrupt(code)
    _say(stopped_line(command))
    return code


_say = say


class StdoutFailed(Exception):
    """Standard output refused the command's output (a closed pipe, a full device)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error)
        self.error = error


class _CheckedStdout:
    """``sys.stdout`` whose write failures are told apart from those of any other file, so
    that only they are reported in one line (another file's failure is a bug to trace)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise StdoutFailed(error) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise StdoutFailed(error) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _command(argv: Sequence[str]) -> str:
    return f"adaspec {argv[0]}" if argv and argv[0] in COMMANDS else "adaspec"


def run_to_stdout(argv: Sequence[str]) -> int:
    """``run`` with a standard output that may fail: exit status 141 and no message when its
    reader went away, one line and exit status 2 when it is closed or cannot be written."""
    command = _command(argv)
    stdout = sys.stdout
    if stdout is None:  # started with descriptor 1 closed: refused before anything runs
        _say(f"{command}: error: stdout: closed; expected an open standard output "
             "(redirect it to /dev/null to discard the output)")
        return 2
    if isinstance(stdout, io.TextIOWrapper) and stdout.errors == "strict":
        # An encoding that cannot spell a completion's text (PYTHONIOENCODING=ascii, a C
        # locale) escapes what it lacks, as standard error does, instead of failing the run.
        stdout.reconfigure(errors="backslashreplace")
    sys.stdout = cast(TextIO, _CheckedStdout(stdout))
    try:
        status = run(argv)
        sys.stdout.flush()  # inside the check, not at interpreter exit
        return status
    except StdoutFailed as failed:
        # What is still buffered goes nowhere, so the flush at exit fails no second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        if isinstance(failed.error, BrokenPipeError):
            return 141
        reason = failed.error.strerror or type(failed.error).__name__
        _say(f"{command}: error: stdout: cannot write the output ({reason})")
        return 2
    finally:
        sys.stdout = stdout


def main() -> None:
    global _process_exits_at_interrupt
    _process_exits_at_interrupt = True
    # The command says a fault in one line; c10d's warnings and errors (a store whose host
    # left, a port another service holds) come with pages of C++ frames, and reach Python
    # as the exceptions the command names. Set before torch loads, unless the user set it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    argv = sys.argv[1:]
    install(_command(argv))
    # Registered before the command loads torch, so it runs after torch's own hooks.
    atexit.register(_ignore_signals_at_teardown)
    try:
        status = run_to_stdout(argv)
        if came() and not _said_stopped:  # its interrupt was swallowed where it landed
            status = _interrupted(_command(argv))
        # All is said; a signal while the interpreter winds down (its threads, torch's
        # teardown) only hurries the exit, with the status already decided.
        _exit_at_interrupt(status)
    except KeyboardInterrupt:  # outside the command: while its output was flushed
        status = _interrupted(_command(argv))
    _exit(status)


_status_decided = False
"""Set once a signal can only hurry the exit (``_exit_at_interrupt``)."""


def _exit_at_interrupt(status: int) -> None:
    """From now on a signal ends the process at once with ``status``; one the process
    inherited ignored stays ignored."""
    global _status_decided
    _status_decided = True
    for number in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(number) != signal.SIG_IGN:
            signal.signal(number, lambda number, frame: os._exit(status))


def _ignore_signals_at_teardown() -> None:
    """The last exit hook. The interpreter then hands the signals its handlers took back to
    the system's default action, which would kill a process whose status is decided while
    it unloads its modules and torch's C++ runtime; an ignored signal keeps that status."""
    if _status_decided:
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_IGN)


def _exit(status: int) -> None:
    """Exit with ``status``. A daemon thread left waiting in torch's C++ (a store that never
    answered, a backend still connecting) may return there while the interpreter tears down,
    and the C++ runtime then aborts the process (status 134): with one alive, the command's
    output is flushed and the process ends without that teardown."""
    # A command a signal stopped ends here too: Python itself would end one whose interrupt
    # passed through an import by SIGINT, whatever status it exits with.
    stopped = status in (INTERRUPTED, TERMINATED) and came()
    if not stopped and not any(t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(status)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed or full: the status says it
            if stream is not None:
                stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
