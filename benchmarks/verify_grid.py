"""Verify time of the reference target with its attention grid sized by the binding, against
the grid of the launch width.

A (Bcap, G) binding packs at most min(w + 1, G) rows per request (``grid_width``), so a round
with fewer rows than a full-width request holds (G=4 at width 5 in a shallow MTP round or a
trimmed verify budget) attends on a grid of that many columns instead of w + 1. Two arms per
shape, interleaved call by call on the same padding rows: ``binding`` (the grid the runtime
builds) and ``launch`` (w + 1 columns, what it built before). Shapes where the two grids are
equal are left out: they run the same code.

    python benchmarks/verify_grid.py [--width W] [--calls N] [--json FILE]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from adaspec.config import load_config
from adaspec.models import load_reference_models
from adaspec.models.protocols import TargetModel
from adaspec.runtime.devices.graphs import padding_rows
from adaspec.runtime.devices.packing import grid_width


def shapes(width: int) -> list[tuple[int, int]]:
    """The launch's legal (Bcap, G) shapes whose binding grid is narrower than w + 1."""
    launch = load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": width,
                          "max_seqs_per_batch": 16}).launch
    return [(num_reqs, num_rows) for num_reqs in launch.prepared_request_buckets()
            for num_rows in launch.legal_target_rows(num_reqs)
            if grid_width(width, num_rows) < width + 1]


def time_shape(target: TargetModel, num_reqs: int, num_rows: int, width: int,
               calls: int) -> dict[str, float]:
    """Median milliseconds per verify call of each arm, interleaved call by call."""
    arms = {"binding": grid_width(width, num_rows), "launch": width + 1}
    rows = {arm: padding_rows(num_reqs, num_rows, per_req, target.num_kv_slots, "cpu")
            for arm, per_req in arms.items()}
    spent: dict[str, list[float]] = {arm: [] for arm in arms}
    with torch.inference_mode():
        for _ in range(3):  # warm both shapes
            for arm in arms:
                target.verify(rows[arm])
        for call in range(calls):
            for arm in (list(arms) if call % 2 == 0 else list(arms)[::-1]):
                started = time.perf_counter()
                target.verify(rows[arm])
                spent[arm].append(time.perf_counter() - started)
    return {arm: 1000 * statistics.median(times) for arm, times in spent.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = load_reference_models().target
    target.allocate(16)
    print(f"python benchmarks/verify_grid.py --width {args.width} --calls {args.calls}")
    print(f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'Bcap':>4} {'G':>3} {'grid':>4} {'binding ms':>10} {'launch ms':>9} {'ratio':>6}")
    results = []
    for num_reqs, num_rows in shapes(args.width):
        ms = time_shape(target, num_reqs, num_rows, args.width, args.calls)
        ratio = ms["binding"] / ms["launch"]
        results.append({"num_reqs_bucket": num_reqs, "num_rows": num_rows,
                        "grid": grid_width(args.width, num_rows), **ms, "ratio": ratio})
        print(f"{num_reqs:4d} {num_rows:3d} {grid_width(args.width, num_rows):4d} "
              f"{ms['binding']:10.3f} {ms['launch']:9.3f} {ratio:6.3f}")
    if args.json:
        with open(args.json, "x") as out:
            json.dump({"width": args.width, "calls": args.calls, "shapes": results}, out,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
