"""How each algorithm drafts a round and keeps its drafter's context: none, DSpark, MTP.

Every drafter returns a block of ``width`` drafted tokens per batch entry with a conditional
confidence per position (DSpark's confidence head; for MTP the selected-token probability),
so allocation, packing and commit are shared. MTP at depth d < w fills positions past d with
zero confidence; the verify caps never admit them.
"""

from typing import Protocol

import torch
from torch import Tensor

from adaspec.models.protocols import DSparkDrafter, MtpDrafter, PrefillOutput, TargetOutput
from adaspec.runtime.devices.commit import CommitResult, publication
from adaspec.runtime.devices.packing import PackedRows
from adaspec.runtime.slots import SlotStates


class Drafting(Protocol):
    width: int
    """w: drafted tokens per request and round (0 without speculation)."""
    keeps_hidden: bool
    """Whether drafting reads the target hidden state behind each anchor (``SlotStates``
    keeps one per slot only then)."""

    def draft(self, states: SlotStates, slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        """Drafted token ids and confidences, both ``[Bcap, width]``, for the gathered
        ``states`` of the batch entries at KV ``slots [Bcap]``."""
        ...

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor],
                      slots: Tensor) -> None:
        """Give the drafter the context of newly prefilled prompts."""
        ...

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        """Keep the drafter's context consistent with what the round committed."""
        ...


class NoDrafting:
    """The target alone: every round verifies only each request's anchor row, and slots keep
    no hidden state (nothing drafts from it)."""

    width = 0
    keeps_hidden = False

    def __init__(self) -> None:
        # Blocks with no columns hold no values that anything could change: one pair per
        # batch shape serves every round.
        self._empty: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def draft(self, states: SlotStates, slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        key = (slots.shape[0], slots.device)
        empty = self._empty.get(key)
        if empty is None:
            confidences = torch.zeros(slots.shape[0], 0, device=slots.device)
            empty = self._empty[key] = (confidences.to(torch.int64), confidences)
        return empty

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor],
                      slots: Tensor) -> None:
        """Nothing to keep."""

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        """Nothing to keep."""


class DSparkDrafting:
    """One parallel block per round from the hidden state behind each anchor; the drafter
    keeps no context of its own."""

    keeps_hidden = True

    def __init__(self, drafter: DSparkDrafter, width: int) -> None:
        self.drafter = drafter
        self.width = width

    def draft(self, states: SlotStates, slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        block = self.drafter.draft(states.hidden, states.anchor_ids, self.width)
        return block.token_ids, block.confidences

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor],
                      slots: Tensor) -> None:
        """Nothing to keep."""

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        """Nothing to keep."""


class MtpDrafting:
    """``depth`` sequential MTP steps; the MTP head keeps a KV context that is published from
    the target's hidden states of committed rows."""

    keeps_hidden = True

    def __init__(self, drafter: MtpDrafter, width: int, context_limit: int,
                 scratch_slot: int) -> None:
        self.drafter = drafter
        self.width = width
        self.context_limit = context_limit
        self.scratch_slot = scratch_slot

    def draft(self, states: SlotStates, slots: Tensor, depth: int) -> tuple[Tensor, Tensor]:
        tokens, probs = [], []
        hidden, token = states.hidden, states.anchor_ids
        for step in range(depth):
            # Step j sits at the position of the row that produced the anchor, plus j. Steps
            # past the context limit draft tokens the caps never verify; they run on the
            # scratch slot so nothing is written outside the cache.
            # Padding entries read the scratch slot's state (anchor position 0), so their
            # first step would sit at -1: clamped into the cache like the far end.
            positions = states.anchor_positions - 1 + step
            inside = (positions < self.context_limit) & (positions >= 0)
            out = self.drafter.step(hidden, token,
                                    positions.clamp(0, self.context_limit - 1),
                                    torch.where(inside, slots, self.scratch_slot))
            hidden, token = out.hidden, out.token_ids
            tokens.append(token)
            probs.append(out.probs)
        drafts = torch.zeros(slots.shape[0], self.width, dtype=torch.int64, device=slots.device)
        confidences = torch.zeros(slots.shape[0], self.width, device=slots.device)
        if depth:
            drafts[:, :depth] = torch.stack(tokens, 1)
            confidences[:, :depth] = torch.stack(probs, 1).to(confidences.dtype)
        return drafts, confidences

    def after_prefill(self, prefill: PrefillOutput, prompts: list[Tensor],
                      slots: Tensor) -> None:
        for index, prompt in enumerate(prompts):
            count = len(prompt) - 1
            if count > 0:
                device = prefill.hidden.device
                self.drafter.publish(prefill.hidden[index, :count], prompt[1:].to(device),
                                     torch.arange(count, device=device),
                                     slots[index].repeat(count))

    def after_commit(self, out: TargetOutput, packed: PackedRows, result: CommitResult) -> None:
        self.drafter.publish(out.hidden, *publication(packed, result, self.scratch_slot))
