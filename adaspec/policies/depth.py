"""Adaptive draft depth (MTP): how many sequential draft steps d a round runs.

Every ``update_interval`` observed batches the policy rescores every depth 1..w by predicted
throughput ``B * (1 + sum(a[:d])) / cost_ms(d)`` (``a_k`` the prefix acceptance of position
k, ``cost_ms(d)`` the calibrated full-cycle cost of a round at depth d for the batch's
request bucket) and switches only when the best depth beats the current one by more than
``switch_min_gain`` (relative), so noise around a tie never flips it.

Censoring. A round at depth d verifies positions 1..d only; it says nothing about deeper
positions, and counting them as rejected would drive the depth down for good. The policy
therefore estimates conditional acceptance ``c_k`` (accepted at k among those that reached
k) per position, from the last ``window_size`` batches *that verified position k*, and
multiplies: ``a_k = c_1 ... c_k``. A position the current depth does not reach keeps the
estimate of the batches that last verified it. To keep learning about the next position, the
one a deeper switch depends on, a round below full width runs one step deeper once every
``probe_interval`` rounds (a probe: counted apart from switches, and the chosen depth does
not change); a position never verified yet borrows the conditional of the deepest position
that was, so the first estimates are neither free nor zero.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.policies.base import DepthContext, PolicyStatistics, RoundFeedback

DepthPricing = Callable[[DepthContext, int], float | None]
"""Full-cycle milliseconds of a round at depth d for this context's batch (None: unpriced)."""

PROBE_EVERY_WINDOWS = 3
"""One probe every three windows of rounds: a probe round costs one step more, so at the
default window of 20 the overhead is a step in 60 rounds (about 1 % against the best fixed
width where that is depth 1), while the next position's estimate still renews fast enough to
follow a step change (benchmarks/policies.py)."""


@dataclass(slots=True)
class _Position:
    """Per-batch (reached, accepted) counts of one draft position, newest last."""

    counts: deque[tuple[int, int]]

    def conditional(self) -> float | None:
        reached = sum(r for r, _ in self.counts)
        if reached == 0:
            return None
        return sum(a for _, a in self.counts) / reached


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
        self._switches = self._probes = 0
        self.probe_interval = max(2, config.window_size * PROBE_EVERY_WINDOWS)

    def observe(self, feedback: RoundFeedback) -> None:
        self._observed += 1
        width = feedback.width
        while len(self._positions) < width:
            self._positions.append(_Position(deque(maxlen=self._config.window_size)))
        for k in range(width):
            reached = accepted = 0
            for length, num_accepted in zip(feedback.verify_lengths, feedback.num_accepted,
                                            strict=True):
                if length > k and num_accepted >= k:  # position k+1 verified and reached
                    reached += 1
                    accepted += num_accepted > k
            if reached:
                self._positions[k].counts.append((reached, accepted))

    def prefix_acceptance(self, width: int) -> list[float]:
        """Estimated a_1..a_w (see the module docstring for unobserved positions)."""
        survival, out, last = 1.0, [], 1.0
        for k in range(width):
            conditional = self._positions[k].conditional() if k < len(self._positions) \
                else None
            if conditional is None:
                conditional = last
            last = conditional
            survival *= conditional
            out.append(survival)
        return out

    def decide(self, context: DepthContext) -> int:
        self._decisions += 1
        width = context.width
        if self._depth is None:
            self._depth = width  # full width until evidence says otherwise
        if self._observed - self._scored_at >= self._config.update_interval:
            self._scored_at = self._observed
            self._rescore(context)
        if self._depth < width and context.round % self.probe_interval == 0:
            self._probes += 1
            return self._depth + 1
        return self._depth

    def _rescore(self, context: DepthContext) -> None:
        assert self._depth is not None
        if self._pricing is None or not self._positions:
            return
        acceptance = self.prefix_acceptance(context.width)
        scores: dict[int, float] = {}
        for depth in range(1, context.width + 1):
            cost = self._pricing(context, depth)
            if cost is None:
                return  # an unpriced batch keeps the current depth
            scores[depth] = context.num_reqs * (1 + sum(acceptance[:depth])) / cost
        best = max(scores, key=lambda d: (scores[d], -d))  # ties: the shallower depth
        if scores[best] > scores[self._depth] * (1 + self._config.switch_min_gain):
            self._depth = best
            self._switches += 1

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, self._observed, {
            "depth": self._depth, "switches": self._switches, "probes": self._probes})

    def settings(self) -> dict[str, object]:
        return self._config.as_dict()
