"""Launch flags at the edge: ``--name=value`` / ``--name value`` tokens into typed settings.

Parsing happens once, here; everything past this module sees a validated ``LaunchConfig``.
The same coercion serves the Python API (``launch_config_from_settings``), where an engine may
pass native values or the strings it read from its own command line.
"""

import ast
import difflib
import functools
import inspect
import numbers
import textwrap
import typing
from collections.abc import Mapping, Sequence
from typing import Literal

from adaspec.config.launch import (
    BEYOND_INTEGERS,
    LaunchConfig,
    describe_type,
    integer_text,
    launch_field_types,
    most_int_digits,
)
from adaspec.errors import MISSING, ConfigError

# Names the specification retired. They are rejected, never mapped: a launch script that
# still uses them must be updated, and silently aliasing would hide that.
RETIRED_NAMES: dict[str, str] = {
    "enable_adaptive_spec_prune": "enable_adaptive_target_verify",
    "enable_adaptive_speculative_decode": "enable_adaptive_target_verify",
}



def retired_name_error(setting: str, name: str, value: object) -> ConfigError:
    """The error for a retired name, as a launch flag or as a key of a JSON file."""
    new = RETIRED_NAMES[name]
    if setting.startswith("--"):
        use = f"--{name} was renamed to --{new}; use --{new}"
    else:
        use = (f"{name} was renamed to {new}, which is a launch flag (--{new}=true), not a "
               f"key of this file")
    return ConfigError(setting, value, f"{use} (the old name is not accepted as an alias)",
                       rule="Adaptive target verification (DSpark): the retired names were "
                            "replaced, not aliased")


def _unknown_flag(name: str, value: object, command: str = "config") -> ConfigError:
    if name in RETIRED_NAMES:
        return retired_name_error(f"--{name}", name, value)
    if name.startswith("-") and name.lstrip("-") in launch_field_types():
        # load_config({"--port": 1}): a setting's name is the flag's without its dashes.
        return ConfigError(name, value, f"unknown setting; settings are named without dashes: "
                           f"{name.lstrip('-')}")
    close = difflib.get_close_matches(name, launch_field_types(), n=1)
    hint = f"did you mean --{close[0]}?" if close else f"see `adaspec {command} --help`"
    if not close and command != "config":
        hint += " (its launch flags are those of `adaspec config --help`)"
    return ConfigError(f"--{name}", value, f"unknown flag; {hint}")


def parse_argv(argv: Sequence[str], command: str = "config") -> dict[str, str]:
    """Split launch tokens into ``{name: raw value}``; every flag needs an explicit value.
    An unknown flag's error points to ``adaspec COMMAND --help``."""
    settings: dict[str, str] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError("argument", token, "expected --name=value or --name value")
        name, sep, value = token[2:].partition("=")
        given: object = value
        if not sep:
            following = argv[index + 1] if index + 1 < len(argv) else "--"
            if following.startswith("--"):
                given = MISSING
            else:
                given = following
                index += 1
        # An unknown or retired name is the more useful error even when its value is missing.
        if name not in launch_field_types():
            raise _unknown_flag(name, given, command)
        if not isinstance(given, str):
            expected = describe_type(launch_field_types()[name])
            raise ConfigError(f"--{name}", MISSING, f"missing value; expected {expected}")
        if name in settings:
            raise ConfigError(f"--{name}", given,
                              f"given twice (first as {settings[name]}); give each flag once")
        settings[name] = given
        index += 1
    return settings


def coerce(name: str, raw: object, hint: object) -> object:
    """Turn a flag's text into its typed value; non-text values pass to the type check (an
    integer of another kind, such as numpy's, as the int it equals)."""
    base = [a for a in typing.get_args(hint) if a is not type(None)]
    target = base[0] if typing.get_origin(hint) is not Literal and base else hint
    if not isinstance(raw, str):
        return _native(raw, target)
    if typing.get_origin(target) is Literal:
        # Choices are matched without case (dspark, DSpark); the canonical spelling is kept.
        for choice in typing.get_args(target):
            if raw.lower() == str(choice).lower():
                return choice
    elif target is bool and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    elif target is int and (number := integer_text(raw)) is not None:
        if abs(number) == BEYOND_INTEGERS:  # shown in an error, it could not be printed
            raise ConfigError(f"--{name}", raw, f"expected an integer of at most "
                              f"{most_int_digits()} digits")
        return number  # the setting's own range names what it takes
    elif target is str and raw.strip():
        return raw
    expected = describe_type(hint)
    if target is str:
        expected = "a non-empty value"
    raise ConfigError(f"--{name}", raw, f"expected {expected}")


def _native(raw: object, target: object) -> object:
    """A value given natively: an integer of another kind (numpy's) as the int it equals;
    anything else as given, for the type check."""
    if target is int and not isinstance(raw, bool) and isinstance(raw, numbers.Integral):
        return int(raw)
    return raw


def launch_config_from_settings(settings: Mapping[str, object]) -> LaunchConfig:
    """Build a ``LaunchConfig`` from flag names to values (text or native)."""
    types = launch_field_types()
    values: dict[str, object] = {}
    for name, raw in settings.items():
        if name not in types:
            raise _unknown_flag(name, raw)
        values[name] = coerce(name, raw, types[name])
    return LaunchConfig(**values)  # type: ignore[arg-type]


@functools.cache
def field_docs() -> dict[str, str]:
    """Each launch field's docstring (the string under it), read from the source once."""
    try:
        source = textwrap.dedent(inspect.getsource(LaunchConfig))
    except (OSError, TypeError):  # no source shipped (zipapp, frozen build)
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, following in zip(body.body, body.body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs
