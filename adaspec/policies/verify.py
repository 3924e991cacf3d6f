"""The verification-budget decision: which padded target rows G maximise expected tokens per
millisecond, given survival estimates and a cost table.

Every request verifies at least its own row (the residual or bonus token), so B rows always
pay off one token each; every further row verifies one drafted token and pays off its
survival (the estimated probability that it and all drafted tokens before it are accepted).
With the best rows taken first, ``tau(G) = B + sum of the top G - B survivals`` and the
budget is the legal tier with the largest ``tau(G) / cost_ms(Bcap, G)`` over all tiers (a
global argmax, not a greedy walk that stops at the first dip). Equal values go to the smaller
G. Without a price for the batch (a KV length or bucket the table does not cover) the
decision is the prewarmed full width.
"""

from collections.abc import Callable, Sequence


def expected_tokens(num_reqs: int, survivals: Sequence[float], num_rows: int) -> float:
    """tau(G) for survivals sorted in descending order."""
    extra = max(0, min(num_rows - num_reqs, len(survivals)))
    return num_reqs + float(sum(survivals[:extra]))


def choose_rows(tiers: Sequence[int], num_reqs: int, survivals: Sequence[float],
                cost_ms: Callable[[int], float | None], full_rows: int) -> int:
    """The tier maximising ``tau(G) / cost_ms(G)``; ``full_rows`` when any tier is unpriced.

    ``survivals`` are the batch's per-(request, position) survival estimates, in any order.
    """
    ranked = sorted(survivals, reverse=True)
    best, best_rate = full_rows, -1.0
    for rows in tiers:
        cost = cost_ms(rows)
        if cost is None:
            return full_rows
        rate = expected_tokens(num_reqs, ranked, rows) / cost
        if rate > best_rate:
            best, best_rate = rows, rate
    return best
