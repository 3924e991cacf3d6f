"""Packing: lay the verify rows of a round into a padded graph of G rows, on the device.

Batch entry i contributes ``1 + verify_lengths[i]`` consecutive rows (its anchor row, then its
admitted draft positions) starting at ``cu_num_rows[i]``; the remaining rows up to G are
padding. Every index is computed from device tensors with fixed shapes (a scatter of grid
cells into rows, never a boolean mask or ``nonzero``), so packing never reads the lengths
back to the host and can be captured in a graph keyed by (Bcap, G).
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


@dataclass(frozen=True, slots=True)
class _Layout:
    """Constants of one (Bcap, w) packing, by flat grid cell ``entry * (w + 1) + offset``."""

    offsets: Tensor  # [w + 1] 0 .. w
    cell_entries: Tensor  # [Bcap * (w + 1)] entry of each cell
    cell_offsets: Tensor  # [Bcap * (w + 1)] offset of each cell
    cell_drafts: Tensor  # [Bcap * (w + 1)] flat draft index entry * w + offset - 1; -1 at 0
    cell_numbers: Tensor  # [Bcap * (w + 1)] 0 .. Bcap * (w + 1) - 1


def _make_layout(num_reqs: int, width: int, device: torch.device) -> _Layout:
    cells = torch.arange(num_reqs * (width + 1), device=device)
    entries, offsets = cells // (width + 1), cells % (width + 1)
    return _Layout(offsets=torch.arange(width + 1, device=device), cell_entries=entries,
                   cell_offsets=offsets,
                   cell_drafts=torch.where(offsets > 0, entries * width + offsets - 1, -1),
                   cell_numbers=cells)


@functools.lru_cache(maxsize=256)
def _cached_layout(num_reqs: int, width: int, device: torch.device) -> _Layout:
    return _make_layout(num_reqs, width, device)


def _layout(num_reqs: int, width: int, device: torch.device) -> _Layout:
    """Cached per shape and device, except while a CUDA graph is being captured: work made
    then is recorded, never run, so its tensors must not be reused outside the graph. The
    constants never leave ``pack_rows``: every tensor it returns is a fresh result."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _make_layout(num_reqs, width, device)
    if device.type in ("cpu", "cuda"):
        return _cached_layout(num_reqs, width, device)
    return _make_layout(num_reqs, width, device)


def pack_rows(verify_lengths: Tensor, anchor_token_ids: Tensor, draft_token_ids: Tensor,
              req_kv_slots: Tensor, anchor_positions: Tensor, req_valid: Tensor,
              num_rows: int) -> PackedRows:
    """Pack ``num_rows`` (G) verify rows.

    ``verify_lengths [Bcap]`` from prefix allocation (their rows plus one anchor row per live
    entry must fit in G); ``anchor_token_ids [Bcap]`` each entry's newest committed token;
    ``draft_token_ids [Bcap, width]``; ``req_kv_slots [Bcap]`` KV slots (padding entries: the
    scratch KV slot); ``anchor_positions [Bcap]``; ``req_valid [Bcap]`` False for padding entries.
    Padding rows belong to entry 0 at offset 0 and are marked invalid, so the target writes
    them to the scratch KV slot.
    """
    if draft_token_ids.shape[1] == 0:
        pack = _pack_anchor if anchor_token_ids.shape[0] == 1 else _pack_anchors
        return pack(verify_lengths, anchor_token_ids, req_kv_slots, anchor_positions, req_valid,
                    num_rows)
    return _pack_general(verify_lengths, anchor_token_ids, draft_token_ids, req_kv_slots,
                         anchor_positions, req_valid, num_rows)


