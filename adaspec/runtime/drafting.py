"""How each algorithm drafts a round and keeps its drafter's context: none, DSpark, MTP.

Every drafter returns a block of ``width`` drafted tokens per batch entry with a conditional
confidence per position (DSpark's confidence head; for MTP the selected-token probability),
so allocation, packing and commit are shared. MTP at depth d < w fills positions past d with
zero confidence; the verify caps never admit them.

A drafter call for a batch entry whose anchor sits at position n is made at p = n - 1 (the
position of the target state it starts from, ``KvSlotStates.hidden``), MTP step j at
p = n - 1 + j. Calls stay at p <= context_limit - 2, so the token a call is given (at p + 1)
is always inside the context; past that, and for padding entries (anchor position 0), they run
on the scratch KV slot at a clamped position: no verify row ever reaches their drafts, because
``emit_budget`` caps a request's last verify row at context_limit - 2.
"""

from typing import Protocol

import torch
from torch import Tensor

from adaspec.models.protocols import (
    ContextRows,
    DrafterContext,
    DSparkDrafter,
    MtpDrafter,
    PrefillOutput,
    TargetOutput,
)
from adaspec.runtime.devices.commit import CommitResult, publication
from adaspec.runtime.devices.packing import PackedRows
from adaspec.runtime.kv_slots import KvSlotStates


class Drafting(Protocol):
    width: int
    """w: drafted tokens per request and round (0 without speculation)."""
    keeps_hidden: bool
    """Whether drafting reads the target hidden state behind each anchor (``KvSlotStates``
    keeps one per KV slot only then)."""
    drafts_by_depth: bool
    """Whether the work of ``draft`` depends on ``depth`` (MTP runs ``depth`` steps; a DSpark
    block always drafts the width), so a prepared draft binding is keyed by it."""

    @property
    def context(self) -> "PublishedContext | None":
        """The context the drafter keeps from published rows, or None: only then does it
        read the prompts' hidden states a prefill returns."""
        ...

    def draft(self, states: KvSlotStates, kv_slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        """Drafted token ids and confidences, both ``[Bcap, width]``, for the gathered
        ``states`` of the batch entries at ``kv_slots [Bcap]``."""
        ...

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                      first_token_ids: Tensor) -> None:
        """Give the drafter the context of newly prefilled prompts, whose first generated
        tokens are ``first_token_ids [B]``."""
        ...

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        """Keep the drafter's context consistent with what the round committed."""
        ...


def call_positions(anchor_positions: Tensor, step: int, kv_slots: Tensor, context_limit: int,
                   scratch_kv_slot: int) -> tuple[Tensor, Tensor]:
    """Positions and KV slots ``[Bcap]`` of draft call ``step`` (0 for the first) of entries
    whose anchors sit at ``anchor_positions``: p = anchor - 1 + step, kept in
    0 .. context_limit - 2; a call outside that runs on the scratch KV slot."""
    positions = anchor_positions + (step - 1)
    clamped = positions.clamp(0, max(context_limit - 2, 0))
    # Four small kernels a call: a round pays them once per draft call.
    return clamped, torch.where(clamped == positions, kv_slots, scratch_kv_slot)


class PublishedContext:
    """Keeps a drafter's own context (``DrafterContext``): allocated with the target's KV
    slots, fed every prompt position after prefill and every committed row after commit."""

    def __init__(self, drafter: DrafterContext, num_kv_slots: int) -> None:
        drafter.allocate(num_kv_slots)
        self.drafter = drafter
        self.scratch_kv_slot = num_kv_slots

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                      first_token_ids: Tensor) -> None:
        self.drafter.publish(ContextRows.of_prompts(prefill, prompts, kv_slots, first_token_ids))

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        next_token_ids, positions, kv_slots = publication(packed, result, self.scratch_kv_slot)
        self.drafter.publish(ContextRows(token_ids=packed.rows.token_ids, hidden=out.hidden,
                                         next_token_ids=next_token_ids, positions=positions,
                                         kv_slots=kv_slots))


