"""Splitting a command line into the command's own flags and the launch flags around them,
and what every command that runs models refuses before it loads them.

Kept free of torch: ``adaspec config`` and ``adaspec models --help`` import this module.
"""

import difflib
from collections.abc import Collection, Mapping, Sequence

from adaspec.config.builtin import check_builtin_limits
from adaspec.config.launch import LaunchConfig, launch_field_types
from adaspec.errors import MISSING, ConfigError
from adaspec.runtime.devices.availability import require_device

Flags = Mapping[str, tuple[str, str]]
"""A command's flags: name -> (metavar, help); an empty metavar marks a switch."""


def flag_lines(flags: Flags) -> list[str]:
    """The flags section of a command's help."""
    lines = ["flags:"]
    for name, (metavar, text) in flags.items():
        value = f"={metavar}" if metavar else ""
        lines.append(f"  --{name}{value}".ljust(26) + text)
    return lines


def take_flags(argv: Sequence[str], flags: Flags, switches: Collection[str]
               ) -> tuple[list[tuple[str, str]], list[str]]:
    """``(name, value)`` of the command's flags in order (a switch's value is empty), and the
    remaining tokens, which are launch flags."""
    own: list[tuple[str, str]] = []
    launch: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        name, has_value, value = token[2:].partition("=") if token.startswith("--") \
            else ("", "", "")
        index += 1
        if name not in flags:
            _check_not_misspelled(name, value if has_value else MISSING, flags)
            launch.append(token)
            continue
        if name in switches:
            if has_value:
                raise ConfigError(f"--{name}", value, "takes no value")
            own.append((name, ""))
            continue
        if not has_value:
            if index >= len(argv) or _is_flag(argv[index], flags):
                # The next flag is not this one's value: taking it would blame the wrong flag.
                raise ConfigError(f"--{name}", MISSING, f"expected a value ({name} "
                                  f"{flags[name][0]}; --{name}=VALUE for a value that "
                                  "starts with --)")
            value, index = argv[index], index + 1
        own.append((name, value))
    return own, launch


def _is_flag(token: str, flags: Flags) -> bool:
    """Whether ``token`` names one of the command's flags or a launch flag."""
    if not token.startswith("--"):
        return False
    name = token[2:].partition("=")[0]
    return name in flags or name in launch_field_types()


def _check_not_misspelled(name: str, value: object, flags: Flags) -> None:
    """Refuse a name that is no launch flag but close to one of the command's own flags (the
    launch parser would only suggest launch flags)."""
    if not name or name in launch_field_types():
        return
    close = difflib.get_close_matches(name, [*flags, *launch_field_types()], n=1)
    if close and close[0] in flags:
        raise ConfigError(f"--{name}", value, f"unknown flag; did you mean --{close[0]}?")


def check_runnable_here(launch: LaunchConfig) -> None:
    """Refuse, before any model loads, a launch the built-in models cannot draft or whose
    device this process cannot use (``--device=npu`` without torch_npu, say)."""
    check_builtin_limits(launch)
    require_device(launch.device)
