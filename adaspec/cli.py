"""The ``adaspec`` command.

User errors (an ``AdaspecError``) end with exit status 2 and exactly one line on stderr that
names the flag or key, the value and what is expected; stdout stays empty. A standard output
that cannot take the output ends quietly when its reader went away (``adaspec config | head
-c1``: exit status 141, as a tool stopped by SIGPIPE) and with one line otherwise (a full
device: exit status 2). Ctrl-C (SIGINT) stops a command with one line on stderr, ``adaspec
COMMAND: interrupted``, and exit status 130 (128 + SIGINT, as a shell reports it); a Ctrl-C
while adaspec exits ends it at once, with the status it was exiting with. Anything
else is a bug in adaspec and keeps its traceback.
"""

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields
from typing import Any, TextIO, cast

from adaspec import __version__
from adaspec.config import RULES, LaunchConfig, load_config_from_argv
from adaspec.config.builtin import check_builtin_limits
from adaspec.config.flags import field_docs, parse_argv
from adaspec.config.launch import BUILTIN_TARGET, BUILTIN_TARGETS, launch_field_types, metavar
from adaspec.config.rules import CROSS_CHECKS
from adaspec.errors import MISSING, AdaspecError, ConfigError, show_value
from adaspec.runtime.command_flags import CommandFlags, Flag, ParsedFlags

USAGE = """usage: adaspec COMMAND [FLAGS]

commands:
  bench     adaptive against fixed-width speculation on real requests (the main job)
  config    check a launch line and print its effective configuration as JSON
  models    identities, sizes and measured quality of the built-in reference models
  generate  decode prompts with the built-in models (speculative or target alone)
  calibrate measure and fit the costs of adaptive target verify, save the bundle
  simulate  evaluate policies offline on a workload (or an event log) and a cost bundle
  states    print the round state graph as a mermaid diagram
  replay    re-run the policies of a recorded event log and report the first divergence

adaspec COMMAND --help shows a command's flags; adaspec --version prints the version."""


CONFIG = CommandFlags(
    command="config",
    usage="[--name=value | --name value] ... | --rules",
    about="Checks the launch line (flags, combination rules, JSON files it names) without "
          "starting anything, then prints every effective setting and its source as JSON. Exit "
          "0 when valid; exit 2 with one line on stderr when not.",
    flags={"rules": Flag(help="list the combination rules it enforces instead (no launch "
                              "flags with it)")},
    launch=True)


def config_help() -> str:
    """The command's own flags, then every launch flag with its expected value, default and
    meaning."""
    lines = [CONFIG.help(), "", "launch flags:"]
    docs, types = field_docs(), launch_field_types()
    for f in fields(LaunchConfig):
        if not f.init:
            continue
        default = "" if f.default is NO_DEFAULT else f" (default {show_value(f.default)})"
        lines.append(f"  --{f.name}={metavar(types[f.name])}{default}")
        if f.name in docs:
            lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)


def run_config(argv: Sequence[str]) -> int:
    args = CONFIG.parse(argv)
    if args.help:
        print(config_help())
        return 0
    if "rules" in args:
        if args.launch_argv:
            # A launch flag without its value or misspelled is named first.
            name, value = next(iter(parse_argv(args.launch_argv).items()))
            raise ConfigError("--rules", MISSING, f"expected no launch flag with it, got "
                              f"--{name}={show_value(value)} (the rules are the same for "
                              "every launch)")
        lines = [rule.describe() for rule in RULES]
        lines += [f"always -> {check.__doc__}" for check in CROSS_CHECKS]
        print("\n".join(lines))
        return 0
    effective = load_config_from_argv(args.launch_argv)
    # A launch of the built-in models is held to what they can draft, so a line that passes
    # here runs; other models are checked against themselves when the runtime starts.
    check_builtin_limits(effective.launch)
    # The saved table's contents and the fields the launch fixes; the model identities and
    # the captured geometry are compared when the runtime starts. Imported here: it loads
    # scipy, which would make every command start slower (and longer to interrupt cleanly).
    from adaspec.policies.bundles import check_saved_table

    check_saved_table(effective.launch)
    document = {"adaspec_version": __version__, **effective.as_dict()}
    print(json.dumps(document, indent=2))
    return 0


MODELS = CommandFlags(
    command="models",
    usage="[--model=BUILTIN] [--json] [--measure]",
    about="Identities, sizes and measured quality of the built-in reference models.",
    flags={"json": Flag(help="print one JSON object instead of a table"),
           "measure": Flag(help="also re-measure greedy acceptance on the packaged held-out "
                                "excerpt (a few seconds)"),
           "model": Flag(metavar="BUILTIN", help=f"which built-in target and its drafts: "
                                                 f"{' or '.join(BUILTIN_TARGETS)} (default "
                                                 f"{BUILTIN_TARGET})")})


def models_choice(args: ParsedFlags) -> tuple[str, set[str]]:
    """The ``--model`` value and the switches given; a ``--model`` that is no built-in target
    refused in one line."""
    model = args.get("model") or BUILTIN_TARGET
    if model not in BUILTIN_TARGETS:
        raise ConfigError("--model", model, f"expected one of {', '.join(BUILTIN_TARGETS)}: "
                          "adaspec models describes the built-in reference models")
    return model, {name for name, _ in args.given} - {"model"}


