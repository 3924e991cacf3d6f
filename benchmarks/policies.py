"""Adaptive policies on seeded synthetic regimes and shaped cost tables, evaluated offline by
the simulator (no models): predicted tokens per second of adaptive verify and adaptive depth
relative to the best fixed width chosen in hindsight and to the oracle of their decision (best
G, or best depth, per round with the round's true acceptance), adaptive depth's switches
per 1000 rounds, and how much the depth oracle gains over the best fixed width (where that is
about 1, no depth policy can beat the fixed width).

    python benchmarks/policies.py [--rounds 2000] [--seeds 3] [--dp_size 1] [--json]

Regimes (``adaspec.policies.workloads``): high and low stationary acceptance, a step change,
a slow drift, alternating phases. Tables: nearly free rows, a staircase, a saturated device.
Figures are medians over the seeds. With ``--dp_size 2`` every round has two shards of 8
requests sharing one G (in the alternating regime the shards are out of phase).
"""

import argparse
import json
import statistics

from adaspec.policies.simulate import simulate
from adaspec.policies.workloads import shaped_tables, synthetic

KINDS = ("high", "low", "step", "drift", "alternating")
FIXED = tuple(f"fixed:{k}" for k in range(1, 6))


def evaluate(rounds: int, seeds: int, dp_size: int = 1) -> list[dict[str, object]]:
    rows = []
    for table_name, table in shaped_tables(dp_size).items():
        for kind in KINDS:
            ratios: dict[str, list[float]] = {key: [] for key in (
                "verify_vs_best_fixed", "verify_vs_oracle", "depth_vs_best_fixed",
                "depth_vs_oracle_depth", "depth_switches_per_1000",
                "oracle_depth_vs_best_fixed")}
            best_names = []
            for seed in range(seeds):
                workload = synthetic(kind, rounds=rounds, batch=8, seed=seed, dp_size=dp_size)
                results = {p: simulate(p, workload, table)
                           for p in (*FIXED, "adaptive-verify", "adaptive-depth", "oracle",
                                     "oracle-depth")}
                rate = {p: r.tokens_per_second for p, r in results.items()}
                best = max(FIXED, key=rate.__getitem__)
                best_names.append(best)
                ratios["verify_vs_best_fixed"].append(rate["adaptive-verify"] / rate[best])
                ratios["verify_vs_oracle"].append(rate["adaptive-verify"] / rate["oracle"])
                ratios["depth_vs_best_fixed"].append(rate["adaptive-depth"] / rate[best])
                ratios["depth_vs_oracle_depth"].append(rate["adaptive-depth"]
                                                       / rate["oracle-depth"])
                ratios["oracle_depth_vs_best_fixed"].append(rate["oracle-depth"] / rate[best])
                depth = results["adaptive-depth"]
                ratios["depth_switches_per_1000"].append(1000 * depth.depth_switches
                                                         / depth.rounds)
            rows.append({"table": table_name, "workload": kind,
                         "best_fixed": statistics.mode(best_names),
                         **{key: round(statistics.median(values), 3)
                            for key, values in ratios.items()}})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dp_size", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = evaluate(args.rounds, args.seeds, args.dp_size)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'table':12} {'workload':12} {'best fixed':>10} {'verify/best':>11} "
              f"{'verify/oracle':>13} {'depth/best':>10} {'depth/oracle':>12} "
              f"{'switches/1000':>13} {'oracle-depth/best':>17}")
        for row in result:
            print(f"{row['table']:12} {row['workload']:12} {row['best_fixed']:>10} "
                  f"{row['verify_vs_best_fixed']:11.3f} {row['verify_vs_oracle']:13.3f} "
                  f"{row['depth_vs_best_fixed']:10.3f} {row['depth_vs_oracle_depth']:12.3f} "
                  f"{row['depth_switches_per_1000']:13.1f} "
                  f"{row['oracle_depth_vs_best_fixed']:17.3f}")
