"""How well the draft-step calibration prices depths against the rounds a bench served.

    adaspec bench --speculative_algorithm=MTP --num_speculative_tokens=5 \\
        --enable_adaptive_draft_step=true --concurrency=1,16 \\
        --arms=fixed:1,fixed:2,fixed:3,fixed:4,fixed:5,adaptive-depth --passes=3 \\
        --event_log_dir=DIR
    python benchmarks/depth_costs.py DIR [DIR ...] [--json]

(every fixed width of the launch is needed). Served: the
median time between the retirements of consecutive rounds that ran the same depth on a full
bucket, from each ``fixed-K.jsonl``. Priced: the calibration windows recorded in the header of
``adaptive-depth.jsonl``, fitted twice, with the additive model in seconds (one depth term
shared by every bucket) and in log seconds (a depth scales its bucket's cost, what the
runtime installs). The depth policy compares depths of one bucket, so the figures are each
depth's cost over depth 1's, and the error is ``|priced ratio / served ratio - 1|``.
"""

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from adaspec.policies.costs import (
    AdditiveTable,
    CostSample,
    LogAdditiveTable,
    fit_additive,
    fit_log_additive,
)
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import recorded_costs
from adaspec.runtime.events.types import DepthDecided, RoundRetired


def served_seconds(path: Path) -> dict[tuple[int, int], float]:
    """(Bcap, d) -> median retirement interval of consecutive full-bucket rounds at d."""
    _, events = read_event_log(path)
    shape: dict[int, tuple[int, int] | None] = {}
    retired: dict[int, float] = {}
    for event in events:
        if isinstance(event, DepthDecided):
            full = event.context.num_reqs == event.context.num_reqs_bucket
            shape[event.round] = (event.context.num_reqs_bucket, event.depth) if full else None
        elif isinstance(event, RoundRetired):
            retired[event.round] = event.time
    gaps: dict[tuple[int, int], list[float]] = defaultdict(list)
    for number, time in retired.items():
        point = shape.get(number)
        if point is not None and number + 1 in retired and point == shape.get(number + 1):
            gaps[point].append(retired[number + 1] - time)
    return {point: statistics.median(times) for point, times in gaps.items()}


def calibration_samples(path: Path) -> list[CostSample]:
    """The draft-step calibration windows of the bundle the run installed."""
    header, _ = read_event_log(path)
    costs = recorded_costs(header)
    if costs is None:
        raise SystemExit(f"{path}: the run installed no cost table")
    return list(next(p for p in costs.profiles if p.over == "depth").samples)


def compare(folder: Path) -> dict[str, object]:
    served: dict[tuple[int, int], float] = {}
    for log in sorted(folder.glob("fixed-*.jsonl")):
        served |= served_seconds(log)
    samples = calibration_samples(folder / "adaptive-depth.jsonl")
    fits: dict[str, AdditiveTable | LogAdditiveTable] = {
        "seconds": fit_additive(samples, level=False), "log": fit_log_additive(samples)}
    buckets = sorted({b for b, _ in served})
    depths = sorted({d for _, d in served})
    rows: list[dict[str, object]] = []
    errors: dict[str, list[float]] = {name: [] for name in fits}
    for bucket in buckets:
        if (bucket, depths[0]) not in served:
            continue
        base = served[(bucket, depths[0])]
        measured = [served[(bucket, d)] / base for d in depths if (bucket, d) in served]
        row: dict[str, object] = {"Bcap": bucket, "depth_1_served_ms": round(1000 * base, 2),
                                  "served": [round(r, 3) for r in measured]}
        for name, table in fits.items():
            priced = [table.seconds(bucket, d) / table.seconds(bucket, depths[0])
                      for d in depths]
            row[name] = [round(r, 3) for r in priced]
            errors[name] += [abs(p / m - 1) for p, m in zip(priced[1:], measured[1:],
                                                            strict=False)]
        rows.append(row)
    return {"folder": str(folder), "depths": depths, "buckets": rows,
            "median_error": {name: round(statistics.median(e), 4)
                             for name, e in errors.items() if e}}


def show(report: dict[str, object]) -> None:
    print(f"{report['folder']}: each depth's cost over depth 1's, depths {report['depths']}")
    for row in report["buckets"]:  # type: ignore[attr-defined]
        print(f"  Bcap {row['Bcap']:2d} (served depth 1: {row['depth_1_served_ms']} ms)")
        for name in ("served", "seconds", "log"):
            print(f"    {name:8s} " + " ".join(f"{v:5.2f}" for v in row[name]))
    print("  median error of the priced ratios: " + ", ".join(
        f"{name} {100 * e:.1f} %" for name, e in report["median_error"].items()))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path,
                        help="event-log folders of MTP benches (fixed arms and adaptive-depth)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reports = [compare(folder) for folder in args.folders]
    if args.json:
        json.dump(reports, sys.stdout, indent=2)
        print()
        return
    for report in reports:
        show(report)


if __name__ == "__main__":
    main()
