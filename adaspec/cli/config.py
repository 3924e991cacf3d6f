"""``adaspec config``: check a launch line and print its effective configuration."""

import json
from collections.abc import Sequence
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import fields

from adaspec import __version__
from adaspec.cli.flags import CommandFlags, Flag, launch_settings
from adaspec.config import RULES, LaunchConfig, load_config
from adaspec.config.builtin import (
    builtin_checkpoints,
    check_builtin_limits,
    check_checkpoint_folders,
    check_checkpoint_launch,
)
from adaspec.config.environment import check_environment
from adaspec.config.flags import field_docs, parse_argv
from adaspec.config.launch import launch_field_types, metavar
from adaspec.config.rules import CROSS_CHECKS
from adaspec.errors import MISSING, ConfigError, show_value

CONFIG = CommandFlags(
    command="config",
    usage="[--name=value | --name value] ... | --rules",
    about="Checks the launch line (flags, combination rules, JSON files it names) without "
          "starting anything (the ADASPEC_* environment variables too), then prints every "
          "effective setting and its source as JSON. Exit "
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


def run(argv: Sequence[str]) -> int:
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
    effective = load_config(launch_settings(args.launch_argv, "config"))
    # A launch of the built-in models is held to what they can draft, and one of checkpoint
    # directories to what a checkpoint can run, so a line that passes here runs; the
    # checkpoints themselves are checked when they load.
    check_builtin_limits(effective.launch)
    check_checkpoint_launch(effective.launch)
    check_checkpoint_folders(effective.launch)
    check_environment(effective.launch)  # the ADASPEC_* variables the start reads
    # The saved table's contents and the fields the launch fixes, and the calibration the
    # start would run; a checkpoint's identity and context limit are known once it loads.
    # Imported here: they load scipy, which would make every command start slower (and
    # longer to interrupt cleanly).
    from adaspec.policies.bundles import check_saved_table
    from adaspec.runtime.plans import check_calibration

    check_saved_table(effective.launch)
    known = builtin_checkpoints(effective.launch)
    check_calibration(effective, None if known is None else known[1])
    document = {"adaspec_version": __version__, **effective.as_dict()}
    print(json.dumps(document, indent=2))
    return 0
