"""Policies by name, so a runtime picks them from its configuration and a replay rebuilds the
recorded ones from the event log header (name, settings, and the cost table it carries)."""

from collections.abc import Callable, Mapping

from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.errors import ConfigError
from adaspec.policies.base import BudgetPolicy, DepthContext, DepthPolicy
from adaspec.policies.bundles import CostBundle
from adaspec.policies.depth import AdaptiveDepth
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.verify import AdaptiveVerify


def _adaptive_depth(settings: Mapping[str, object], costs: CostBundle | None) -> DepthPolicy:
    try:
        config = DraftStepPolicyConfig(**settings)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError("adaptive-depth settings", dict(settings), "expected the keys "
                          "window_size, update_interval, switch_min_gain") from None
    if costs is None:
        return AdaptiveDepth(config, None)
    table = costs

    def price(context: DepthContext, depth: int) -> float | None:
        return table.depth_cost_ms(context.num_reqs_bucket, depth)

    return AdaptiveDepth(config, price)


DEPTH_POLICIES: dict[str, Callable[[Mapping[str, object], CostBundle | None],
                                   DepthPolicy]] = {
    "fixed": lambda settings, costs: FixedDepth(),
    "adaptive-depth": _adaptive_depth,
}
BUDGET_POLICIES: dict[str, Callable[[Mapping[str, object], CostBundle | None],
                                    BudgetPolicy]] = {
    "full": lambda settings, costs: FullBudget(),
    "adaptive-verify": lambda settings, costs: AdaptiveVerify(costs),
}
NEEDS_COSTS = frozenset({"adaptive-verify", "adaptive-depth"})


def make_depth_policy(name: str, settings: Mapping[str, object],
                      costs: CostBundle | None = None) -> DepthPolicy:
    if name not in DEPTH_POLICIES:
        raise ConfigError("depth_policy", name,
                          f"expected one of {', '.join(sorted(DEPTH_POLICIES))}")
    if name in NEEDS_COSTS and costs is None:
        raise ConfigError("depth_policy", name, "needs a cost table (calibrated at start, or "
                          "the one an event log's header carries)")
    return DEPTH_POLICIES[name](settings, costs)


def make_budget_policy(name: str, settings: Mapping[str, object],
                       costs: CostBundle | None = None) -> BudgetPolicy:
    if name not in BUDGET_POLICIES:
        raise ConfigError("budget_policy", name,
                          f"expected one of {', '.join(sorted(BUDGET_POLICIES))}")
    if name in NEEDS_COSTS and costs is None:
        raise ConfigError("budget_policy", name, "needs a cost table (calibrated at start, or "
                          "the one an event log's header carries)")
    return BUDGET_POLICIES[name](settings, costs)
