"""The fixed-width baselines: always draft the full width, always verify every drafted token.

Formula: depth d = w; G = B * (d + 1) rounded up to the first legal tier. No warm-up, no
hysteresis: the decision never changes with feedback, which the policies only count.
"""

from adaspec.policies.base import (
    BudgetContext,
    DepthContext,
    PolicyStatistics,
    RoundFeedback,
    covering_rows,
)


class _Counting:
    """Decisions and observed rounds, the only state a fixed policy has."""

    name = "counting"

    def __init__(self) -> None:
        self._decisions = 0
        self._observed = 0

    def observe(self, feedback: RoundFeedback) -> None:
        self._observed += 1

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, self._observed)

    def settings(self) -> dict[str, object]:
        return {}


class FixedDepth(_Counting):
    """Draft all ``w`` positions every round."""

    name = "fixed"

    def decide(self, context: DepthContext) -> int:
        self._decisions += 1
        return context.width


class FullBudget(_Counting):
    """Verify every drafted token: the smallest tier holding B * (d + 1) rows."""

    name = "full"

    def decide(self, context: BudgetContext) -> int:
        self._decisions += 1
        return covering_rows(context, context.depth)
