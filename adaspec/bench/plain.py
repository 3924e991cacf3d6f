"""The plain loop: the target alone in a straight decode loop, with no runtime at all.

Every speed figure of the project is read against it: it is what the hardware does without
adaspec. A closed loop of C clients over a prompt list, greedy: whenever a request ends, the
next prompt is prefilled and joins the batch; every step verifies one row per running
request (its newest token), takes the argmax, and reads the tokens back to decide who ends.
It runs on the calling thread under ``torch.no_grad``, with no pipeline slots, no events and
no state machine. A request ends at ``max_tokens`` or when its next token would not fit the
context, the same rule as the runtime, so greedy outputs must be identical.
"""

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from adaspec.config.requests import check_room
from adaspec.models.protocols import TargetModel, VerifyRows
from adaspec.runtime.requests import check_prompt, prompt_ids


@dataclass(frozen=True, slots=True)
class PlainRun:
    """What one plain-loop run produced."""

    outputs: tuple[tuple[int, ...], ...]  # generated token ids per prompt, in prompt order
    seconds: float  # wall time of the whole run
    steps: int  # target forwards after the prefills
    tpot_s: tuple[float, ...]  # per request with two or more tokens: (last - first) / (n - 1)


@dataclass(slots=True)
class _Running:
    index: int  # the prompt's place in the list
    kv_slot: int
    position: int  # position of the newest token (the next row's)
    tokens: list[int]
    first_time: float


def plain_loop(target: TargetModel, prompts: Sequence[Sequence[int]], max_tokens: int,
               concurrency: int) -> PlainRun:
    """Decode ``prompts`` greedily, ``concurrency`` at a time, ``max_tokens`` each.

    The target must be allocated with at least ``concurrency`` KV slots; the loop uses KV
    slots ``0 .. concurrency - 1`` (a prefill of unequal prompts writes its padding to the
    scratch KV slot, as in the runtime)."""
    if not 1 <= concurrency <= target.num_kv_slots:
        raise ValueError(f"concurrency={concurrency}: expected 1..{target.num_kv_slots} (the "
                         "target's allocated KV slots)")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: expected at least 1")
    checked = []
    for index, prompt in enumerate(prompts):  # the runtime's own rules, so outputs compare
        ids = prompt_ids(prompt, f"prompts[{index}]")
        check_prompt(target, ids, f"prompts[{index}]")
        check_room(target.context_limit, len(ids), max_tokens)
        checked.append(ids)
    with torch.no_grad():
        return _run(target, checked, max_tokens, concurrency)


def _run(target: TargetModel, prompts: Sequence[Sequence[int]], max_tokens: int,
         concurrency: int) -> PlainRun:
    device = _device_of(target)
    waiting = deque(enumerate(prompts))
    free = list(range(concurrency))[::-1]
    running: list[_Running] = []
    outputs: list[tuple[int, ...]] = [()] * len(prompts)
    tpot: list[float] = []
    steps = 0
    started = time.perf_counter()
    while waiting or running:
        admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if admitted:
            running += _prefill(target, admitted, free, device)
        running = _end(target, running, max_tokens, outputs, tpot, free)
        if not running:
            continue
        next_ids = _step(target, running, device)
        steps += 1
        now = time.perf_counter()
        for request, token in zip(running, next_ids, strict=True):
            request.tokens.append(token)
            request.position += 1
        running = _end(target, running, max_tokens, outputs, tpot, free, now)
    return PlainRun(outputs=tuple(outputs), seconds=time.perf_counter() - started,
                    steps=steps, tpot_s=tuple(tpot))


def _device_of(target: TargetModel) -> torch.device:
    parameters = getattr(target, "parameters", None)
    if parameters is not None:
        return torch.device(next(parameters()).device)
    return torch.device("cpu")


def _prefill(target: TargetModel, admitted: list[tuple[int, Sequence[int]]], free: list[int],
             device: torch.device) -> list[_Running]:
    kv_slots = [free.pop() for _ in admitted]
    prompts = [torch.tensor(list(p), dtype=torch.int64, device=device) for _, p in admitted]
    out = target.prefill(prompts, torch.tensor(kv_slots, dtype=torch.int64, device=device))
    first = out.last.logits.argmax(-1).tolist()
    now = time.perf_counter()
    return [_Running(index=index, kv_slot=kv_slot, position=len(prompt), tokens=[token],
                     first_time=now)
            for (index, prompt), kv_slot, token in zip(admitted, kv_slots, first, strict=True)]


def _step(target: TargetModel, running: list[_Running], device: torch.device) -> list[int]:
    """One target forward over each running request's newest token; the greedy next ids."""
    num = len(running)

    def column(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    index = torch.arange(num, device=device)
    rows = VerifyRows(token_ids=column([r.tokens[-1] for r in running]), row_reqs=index,
                      row_offsets=torch.zeros_like(index),
                      row_valid=torch.ones(num, dtype=torch.bool, device=device),
                      req_kv_slots=column([r.kv_slot for r in running]),
                      req_starts=column([r.position for r in running]), rows_per_req=1)
    next_ids: list[int] = target.verify(rows).logits.argmax(-1).tolist()
    return next_ids


def _end(target: TargetModel, running: list[_Running], max_tokens: int,
         outputs: list[tuple[int, ...]], tpot: list[float], free: list[int],
         now: float | None = None) -> list[_Running]:
    """Requests that reached ``max_tokens`` or the context limit leave; the rest go on."""
    going = []
    for request in running:
        if len(request.tokens) < max_tokens and request.position < target.context_limit - 1:
            going.append(request)
            continue
        outputs[request.index] = tuple(request.tokens)
        free.append(request.kv_slot)
        if len(request.tokens) > 1 and now is not None:
            tpot.append((now - request.first_time) / (len(request.tokens) - 1))
    return going
