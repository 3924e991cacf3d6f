"""Per-request decoding state kept on the device, indexed by KV slot.

With two rounds in flight, round n starts before the host has seen round n-1's result, so
everything round n needs from round n-1 (each request's newest token, its position, the
hidden state its drafter continues from, how many tokens it may still produce, whether it is
still running) lives in device arrays that round n-1's commit updates in place. The host only
says which KV slots form the batch; a request that finished in round n-1 is still in round
n's host batch, and its ``live`` flag keeps round n from committing anything for it.

Row ``num_kv_slots`` is the scratch row: padding entries of a batch read and write there.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from adaspec.config.requests import MAX_STOP_TOKENS
from adaspec.runtime.devices.sampling import SamplingTensors


@dataclass(frozen=True, slots=True)
class KvSlotStates:
    """Decoding state of every KV slot (``num_kv_slots + 1`` rows, the last one scratch)."""

    anchor_ids: Tensor  # [S + 1] int64 newest committed token (the next round's anchor)
    anchor_positions: Tensor  # [S + 1] int64 position of that token
    hidden: Tensor  # [S + 1, hidden_size] target hidden state of the row that produced it;
    #                 no columns when nothing drafts from it (``keeps_hidden``)
    remaining: Tensor  # [S + 1] int64 tokens the request may still generate
    live: Tensor  # [S + 1] bool the request is still decoding

    @classmethod
    def allocate(cls, num_kv_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> "KvSlotStates":
        rows = num_kv_slots + 1
        return cls(anchor_ids=torch.zeros(rows, dtype=torch.int64, device=device),
                   anchor_positions=torch.zeros(rows, dtype=torch.int64, device=device),
                   hidden=torch.zeros(rows, hidden_size, dtype=dtype, device=device),
                   remaining=torch.zeros(rows, dtype=torch.int64, device=device),
                   live=torch.zeros(rows, dtype=torch.bool, device=device))

    @property
    def scratch(self) -> int:
        return self.anchor_ids.shape[0] - 1

    @property
    def keeps_hidden(self) -> bool:
        return self.hidden.shape[1] > 0

    def gather(self, kv_slots: Tensor) -> "KvSlotStates":
        """The rows of ``kv_slots [Bcap]`` (copies, so a later scatter cannot change them).
        ``index_select`` rather than ``tensor[kv_slots]``: the same rows at a fraction of the
        CPU cost of advanced indexing, which a round pays for every tensor it gathers."""
        return KvSlotStates(anchor_ids=self.anchor_ids.index_select(0, kv_slots),
                            anchor_positions=self.anchor_positions.index_select(0, kv_slots),
                            hidden=self.hidden.index_select(0, kv_slots),
                            remaining=self.remaining.index_select(0, kv_slots),
                            live=self.live.index_select(0, kv_slots))

    def scatter(self, kv_slots: Tensor, rows: "KvSlotStates") -> None:
        """Write ``rows`` back at ``kv_slots``. Padding entries all point at the scratch row, so
        duplicate indices only ever collide there."""
        self.anchor_ids.index_copy_(0, kv_slots, rows.anchor_ids)
        self.anchor_positions.index_copy_(0, kv_slots, rows.anchor_positions)
        if self.hidden.shape[1]:
            self.hidden.index_copy_(0, kv_slots, rows.hidden)
        self.remaining.index_copy_(0, kv_slots, rows.remaining)
        self.live.index_copy_(0, kv_slots, rows.live)




@dataclass(frozen=True, slots=True)
class KvSlotSampling:
    """Each KV slot's sampling parameters, written once at prefill, so a round only gathers
    them on the device instead of building them on the host every round."""

    temperature: Tensor  # [S + 1] float64; 0 decodes greedily
    top_k: Tensor  # [S + 1] int64
    top_p: Tensor  # [S + 1] float64
    min_p: Tensor  # [S + 1] float64
    stop_token_ids: Tensor  # [S + 1, MAX_STOP_TOKENS] int64, -1 padded

    @classmethod
    def allocate(cls, num_kv_slots: int, device: torch.device | str) -> "KvSlotSampling":
        rows = num_kv_slots + 1
        return cls(temperature=torch.zeros(rows, dtype=torch.float64, device=device),
                   top_k=torch.zeros(rows, dtype=torch.int64, device=device),
                   top_p=torch.ones(rows, dtype=torch.float64, device=device),
                   min_p=torch.zeros(rows, dtype=torch.float64, device=device),
                   stop_token_ids=torch.full((rows, MAX_STOP_TOKENS), -1, dtype=torch.int64,
                                             device=device))

    def write(self, kv_slots: Tensor, params: SamplingTensors, stop_token_ids: Tensor) -> None:
        self.temperature[kv_slots] = params.temperature
        self.top_k[kv_slots] = params.top_k
        self.top_p[kv_slots] = params.top_p
        self.min_p[kv_slots] = params.min_p
        self.stop_token_ids[kv_slots] = stop_token_ids

    def gather(self, kv_slots: Tensor, all_greedy: bool) -> SamplingTensors:
        return SamplingTensors(temperature=self.temperature.index_select(0, kv_slots),
                               top_k=self.top_k.index_select(0, kv_slots),
                               top_p=self.top_p.index_select(0, kv_slots),
                               min_p=self.min_p.index_select(0, kv_slots),
                               all_greedy=all_greedy)


class KvSlotPool:
    """The host's KV slots: free ones handed to admitted requests (the most recently freed
    first; at the start, the lowest), and those of ended requests held back until nothing in
    flight writes them any more. A request's KV slot is ``-1`` when it holds none."""

    def __init__(self, num_kv_slots: int) -> None:
        self._free = list(range(num_kv_slots))[::-1]  # pop() takes from the end
        self._held: list[HoldsKvSlot] = []  # ended, their KV slot not yet free

    @property
    def available(self) -> bool:
        return bool(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def hold(self, request: "HoldsKvSlot") -> None:
        """``request`` ended: its KV slot is freed by a later ``reclaim``."""
        if request.kv_slot >= 0:
            self._held.append(request)

    def reclaim(self, retired_through: int, writing: Callable[["HoldsKvSlot"], bool]) -> None:
        """Free the KV slots of ended requests whose last round retired (through
        ``retired_through``) and that ``writing`` (a prefill still pending) does not name."""
        keep = []
        for request in self._held:
            if request.last_round <= retired_through and not writing(request):
                self._free.append(request.kv_slot)
                request.kv_slot = -1
            else:
                keep.append(request)
        self._held = keep


class HoldsKvSlot(Protocol):
    """A request as the pool sees it."""

    kv_slot: int
    last_round: int
