"""Runtime host overhead per round, and its share of round time with the reference models.

Two measurements, in one run:

1. **Instant device**: the runtime as it serves (policies, state machine, events, request
   bookkeeping, token streaming, trace off or on), but the device stream is replaced by
   ``InstantDevice``, a stand-in that skips the device work and answers each round's retire
   with a synthetic result (every live request accepts half its drafts). What remains per
   round is host overhead; arms (trace off, trace on, event log on) alternate round-robin.
   The stand-in's own bookkeeping (telling a retire from other work, making up its result)
   is timed and taken out: it is not the runtime's, and it was about a third of the figure.
2. **Reference models on the CPU**: real rounds at batch 1 and 16, on the default cpu stream,
   which runs the device work on the loop's own thread. The device time is the time spent
   inside stream work items (the stream's one call site, ``streams._call``, is timed for the
   run), the host overhead is the rest of the wall time; the share is host over wall.

    python benchmarks/runtime_overhead.py [--rounds N] [--json FILE]
"""

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from adaspec.config import SamplingParams, load_config
from adaspec.models import load_reference_models
from adaspec.runtime.devices import streams
from adaspec.runtime.devices.streams import Completion
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.rounds import PrefillResult, RetiredRound, RoundWork, prefill

WIDTH = 5


class Listed:
    """A retired column as the host reads it (``tolist``), without a tensor behind it."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def tolist(self) -> list[Any]:
        return self._values


def synthetic_columns(num: int) -> dict[str, Listed]:
    """The columns of a synthetic retire that do not change between rounds."""
    accepted = WIDTH // 2
    return {"token_ids": Listed([[66] * (WIDTH + 1)] * num),
            "num_emitted": Listed([accepted + 1] * num),
            "num_accepted": Listed([accepted] * num), "verify_lengths": Listed([WIDTH] * num),
            "confidences": Listed([[0.5] * WIDTH] * num)}


class InstantDevice:
    """A device stream that finishes everything at once: stages do nothing, a prefill emits
    one token per request, a retire reports half the drafts accepted for every live entry
    and finishes a request once it has been in ``rounds`` rounds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rounds: int) -> None:
        self.device = torch.device("cpu")
        self._loop = loop
        self._rounds = rounds
        self._seen: dict[int, int] = {}
        self._slot_lists: dict[int, list[int]] = {}
        self._constant: dict[int, dict[str, Listed]] = {}
        self.own_seconds = 0.0  # time spent making up answers: the stand-in's, not the host's

    def enqueue(self, work: Any, on_done: Any = None) -> Completion[Any]:
        future = self._loop.create_future()
        started = time.perf_counter()
        answer = self._answer(work)
        self.own_seconds += time.perf_counter() - started
        future.set_result(answer)
        if on_done is not None:
            on_done(future)
        return Completion(future)

    def _answer(self, work: Any) -> Any:
        if isinstance(work, functools.partial) and work.func is prefill:
            kv_slots = work.args[1].kv_slots.tolist()
            for kv_slot in kv_slots:
                self._seen[kv_slot] = 0
            num = len(kv_slots)
            return PrefillResult(first=torch.full((num,), 65),
                                 live=torch.ones(num, dtype=torch.bool),
                                 stopped=torch.zeros(num, dtype=torch.bool))
        owner = getattr(work, "__self__", None)
        if isinstance(owner, RoundWork) and work.__name__ in ("retire", "run_stages"):
            return self._retire(owner)
        return None

    def _retire(self, work: RoundWork) -> RetiredRound:
        kv_slots = self._slot_lists.get(id(work.inputs.kv_slots))
        if kv_slots is None:  # the batch's KV-slot tensor is reused while it is unchanged
            kv_slots = self._slot_lists[id(work.inputs.kv_slots)] = work.inputs.kv_slots.tolist()
        scratch = work.ctx.states.scratch
        live, finish = [], []
        seen, rounds = self._seen, self._rounds
        for kv_slot in kv_slots:
            going = kv_slot != scratch and seen.get(kv_slot, rounds) < rounds
            live.append(going)
            if going:
                seen[kv_slot] += 1
            finish.append(2 if going and seen[kv_slot] == rounds else 0)
        constant = self._constant.get(len(kv_slots))
        if constant is None:
            constant = self._constant[len(kv_slots)] = synthetic_columns(len(kv_slots))
        return RetiredRound(**constant, finish=Listed(finish),  # type: ignore[arg-type]
                            live=Listed(live))

    def close(self) -> None:
        """Nothing to release."""


