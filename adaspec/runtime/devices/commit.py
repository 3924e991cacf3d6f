"""Commit: from the target token of every verify row, what each request keeps this round.

Row j of a request verified draft position j+1: the drafted token is accepted when the row
before it produced the same target token (greedy argmax or draw). The accepted run is the
leading stretch of matches; the target token of the first row past it is committed too, as
the residual token (a mismatch) or the bonus token (every verified draft matched). Because an
accepted draft equals its row's target token, the committed tokens are simply the target
tokens of rows 0 .. accepted: each committed once, none dropped. A stop token or the
request's token budget (``allocation.emit_budget``: max_tokens and the context limit) inside
that run cuts it right after the token concerned.

Everything stays on the device in fixed shapes; the small results reach the host only through
the retire copy.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from adaspec.runtime.devices.packing import PackedRows

RUNNING = 0
FINISHED_STOP = 1
FINISHED_LENGTH = 2
"""Finish codes in ``CommitResult.finish``: still running, emitted a stop token, or reached
its token budget (max_tokens or the context limit)."""


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What one round commits. Acceptance length (AL) = num_accepted + 1: it counts the
    residual or bonus token."""

    num_accepted: Tensor  # [Bcap] int64 drafted tokens the target agreed with (before stops)
    num_emitted: Tensor  # [Bcap] int64 tokens committed; 0 for padding entries
    token_ids: Tensor  # [Bcap, width + 1] int64 committed tokens, -1 past num_emitted
    finish: Tensor  # [Bcap] int8 RUNNING, FINISHED_STOP or FINISHED_LENGTH
    next_anchor_ids: Tensor  # [Bcap] int64 newest committed token (padding: -1)
    last_rows: Tensor  # [Bcap] int64 packed row whose output produced that token; its hidden
    #                    state is what the drafter continues from (meaningless for padding)
    row_committed: Tensor  # [G] bool rows whose following token was committed: their KV and
    #                        the drafter's context at their position become permanent
    row_next_token_ids: Tensor  # [G] int64 the committed token after each such row, else -1


