"""Policies by name, so a runtime picks them from its configuration and a replay rebuilds the
recorded ones from the event log header (name, settings, and the cost table it carries)."""

from collections.abc import Callable, Mapping

from adaspec.errors import ConfigError
from adaspec.policies.base import BudgetPolicy, DepthPolicy
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.verify import AdaptiveVerify, CostPricing

DEPTH_POLICIES: dict[str, Callable[[Mapping[str, object]], DepthPolicy]] = {
    "fixed": lambda settings: FixedDepth(),
}
BUDGET_POLICIES: dict[str, Callable[[Mapping[str, object], CostPricing | None],
                                    BudgetPolicy]] = {
    "full": lambda settings, costs: FullBudget(),
    "adaptive-verify": lambda settings, costs: AdaptiveVerify(costs),
}
NEEDS_COSTS = frozenset({"adaptive-verify"})


def make_depth_policy(name: str, settings: Mapping[str, object]) -> DepthPolicy:
    if name not in DEPTH_POLICIES:
        raise ConfigError("depth_policy", name,
                          f"expected one of {', '.join(sorted(DEPTH_POLICIES))}")
    return DEPTH_POLICIES[name](settings)


def make_budget_policy(name: str, settings: Mapping[str, object],
                       costs: CostPricing | None = None) -> BudgetPolicy:
    if name not in BUDGET_POLICIES:
        raise ConfigError("budget_policy", name,
                          f"expected one of {', '.join(sorted(BUDGET_POLICIES))}")
    if name in NEEDS_COSTS and costs is None:
        raise ConfigError("budget_policy", name, "needs a cost table (calibrated at start, or "
                          "the one an event log's header carries)")
    return BUDGET_POLICIES[name](settings, costs)
