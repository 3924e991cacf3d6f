"""What each reference drafter costs beside the target it drafts for, at one request.

A drafter pays off only when it is much cheaper than the target: with acceptance length AL and
a drafter costing a fraction c of a target verify, a round can give at most about AL / (1 + c)
times the target alone (a round with k sequential MTP steps pays k times an MTP step's c).
The figures here are wall times of the models' own serving calls on the calling thread at
batch 1, interleaved (target, DSpark, MTP, target, ...) and the fastest
of several rounds kept for each, so a slow spell of a shared machine does not land on one.
"""

import time
from collections.abc import Callable

import torch

from adaspec.models.checkpoint import ReferenceModels
from adaspec.models.protocols import VerifyRows

POSITION = 300
"""The anchor position measured at: past the attention windows, so every key is real."""


def _timings(calls: dict[str, Callable[[], object]], calls_per_round: int,
             rounds: int) -> dict[str, float]:
    """Fastest seconds per call of each entry over ``rounds`` interleaved rounds."""
    for call in calls.values():  # caches and allocator warm
        for _ in range(5):
            call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            for _ in range(calls_per_round):
                call()
            best[name] = min(best[name], (time.perf_counter() - started) / calls_per_round)
    return best


def drafter_costs(models: ReferenceModels, width: int = 5, threads: int = 1,
                  calls_per_round: int = 50, rounds: int = 8) -> dict[str, object]:
    """Milliseconds of a target step (one row), a target verify of ``width + 1`` rows, a DSpark
    block of ``width`` and one MTP step, each at one request with ``threads`` torch threads,
    and each drafter's cost over the target step and over that verify. The target's and the
    MTP head's KV caches are reallocated for one request: measure on models not serving."""
    target, mtp, dspark = models.target, models.mtp, models.dspark
    target.allocate(1)
    mtp.allocate(1)
    device = target.embed.weight.device
    step_rows = VerifyRows.from_requests([(0, POSITION, [65])], num_rows=1, num_reqs=1,
                                         rows_per_req=1, scratch_kv_slot=1, device=device)
    block_rows = VerifyRows.from_requests([(0, POSITION, [65] * (width + 1))],
                                          num_rows=width + 1, num_reqs=1,
                                          rows_per_req=width + 1, scratch_kv_slot=1, device=device)
    hidden = torch.zeros(1, target.hidden_size, device=device)
    token = torch.tensor([65], device=device)
    position = torch.tensor([POSITION], device=device)
    slot = torch.tensor([0], device=device)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            seconds = _timings({
                "target_step": lambda: target.verify(step_rows),
                "target_verify": lambda: target.verify(block_rows),
                "dspark_block": lambda: dspark.draft(hidden, token, position, slot, width),
                "mtp_step": lambda: mtp.step(hidden, token, position, slot)},
                calls_per_round, rounds)
    finally:
        torch.set_num_threads(previous)
    step, verify = seconds["target_step"], seconds["target_verify"]
    return {
        "batch": 1, "width": width, "threads": threads,
        "ms": {name: round(1000 * value, 4) for name, value in seconds.items()},
        "dspark_over_target_step": round(seconds["dspark_block"] / step, 3),
        "mtp_step_over_target_step": round(seconds["mtp_step"] / step, 3),
        "dspark_over_target_verify": round(seconds["dspark_block"] / verify, 3),
        "mtp_step_over_target_verify": round(seconds["mtp_step"] / verify, 3),
    }
