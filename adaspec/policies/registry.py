"""Policies by name, so a runtime picks them from its configuration and a replay rebuilds the
recorded ones from the event log header (name, settings, and the cost table it carries)."""

from collections.abc import Callable, Mapping
from typing import TypeVar

from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.errors import ConfigError
from adaspec.policies.base import BudgetPolicy, DepthPolicy
from adaspec.policies.bundles import CostBundle
from adaspec.policies.depth import AdaptiveDepth, bundle_pricing
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.verify import AdaptiveVerify


def _adaptive_depth(settings: Mapping[str, object], costs: CostBundle | None) -> DepthPolicy:
    keys = {"window_size", "update_interval", "switch_min_gain"}
    try:
        if set(settings) != keys:  # the runtime records all three: none is left to a default
            raise TypeError
        config = DraftStepPolicyConfig(**settings)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError("adaptive-depth settings", dict(settings), "expected the keys "
                          "window_size, update_interval, switch_min_gain") from None
    assert costs is not None  # NEEDS_COSTS: checked by _make
    return AdaptiveDepth(config, bundle_pricing(costs))


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
BUILT_IN_CLASSES: dict[str, type] = {"fixed": FixedDepth, "adaptive-depth": AdaptiveDepth,
                                     "full": FullBudget, "adaptive-verify": AdaptiveVerify}
"""The class of each built-in policy name: an event log's header names a policy, and a
replay rebuilds the built-in one of that name."""
Policy = TypeVar("Policy", DepthPolicy, BudgetPolicy)
NEEDS_COSTS = frozenset({"adaptive-verify", "adaptive-depth"})


def _make(role: str, table: Mapping[str, Callable[[Mapping[str, object], CostBundle | None],
                                                 Policy]],
          name: str, settings: Mapping[str, object], costs: CostBundle | None) -> Policy:
    if name not in table:
        raise ConfigError(role, name, f"expected one of {', '.join(sorted(table))}")
    if name in NEEDS_COSTS and costs is None:
        raise ConfigError(role, name, "needs a cost table (calibrated at start, or the one an "
                          "event log's header carries)")
    policy = table[name](settings, costs)
    unknown = sorted(set(settings) - set(policy.settings()))
    if unknown:  # a setting the policy does not have would be dropped silently
        raise ConfigError(f"{role} {name} settings", dict(settings),
                          f"{unknown[0]} is not a setting of {name}; expected "
                          + (", ".join(sorted(policy.settings())) or "none"))
    return policy


def make_depth_policy(name: str, settings: Mapping[str, object],
                      costs: CostBundle | None = None) -> DepthPolicy:
    return _make("depth_policy", DEPTH_POLICIES, name, settings, costs)


def make_budget_policy(name: str, settings: Mapping[str, object],
                       costs: CostBundle | None = None) -> BudgetPolicy:
    return _make("budget_policy", BUDGET_POLICIES, name, settings, costs)
