"""Stage bindings of split mode: the drafter's forwards, packing and the target's verify of one
pipeline slot, each prepared per shape at startup.

A split round runs its stages one after another on the stream. Random sampling and commit run
eagerly, outside any graph (they read sampling parameters and write the KV slot states); the
draft stage, the pack stage and the verify stage each replay a binding: a CUDA graph on cuda, a
prewarmed eager call on the CPU. The slot's ``BindingRegistry`` maps (Bcap, G) to a
``SplitBinding`` that holds that shape's pack and verify and the bucket's draft bindings. Draft
work depends on the batch and the depth, not on G, so draft bindings are keyed (slot, width,
Bcap, depth) and shared by every G of the bucket; a drafter whose work ignores the depth
(DSpark) has one per bucket, at the width. A pack binding takes the depth as a device value,
so one graph per (Bcap, G) serves every depth.

Graphs of one kind share one memory pool per slot: a round replays one graph of each kind, and
its stages read the draft's and pack's outputs until commit, so kinds never share a pool (one
kind's scratch memory could be another's live output). Preparation runs on padding only: every
entry is the scratch KV slot, whose state, KV and drafter context no request reads.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from adaspec.errors import GraphBindingMissing
from adaspec.models.protocols import TargetOutput, VerifyRows
from adaspec.runtime.devices.graphs import BoundCall, binding_factory
from adaspec.runtime.devices.packing import PackedRows
from adaspec.runtime.kv_slots import KvSlotStates
from adaspec.runtime.rounds import DeviceContext, draft_block, pack_block

Drafted = tuple[KvSlotStates, Tensor, Tensor]


class DraftBinding:
    """The draft stage of one (Bcap, depth): gathers the entries' states and drafts."""

    def __init__(self, ctx: DeviceContext, num_reqs: int, depth: int, pool: Any,
                 warm: bool) -> None:
        self.shape = (num_reqs, depth)
        padding = torch.full((num_reqs,), ctx.states.scratch, dtype=torch.int64,
                             device=ctx.device)
        self.call = BoundCall(f"draft binding (Bcap={num_reqs}, depth={depth})",
                              lambda kv_slots: draft_block(ctx, kv_slots, depth), (padding,),
                              pool, warm=warm)

    def __call__(self, kv_slots: Tensor) -> Drafted:
        drafted: Drafted = self.call(kv_slots)
        return drafted


class PackBinding:
    """The pack stage of one (Bcap, G), for every depth. On cuda the depth enters the graph
    as a device value (copied from a device constant: no host value enters a replay); on the
    CPU the eager call takes it as an int, which lets a full-width G skip allocation."""

    def __init__(self, ctx: DeviceContext, num_reqs: int, num_rows: int, example: Drafted,
                 pool: Any) -> None:
        self.shape = (num_reqs, num_rows)
        rows, drafts, confidences = example
        self.captured = ctx.device.type == "cuda"
        self.depths = torch.arange(drafts.shape[1] + 1, device=ctx.device)
        padding = torch.full((num_reqs,), ctx.states.scratch, dtype=torch.int64,
                             device=ctx.device)

        def pack(anchor_ids: Tensor, anchor_positions: Tensor, remaining: Tensor, live: Tensor,
                 drafts: Tensor, confidences: Tensor, kv_slots: Tensor, depth: Tensor | int
                 ) -> tuple[Tensor, PackedRows]:
            # Packing never reads the hidden states: an empty column block stands for them.
            rows = KvSlotStates(anchor_ids=anchor_ids, anchor_positions=anchor_positions,
                                hidden=confidences[:, :0], remaining=remaining, live=live)
            return pack_block(ctx, rows, drafts, confidences, kv_slots, depth, num_rows)

        self.call = BoundCall(f"pack binding (Bcap={num_reqs}, G={num_rows})", pack,
                              self._args(rows, drafts, confidences, padding, drafts.shape[1]),
                              pool)

    def _args(self, rows: KvSlotStates, drafts: Tensor, confidences: Tensor, kv_slots: Tensor,
              depth: int) -> tuple[Any, ...]:
        return (rows.anchor_ids, rows.anchor_positions, rows.remaining, rows.live, drafts,
                confidences, kv_slots, self.depths[depth] if self.captured else depth)

    def __call__(self, rows: KvSlotStates, drafts: Tensor, confidences: Tensor,
                 kv_slots: Tensor, depth: int) -> tuple[Tensor, PackedRows]:
        packed: tuple[Tensor, PackedRows] = self.call(
            *self._args(rows, drafts, confidences, kv_slots, depth))
        return packed


