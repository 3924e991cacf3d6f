"""How much adaptive target verify can win over the best fixed width, as a function of what
verified rows cost: the recorded feedback of a real run, priced by its calibrated table and by
tables whose row term is scaled.

A round of request bucket Bcap verifying G rows costs ``fixed(Bcap) + b * G``; ``r`` is the
share of Bcap rows in the round that verifies exactly one row a request,
``r = b * Bcap / (fixed(Bcap) + b * Bcap)``, read at the largest calibrated bucket. On an
accelerator at high load r is large (every row's multiply-adds count); where per-request work
dominates (KV reads, drafting, host), r is near 0 and verifying every drafted token is right.
The first line prices the run with the calibrated table itself and prints its r; each further
line keeps the table's fixed part and replaces its row term with the ``b * G`` that gives
that r.

    python benchmarks/row_costs.py --workload LOG.jsonl --cost_table TABLE.json
                                   [--ratios 0.05,0.1,0.2,0.3,0.5]

LOG.jsonl: an event log of a fixed-width DSpark run at the largest width (every drafted token
verified, so nothing is censored), e.g. ``adaspec bench --arms=fixed:5 --event_log_dir DIR``;
TABLE.json: a bundle saved by ``adaspec calibrate`` for the same launch.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from adaspec.cli.simulate import read_workload
from adaspec.policies.bundles import CostBundle, CostProfile, load_bundle
from adaspec.policies.costs import AdditiveTable
from adaspec.policies.simulate import Workload, simulate


def measured_ratio(table: AdditiveTable, width: int) -> float:
    """r of a table at its largest bucket: the mean cost of a row between G = Bcap and
    G = Bcap * (w + 1), times Bcap, over the cost at G = Bcap."""
    bucket = table.buckets[-1]
    full = min(bucket * (width + 1), table.rows[-1])
    low, high = table.cost_ms(bucket, bucket), table.cost_ms(bucket, full)
    return (high - low) / (full - bucket) * bucket / low


def scaled(table: AdditiveTable, ratio: float) -> AdditiveTable:
    """The table with its row term replaced by ``b * G``, b giving ``ratio`` at the largest
    bucket (``measured_ratio`` of the result); the fixed part (bias and bucket terms) is
    kept."""
    if not 0 <= ratio < 1:
        raise SystemExit(f"row_costs: --ratios: {ratio} is not in 0..1 (1 excluded)")
    fixed = table.bias + table.alpha[-1]
    per_row = ratio / (1 - ratio) * fixed / table.buckets[-1]
    return dataclasses.replace(table, theta=tuple(per_row * g for g in table.rows))


def with_table(costs: CostBundle, ratio: float) -> CostBundle:
    profiles = []
    for profile in costs.profiles:
        if not isinstance(profile.table, AdditiveTable):
            raise SystemExit(f"row_costs: a {profile.table.kind} table cannot be scaled; "
                             "calibrate with the additive model")
        profiles.append(CostProfile(profile.context, scaled(profile.table, ratio), (),
                                    profile.over))
    return dataclasses.replace(costs, profiles=tuple(profiles))


def compare(workload: Workload, costs: CostBundle) -> dict[str, float]:
    """The best fixed width, and the predicted tokens/s of the full width, adaptive verify and
    the per-round oracle over it."""
    specs = [f"fixed:{k}" for k in range(1, workload.width + 1)]
    rates = {spec: simulate(spec, workload, costs).tokens_per_second
             for spec in (*specs, "adaptive-verify", "oracle")}
    best = max(specs, key=rates.__getitem__)
    return {"best_fixed": int(best.split(":")[1]),
            "full_width_vs_best_fixed": rates[specs[-1]] / rates[best],
            "adaptive_vs_best_fixed": rates["adaptive-verify"] / rates[best],
            "oracle_vs_best_fixed": rates["oracle"] / rates[best]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--cost_table", required=True)
    parser.add_argument("--ratios", default="0.05,0.1,0.2,0.3,0.5")
    args = parser.parse_args()
    workload, _ = read_workload(args.workload)
    costs = load_bundle(args.cost_table, json.loads(Path(args.cost_table).read_text()))
    table = costs.profiles[0].table
    assert isinstance(table, AdditiveTable)
    rows = [("calibrated", measured_ratio(table, workload.width), compare(workload, costs))]
    rows += [("scaled", ratio, compare(workload, with_table(costs, ratio)))
             for ratio in (float(r) for r in args.ratios.split(","))]
    print(f"# {len(workload.rounds)} rounds of width {workload.width}; largest bucket "
          f"{table.buckets[-1]}")
    print("table        r      best fixed  full width/best  adaptive/best  oracle/best")
    for name, ratio, found in rows:
        print(f"{name:<11} {ratio:5.3f}  fixed:{found['best_fixed']:<5} "
              f"{found['full_width_vs_best_fixed']:15.3f}  "
              f"{found['adaptive_vs_best_fixed']:13.3f}  {found['oracle_vs_best_fixed']:11.3f}")


if __name__ == "__main__":
    main()
