"""Per-request decoding state kept on the device, indexed by KV slot.

With two rounds in flight, round n starts before the host has seen round n-1's result, so
everything round n needs from round n-1 (each request's newest token, its position, the
hidden state its drafter continues from, how many tokens it may still produce, whether it is
still running) lives in device arrays that round n-1's commit updates in place. The host only
says which KV slots form the batch; a request that finished in round n-1 is still in round
n's host batch, and its ``live`` flag keeps round n from committing anything for it.

Row ``num_slots`` is the scratch row: padding entries of a batch read and write there.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from adaspec.config.requests import MAX_STOP_TOKENS
from adaspec.runtime.devices.sampling import SamplingTensors


@dataclass(frozen=True, slots=True)
class SlotStates:
    """Decoding state of every KV slot (``num_slots + 1`` rows, the last one scratch)."""

    anchor_ids: Tensor  # [S + 1] int64 newest committed token (the next round's anchor)
    anchor_positions: Tensor  # [S + 1] int64 position of that token
    hidden: Tensor  # [S + 1, hidden_size] target hidden state of the row that produced it;
    #                 no columns when nothing drafts from it (``keeps_hidden``)
    remaining: Tensor  # [S + 1] int64 tokens the request may still generate
    live: Tensor  # [S + 1] bool the request is still decoding

    @classmethod
    def allocate(cls, num_slots: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> "SlotStates":
        rows = num_slots + 1
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

    def gather(self, slots: Tensor) -> "SlotStates":
        """The rows of ``slots [Bcap]`` (copies, so a later scatter cannot change them).
        ``index_select`` rather than ``tensor[slots]``: the same rows at a fraction of the
        CPU cost of advanced indexing, which a round pays for every tensor it gathers."""
        return SlotStates(anchor_ids=self.anchor_ids.index_select(0, slots),
                          anchor_positions=self.anchor_positions.index_select(0, slots),
                          hidden=self.hidden.index_select(0, slots),
                          remaining=self.remaining.index_select(0, slots),
                          live=self.live.index_select(0, slots))

    def scatter(self, slots: Tensor, rows: "SlotStates") -> None:
        """Write ``rows`` back at ``slots``. Padding entries all point at the scratch row, so
        duplicate indices only ever collide there."""
        self.anchor_ids.index_copy_(0, slots, rows.anchor_ids)
        self.anchor_positions.index_copy_(0, slots, rows.anchor_positions)
        if self.hidden.shape[1]:
            self.hidden.index_copy_(0, slots, rows.hidden)
        self.remaining.index_copy_(0, slots, rows.remaining)
        self.live.index_copy_(0, slots, rows.live)




@dataclass(frozen=True, slots=True)
class SlotSampling:
    """Each KV slot's sampling parameters, written once at prefill, so a round only gathers
    them on the device instead of building them on the host every round."""

    temperature: Tensor  # [S + 1] float64; 0 decodes greedily
    top_k: Tensor  # [S + 1] int64
    top_p: Tensor  # [S + 1] float64
    min_p: Tensor  # [S + 1] float64
    stop_token_ids: Tensor  # [S + 1, MAX_STOP_TOKENS] int64, -1 padded

    @classmethod
    def allocate(cls, num_slots: int, device: torch.device | str) -> "SlotSampling":
        rows = num_slots + 1
        return cls(temperature=torch.zeros(rows, dtype=torch.float64, device=device),
                   top_k=torch.zeros(rows, dtype=torch.int64, device=device),
                   top_p=torch.ones(rows, dtype=torch.float64, device=device),
                   min_p=torch.zeros(rows, dtype=torch.float64, device=device),
                   stop_token_ids=torch.full((rows, MAX_STOP_TOKENS), -1, dtype=torch.int64,
                                             device=device))

    def write(self, slots: Tensor, params: SamplingTensors, stop_token_ids: Tensor) -> None:
        self.temperature[slots] = params.temperature
        self.top_k[slots] = params.top_k
        self.top_p[slots] = params.top_p
        self.min_p[slots] = params.min_p
        self.stop_token_ids[slots] = stop_token_ids

    def gather(self, slots: Tensor, all_greedy: bool) -> SamplingTensors:
        return SamplingTensors(temperature=self.temperature.index_select(0, slots),
                               top_k=self.top_k.index_select(0, slots),
                               top_p=self.top_p.index_select(0, slots),
                               min_p=self.min_p.index_select(0, slots),
                               all_greedy=all_greedy)
