"""``adaspec calibrate``: measure and fit the costs of adaptive target verify, save the bundle.

    adaspec calibrate [LAUNCH FLAGS] --adaptive_target_verify_cost_table_output=FILE [--json]

It starts the runtime exactly as a serving launch with the same flags would (warmup, then
calibration on the real pipeline), writes the bundle, and stops; a later launch reuses it
with ``--adaptive_target_verify_cost_table=FILE``. Progress goes to stderr: a bar on a
terminal, one JSON line per window otherwise; the effective configuration is logged there
too. The summary (or ``--json``) goes to stdout.
"""

import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from adaspec.cli import interrupts
from adaspec.cli.flags import CommandFlags, Flag, check_runnable_here, launch_settings
from adaspec.config import load_config
from adaspec.errors import MISSING, ConfigError
from adaspec.models.launch import checkpoint_models
from adaspec.policies.bundles import CostBundle
from adaspec.policies.costs import AdditiveTable, relative_errors
from adaspec.runtime.calibration import PointMeasured, Progress
from adaspec.runtime.engine import Runtime, RuntimeOptions, rank_device

BAR_WIDTH = 30


CALIBRATE = CommandFlags(
    command="calibrate",
    usage="[LAUNCH FLAGS] --adaptive_target_verify_cost_table_output=FILE [--json]",
    about="Calibrates the full-step costs of adaptive target verify on the built-in reference "
          "models (or the checkpoint directories of --model and --draft_model) exactly as a "
          "serving launch with these flags would, saves the bundle to FILE (which must not "
          "exist), and prints a summary. Launch flags are those of `adaspec config --help`; "
          "--enable_adaptive_target_verify=true is required, and "
          "--adaptive_target_verify_calibration=JSON restricts the grid.",
    flags={"json": Flag(help="print one JSON object instead of text")},
    launch=True)


class ProgressStream:
    """Where progress goes: ``stream`` while it takes it. A closed or full standard error,
    or one whose reader went away, drops the progress, never the run (the run's outputs and
    its exit status say how it went)."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream  # None: started with descriptor 2 closed

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def write(self, text: str) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except OSError:
            self._stream = None


def progress_reporter(stream: TextIO | None) -> Progress:
    """A bar when ``stream`` is a terminal, one JSON line per window otherwise."""
    progress = ProgressStream(stream)
    if progress.isatty():
        def bar(measured: PointMeasured) -> None:
            filled = BAR_WIDTH * measured.done // measured.total
            done = "\n" if measured.done == measured.total else ""
            progress.write(f"\rcalibrating [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                           f"{measured.done}/{measured.total} windows  "
                           f"Bcap={measured.num_reqs_bucket} d={measured.depth} "
                           f"G={measured.num_rows} "
                           f"{1000 * measured.seconds:.2f} ms  {done}")
        return bar

    def line(measured: PointMeasured) -> None:
        progress.write(measured.log_line() + "\n")
    return line


def summary(bundle: CostBundle, output: str, seconds: float) -> dict[str, Any]:
    """What the run measured and fitted, JSON-ready."""
    profiles = []
    for profile in bundle.profiles:
        errors = sorted(relative_errors(profile.table, profile.samples))
        entry: dict[str, Any] = {
            "context": profile.context.as_dict(), "model": profile.table.kind,
            "points": len({(s.num_reqs_bucket, s.num_rows) for s in profile.samples}),
            "windows": len(profile.samples),
            "fit_median_relative_error": round(errors[len(errors) // 2], 4),
            "cost_ms": {f"{b},{g}": round(profile.table.cost_ms(b, g), 4)
                        for b, g in sorted({(s.num_reqs_bucket, s.num_rows)
                                            for s in profile.samples})}}
        if isinstance(profile.table, AdditiveTable):
            entry["residual_rms_ms"] = round(1000 * profile.table.residual_rms, 4)
        profiles.append(entry)
    return {"output": output, "source": bundle.source, "seconds": round(seconds, 2),
            "profiles": profiles}


def run(argv: Sequence[str]) -> int:
    args = CALIBRATE.parse(argv)
    if args.help:
        print(CALIBRATE.help())
        return 0
    config = load_config(launch_settings(args.launch_argv, "calibrate"))
    launch = config.launch
    # Before the checks of this command: a device this process cannot use is the first thing
    # to say about the launch.
    check_runnable_here(launch)
    if not launch.enable_adaptive_target_verify:
        raise ConfigError("--enable_adaptive_target_verify", launch.enable_adaptive_target_verify,
                          "expected true: adaspec calibrate measures the costs of adaptive "
                          "target verify")
    output = launch.adaptive_target_verify_cost_table_output
    if output is None:
        raise ConfigError("--adaptive_target_verify_cost_table_output", MISSING,
                          "required: adaspec calibrate saves the bundle there (a new file)")
    # load_config checked the path already (adaspec.config.paths.new_file), before any
    # calibration.
    models = checkpoint_models(launch, rank_device(launch))
    runtime = Runtime(config, models=models, options=RuntimeOptions(
        calibration_progress=progress_reporter(sys.stderr)))
    interrupts.tell_saved_table(lambda: runtime.saved_cost_table)
    started = time.perf_counter()
    with _logging_to(sys.stderr):
        interrupts.run(_start_and_stop(runtime))
    assert runtime.costs is not None
    if not runtime.is_front:  # rank 0 fitted and saved the table every rank installed
        print(f"rank {runtime.rank}: installed rank 0's cost table (rank 0 saved {output})")
        return 0
    report = summary(runtime.costs, output, time.perf_counter() - started)
    if "json" in args:
        print(json.dumps(report, indent=2))
    else:
        print(f"calibrated in {report['seconds']} s; saved {output}")
        for profile in report["profiles"]:
            context = profile["context"]
            print(f"KV {context['min_kv_length']}..{context['max_kv_length']}: "
                  f"{profile['model']} fit of {profile['points']} points "
                  f"({profile['windows']} windows), median fit error "
                  f"{100 * profile['fit_median_relative_error']:.1f} %")
            for shape, cost in profile["cost_ms"].items():
                print(f"  Bcap,G={shape}: {cost:.3f} ms")
    sys.stdout.flush()
    return 0


async def _start_and_stop(runtime: Runtime) -> None:
    await runtime.start()
    await runtime.stop()


@contextmanager
def _logging_to(stream: TextIO) -> Iterator[None]:
    """The effective configuration line on stderr while the command runs (an embedding
    process configures its own logging; the command leaves the logger as it found it)."""
    logger = logging.getLogger("adaspec")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
