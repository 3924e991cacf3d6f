"""The verification-budget decision: which padded target rows G maximise expected tokens per
millisecond, given survival estimates and a cost table.

Every request verifies at least its own row (the residual or bonus token), so B rows always
pay off one token each; every further row verifies one drafted token and pays off its
survival (the estimated probability that it and all drafted tokens before it are accepted).
With the best rows taken first, ``tau(G) = B + sum of the top G - B survivals`` and the
budget is the legal G with the largest ``tau(G) / cost_ms(Bcap, G)`` over all of them (a
global argmax, not a greedy walk that stops at the first dip). Equal values go to the smaller
G. Without a price for the batch (a KV length or bucket the table does not cover) the
decision is the prewarmed full width.

DP shards run one common physical graph of G rows each, in parallel, so a round costs
``cost_ms(Bcap, G)`` once and yields the sum of every shard's ``tau_s(G)`` (each shard fills
its own G rows with its own requests' survivals): the common G maximises
``sum_s tau_s(G) / cost_ms(Bcap, G)``.
"""

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Protocol

from adaspec.policies.base import BudgetContext, PolicyStatistics, RoundFeedback, covering_rows


def expected_tokens(num_reqs: int, survivals: Sequence[float], num_rows: int) -> float:
    """tau(G) for survivals sorted in descending order."""
    extra = max(0, min(num_rows - num_reqs, len(survivals)))
    return num_reqs + float(sum(survivals[:extra]))


ShardSurvivals = tuple[int, Sequence[float]]
"""One shard's B and its per-(request, position) survival estimates, in any order."""


def choose_rows(legal_rows: Sequence[int], shards: Sequence[ShardSurvivals],
                cost_ms: Callable[[int], float | None], full_rows: int) -> int:
    """The tier maximising ``sum of tau_s(G) / cost_ms(G)`` over the shards (one shard
    without DP); ``full_rows`` when any tier is unpriced."""
    ranked = [(num_reqs, sorted(survivals, reverse=True)) for num_reqs, survivals in shards]
    best, best_rate = full_rows, -1.0
    for rows in legal_rows:
        cost = cost_ms(rows)
        if cost is None:
            return full_rows
        rate = sum(expected_tokens(num_reqs, survivals, rows)
                   for num_reqs, survivals in ranked) / cost
        if rate > best_rate:
            best, best_rate = rows, rate
    return best


class CostPricing(Protocol):
    """What the policy needs of an installed cost table (a ``CostBundle``)."""

    def cost_ms(self, num_reqs_bucket: int, num_rows: int, kv_length: int) -> float | None: ...


FORGET_AFTER_ROUNDS = 16
"""A request absent from this many retired rounds has ended (ids are never reused): its
survivals are dropped so the policy's memory stays bounded by the live batch."""


class AdaptiveVerify:
    """Adaptive target verify: the padded target rows G of round n from feedback retired
    through round n-2 and the installed cost table (one G common to all DP shards when the
    context lists them; request history is kept per shard).

    Each request's survival estimates are the running products of the confidences it was
    drafted with in its newest retired round (the DSpark head's, or MTP's selected-token
    probability); the device then fills the chosen G rows with the current round's own
    survivals. A request with no retired round yet borrows the mean survivals of the newest
    retired round; with no retired round at all, or no price for the batch (a bucket or KV
    length the table does not cover), the round keeps the prewarmed full width.
    """

    name = "adaptive-verify"

    def __init__(self, costs: CostPricing | None) -> None:
        self._costs = costs
        self._survivals: dict[tuple[int, int], tuple[float, ...]] = {}  # (shard, request)
        self._seen: dict[tuple[int, int], int] = {}
        self._newest: tuple[int, list[tuple[float, ...]]] | None = None  # round, its rows
        self._decisions = self._observed = 0
        self._full_unpriced = self._full_no_history = self._trimmed = 0
        self._rows_chosen = self._rows_full = 0

    def observe(self, feedback: RoundFeedback) -> None:
        self._observed += 1
        if not feedback.confidences or not feedback.request_ids:
            return
        rows = [tuple(itertools.accumulate(row, operator.mul))
                for row in feedback.confidences]
        for request_id, survivals in zip(feedback.request_ids, rows, strict=True):
            self._survivals[feedback.shard, request_id] = survivals
            self._seen[feedback.shard, request_id] = feedback.round
        # The prior pools every shard's rows of the newest retired round.
        if self._newest is not None and self._newest[0] == feedback.round:
            self._newest[1].extend(rows)
            return  # another shard of the same round: nothing new to forget
        self._newest = (feedback.round, list(rows))
        gone = [key for key, seen in self._seen.items()
                if feedback.round - seen > FORGET_AFTER_ROUNDS]
        for key in gone:
            del self._survivals[key], self._seen[key]

    def decide(self, context: BudgetContext) -> int:
        self._decisions += 1
        full = covering_rows(context, context.depth)
        chosen = self._choose(context, full)
        self._rows_chosen += chosen
        self._rows_full += full
        self._trimmed += chosen < full
        return chosen

    def _choose(self, context: BudgetContext, full: int) -> int:
        shards = self._pooled(context)
        if shards is None:
            self._full_no_history += 1
            return full
        costs = self._costs
        if costs is None or costs.cost_ms(context.num_reqs_bucket, full,
                                          context.max_kv_length) is None:
            self._full_unpriced += 1
            return full
        # A tier above full width verifies nothing more and costs no less: never better.
        return choose_rows(
            [rows for rows in context.legal_rows if rows <= full], shards,
            lambda rows: costs.cost_ms(context.num_reqs_bucket, rows, context.max_kv_length),
            full)

    def _pooled(self, context: BudgetContext) -> list[ShardSurvivals] | None:
        """Every shard's B and the survivals of every (request, position) it can verify this
        round; None without any retired evidence."""
        if self._newest is None:
            return None
        out: list[ShardSurvivals] = []
        prior: tuple[float, ...] | None = None  # computed only for a request without history
        for shard, ids in context.batches():
            if not ids and not context.shard_sizes:  # a context without ids: all borrow
                ids = (-1,) * context.num_reqs
            pooled: list[float] = []
            for request_id in ids:
                survivals = self._survivals.get((shard, request_id))
                if survivals is None:
                    prior = prior or self._prior()
                    survivals = prior
                pooled.extend(survivals[:context.depth])
            out.append((len(ids), pooled))
        return out

    def _prior(self) -> tuple[float, ...]:
        """The mean survivals of the newest retired round (every shard's rows)."""
        assert self._newest is not None
        rows = self._newest[1]
        return tuple(sum(column) / len(rows) for column in zip(*rows, strict=True))

    def statistics(self) -> PolicyStatistics:
        fraction = self._rows_chosen / self._rows_full if self._rows_full else 1.0
        return PolicyStatistics(self.name, self._decisions, self._observed, {
            "rows_vs_full_width": round(fraction, 4), "trimmed_rounds": self._trimmed,
            "full_width_unpriced": self._full_unpriced,
            "full_width_no_history": self._full_no_history})

    def settings(self) -> dict[str, object]:
        """The cost table travels in the event-log header, not here."""
        return {}
