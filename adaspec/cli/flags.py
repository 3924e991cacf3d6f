"""Every command's flags, declared once (``CommandFlags``): parsed, refused and described in
the command's help from the same declaration; and what every command that runs models refuses
before it loads them.

One parser for every command, so that every command line fails the same way: a flag without
its value is named itself (the next flag is never taken as its value), a misspelled flag gets
"did you mean", a flag given twice is refused unless it is declared repeatable, ``--help`` or
``-h`` anywhere prints the command's help. A command that takes launch flags passes every
token it does not declare to the launch parser (``adaspec.config.flags.parse_argv``); any other
command refuses it.

Kept free of torch: ``adaspec config`` and ``adaspec models --help`` import this module.
"""

import difflib
import math
import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from adaspec.availability import require_device
from adaspec.config.builtin import check_builtin_limits, check_checkpoint_launch
from adaspec.config.files import underflows
from adaspec.config.flags import parse_argv
from adaspec.config.launch import (
    LaunchConfig,
    integer_text,
    launch_field_types,
    torchrun_settings,
)
from adaspec.config.requests import SamplingParams
from adaspec.errors import MISSING, AdaspecError, ConfigError, InvalidRequest, OutputWriteError

HELP_FLAGS = ("-h", "--help")
"""Anywhere on a command line (not as the value of ``--name=VALUE``), they ask for the help."""

_HELP_COLUMN = 26
_HELP_WIDTH = 96


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """One flag of a command."""

    help: str
    """Its line in the command's help."""
    metavar: str = ""
    """What its value is (``FILE``, ``N``); empty for a switch, which takes no value."""
    repeat: bool = False
    """May be given more than once (``simulate --policy``), every value kept in order; any
    other flag given twice is refused."""
    required: bool = False
    """Refused when absent."""


RUN_FLAGS = {
    "seed": Flag(metavar="S", help="seed of every random draw (default 0)"),
    "event_log": Flag(metavar="FILE", help="write the event log here (the file must not "
                      "exist)"),
    "trace": Flag(metavar="FILE", help="write the state trace here, in place of "
                  "ADASPEC_TRACE, which is then not read (the file must not exist)"),
}
"""The flags of every command that decodes requests (generate, serve): the seed of its random
draws and the files a run writes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Positional:
    """The one argument a command takes without a flag (``adaspec replay LOG``)."""

    metavar: str
    """Its name in the usage line and in messages (``LOG``)."""
    what: str
    """What it is, as in "expected exactly one event log path"."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedFlags:
    """A command line as its command declared it."""

    given: tuple[tuple[str, str], ...] = ()
    """``(name, value)`` of the command's own flags in command-line order; a switch's value
    is empty."""
    positional: str | None = None
    """The positional argument, for a command that declares one."""
    launch_argv: tuple[str, ...] = ()
    """The remaining tokens, launch flags, in order (for a command that takes them)."""
    help: bool = False
    """``--help`` or ``-h`` was given: nothing else was parsed."""

    def __contains__(self, name: object) -> bool:
        return any(given == name for given, _ in self.given)

    def __getitem__(self, name: str) -> str:
        """The value of a required flag (the parser refused its absence)."""
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def get(self, name: str) -> str | None:
        """The value of a flag given at most once, ``None`` when absent."""
        return next((value for given, value in self.given if given == name), None)

    def values(self, name: str) -> list[str]:
        """Every value of a repeatable flag, in order."""
        return [value for given, value in self.given if given == name]


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandFlags:
    """A command's flags, its positional argument and whether it takes launch flags."""

    command: str
    """The command's name (``simulate``), in messages and in the usage line."""
    usage: str
    """The usage after ``adaspec COMMAND``; a newline continues it on the next line."""
    about: str
    """What the command does: the help's text, paragraphs separated by a blank line (each is
    wrapped)."""
    flags: Mapping[str, Flag]
    """Name (without ``--``) -> its declaration, in the help's order."""
    positional: Positional | None = None
    launch: bool = False
    """Whether a flag the command does not declare is a launch flag, passed on in
    ``launch_argv`` (generate, calibrate, bench, config), rather than refused."""

    def usage_line(self) -> str:
        """``usage: adaspec COMMAND ...``, the usage's further lines under its first."""
        head = f"usage: adaspec {self.command} "
        return head + self.usage.replace("\n", "\n" + " " * len(head))

    def usage_text(self) -> str:
        """The usage on one line, as a message quotes it."""
        return f"adaspec {self.command} {' '.join(self.usage.split())}"

    def help(self) -> str:
        """The command's help: usage, what it does and every declared flag."""
        about = [textwrap.fill(paragraph, _HELP_WIDTH - 8, break_on_hyphens=False)
                 for paragraph in self.about.split("\n\n")]
        lines = [self.usage_line(), "", "\n\n".join(about), "", *flag_lines(self.flags)]
        lines.append("  -h, --help".ljust(_HELP_COLUMN) + "print this help")
        return "\n".join(lines)

    def parse(self, argv: Sequence[str]) -> ParsedFlags:
        """The command line as declared; a ``ConfigError`` naming the flag at fault for the
        first thing, left to right, that is not."""
        if any(token in HELP_FLAGS for token in argv):
            return ParsedFlags(help=True)
        parsed = _Scan(self, argv).run()
        for name, flag in self.flags.items():
            if flag.required and name not in parsed:
                raise ConfigError(f"--{name}", MISSING, f"required; give --{name} "
                                  f"{flag.metavar} (adaspec {self.command} --help shows "
                                  "every flag)")
        return parsed

    def expected(self) -> str:
        """The command's flags, as a message lists them."""
        *others, last = (f"--{name}" for name in self.flags)
        return f"{', '.join(others)} or {last}" if others else last


