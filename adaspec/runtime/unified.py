"""Whole-round bindings of unified mode: one prepared (Bcap, G) round per pipeline slot.

A unified round runs draft, consensus, pack, verify, greedy sample and commit as one device
unit. On CUDA that unit is captured once per binding as one graph over a fixed KV-slot input
buffer and replayed with each round's KV slots copied into it; the round's outputs are the
graph's own buffers, read by the retire copy before the same slot replays again (the next
round of a pipeline slot is submitted only after this one retired). On the CPU the binding
is the same round prewarmed once on padding and then run eagerly. Unified rounds are greedy
only (the launch refuses a positive temperature), so no random draw is ever captured.

Capture and warm-up run on padding rows only: every entry is the scratch KV slot, whose
state, KV and drafter context no request reads.
"""

import dataclasses
from typing import Any

import torch

from adaspec.runtime.devices.graphs import capture
from adaspec.runtime.rounds import DeviceContext, RetiredRound, RoundInputs, RoundWork
from adaspec.runtime.states import STAGES


class BoundRound:
    """One (Bcap, G) unified round at full depth, prepared at startup."""

    def __init__(self, ctx: DeviceContext, width: int, num_reqs: int, num_rows: int,
                 pool: Any = None) -> None:
        self.shape = (num_reqs, num_rows)
        self.width = width
        self.kv_slots = torch.full((num_reqs,), ctx.states.scratch, dtype=torch.int64,
                                   device=ctx.device)
        # No stage hook: preparation is not a round, and fault injection must not see it.
        quiet = dataclasses.replace(ctx, stage_hook=None)
        self.work = RoundWork(quiet, RoundInputs(
            round=-1, kv_slots=self.kv_slots, depth=width, num_rows=num_rows, all_greedy=True,
            verify=ctx.target.verify, any_stop=True))
        self.graph: torch.cuda.CUDAGraph | None = None
        if ctx.device.type == "cuda":
            self.graph = capture(self._run_body, pool)[0]
        else:
            self._run_body()  # prewarm: allocator and kernel caches as a real round leaves them

    def _run_body(self) -> None:
        for name in STAGES[:-1]:  # retire is the host copy, taken outside the unit
            self.work.stage(name)()

    def __call__(self, work: RoundWork) -> RetiredRound:
        """Run ``work``'s round through this binding and return its retire copy."""
        inputs = work.inputs
        if (inputs.kv_slots.shape[0], inputs.num_rows) != self.shape or \
                inputs.depth != self.width or not inputs.all_greedy:
            raise ValueError(f"(Bcap, G, depth, greedy)=({inputs.kv_slots.shape[0]}, "
                             f"{inputs.num_rows}, {inputs.depth}, {inputs.all_greedy}): this "
                             f"unified binding was prepared for ({self.shape[0]}, "
                             f"{self.shape[1]}, {self.width}, True)")
        if self.graph is None:
            return work.run_all()
        for name in STAGES[:-1]:
            work.announce(name)  # the stages a replay runs, in order, before it runs them
        self.kv_slots.copy_(inputs.kv_slots, non_blocking=True)
        self.graph.replay()
        work.adopt(self.work)
        return work.retire()


def round_binding_factory(ctx: DeviceContext, width: int) -> Any:
    """How one pipeline slot's ``BindingRegistry`` prepares a unified (Bcap, G) round: a
    CUDA graph in the slot's shared memory pool on cuda, a prewarmed eager round on the CPU
    (the device's graph backend check is ``binding_factory``'s, made first)."""
    pool = torch.cuda.graph_pool_handle() if ctx.device.type == "cuda" else None
    return lambda num_reqs, num_rows: BoundRound(ctx, width, num_reqs, num_rows, pool)

