"""Startup calibration on the reference models: how long it takes, and how well the fitted
table predicts points it was not fitted to.

    python benchmarks/calibration.py [--max_seqs_per_batch 16] [--skip_timing]

1. **Time**: ``Runtime.start`` of an adaptive-target-verify launch with the built-in
   calibration defaults, and with a reduced JSON grid (buckets 1 and 4), side by side.
2. **Held-out points** (leave one out): on the default grid's measurements, each point whose
   bucket and G stay in the grid without it is dropped, the table refitted without it, and its
   predicted cost compared with its measured median window.
3. **Fresh measurements**: a second, independent calibration (new requests, minutes later)
   compared with the first table's predictions, as measured and after removing the common
   speed factor of the machine between the two runs.

Errors are ``|predicted - measured| / measured``; the figure is their median.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adaspec.config import load_config
from adaspec.models import load_reference_models
from adaspec.policies.costs import CostSample, fit_additive, grid_components, point_medians
from adaspec.runtime.engine import Runtime, RuntimeOptions

LAUNCH = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
          "enable_adaptive_target_verify": True}


def quiet(_: object) -> None:
    """Progress is not printed: the benchmark prints its own figures."""


async def started(flags: dict[str, object]) -> tuple[Runtime, float]:
    runtime = Runtime(load_config(flags), models=load_reference_models(),
                      options=RuntimeOptions(calibration_progress=quiet))
    begin = time.perf_counter()
    await runtime.start()
    return runtime, time.perf_counter() - begin


def leave_one_out(samples: list[CostSample]) -> list[tuple[tuple[int, int], float, float]]:
    """(point, predicted, measured median) for every point the grid can spare."""
    medians = point_medians(samples)
    out = []
    for held in medians:
        point = (held.num_reqs_bucket, held.num_rows)
        rest = [s for s in samples if (s.num_reqs_bucket, s.num_rows) != point]
        rest_points = {(s.num_reqs_bucket, s.num_rows) for s in rest}
        if (point[0] not in {b for b, _ in rest_points}
                or point[1] not in {g for _, g in rest_points}
                or grid_components(sorted(rest_points)) > 1):
            continue  # its own terms would be unknown: nothing to predict from
        table = fit_additive(rest)
        out.append((point, table.seconds(*point), held.seconds))
    return out


def median_error(rows: list[tuple[tuple[int, int], float, float]]) -> float:
    return statistics.median(abs(p - m) / m for _, p, m in rows)


async def main(args: argparse.Namespace) -> dict[str, object]:
    base = LAUNCH | {"max_seqs_per_batch": args.max_seqs_per_batch}
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as folder:
        reduced = Path(folder, "reduced.json")
        reduced.write_text(json.dumps({"request_buckets": [1, 4]}))
        runtime, default_seconds = await started(base)
        await runtime.stop()
        first = runtime.costs
        assert first is not None
        if not args.skip_timing:
            small, reduced_seconds = await started(
                base | {"adaptive_target_verify_calibration": str(reduced)})
            await small.stop()
            assert small.costs is not None
            report["start_seconds"] = {
                "defaults": round(default_seconds, 1), "reduced_grid": round(reduced_seconds, 1),
                "defaults_points": len(first.settings["points"]),  # type: ignore[arg-type]
                "reduced_points": len(small.costs.settings["points"]),  # type: ignore[arg-type]
                "reduced/defaults": round(reduced_seconds / default_seconds, 3)}
        again, _ = await started(base)
        await again.stop()
        assert again.costs is not None
    samples = list(first.profiles[0].samples)
    held = leave_one_out(samples)
    table = first.profiles[0].table
    fresh = [((s.num_reqs_bucket, s.num_rows), table.cost_ms(s.num_reqs_bucket, s.num_rows)
              / 1000, s.seconds) for s in point_medians(list(again.costs.profiles[0].samples))]
    report["held_out"] = {"points": len(held), "median_error": round(median_error(held), 4),
                          "max_error": round(max(abs(p - m) / m for _, p, m in held), 4)}
    # A shared machine runs at different speeds minutes apart; a common factor moves every
    # cost alike and changes no decision (they compare tiers of one table), so the error
    # left after removing it is the table's shape error.
    speed = statistics.median(m / p for _, p, m in fresh)
    rescaled = [(point, p * speed, m) for point, p, m in fresh]
    report["fresh_pass"] = {"points": len(fresh), "median_error": round(median_error(fresh), 4),
                            "max_error": round(max(abs(p - m) / m for _, p, m in fresh), 4),
                            "measured/predicted (median)": round(speed, 3),
                            "median_error_after_that_factor": round(median_error(rescaled), 4)}
    report["points"] = [{"Bcap": b, "G": g, "predicted_ms": round(1000 * p, 3),
                         "measured_ms": round(1000 * m, 3)} for (b, g), p, m in held]
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_seqs_per_batch", type=int, default=16)
    parser.add_argument("--skip_timing", action="store_true",
                        help="skip the reduced-grid start (accuracy figures only)")
    result = asyncio.run(main(parser.parse_args()))
    json.dump(result, sys.stdout, indent=2)
    print()