async def instant_rounds(models: Any, batch: int, rounds: int, trace: str | None,
                         event_log: str | None) -> float:
    """Microseconds of host work per round with an instant device."""
    config = load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": WIDTH,
                          "max_seqs_per_batch": batch})
    runtime = Runtime(config, models=models,
                      options=RuntimeOptions(trace=trace, event_log=event_log))
    await runtime.start()
    assert runtime._pipeline is not None
    # Requests stay within the target's context: the host ends a request where its budget
    # does, which a stand-in that ignores the context must not outrun.
    per_request = min(rounds, (models.target.context_limit - 8) // (WIDTH // 2 + 1) - 1)
    device = InstantDevice(asyncio.get_running_loop(), per_request)
    runtime._pipeline.stream = device  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=1 + per_request * (WIDTH // 2 + 1))
    start = time.perf_counter()
    for _ in range(-(-rounds // per_request)):  # waves of ``batch`` requests
        handles = [runtime.submit([65, 66, 67], params) for _ in range(batch)]
        for handle in handles:
            await handle.result()
    elapsed = time.perf_counter() - start - device.own_seconds
    submitted = runtime.statistics().rounds_submitted
    await runtime.stop()
    return elapsed / submitted * 1e6


ARMS = ("trace off", "trace on", "event log on")


def measure_instant(models: Any, rounds: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median microseconds per round for each arm and batch, arms interleaved per repeat."""
    samples: dict[tuple[str, int], list[float]] = {(a, b): [] for a in ARMS for b in (1, 16)}
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(repeats):
            for (arm, batch), values in samples.items():
                name = f"{repeat}-{batch}"
                trace = os.path.join(folder, f"t{name}") if arm == "trace on" else None
                log = os.path.join(folder, f"l{name}") if arm == "event log on" else None
                values.append(asyncio.run(instant_rounds(models, batch, rounds, trace, log)))
    return {arm: {f"batch {b}": round(statistics.median(samples[(arm, b)]), 1)
                  for b in (1, 16)} for arm in ARMS}


async def real_rounds(models: Any, batch: int, tokens: int) -> dict[str, float]:
    config = load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": WIDTH,
                          "max_seqs_per_batch": batch})
    runtime = Runtime(config, models=models)
    await runtime.start()
    prompt = list(b"ROMEO.\nBut soft, what light through yonder window breaks? It is ")
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    spent = [0.0]
    untimed = streams._call

    def timed(work: Any) -> Any:
        started = time.perf_counter()
        try:
            return untimed(work)
        finally:
            spent[0] += time.perf_counter() - started

    streams._call = timed
    try:
        wall0 = time.perf_counter()
        handles = [runtime.submit(prompt, params) for _ in range(batch)]
        for handle in handles:
            await handle.result()
        wall = time.perf_counter() - wall0
    finally:
        streams._call = untimed
    device = spent[0]
    host = wall - device
    rounds = runtime.statistics().rounds_submitted
    await runtime.stop()
    return {"batch": batch, "rounds": rounds,
            "wall_us_per_round": round(wall / rounds * 1e6, 1),
            "host_us_per_round": round(host / rounds * 1e6, 1),
            "device_us_per_round": round(device / rounds * 1e6, 1),
            "host_share": round(host / wall, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="rounds per instant run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if streams.cpu_stream_kind() != "loop":
        # host = wall - device only holds when device work and host share one thread.
        parser.error(f"{streams.CPU_STREAM_ENV}={streams.cpu_stream_kind()}: this script "
                     "measures the loop stream only; unset it")
    models = load_reference_models()
    machine = (f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
               f"Python {platform.python_version()}")
    print(f"# python benchmarks/runtime_overhead.py --rounds {args.rounds} "
          f"--repeats {args.repeats}")
    print(f"# {machine}")
    instant = measure_instant(models, args.rounds, args.repeats)
    print(f"host overhead per round, instant device (median of {args.repeats} runs of "
          f"{args.rounds} rounds):")
    for arm, values in instant.items():
        print(f"  {arm:14} " + "  ".join(f"{k}: {v:7.1f} us" for k, v in values.items()))
    real = [asyncio.run(real_rounds(models, batch, 48)) for batch in (1, 16)]
    print("reference models on the CPU (DSpark width 5, 48 tokens per request):")
    for row in real:
        print(f"  batch {row['batch']:>2}: {row['rounds']} rounds, wall "
              f"{row['wall_us_per_round']} us/round, host {row['host_us_per_round']} us, "
              f"device {row['device_us_per_round']} us, host share {row['host_share']:.1%}")
    if args.json:
        with open(args.json, "x") as handle:
            json.dump({"machine": machine, "instant_device_us": instant, "reference": real},
                      handle, indent=2)


if __name__ == "__main__":
    main()