def run_models(argv: Sequence[str]) -> int:
    args = MODELS.parse(argv)
    if args.help:
        print(MODELS.help())
        return 0
    model, flags = models_choice(args)
    # Deferred: torch loads only for commands that need models.
    from adaspec.models.checkpoint import load_reference_models
    from adaspec.models.drafter_cost import drafter_costs
    from adaspec.models.report import format_report, measure_excerpt, models_report
    from adaspec.runtime.devices.streams import cpu_threads

    threads = cpu_threads()  # a bad ADASPEC_CPU_* setting is refused before the models load
    family = BUILTIN_TARGETS[model]
    models = load_reference_models(name=family)
    report = models_report(models)
    report["model"] = model
    # Measured as the cpu stream runs them: with its thread count, at one request.
    report["drafter_cost"] = drafter_costs(models, threads=threads)
    if "measure" in flags:
        report["measured_on_excerpt"] = measure_excerpt(models)
    print(json.dumps(report, indent=2) if "json" in flags else format_report(report))
    return 0


def run_generate(argv: Sequence[str]) -> int:
    from adaspec.runtime.generate import run_generate as generate  # deferred: loads torch

    return generate(argv)


def run_calibrate(argv: Sequence[str]) -> int:
    from adaspec.runtime.calibrate_command import run_calibrate as calibrate  # loads torch

    return calibrate(argv)


def run_bench(argv: Sequence[str]) -> int:
    from adaspec.runtime.bench_command import run_bench_command  # deferred: loads torch

    return run_bench_command(argv)


def run_simulate(argv: Sequence[str]) -> int:
    from adaspec.runtime.simulate_command import run_simulate as simulate

    return simulate(argv)


STATES = CommandFlags(
    command="states",
    usage="[--diagram]",
    about="Prints the round state graph as a mermaid stateDiagram.",
    flags={"diagram": Flag(help="the same (the diagram is the only output there is)")})


def run_states(argv: Sequence[str]) -> int:
    if STATES.parse(argv).help:
        print(STATES.help())
        return 0
    from adaspec.runtime.states import mermaid

    print(mermaid())
    return 0


def run_replay(argv: Sequence[str]) -> int:
    from adaspec.runtime.replay_command import main as replay

    return replay(list(argv))


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "config": run_config, "models": run_models, "generate": run_generate,
    "calibrate": run_calibrate, "bench": run_bench, "simulate": run_simulate, "states": run_states,
    "replay": run_replay}


def run(argv: Sequence[str]) -> int:
    """Dispatch one command line; returns the exit status."""
    if not argv or argv[0] in ("-h", "--help"):  # no command: say what there is
        print(USAGE)
        return 0
    if argv[0] == "--version":
        if len(argv) > 1:
            print(f"adaspec --version: error: argument={show_value(argv[1])}: expected "
                  "nothing after --version", file=sys.stderr)
            return 2
        print(f"adaspec {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"adaspec: error: command={show_value(argv[0])}: unknown; expected one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except AdaspecError as error:
        _say(f"adaspec {argv[0]}: error: {error}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C (SIGINT): the command has stopped what it ran
        _interrupted(f"adaspec {argv[0]}")
        return INTERRUPTED


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it."""

_process_exits_at_interrupt = False
"""Set by ``main``: the process then ends at once at the next Ctrl-C after the first (a
``run`` inside another program leaves that program's signal handling alone)."""


def _interrupted(command: str) -> None:
    if _process_exits_at_interrupt:
        _exit_at_interrupt(INTERRUPTED)
    _say(f"{command}: interrupted")


def _say(line: str) -> None:
    """One line on standard error, if there is one to take it."""
    if sys.stderr is not None:  # None: started with descriptor 2 closed
        try:
            print(line, file=sys.stderr)
        except OSError:  # a full standard error: the exit status still says it
            pass


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
        print(f"{command}: error: stdout: closed; expected an open standard output "
              "(redirect it to /dev/null to discard the output)", file=sys.stderr)
        return 2
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
        with contextlib.suppress(OSError):  # a full standard error too: the status says it
            print(f"{command}: error: stdout: cannot write the output ({reason})",
                  file=sys.stderr)
        return 2
    finally:
        sys.stdout = stdout


def main() -> None:
    global _process_exits_at_interrupt
    _process_exits_at_interrupt = True
    argv = sys.argv[1:]
    try:
        status = run_to_stdout(argv)
        # All is said; a Ctrl-C while the interpreter winds down (its threads, torch's
        # teardown) only hurries the exit, with the status already decided.
        _exit_at_interrupt(status)
    except KeyboardInterrupt:  # outside the command: while its output was flushed
        status = INTERRUPTED
        _interrupted(_command(argv))
    sys.exit(status)


def _exit_at_interrupt(status: int) -> None:
    signal.signal(signal.SIGINT, lambda number, frame: os._exit(status))


if __name__ == "__main__":
    main()
