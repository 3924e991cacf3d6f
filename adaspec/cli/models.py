"""``adaspec models``: identities, sizes and measured quality of the built-in models."""

import json
from collections.abc import Sequence

from adaspec.cli.flags import CommandFlags, Flag, ParsedFlags
from adaspec.config.limits import BUILTIN_TARGET, BUILTIN_TARGETS
from adaspec.errors import ConfigError

MODELS = CommandFlags(
    command="models",
    usage="[--model=BUILTIN] [--json] [--measure]",
    about="Identities, sizes and measured quality of the built-in reference models.",
    flags={"json": Flag(help="print one JSON object instead of a table"),
           "measure": Flag(help="also re-measure greedy acceptance on the packaged held-out "
                                "excerpt (seconds for the small target, minutes for "
                                "builtin:target-large on a small CPU)"),
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


def run(argv: Sequence[str]) -> int:
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
