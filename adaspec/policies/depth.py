"""Adaptive draft depth (MTP): how many sequential draft steps d a round runs.

Every ``update_interval`` observed batches the policy rescores every depth 1..w by predicted
throughput ``B * (1 + sum(a[:d])) / cost_ms(d)`` (``a_k`` the prefix acceptance of position
k, ``cost_ms(d)`` the calibrated full-cycle cost of what a round at depth d runs for this
batch: its request bucket, its KV length and the rows it verifies, see ``bundle_pricing``)
and switches only when the best depth beats the current one by more than
``switch_min_gain`` (relative), so noise around a tie never flips it. A batch the table does
not price (its KV length or bucket lies outside what was calibrated) runs at the prewarmed full
width w, as the specification has uncovered batches do, and leaves the chosen depth as it was.

Censoring. A round at depth d verifies positions 1..d only; it says nothing about deeper
positions, and counting them as rejected would drive the depth down for good. The policy
therefore estimates conditional acceptance ``c_k`` (accepted at k among those that reached
k) per position, from the last ``window_size`` batches *that verified position k*, and
multiplies: ``a_k = c_1 ... c_k``. A position the current depth does not reach keeps the
counts of the batches that last verified it, which may be old: acceptance moves with the
text, and a stale deep estimate would pin the depth where it was. Every round verifies
position 1, so its conditional is always current; the policy treats a change of acceptance
as a shift of the logit common to all positions, and moves each ``c_k`` by the change of
position 1's logit between the batches that verified k and the last window. A position the
depth reaches has been verified by the same batches as position 1, so its shift is zero; a
position last seen in another regime follows position 1 into the new one. To keep learning
what the shift cannot tell (a deep position that got worse on its own), a round below full
width runs one step deeper once every ``probe_interval`` rounds (a probe: counted apart
from switches, and the chosen depth does not change). A position never verified yet
borrows the estimate of the deepest position that was, so the first estimates are neither
free nor zero.
"""

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.policies.base import DepthContext, PolicyStatistics, RoundFeedback, covering_tier
from adaspec.policies.bundles import CostBundle

DepthPricing = Callable[[DepthContext, int], float | None]
"""Full-cycle milliseconds of a round at depth d for this context's batch (None: unpriced)."""


def bundle_pricing(costs: CostBundle) -> DepthPricing:
    """What the round will run, priced from a bundle's depth profiles (the runtime's pricing,
    which ``adaspec simulate`` and replay share): Bcap draft entries at depth d, verifying
    the tier that covers the batch's B * (d + 1) rows (adaptive draft steps verify every
    drafted token), in the profile of the batch's KV length (``CostBundle.depth_cost_ms``).
    A context that does not record its KV length (an older log) is priced as it was then,
    by the first depth profile."""
    def price(context: DepthContext, depth: int) -> float | None:
        bucket = context.num_reqs_bucket
        tiers = costs.legal_rows(bucket)
        rows = covering_tier(tiers, context.num_reqs, depth) if tiers else None
        return costs.depth_cost_ms(bucket, depth, context.max_kv_length or None, rows)
    return price


PROBE_EVERY_WINDOWS = 3
"""One probe every three windows of rounds: a probe round costs one step more, so at the
default window of 20 the overhead is one step in 60 rounds, while the next position's
estimate still renews fast enough to follow a step change (benchmarks/policies.py measures
both)."""


LOGIT_CLAMP = 0.01
"""Rates are clamped to [0.01, 0.99] before taking logits: a window where every request
accepted (or none did) must give a finite shift."""


def logit(rate: float) -> float:
    """log(p / (1 - p)), with p clamped to [LOGIT_CLAMP, 1 - LOGIT_CLAMP]."""
    rate = min(1 - LOGIT_CLAMP, max(LOGIT_CLAMP, rate))
    return math.log(rate / (1 - rate))


def sigmoid(value: float) -> float:
    return 1 / (1 + math.exp(-value))


@dataclass(slots=True)
class _Position:
    """Per-batch counts of one draft position, newest last: (reached, accepted) at this
    position, and (reached, accepted) at position 1 in the same batch (the anchor)."""

    counts: deque[tuple[int, int, int, int]]

    def conditional(self) -> float | None:
        reached = sum(count[0] for count in self.counts)
        if reached == 0:
            return None
        return sum(count[1] for count in self.counts) / reached

    def anchor(self) -> float:
        """Position 1's conditional over the batches this position was verified in."""
        return sum(count[3] for count in self.counts) / sum(count[2] for count in self.counts)


