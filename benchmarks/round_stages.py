"""Where a round's time goes on the CPU: the device worker's CPU time per stage, beside the
plain loop's time per step, on the reference models.

Each stage of a round is timed where it runs (the ``RoundWork`` stage methods, wrapped for the
run) and every other stream work item where the stream runs it (``streams._call``, wrapped),
counted under its name (the round's stages, ``prefill``), in wall milliseconds per round;
``host`` is the rest of the round's wall time (the runtime's own Python and the event loop,
which the default cpu stream shares a thread with). Launches alternate with plain-loop runs
over the same prompts, so both see the same machine.

    python benchmarks/round_stages.py [--arms none,DSpark:4,MTP:4] [--concurrency 1,16]
                                      [--repeats 3] [--json FILE]
"""

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from adaspec.bench.plain import plain_loop
from adaspec.bench.run import shipped_prompts
from adaspec.config import SamplingParams, load_config
from adaspec.models import load_reference_models
from adaspec.runtime.devices import streams
from adaspec.runtime.engine import Runtime
from adaspec.runtime.rounds import RoundWork
from adaspec.runtime.states import STAGES

TOKENS = 96


ROUND_ITEMS = frozenset({*STAGES, "run_stages", "run_unified"})
"""Stream items made of stages: the stages are timed themselves, so these are not."""


class StageClock:
    """Wall time spent inside each stage of a round and each other kind of stream work item
    (``prefill``), while ``on``. Stages are timed where they run, whether the stream runs a
    round as one item (``RoundWork.run_stages``, the default), as a unit or stage by stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self._untimed = streams._call
        self._stages = {name: getattr(RoundWork, name) for name in STAGES}

    def __enter__(self) -> "StageClock":
        streams._call = self._timed
        for name, method in self._stages.items():
            setattr(RoundWork, name, self._timed_stage(name, method))
        return self

    def __exit__(self, *exc_info: object) -> None:
        streams._call = self._untimed
        for name, method in self._stages.items():
            setattr(RoundWork, name, method)

    def _timed(self, work: Any) -> Any:
        name = _work_name(work)
        if name in ROUND_ITEMS:
            return self._untimed(work)
        started = time.perf_counter()
        try:
            return self._untimed(work)
        finally:
            if self.on:
                self.seconds[name] += time.perf_counter() - started

    def _timed_stage(self, name: str, method: Any) -> Any:
        @functools.wraps(method)
        def timed(work: RoundWork) -> Any:
            started = time.perf_counter()
            try:
                return method(work)
            finally:
                if self.on:
                    self.seconds[name] += time.perf_counter() - started
        return timed


def _work_name(work: Any) -> str:
    inner = work.func if isinstance(work, functools.partial) else work
    return str(getattr(inner, "__name__", "other"))


def launch(arm: str, concurrency: int) -> dict[str, object]:
    """At most ``concurrency`` requests decode at once, like the plain loop's C clients."""
    if arm == "none":
        return {"speculative_algorithm": "none", "max_seqs_per_batch": concurrency}
    algorithm, width = arm.split(":")
    return {"speculative_algorithm": algorithm, "num_speculative_tokens": int(width),
            "max_seqs_per_batch": concurrency}


async def served(arm: str, concurrency: int, prompts: list[list[int]]) -> dict[str, Any]:
    runtime = Runtime(load_config(launch(arm, concurrency)))
    await runtime.start()
    with StageClock() as clock:
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
            clock.on = False  # what runs after the timed window is not the window's
            await runtime.wait_idle()
            rounds = max(runtime.statistics().rounds_retired - before.rounds_retired, 1)
        finally:
            await runtime.stop()
    stages = {name: round(1000 * spent / rounds, 3) for name, spent in clock.seconds.items()}
    stages["host"] = round(1000 * (seconds - sum(clock.seconds.values())) / rounds, 3)
    return {"arm": arm, "concurrency": concurrency, "rounds": rounds,
            "ms_per_round": round(1000 * seconds / rounds, 3),
            "tokens_per_second": round(tokens / seconds, 1), "stage_ms": stages}


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
            entry["stage_ms"] = {name: round(statistics.median(
                r["stage_ms"].get(name, 0.0) for r in rows), 3)
                for name in rows[0]["stage_ms"]}
        summary.append(entry)
    return summary


if __name__ == "__main__":
    main()
