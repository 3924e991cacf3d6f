"""Budget policies on seeded synthetic regimes and shaped cost tables, evaluated offline by
the simulator (no models): each policy's predicted tokens per second relative to the best
fixed width chosen in hindsight and to the oracle.

    python benchmarks/policies.py [--rounds 2000] [--seeds 3] [--json]

Regimes (``adaspec.policies.workloads``): high and low stationary acceptance, a step change,
a slow drift, alternating phases. Tables: nearly free rows, a staircase, a saturated device.
Figures are medians over the seeds.
"""

import argparse
import json
import statistics

from adaspec.policies.simulate import simulate
from adaspec.policies.workloads import shaped_tables, synthetic

KINDS = ("high", "low", "step", "drift", "alternating")
FIXED = tuple(f"fixed:{k}" for k in range(1, 6))


def evaluate(rounds: int, seeds: int) -> list[dict[str, object]]:
    rows = []
    for table_name, table in shaped_tables().items():
        for kind in KINDS:
            vs_best, vs_oracle, best_names = [], [], []
            for seed in range(seeds):
                workload = synthetic(kind, rounds=rounds, batch=8, seed=seed)
                rate = {p: simulate(p, workload, table).tokens_per_second
                        for p in (*FIXED, "adaptive-verify", "oracle")}
                best = max(FIXED, key=rate.__getitem__)
                best_names.append(best)
                vs_best.append(rate["adaptive-verify"] / rate[best])
                vs_oracle.append(rate["adaptive-verify"] / rate["oracle"])
            rows.append({"table": table_name, "workload": kind,
                         "best_fixed": statistics.mode(best_names),
                         "adaptive_vs_best_fixed": round(statistics.median(vs_best), 3),
                         "adaptive_vs_oracle": round(statistics.median(vs_oracle), 3)})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = evaluate(args.rounds, args.seeds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{'table':12} {'workload':12} {'best fixed':>10} {'vs best':>8} {'vs oracle':>9}")
        for row in result:
            print(f"{row['table']:12} {row['workload']:12} {row['best_fixed']:>10} "
                  f"{row['adaptive_vs_best_fixed']:8.3f} {row['adaptive_vs_oracle']:9.3f}")
