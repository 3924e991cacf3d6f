"""Kernel benchmark: microseconds per round for allocation + packing + sampling + commit.

Two arms, measured side by side in one run and interleaved round by round so machine noise
hits both alike: the tensor kernels of ``adaspec.runtime.devices`` on the CPU, and the
plain-Python loops of ``adaspec.runtime.devices.reference`` doing the same work on lists.
Each case is a batch of ``num_reqs`` requests at draft width ``width`` over the reference
model's 256-token vocabulary, with a verify budget of half the drafted tokens
(G = B + B * width / 2 rows), in two mixes: every request greedy, and half greedy with half
sampling with filters (temperature 0.8, top-k 40, top-p 0.9, min-p 0.02). Target logits are
given (the target forward is not part of the kernels).

    python benchmarks/kernels.py [--rounds N] [--json FILE]
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adaspec.config.requests import SamplingParams
from adaspec.runtime.devices import reference
from adaspec.runtime.devices.allocation import allocate_prefixes, emit_budget, verify_caps
from adaspec.runtime.devices.commit import commit_rows
from adaspec.runtime.devices.packing import pack_rows
from adaspec.runtime.devices.sampling import SamplingTensors, sample_rows

VOCAB = 256
CONTEXT_LIMIT = 1024


@dataclass(frozen=True)
class Inputs:
    """One round's inputs, as tensors for the kernels and as lists for the loops."""

    num_rows: int
    confidences: torch.Tensor
    drafts: torch.Tensor
    anchors: torch.Tensor
    starts: torch.Tensor
    remaining: torch.Tensor
    valid: torch.Tensor
    stops: torch.Tensor
    logits: torch.Tensor
    uniforms: torch.Tensor
    params: list[SamplingParams]


def make_inputs(num_reqs: int, width: int, mix: str, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + num_reqs * width // 2
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 or mix == "greedy" else
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
              for i in range(num_reqs)]
    return Inputs(
        num_rows=num_rows,
        confidences=torch.rand(num_reqs, width, generator=gen),
        drafts=torch.randint(0, VOCAB, (num_reqs, width), generator=gen),
        anchors=torch.randint(0, VOCAB, (num_reqs,), generator=gen),
        starts=torch.randint(0, 512, (num_reqs,), generator=gen),
        remaining=torch.full((num_reqs,), 100, dtype=torch.int64),
        valid=torch.ones(num_reqs, dtype=torch.bool),
        stops=torch.full((num_reqs, 1), -1, dtype=torch.int64),
        logits=torch.randn(num_rows, VOCAB, generator=gen) * 3,
        uniforms=torch.rand(num_rows, generator=gen, dtype=torch.float64),
        params=params)


def kernel_round(x: Inputs, tensors: SamplingTensors) -> None:
    width = x.drafts.shape[1]
    budget = emit_budget(x.remaining, x.starts, CONTEXT_LIMIT)
    caps = verify_caps(width, budget, x.valid)
    lengths = allocate_prefixes(x.confidences, x.num_rows, caps, x.valid)
    packed = pack_rows(lengths, x.anchors, x.drafts, torch.arange(len(x.params)), x.starts,
                       x.valid, x.num_rows)
    sampled = sample_rows(x.logits, packed.rows.row_reqs, tensors, x.uniforms)
    commit_rows(packed, sampled, x.drafts, x.stops, budget, x.valid)


def loop_round(x: Inputs, lists: dict[str, list]) -> None:  # type: ignore[type-arg]
    width = len(lists["drafts"][0])
    budget = [min(r, CONTEXT_LIMIT - 1 - s)
              for r, s in zip(lists["remaining"], lists["starts"], strict=True)]
    caps = [max(0, min(width, b - 1)) for b in budget]
    lengths = reference.allocate(lists["confidences"], x.num_rows, caps, lists["valid"])
    packed = reference.pack(lengths, lists["anchors"], lists["drafts"], lists["valid"],
                            x.num_rows)
    per_row = [x.params[r] for r in packed.row_reqs]
    sampled = reference.sample(lists["logits"], [float(p.temperature or 0) for p in per_row],
                               [p.top_k for p in per_row], [p.top_p for p in per_row],
                               [p.min_p for p in per_row], lists["uniforms"])
    reference.commit(sampled, packed, lengths, lists["drafts"], lists["stops"], budget,
                     lists["valid"])


def as_lists(x: Inputs) -> dict[str, list]:  # type: ignore[type-arg]
    names = ("confidences", "drafts", "anchors", "starts", "remaining", "valid", "stops",
             "logits", "uniforms")
    return {name: getattr(x, name).tolist() for name in names}


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(num_reqs: int, width: int, mix: str, rounds: int) -> dict[str, float | int | str]:
    x = make_inputs(num_reqs, width, mix, seed=num_reqs * 100 + width)
    tensors = SamplingTensors.from_params(x.params, num_reqs)
    lists = as_lists(x)
    for _ in range(3):  # warm caches and allocator for both arms
        kernel_round(x, tensors)
        loop_round(x, lists)
    kernel_us, loop_us = [], []
    for _ in range(rounds):
        kernel_us.append(timed(lambda: kernel_round(x, tensors)))
        loop_us.append(timed(lambda: loop_round(x, lists)))
    kernels = statistics.median(kernel_us)
    loops = statistics.median(loop_us)
    return {"mix": mix, "num_reqs": num_reqs, "width": width, "rows": x.num_rows,
            "kernels_us": round(kernels, 1), "python_loop_us": round(loops, 1),
            "loop_over_kernels": round(loops / kernels, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    machine = (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
               f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
               f"Python {platform.python_version()}")
    print(f"# python benchmarks/kernels.py --rounds {args.rounds}")
    print(f"# {machine}")
    print(f"# median of {args.rounds} interleaved rounds per arm; G = B + B*width/2 rows")
    print(f"{'mix':>6} {'B':>3} {'w':>2} {'G':>4} {'kernels us':>11} {'python loop us':>15} "
          f"{'loop/kernels':>13}")
    results = []
    for mix, width, num_reqs in itertools.product(("greedy", "mixed"), (5, 7), (1, 8, 16)):
        row = measure(num_reqs, width, mix, args.rounds)
        results.append(row)
        print(f"{mix:>6} {row['num_reqs']:>3} {row['width']:>2} {row['rows']:>4} "
              f"{row['kernels_us']:>11} {row['python_loop_us']:>15} "
              f"{row['loop_over_kernels']:>13}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "x") as handle:
            json.dump({"machine": machine, "rounds": args.rounds, "results": results}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