def _pack_general(verify_lengths: Tensor, anchor_token_ids: Tensor, draft_token_ids: Tensor,
                  req_kv_slots: Tensor, anchor_positions: Tensor, req_valid: Tensor,
                  num_rows: int) -> PackedRows:
    num_reqs, width = draft_token_ids.shape
    layout = _layout(num_reqs, width, draft_token_ids.device)
    lengths = verify_lengths * req_valid
    entry_rows = (lengths + 1) * req_valid
    ends = torch.cumsum(entry_rows, dim=0)
    cu_num_rows = F.pad(ends, (1, 0))
    # Rows past G would be dropped and their requests would commit a neighbour's tokens.
    # The host picks G from the legal rows (G >= Bcap), so this only fires on a caller bug; the
    # check is asynchronous on an accelerator and never waits for the device.
    torch._assert_async(ends[-1] <= num_rows,
                        f"pack_rows: the verify rows do not fit G={num_rows} rows (G must be "
                        "at least the live requests, and lengths come from allocate_prefixes)")
    grid_valid = layout.offsets < entry_rows[:, None]
    unclamped = cu_num_rows[:-1, None] + layout.offsets
    # Each row learns its grid cell by a scatter of cell numbers: cells without a row land
    # on a dump row past G, so shapes stay fixed and nothing is read back.
    targets = torch.where(grid_valid, unclamped, num_rows).clamp(max=num_rows).flatten()
    row_cells = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=targets.device)
    row_cells.index_copy_(0, targets, layout.cell_numbers)
    row_cells = row_cells[:num_rows]
    row_valid = row_cells >= 0
    cells = row_cells.clamp(min=0)  # padding rows: cell 0, entry 0 at offset 0
    draft_indices = torch.where(row_valid, layout.cell_drafts.index_select(0, cells), -1)
    candidates = torch.cat([anchor_token_ids[:, None], draft_token_ids], dim=1)
    rows = VerifyRows(token_ids=candidates.flatten().index_select(0, cells),
                      row_reqs=layout.cell_entries.index_select(0, cells),
                      row_offsets=layout.cell_offsets.index_select(0, cells),
                      row_valid=row_valid, req_kv_slots=req_kv_slots, req_starts=anchor_positions,
                      rows_per_req=grid_width(width, num_rows))
    return PackedRows(rows=rows, verify_lengths=lengths, num_entry_rows=entry_rows,
                      cu_num_rows=cu_num_rows, grid_rows=unclamped.clamp(max=num_rows - 1),
                      grid_valid=grid_valid, draft_indices=draft_indices)


def _pack_anchors(verify_lengths: Tensor, anchor_token_ids: Tensor, req_kv_slots: Tensor,
                  anchor_positions: Tensor, req_valid: Tensor, num_rows: int) -> PackedRows:
    """``pack_rows`` of a round without drafts (width 0): each live entry's anchor row in
    entry order, then padding. The layout is the general one, built from the entries
    directly (a grid of one column is the entries themselves), in fewer kernels. Without
    drafts every verify length is 0 (``allocate_prefixes`` of no columns), so the lengths
    are returned as given, their own fresh tensor."""
    num_reqs = anchor_token_ids.shape[0]
    device = anchor_token_ids.device
    entry_rows = req_valid.to(torch.int64)
    ends = torch.cumsum(entry_rows, dim=0)
    firsts = ends - entry_rows
    torch._assert_async(ends[-1] <= num_rows,
                        f"pack_rows: the verify rows do not fit G={num_rows} rows (G must be "
                        "at least the live requests)")
    row_entries = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    row_entries.index_copy_(0, torch.where(req_valid, firsts, num_rows),
                            _layout(num_reqs, 0, device).cell_numbers)
    row_entries = row_entries[:num_rows]
    row_valid = row_entries >= 0
    entries = row_entries.clamp(min=0)  # padding rows: entry 0
    rows = VerifyRows(token_ids=anchor_token_ids.index_select(0, entries), row_reqs=entries,
                      row_offsets=torch.zeros_like(entries), row_valid=row_valid,
                      req_kv_slots=req_kv_slots, req_starts=anchor_positions,
                      rows_per_req=grid_width(0, num_rows))
    return PackedRows(rows=rows, verify_lengths=verify_lengths,
                      num_entry_rows=entry_rows, cu_num_rows=torch.cat((firsts, ends[-1:])),
                      grid_rows=firsts.clamp(max=num_rows - 1)[:, None],
                      grid_valid=req_valid[:, None],
                      draft_indices=torch.full_like(entries, -1))


def _pack_anchor(verify_lengths: Tensor, anchor_token_ids: Tensor, req_kv_slots: Tensor,
                 anchor_positions: Tensor, req_valid: Tensor, num_rows: int) -> PackedRows:
    """``_pack_anchors`` of a batch of one entry: its row is row 0 whether it is live or not
    (a padding row belongs to entry 0 anyway), so the layout needs no ranking, and one row
    always fits G."""
    device = anchor_token_ids.device
    entry_rows = req_valid.to(torch.int64)
    row_valid = req_valid
    if num_rows > 1:
        row_valid = torch.cat((req_valid, torch.zeros(num_rows - 1, dtype=torch.bool,
                                                      device=device)))
    entries = torch.zeros(num_rows, dtype=torch.int64, device=device)
    rows = VerifyRows(token_ids=anchor_token_ids.expand(num_rows).clone(), row_reqs=entries,
                      row_offsets=torch.zeros_like(entries), row_valid=row_valid,
                      req_kv_slots=req_kv_slots, req_starts=anchor_positions,
                      rows_per_req=grid_width(0, num_rows))
    return PackedRows(rows=rows, verify_lengths=verify_lengths,
                      num_entry_rows=entry_rows, cu_num_rows=torch.cat((entries[:1], entry_rows)),
                      grid_rows=torch.zeros((1, 1), dtype=torch.int64, device=device),
                      grid_valid=req_valid[:, None],
                      draft_indices=torch.full_like(entries, -1))