class _Scan:
    """One left-to-right pass over a command line."""

    def __init__(self, command: CommandFlags, argv: Sequence[str]) -> None:
        self.command = command
        self.argv = argv
        self.index = 0
        self.given: list[tuple[str, str]] = []
        self.positionals: list[str] = []
        self.launch: list[str] = []

    def run(self) -> ParsedFlags:
        while self.index < len(self.argv):
            token = self.argv[self.index]
            self.index += 1
            name, has_value, value = token[2:].partition("=") if token.startswith("--") \
                else ("", "", "")
            flag = self.command.flags.get(name)
            if flag is None:
                self._other(token, name, value if has_value else MISSING)
            elif not flag.metavar:
                if has_value:
                    raise ConfigError(f"--{name}", value, "takes no value")
                self._take(name, "", flag)
            elif has_value and not value:  # "--name=": no flag takes nothing for a value
                raise ConfigError(f"--{name}", value, f"expected a value (--{name}="
                                  f"{flag.metavar})")
            else:
                self._take(name, value if has_value else self._value_of(name, flag), flag)
        return ParsedFlags(given=tuple(self.given), positional=self._positional(),
                           launch_argv=tuple(self.launch))

    def _value_of(self, name: str, flag: Flag) -> str:
        """The next token, which must not look like a flag: taking one would blame the wrong
        flag (``--workload --policy x``), so such a value is given as ``--name=VALUE``."""
        if self.index >= len(self.argv) or self.argv[self.index].startswith("--"):
            raise ConfigError(f"--{name}", MISSING, f"expected a value (--{name} "
                              f"{flag.metavar}, or --{name}={flag.metavar} for a value that "
                              "starts with --)")
        self.index += 1
        value = self.argv[self.index - 1]
        if not value:  # --name "" means nothing, as --name= does
            raise ConfigError(f"--{name}", value, f"expected a value (--{name} {flag.metavar})")
        return value

    def _take(self, name: str, value: str, flag: Flag) -> None:
        first = next((v for given, v in self.given if given == name), None)
        if first is not None and not flag.repeat:
            was = f" (first as {first})" if value else ""
            raise ConfigError(f"--{name}", value or MISSING,
                              f"given twice{was}; give each flag once")
        self.given.append((name, value))

    def _other(self, token: str, name: str, value: object) -> None:
        """A token that is none of the command's flags: a launch flag, the positional
        argument, or refused."""
        if token.startswith("-") and token != "-":
            _check_not_misspelled(token, value, self.command)
            if not self.command.launch:
                shown = f"--{name}" if token.startswith("--") else token
                raise ConfigError(shown, value, f"unknown flag; expected "
                                  f"{self.command.expected()}")
        if self.command.launch:
            self.launch.append(token)
        elif self.command.positional is not None:
            self.positionals.append(token)
        else:
            raise ConfigError("argument", token, f"expected a flag: {self.command.expected()}"
                              f"{self._after_switch()}")

    def _after_switch(self) -> str:
        """Why a bare word after a switch is not its value."""
        previous = self.argv[self.index - 2] if self.index >= 2 else ""
        name = previous[2:] if previous.startswith("--") else ""
        flag = self.command.flags.get(name)
        return f" (--{name} takes no value)" if flag is not None and not flag.metavar else ""

    def _positional(self) -> str | None:
        positional = self.command.positional
        if positional is None:
            return None
        if len(self.positionals) != 1:
            given = " ".join(self.positionals) if self.positionals else MISSING
            raise ConfigError(positional.metavar, given, f"expected exactly one "
                              f"{positional.what}; usage: {self.command.usage_text()}")
        return self.positionals[0]


