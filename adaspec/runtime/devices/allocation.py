"""Prefix allocation: which drafted tokens the target verifies this round.

The host fixes the padded target graph rows G ahead of the round from lagged feedback; this
stage fills the ``G - B`` rows left after every live request's anchor row with the current
round's most likely surviving draft positions. It runs on the device, before the target
forward, so trimming really shrinks target work and the host never waits for it.

Survival of draft position k is the running product of the conditional confidences of
positions 1..k. Candidates are ranked by survival; equal survivals keep batch order
(request index, then position), a rule that does not look at any token, so no drafted token
can buy its own admission by its value. Because a survival never exceeds the one before it
and ties keep position order, every request's admitted positions form a contiguous prefix.
With data parallelism each DP shard runs this on its own requests with the common G.
"""

import torch
from torch import Tensor


def emit_budget(remaining: Tensor, anchor_positions: Tensor, context_limit: int) -> Tensor:
    """[Bcap] int64: the most tokens each batch entry may commit this round.

    ``remaining`` counts the tokens a request may still generate (max_tokens less what it
    has). A committed token at position p needs p <= context_limit - 1, so an entry whose
    anchor sits at position a has room for ``context_limit - 1 - a`` more. Passing this
    budget to both ``verify_caps`` and ``commit_rows`` ends a request at the context limit
    with a length finish instead of letting its next anchor fall outside the cache.
    """
    return torch.minimum(remaining, context_limit - 1 - anchor_positions)


def verify_caps(depth: int | Tensor, budget: Tensor, req_valid: Tensor) -> Tensor:
    """[Bcap] int64: the most drafted tokens each batch entry may verify: the round's
    ``depth`` drafts at most (an int, or a 0-dim int64 tensor on ``budget``'s device).

    An entry with ``budget`` tokens left (``emit_budget``) commits at most that many this
    round, accepted drafts plus the residual or bonus token, so verifying more than
    ``budget - 1`` drafts is wasted target work. Padding entries get 0.
    """
    if isinstance(depth, Tensor):
        return torch.minimum((budget - 1).clamp(min=0), depth) * req_valid
    return (budget - 1).clamp(min=0, max=depth) * req_valid


def prefix_survivals(confidences: Tensor) -> Tensor:
    """[Bcap, width] float64 running products of conditional confidences.

    Float64 keeps rounding far below any difference of confidence that matters, and every
    rank computes the same products from the same (agreed) confidences, so the ranking and its
    batch-order tie-break are identical everywhere. Non-finite or out-of-range confidences are
    clamped into [0, 1] so survival never grows along a request.
    """
    clean = torch.nan_to_num(confidences.to(torch.float64), nan=0.0).clamp(0.0, 1.0)
    return torch.cumprod(clean, dim=1)


def allocate_prefixes(confidences: Tensor, num_rows: int, caps: Tensor,
                      req_valid: Tensor) -> Tensor:
    """[Bcap] int64 verify lengths: drafted tokens each batch entry verifies this round.

    ``confidences [Bcap, width]``: conditional acceptance estimates (DSpark confidence head,
    or the MTP selected-token probability). ``num_rows``: G, the padded target rows, which the
    caller guarantees to be at least the number of live entries. ``caps [Bcap]``: per-entry
    limits from ``verify_caps``. ``req_valid [Bcap]``: False for padding entries, which get no
    row at all. The top ``G - B`` eligible survivals are admitted, where B counts live entries.
    """
    num_reqs, width = confidences.shape
    positions = torch.arange(width, device=confidences.device)
    eligible = req_valid[:, None] & (positions[None, :] < caps[:, None])  # [Bcap, width]
    # Survivals lie in [0, 1]; ineligible candidates sort after every eligible one.
    scores = torch.where(eligible, prefix_survivals(confidences), -1.0).flatten()
    # A stable descending sort keeps the flattened (request, position) order among equal
    # scores: the value-independent tie-break.
    order = torch.sort(scores, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    free_rows = num_rows - req_valid.sum()
    admitted = eligible & (rank < free_rows).view(num_reqs, width)
    # The admitted set is prefix-closed by construction; counting the leading run (rather
    # than summing) keeps lengths contiguous even if that invariant were ever broken.
    return torch.cumprod(admitted.to(torch.int64), dim=1).sum(dim=1)