@dataclasses.dataclass(frozen=True, slots=True)
class SplitBinding:
    """What a split round of one (Bcap, G) runs: its draft per depth, its pack, its verify."""

    key: tuple[int, int, int, int]  # (slot, width, Bcap, G)
    drafts: dict[int, DraftBinding]  # by depth; the bucket's, shared by every G
    pack: PackBinding
    verify: Callable[[VerifyRows], TargetOutput]
    drafts_by_depth: bool

    def draft(self, depth: int) -> DraftBinding:
        """The draft binding a round of ``depth`` runs (the deepest when depth changes
        nothing the drafter does)."""
        found = self.drafts.get(depth if self.drafts_by_depth else max(self.drafts))
        if found is None:  # a fixed-depth launch whose policy left the width
            raise GraphBindingMissing((*self.key[:3], depth), len(self.drafts), "depth")
        return found


class SplitBindings:
    """How one pipeline slot's ``BindingRegistry`` prepares split (Bcap, G) bindings; it
    keeps the slot's draft bindings, prepared with the first G of each bucket."""

    def __init__(self, ctx: DeviceContext, width: int, device: str, slot: int,
                 varying_depth: bool) -> None:
        self.ctx = ctx
        self.width = width
        self.slot = slot
        self.verify = binding_factory(ctx.target, width, device)
        cuda = ctx.device.type == "cuda"
        self.draft_pool = torch.cuda.graph_pool_handle() if cuda else None
        self.pack_pool = torch.cuda.graph_pool_handle() if cuda else None
        self.by_depth = ctx.drafting.drafts_by_depth
        # Every depth a policy may pick when it may pick any (adaptive draft steps, their
        # calibration, a policy of the embedder's), else the width alone; deepest first:
        # graphs sharing a pool are best captured in decreasing size.
        varies = self.by_depth and varying_depth and width > 1
        self.depths = tuple(range(width, 0, -1)) if varies else (width,)
        self._drafts: dict[int, dict[int, DraftBinding]] = {}
        self._examples: dict[int, Drafted] = {}
        self.preparing = "a binding"  # what is being prepared: names a failure at start

    @property
    def draft_keys(self) -> tuple[tuple[int, int, int, int], ...]:
        """(slot, width, Bcap, depth) of every draft binding prepared."""
        return tuple(sorted((self.slot, self.width, bucket, depth)
                            for bucket, drafts in self._drafts.items() for depth in drafts))

    def __call__(self, num_reqs: int, num_rows: int) -> SplitBinding:
        # The target's verify first (its own memory pool): its outputs are checked against
        # the target's sizes before a drafter reads hidden states of that width.
        self.preparing = "the target's verify"
        verify = self.verify(num_reqs, num_rows)
        drafts = self._drafts.get(num_reqs)
        if drafts is None:
            # On the CPU only the deepest draft is prewarmed: it runs every shape the
            # shallower ones run.
            self.preparing = "the drafter's draft"
            drafts = self._drafts[num_reqs] = {
                depth: DraftBinding(self.ctx, num_reqs, depth, self.draft_pool,
                                    warm=depth == self.depths[0]) for depth in self.depths}
        self.preparing = "packing"
        pack = PackBinding(self.ctx, num_reqs, num_rows, self._example(num_reqs, drafts),
                           self.pack_pool)
        return SplitBinding(key=(self.slot, self.width, num_reqs, num_rows), drafts=drafts,
                            pack=pack, verify=verify, drafts_by_depth=self.by_depth)

    def _example(self, num_reqs: int, drafts: dict[int, DraftBinding]) -> Drafted:
        """A draft of the bucket on padding, the pack binding's example inputs: on the CPU
        the deepest draft's prewarm; on cuda an eager run (a captured graph's outputs hold
        nothing meaningful before its first replay)."""
        example = self._examples.get(num_reqs)
        if example is None:
            deepest = drafts[self.depths[0]]
            example = deepest.call.outputs if deepest.call.graph is None else draft_block(
                self.ctx, torch.full((num_reqs,), self.ctx.states.scratch, dtype=torch.int64,
                                     device=self.ctx.device), self.depths[0])
            self._examples[num_reqs] = example
        return example