def own_context(drafter: object, num_kv_slots: int) -> PublishedContext | None:
    """The published context of a DSpark drafter that keeps one (it has ``publish``: the
    start's conformance check made sure it is a whole ``DrafterContext``), or None."""
    if not callable(getattr(drafter, "publish", None)):
        return None
    return PublishedContext(drafter, num_kv_slots)  # type: ignore[arg-type]


class NoDrafting:
    """The target alone: every round verifies only each request's anchor row, and KV slots keep
    no hidden state (nothing drafts from it)."""

    width = 0
    keeps_hidden = False
    context = None
    drafts_by_depth = False

    def __init__(self) -> None:
        # Blocks with no columns hold no values that anything could change: one pair per
        # batch shape serves every round.
        self._empty: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def draft(self, states: KvSlotStates, kv_slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        key = (kv_slots.shape[0], kv_slots.device)
        empty = self._empty.get(key)
        if empty is None:
            confidences = torch.zeros(kv_slots.shape[0], 0, device=kv_slots.device)
            empty = self._empty[key] = (confidences.to(torch.int64), confidences)
        return empty

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                      first_token_ids: Tensor) -> None:
        """Nothing to keep."""

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        """Nothing to keep."""


class DSparkDrafting:
    """One parallel block per round from the hidden state behind each anchor; a drafter that
    keeps a context of its own (``DrafterContext``) gets it published as an MTP head does."""

    keeps_hidden = True
    drafts_by_depth = False

    def __init__(self, drafter: DSparkDrafter, width: int, context_limit: int,
                 num_kv_slots: int) -> None:
        self.drafter = drafter
        self.width = width
        self.context_limit = context_limit
        self.scratch_kv_slot = num_kv_slots
        self.context = own_context(drafter, num_kv_slots)

    def draft(self, states: KvSlotStates, kv_slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        positions, call_kv_slots = call_positions(states.anchor_positions, 0, kv_slots,
                                                  self.context_limit, self.scratch_kv_slot)
        block = self.drafter.draft(states.hidden, states.anchor_ids, positions, call_kv_slots,
                                   self.width)
        return block.token_ids, clean_confidences(block.confidences)

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                      first_token_ids: Tensor) -> None:
        if self.context is not None:
            self.context.after_prefill(prefill, prompts, kv_slots, first_token_ids)

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        if self.context is not None:
            self.context.after_commit(out, packed, result)


def clean_confidences(confidences: Tensor) -> Tensor:
    """A drafter's confidences as the runtime uses, retires and logs them: clamped into
    [0, 1], NaN read as 0 (no confidence), so the allocation, the policies' feedback and the
    event log see the same numbers, and a replay of the log reproduces the run."""
    return torch.nan_to_num(confidences, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)


class MtpDrafting:
    """``depth`` sequential MTP steps; the MTP head keeps a KV context that is published from
    the prompt and from the target's hidden states of committed rows."""

    keeps_hidden = True
    drafts_by_depth = True

    def __init__(self, drafter: MtpDrafter, width: int, context_limit: int,
                 num_kv_slots: int) -> None:
        self.drafter = drafter
        self.width = width
        self.context_limit = context_limit
        self.scratch_kv_slot = num_kv_slots
        self.context = PublishedContext(drafter, num_kv_slots)

    def draft(self, states: KvSlotStates, kv_slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        tokens, probs = [], []
        hidden, token = states.hidden, states.anchor_ids
        for step in range(depth):
            positions, step_kv_slots = call_positions(states.anchor_positions, step, kv_slots,
                                                      self.context_limit, self.scratch_kv_slot)
            out = self.drafter.step(hidden, token, positions, step_kv_slots)
            hidden, token = out.hidden, out.token_ids
            tokens.append(token)
            probs.append(out.probs)
        drafts = torch.zeros(kv_slots.shape[0], self.width, dtype=torch.int64,
                             device=kv_slots.device)
        confidences = torch.zeros(kv_slots.shape[0], self.width, device=kv_slots.device)
        if depth:
            drafts[:, :depth] = torch.stack(tokens, 1)
            confidences[:, :depth] = torch.stack(probs, 1).to(confidences.dtype)
        return drafts, clean_confidences(confidences)

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                      first_token_ids: Tensor) -> None:
        self.context.after_prefill(prefill, prompts, kv_slots, first_token_ids)

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        self.context.after_commit(out, packed, result)
