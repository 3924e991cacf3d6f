"""Policies by name, so a runtime picks them from its configuration and a replay rebuilds the
recorded ones from the event log header (name and settings)."""

from collections.abc import Callable, Mapping

from adaspec.errors import ConfigError
from adaspec.policies.base import BudgetPolicy, DepthPolicy
from adaspec.policies.fixed import FixedDepth, FullBudget

DEPTH_POLICIES: dict[str, Callable[[Mapping[str, object]], DepthPolicy]] = {
    "fixed": lambda settings: FixedDepth(),
}
BUDGET_POLICIES: dict[str, Callable[[Mapping[str, object]], BudgetPolicy]] = {
    "full": lambda settings: FullBudget(),
}


def make_depth_policy(name: str, settings: Mapping[str, object]) -> DepthPolicy:
    if name not in DEPTH_POLICIES:
        raise ConfigError("depth_policy", name,
                          f"expected one of {', '.join(sorted(DEPTH_POLICIES))}")
    return DEPTH_POLICIES[name](settings)


def make_budget_policy(name: str, settings: Mapping[str, object]) -> BudgetPolicy:
    if name not in BUDGET_POLICIES:
        raise ConfigError("budget_policy", name,
                          f"expected one of {', '.join(sorted(BUDGET_POLICIES))}")
    return BUDGET_POLICIES[name](settings)