def _check_not_misspelled(token: str, value: object, command: CommandFlags) -> None:
    """Refuse a flag that is no launch flag but close to one of the command's own flags (the
    launch parser would only suggest launch flags); ``-json`` for ``--json`` too."""
    name = token.lstrip("-").partition("=")[0] if token.startswith("--") else token.lstrip("-")
    if not name or (command.launch and token.startswith("--") and name in launch_field_types()):
        return
    candidates = [*command.flags, *launch_field_types()] if command.launch else [*command.flags]
    close = difflib.get_close_matches(name, candidates, n=1)
    if close and close[0] in command.flags:
        shown = f"--{name}" if token.startswith("--") else token
        raise ConfigError(shown, value, f"unknown flag; did you mean --{close[0]}?")


def flag_lines(flags: Mapping[str, Flag]) -> list[str]:
    """The flags section of a command's help, each flag's text wrapped in its column."""
    lines = ["flags:"]
    for name, declared in flags.items():
        metavar = declared.metavar
        text = f"{declared.help} (required)" if declared.required else declared.help
        value = f"={metavar}" if metavar else ""
        head = f"  --{name}{value}"
        wrapped = textwrap.wrap(text, _HELP_WIDTH - _HELP_COLUMN, break_on_hyphens=False,
                                break_long_words=False) or [""]
        if len(head) >= _HELP_COLUMN:  # a long name gets its text on the lines below
            lines.append(head)
        else:
            lines.append(head.ljust(_HELP_COLUMN) + wrapped.pop(0))
        lines += [" " * _HELP_COLUMN + line for line in wrapped]
    return lines


DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", re.ASCII)
"""A number as a user writes one: no nan, inf, hex or digit separators (float() takes them)."""


def sampling_flag(name: str, raw: str) -> int | float:
    """The value of the sampling flag ``--name`` (temperature, top_k, top_p, min_p), held to
    the rule the request field of that name follows (``SamplingParams``); refused naming the
    flag."""
    text = raw.strip()
    value: int | float | None = None
    if name == "top_k":
        value = integer_text(text)
    elif DECIMAL.fullmatch(text) and math.isfinite(float(text)):
        value = float(text)  # 1e999 reads as inf: refused with the other non-numbers
        if underflows(text, value):  # a tiny number was asked for, not greedy decoding
            raise ConfigError(f"--{name}", raw, "a nonzero number below the smallest double; "
                              f"{_field_range(name, math.nan)}")
    # Text that is no finite number is refused with the field's range: NaN stands for it, as
    # the text itself would be called "not a str".
    refused = _field_range(name, math.nan if value is None else value)
    if refused:
        raise ConfigError(f"--{name}", raw, refused)
    assert value is not None
    return value


def _field_range(name: str, value: float) -> str:
    """What the request field ``name`` expects, when it refuses ``value`` (else "")."""
    try:
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    except InvalidRequest as error:
        return error.expected
    return ""


def check_runnable_here(launch: LaunchConfig) -> None:
    """Refuse, before any model loads, a launch the built-in models cannot draft or whose
    device this process cannot use (``--device=npu`` without torch_npu, say)."""
    check_builtin_limits(launch)
    check_checkpoint_launch(launch)
    require_device(launch.device)


def output_named_by_flag(error: AdaspecError, flag: str | None = None) -> AdaspecError:
    """An output the runtime could not write, named by the flag that gave its path. The
    runtime names its ``RuntimeOptions`` field (``event_log``, ``trace``), which the generate
    and serve flags of the same name set; ``flag`` names another (bench's
    ``--event_log_dir``). ``ADASPEC_TRACE``, and any other error, keep their own names."""
    if not isinstance(error, OutputWriteError) or error.setting not in ("event_log", "trace"):
        return error
    return OutputWriteError(flag or f"--{error.setting}", error.path, error.what,
                            error.reason)


def launch_settings(launch_argv: Sequence[str], command: str) -> dict[str, str]:
    """``command``'s launch flags, with torchrun's rank and rendezvous when it started this
    process (``adaspec.config.launch.torchrun_settings``)."""
    return torchrun_settings(parse_argv(launch_argv, command), os.environ)