def accepted_lengths(packed: PackedRows, target_token_ids: Tensor,
                     draft_token_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Target tokens on the (entry, offset) grid ``[Bcap, width + 1]`` and the accepted
    draft count of each entry ``[Bcap]``."""
    gathered = target_token_ids.index_select(0, packed.grid_rows.flatten())
    grid_tokens = torch.where(packed.grid_valid, gathered.view_as(packed.grid_rows), -1)
    verified = packed.grid_valid[:, 1:]  # draft position j+1 has a row
    matches = verified & (grid_tokens[:, :-1] == draft_token_ids)
    return grid_tokens, torch.cumprod(matches.to(torch.int64), dim=1).sum(dim=1)


def stop_cut(tokens: Tensor, stop_token_ids: Tensor) -> Tensor:
    """[Bcap] tokens to keep so the run ends just after its first stop token (more than the
    run's length when there is none). ``stop_token_ids [Bcap, S]`` is padded with -1, which
    matches nothing."""
    hits = (tokens[:, :, None] == stop_token_ids[:, None, :]).any(dim=-1) & (tokens >= 0)
    offsets = torch.arange(tokens.shape[1], device=tokens.device)
    no_stop = tokens.shape[1] + 1
    return torch.where(hits, offsets, no_stop).min(dim=1).values + 1


def commit_rows(packed: PackedRows, target_token_ids: Tensor, draft_token_ids: Tensor,
                stop_token_ids: Tensor | None, budget: Tensor, req_valid: Tensor
                ) -> CommitResult:
    """Commit one round.

    ``target_token_ids [G]`` from ``sample_rows`` (agreed across TP ranks); ``draft_token_ids
    [Bcap, width]``; ``stop_token_ids [Bcap, S]``, or None when no entry has any (the same
    result as all -1, without looking); ``budget [Bcap]`` from ``emit_budget``, the tokens
    each entry may still commit (at least 1 for live entries); ``req_valid [Bcap]``.
    """
    if draft_token_ids.shape[1] == 0:
        return _commit_anchors(packed, target_token_ids, stop_token_ids, budget, req_valid)
    return _commit_general(packed, target_token_ids, draft_token_ids, stop_token_ids, budget,
                           req_valid)


def _commit_general(packed: PackedRows, target_token_ids: Tensor, draft_token_ids: Tensor,
                    stop_token_ids: Tensor | None, budget: Tensor, req_valid: Tensor
                    ) -> CommitResult:
    grid_tokens, num_accepted = accepted_lengths(packed, target_token_ids, draft_token_ids)
    offsets = torch.arange(grid_tokens.shape[1], device=grid_tokens.device)
    allowed = torch.minimum(num_accepted + 1, budget)
    if stop_token_ids is None:
        num_emitted = allowed * req_valid
        finish = torch.where(num_emitted >= budget, FINISHED_LENGTH, RUNNING)
    else:
        candidates = torch.where(offsets <= num_accepted[:, None], grid_tokens, -1)
        cut = stop_cut(candidates, stop_token_ids)
        num_emitted = torch.minimum(allowed, cut) * req_valid
        finish = torch.where(cut <= allowed, FINISHED_STOP,
                             torch.where(num_emitted >= budget, FINISHED_LENGTH, RUNNING))
    # What is emitted never runs past the accepted drafts and the token after them, so it is
    # simply the leading num_emitted target tokens of the entry's grid.
    token_ids = torch.where(offsets < num_emitted[:, None], grid_tokens, -1)
    finish = (finish * req_valid).to(torch.int8)
    last_rows = packed.grid_rows.gather(1, (num_emitted - 1).clamp(min=0)[:, None]).squeeze(1)
    rows = packed.rows
    row_committed = rows.row_valid & (rows.row_offsets < num_emitted.index_select(0,
                                                                                 rows.row_reqs))
    # A committed row's following token is that row's own target token.
    return CommitResult(
        num_accepted=num_accepted * req_valid, num_emitted=num_emitted,
        token_ids=token_ids, finish=finish,
        next_anchor_ids=torch.where(num_emitted > 0,
                                    target_token_ids.index_select(0, last_rows), -1),
        last_rows=last_rows, row_committed=row_committed,
        row_next_token_ids=torch.where(row_committed, target_token_ids, -1))


def _commit_anchors(packed: PackedRows, target_token_ids: Tensor, stop_token_ids: Tensor | None,
                    budget: Tensor, req_valid: Tensor) -> CommitResult:
    """``commit_rows`` of a round without drafts (width 0): every live entry commits its
    anchor row's target token, which may be a stop token or its last; the same result as
    the general rule, in fewer kernels. A live entry's budget is at least 1 (the rule of
    ``commit_rows``), so each live entry commits exactly one token and every row of a live
    entry is committed."""
    last_rows = packed.grid_rows[:, 0]
    anchor_tokens = target_token_ids.index_select(0, last_rows)
    finish = (req_valid & (budget <= 1)).to(torch.int8).mul_(FINISHED_LENGTH)
    if stop_token_ids is not None:
        stopped = (anchor_tokens[:, None] == stop_token_ids).any(dim=1) & req_valid
        finish.masked_fill_(stopped, FINISHED_STOP)
    num_emitted = req_valid.to(torch.int64)
    tokens = torch.where(req_valid, anchor_tokens, -1)
    row_committed = packed.rows.row_valid.clone()
    return CommitResult(
        num_accepted=torch.zeros_like(num_emitted), num_emitted=num_emitted,
        token_ids=tokens[:, None], finish=finish, next_anchor_ids=tokens, last_rows=last_rows,
        row_committed=row_committed,
        row_next_token_ids=torch.where(row_committed, target_token_ids, -1))


def publication(packed: PackedRows, result: CommitResult,
                scratch_kv_slot: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(next_token_ids, positions, kv_slots)``, each ``[G]``, for a drafter that keeps its own
    context (``MtpDrafter.publish`` with the target's packed hidden states): every committed
    row publishes its position and the token after it in its request's KV slot; the other rows
    (rejected suffix, padding) go to the scratch KV slot, so the shape never depends on the round.
    """
    rows = packed.rows
    kv_slots = torch.where(result.row_committed,
                           rows.req_kv_slots.index_select(0, rows.row_reqs), scratch_kv_slot)
    next_ids = result.row_next_token_ids.clamp(min=0)
    return next_ids, rows.positions, kv_slots
