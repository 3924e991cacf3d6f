"""Packing: lay the verify rows of a round into a padded graph of G rows, on the device.

Batch entry i contributes ``1 + verify_lengths[i]`` consecutive rows (its anchor row, then its
admitted draft positions) starting at ``cu_num_rows[i]``; the remaining rows up to G are
padding. Every index is computed from device tensors with fixed shapes (``searchsorted``
over the offsets, never a boolean mask or ``nonzero``), so packing never reads the lengths
back to the host and can be captured in a graph keyed by (Bcap, G).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from adaspec.models.protocols import VerifyRows


@dataclass(frozen=True, slots=True)
class PackedRows:
    """The verify rows of one round and the maps between rows and (request, position)."""

    rows: VerifyRows  # what the target verifies: [G] rows over Bcap batch entries
    verify_lengths: Tensor  # [Bcap] int64 drafted tokens each entry verifies
    num_entry_rows: Tensor  # [Bcap] int64 rows of each entry: 1 + verify length, 0 for padding
    cu_num_rows: Tensor  # [Bcap + 1] int64 first row of each entry; cu_num_rows[-1] = used rows
    grid_rows: Tensor  # [Bcap, width + 1] int64 packed row of (entry, offset); clamped
    grid_valid: Tensor  # [Bcap, width + 1] bool whether that (entry, offset) has a row
    draft_indices: Tensor  # [G] int64 flat index entry * width + (offset - 1) of each draft
    #                        row's token in the [Bcap, width] draft block; -1 elsewhere

    @property
    def width(self) -> int:
        return self.grid_rows.shape[1] - 1


def grid_width(width: int, num_rows: int) -> int:
    """The most rows one request can hold in a G-row round: w + 1, or G where G is smaller.
    The target's attention grid has one column per such row, so a shallow round in a wide
    launch does not pay for columns no request can fill."""
    return min(width + 1, num_rows)


def pack_rows(verify_lengths: Tensor, anchor_token_ids: Tensor, draft_token_ids: Tensor,
              req_slots: Tensor, anchor_positions: Tensor, req_valid: Tensor,
              num_rows: int) -> PackedRows:
    """Pack ``num_rows`` (G) verify rows.

    ``verify_lengths [Bcap]`` from prefix allocation (their rows plus one anchor row per live
    entry must fit in G); ``anchor_token_ids [Bcap]`` each entry's newest committed token;
    ``draft_token_ids [Bcap, width]``; ``req_slots [Bcap]`` KV slots (padding entries: the
    scratch slot); ``anchor_positions [Bcap]``; ``req_valid [Bcap]`` False for padding entries.
    Padding rows belong to entry 0 at offset 0 and are marked invalid, so the target writes
    them to the scratch slot.
    """
    num_reqs, width = draft_token_ids.shape
    device = draft_token_ids.device
    lengths = torch.where(req_valid, verify_lengths, torch.zeros_like(verify_lengths))
    entry_rows = torch.where(req_valid, lengths + 1, torch.zeros_like(lengths))
    cu_num_rows = torch.zeros(num_reqs + 1, dtype=torch.int64, device=device)
    cu_num_rows[1:] = torch.cumsum(entry_rows, dim=0)
    # Rows past G would be dropped and their requests would commit a neighbour's tokens.
    # The host picks G from legal tiers (G >= Bcap), so this only fires on a caller bug; the
    # check is asynchronous on an accelerator and never waits for the device.
    torch._assert_async(cu_num_rows[-1] <= num_rows,
                        f"pack_rows: the verify rows do not fit G={num_rows} rows (G must be "
                        "at least the live requests, and lengths come from allocate_prefixes)")

    row = torch.arange(num_rows, device=device)
    # Entry i owns rows cu[i] .. cu[i+1]-1: the first entry whose end lies beyond the row.
    owner = torch.searchsorted(cu_num_rows[1:], row, right=True)
    row_valid = row < cu_num_rows[-1]
    row_reqs = torch.where(row_valid, owner, 0).clamp(max=num_reqs - 1)
    row_offsets = torch.where(row_valid, row - cu_num_rows.index_select(0, row_reqs), 0)

    is_draft = row_valid & (row_offsets > 0)
    draft_indices = torch.where(is_draft, row_reqs * width + row_offsets - 1, -1)
    token_ids = anchor_token_ids.index_select(0, row_reqs)
    if width:  # without speculation (width 0) every row is an anchor row
        drafted = draft_token_ids.flatten().index_select(0, draft_indices.clamp(min=0))
        token_ids = torch.where(is_draft, drafted, token_ids)

    offsets = torch.arange(width + 1, device=device)
    grid_valid = offsets[None, :] < entry_rows[:, None]
    grid_rows = (cu_num_rows[:-1, None] + offsets[None, :]).clamp(max=num_rows - 1)
    rows = VerifyRows(token_ids=token_ids, row_reqs=row_reqs, row_offsets=row_offsets,
                      row_valid=row_valid, req_slots=req_slots, req_starts=anchor_positions,
                      rows_per_req=grid_width(width, num_rows))
    return PackedRows(rows=rows, verify_lengths=lengths, num_entry_rows=entry_rows,
                      cu_num_rows=cu_num_rows, grid_rows=grid_rows, grid_valid=grid_valid,
                      draft_indices=draft_indices)
