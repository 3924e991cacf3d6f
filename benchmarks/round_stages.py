"""Where a round's time goes on the CPU: the device worker's CPU time per stage, beside the
plain loop's time per step, on the reference models.

Each stage is timed by the runtime's stage hook (called on the worker as a stage's device work
starts): a stage's time is the worker's CPU time (``time.thread_time``) from its start to the
start of the next item on the stream, so queue waits between rounds are not counted. Launches
alternate with plain-loop runs over the same prompts, so both see the same machine.

    python benchmarks/round_stages.py [--arms none,DSpark:4,MTP:4] [--concurrency 1,16]
                                      [--repeats 3] [--json FILE]
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from adaspec.config import SamplingParams, load_config
from adaspec.models import load_reference_models
from adaspec.runtime.bench import shipped_prompts
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.plain import plain_loop

TOKENS = 96


class StageClock:
    """Stage hook: the worker's CPU time between consecutive stage starts, per stage."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._last: tuple[str, float] | None = None
        self.on = False

    def __call__(self, round_index: int, stage: str) -> None:
        now = time.thread_time()
        if self._last is not None and self.on:
            self.samples[self._last[0]].append(now - self._last[1])
        self._last = (stage, now)


def launch(arm: str, concurrency: int) -> dict[str, object]:
    """At most ``concurrency`` requests decode at once, like the plain loop's C clients."""
    if arm == "none":
        return {"speculative_algorithm": "none", "max_seqs_per_batch": concurrency}
    algorithm, width = arm.split(":")
    return {"speculative_algorithm": algorithm, "num_speculative_tokens": int(width),
            "max_seqs_per_batch": concurrency}


async def served(arm: str, concurrency: int, prompts: list[list[int]]) -> dict[str, Any]:
    clock = StageClock()
    runtime = Runtime(load_config(launch(arm, concurrency)),
                      options=RuntimeOptions(stage_hook=clock))
    await runtime.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS)
        warm = [runtime.submit(p, params) for p in prompts[:concurrency]]
        for handle in warm:
            await handle.result()
        await runtime.wait_idle()
        clock.on = True
        before = runtime.statistics()
        started = time.perf_counter()
        handles = [runtime.submit(p, params) for p in prompts]
        tokens = sum([len((await h.result()).token_ids) for h in handles])
        seconds = time.perf_counter() - started
        await runtime.wait_idle()
        rounds = runtime.statistics().rounds_retired - before.rounds_retired
    finally:
        await runtime.stop()
    stages = {name: round(1000 * statistics.median(values), 3)
              for name, values in clock.samples.items()}
    return {"arm": arm, "concurrency": concurrency, "rounds": rounds,
            "ms_per_round": round(1000 * seconds / max(rounds, 1), 3),
            "tokens_per_second": round(tokens / seconds, 1), "stage_cpu_ms": stages}


def plain(concurrency: int, prompts: list[list[int]], models: Any) -> dict[str, float]:
    run = plain_loop(models.target, prompts, TOKENS, concurrency)
    tokens = sum(len(out) for out in run.outputs)
    return {"ms_per_step": round(1000 * run.seconds / max(run.steps, 1), 3),
            "tokens_per_second": round(tokens / run.seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="none,DSpark:4,MTP:4")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this new file")
    args = parser.parse_args()
    arms = args.arms.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    models = load_reference_models()
    models.target.allocate(max(levels))
    pool = [list(p) for p in shipped_prompts()]
    print(f"# python benchmarks/round_stages.py --arms {args.arms} --concurrency "
          f"{args.concurrency} --repeats {args.repeats}")
    print(f"# {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}")
    results: list[dict[str, Any]] = []
    for level in levels:
        prompts = [pool[i % len(pool)] for i in range(2 * level)]
        for _ in range(args.repeats):
            results.append({"arm": "plain", "concurrency": level,
                            **plain(level, prompts, models)})
            results += [asyncio.run(served(arm, level, prompts)) for arm in arms]
    summary = summarise(results)
    for row in summary:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "x") as handle:
            json.dump({"runs": results, "summary": summary}, handle, indent=2)


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the repeats, per (arm, concurrency)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in results:
        groups[row["arm"], row["concurrency"]].append(row)
    summary = []
    for (arm, level), rows in groups.items():
        entry: dict[str, Any] = {"arm": arm, "concurrency": level,
                                 "tokens_per_second": statistics.median(
                                     r["tokens_per_second"] for r in rows)}
        if arm == "plain":
            entry["ms_per_step"] = statistics.median(r["ms_per_step"] for r in rows)
        else:
            entry["ms_per_round"] = statistics.median(r["ms_per_round"] for r in rows)
            entry["stage_cpu_ms"] = {name: round(statistics.median(
                r["stage_cpu_ms"].get(name, 0.0) for r in rows), 3)
                for name in rows[0]["stage_cpu_ms"]}
        summary.append(entry)
    return summary


if __name__ == "__main__":
    main()