class AdaptiveDepth:
    """Chooses d in 1..w from lagged, censoring-aware prefix acceptance and depth costs."""

    name = "adaptive-depth"

    def __init__(self, config: DraftStepPolicyConfig, pricing: DepthPricing | None) -> None:
        self._config = config
        self._pricing = pricing
        self._positions: list[_Position] = []
        self._depth: int | None = None  # the chosen (non-probe) depth
        self._observed = self._decisions = 0
        self._scored_at = 0  # observed batches at the last rescoring
        self._switches = self._probes = self._unpriced = 0
        self._probing = True  # whether a deeper depth could still win (see _rescore)
        self.probe_interval = max(2, config.window_size * PROBE_EVERY_WINDOWS)

    def observe(self, feedback: RoundFeedback) -> None:
        self._observed += 1
        width = feedback.width
        while len(self._positions) < width:
            self._positions.append(_Position(deque(maxlen=self._config.window_size)))
        deepest = max(feedback.verify_lengths, default=0)
        counts = [self._position_counts(feedback, k) for k in range(deepest)]
        for k, (reached, accepted) in enumerate(counts):
            # Every batch that verified position k joins its window, even if no request got
            # that far: the anchor must be position 1 over the same batches as the recent
            # window, or a window of only the batches that reached k (the easy ones) would
            # read as a regime change.
            self._positions[k].counts.append((reached, accepted, *counts[0]))

    @staticmethod
    def _position_counts(feedback: RoundFeedback, k: int) -> tuple[int, int]:
        """(reached, accepted) at position k+1: requests that verified it and accepted every
        draft before it, and those of them that accepted it too."""
        reached = accepted = 0
        for length, num_accepted in zip(feedback.verify_lengths, feedback.num_accepted,
                                        strict=True):
            if length > k and num_accepted >= k:
                reached += 1
                accepted += num_accepted > k
        return reached, accepted

    def prefix_acceptance(self, width: int) -> list[float]:
        """Estimated a_1..a_w (see the module docstring for unobserved positions)."""
        survival, out, last = 1.0, [], 1.0
        current = self._positions[0].conditional() if self._positions else None
        for k in range(width):
            conditional = self._shifted(k, current)
            if conditional is None:
                conditional = last
            last = conditional
            survival *= conditional
            out.append(survival)
        return out

    def _shifted(self, k: int, current: float | None) -> float | None:
        """c_k moved by position 1's logit change since the batches that verified k."""
        if k >= len(self._positions):
            return None
        position = self._positions[k]
        conditional = position.conditional()
        if conditional is None or current is None:
            return conditional
        shift = logit(current) - logit(position.anchor())
        if shift == 0.0:
            return conditional  # verified with position 1 over the same window: as counted
        return sigmoid(logit(conditional) + shift)

    def decide(self, context: DepthContext) -> int:
        self._decisions += 1
        width = context.width
        if self._depth is None:
            self._depth = width  # full width until evidence says otherwise
        if self._pricing is not None and self._pricing(context, width) is None:
            # No calibrated price for this batch (its KV length or bucket lies outside the
            # table): it runs at the prewarmed full width, and the chosen depth waits.
            self._unpriced += 1
            return width
        if self._observed - self._scored_at >= self._config.update_interval:
            self._scored_at = self._observed
            self._rescore(context)
        if self._depth < width and self._probing and context.round % self.probe_interval == 0:
            self._probes += 1
            return self._depth + 1
        return self._depth

    def _rescore(self, context: DepthContext) -> None:
        assert self._depth is not None
        if self._pricing is None or not self._positions:
            return
        priced = [self._pricing(context, depth) for depth in range(1, context.width + 1)]
        costs = [cost for cost in priced if cost is not None]
        if len(costs) < len(priced):
            return  # an unpriced batch keeps the current depth
        acceptance = self.prefix_acceptance(context.width)
        scores = self._scores(context.num_reqs, acceptance, costs)
        best = max(scores, key=lambda d: (scores[d], -d))  # ties: the shallower depth
        threshold = 1 + self._config.switch_min_gain
        if scores[best] > scores[self._depth] * threshold:
            self._depth = best
            self._switches += 1
        # Probe only where the answer could change the decision: if even positions past the
        # depth accepting everything that reaches them would not make a deeper depth win,
        # a probe would cost a step and teach nothing.
        depth = self._depth
        optimistic = acceptance[:depth] + [acceptance[depth - 1]] * (context.width - depth)
        bound = self._scores(context.num_reqs, optimistic, costs)
        self._probing = any(bound[deeper] > scores[depth] * threshold
                            for deeper in range(depth + 1, context.width + 1))

    @staticmethod
    def _scores(num_reqs: int, acceptance: list[float], costs: list[float]) -> dict[int, float]:
        """Predicted tokens per millisecond of every depth d: B * (1 + a_1 + ... + a_d) / cost."""
        return {depth: num_reqs * (1 + sum(acceptance[:depth])) / costs[depth - 1]
                for depth in range(1, len(costs) + 1)}

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, self._observed, {
            "depth": self._depth, "switches": self._switches, "probes": self._probes,
            "unpriced": self._unpriced})

    def settings(self) -> dict[str, object]:
        return self._config.as_dict()
