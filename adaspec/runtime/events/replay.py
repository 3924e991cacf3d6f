"""Replay: run policies again over a recorded event log, with no model and no device.

Policies are pure functions of the calls they receive, so feeding them the recorded sequence
(``observe`` at each retired round, ``decide`` at each recorded decision, in log order) must
give back the recorded depth d and budget G. With the recorded policies this checks that a run
is reproducible; with other policies it is a counterfactual evaluation on the same recorded
acceptance: the contexts and the feedback stay the recorded ones, so a different depth does
not change the budget context that follows it.

Replay also checks the lag: the decisions of round n may see feedback of rounds <= n-2 only
(n-1 for a run without schedule overlap, whose header records lag 1).

Nothing is replayed before the whole log is checked (``check_recorded_run``): the header's
launch settings as a launch would check them, the context limit of a built-in target (known
by its identity) against its model card, its cost table against them, and the events as one
run of that launch (``log.check_run``). ``adaspec simulate`` reads a recorded run through
the same checks.
"""

import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from adaspec.config.builtin import builtin_target_limit
from adaspec.config.calibration import key_prefix
from adaspec.config.effective import effective_value, execution_shape
from adaspec.config.launch import LaunchConfig, launch_field_types
from adaspec.config.requests import check_recorded_request
from adaspec.errors import (
    ConfigError,
    EventLogError,
    IncompatibleCostTable,
    ReplayMismatch,
    show_value,
)
from adaspec.policies.base import BudgetPolicy, DepthPolicy, RoundFeedback
from adaspec.policies.bundles import (
    Compatibility,
    CostBundle,
    bundle_from_dict,
)
from adaspec.policies.registry import (
    BUDGET_POLICIES,
    DEPTH_POLICIES,
    make_budget_policy,
    make_depth_policy,
)
from adaspec.runtime.events.log import LogHeader, RunShape, check_run, read_event_log
from adaspec.runtime.events.types import (
    BudgetDecided,
    DepthDecided,
    Event,
    RoundRetired,
    ShardRetired,
)

Decision = Literal["depth", "budget"]

_SYMBOL: dict[str, str] = {"depth": "d", "budget": "G"}  # glossary letter of each decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """A recorded decision the replayed policy did not reproduce."""

    round: int
    decision: Decision
    recorded: int  # depth d or rows G in the log
    replayed: int  # what the replayed policy chose from the same context
    event_index: int  # position among the log's events; its file line is event_index + 2

    def detail(self) -> str:
        letter = _SYMBOL[self.decision]
        return (f"recorded {letter}={self.recorded}, replayed {letter}={self.replayed} "
                f"(event {self.event_index}, log line {self.event_index + 2})")

    def describe(self) -> str:
        return f"round {self.round} {self.decision} decision: {self.detail()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LagViolation:
    """A recorded decision of round n that could see feedback of round n-1 or later, so it
    depended on timing: the log cannot be replayed as the lag rule promises."""

    round: int
    decision: Decision
    newest_feedback: int  # newest retired round the decision could see (> allowed)
    allowed: int  # newest round the lag allows: round - 2 (round - 1 without overlap)
    from_context: bool  # True: the context says so; False: a retirement came first in the log
    event_index: int

    def detail(self) -> str:
        seen = ("its context says feedback through round" if self.from_context
                else "it came after the log retired round")
        return (f"{seen} {self.newest_feedback}, but the lag allows feedback of rounds <= "
                f"{self.allowed} only (event {self.event_index}, log line "
                f"{self.event_index + 2})")

    def describe(self) -> str:
        return f"round {self.round} {self.decision} decision: {self.detail()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayReport:
    """What a replay found. ``ok`` when every decision matched and the lag held."""

    depth_policy: Mapping[str, Any]  # {"name", "settings"} of the depth policy replayed
    budget_policy: Mapping[str, Any]  # same for the budget policy
    counterfactual: bool  # a policy other than the recorded one (name or settings) was replayed
    num_rounds: int  # distinct rounds with at least one decision checked
    num_decisions: int  # depth and budget decisions checked
    num_observed: int  # retired rounds whose feedback the policies observed
    num_divergences: int  # decisions that differed (all of them, not only the first)
    first_divergence: Divergence | None
    num_lag_violations: int
    first_lag_violation: LagViolation | None
    lag: int = 2  # the run's lag: round n may use feedback of rounds <= n - lag
    not_the_launchs: tuple[str, ...] = ()  # roles whose recorded policy its config does not make

    @property
    def all_matched(self) -> bool:
        return self.num_divergences == 0

    @property
    def ok(self) -> bool:
        return self.num_divergences == 0 and self.num_lag_violations == 0

    def check(self) -> None:
        """Raise ``ReplayMismatch`` for the earliest finding in log order, if any (for tests
        that assert a run replays exactly)."""
        findings = [f for f in (self.first_divergence, self.first_lag_violation) if f]
        if findings:
            first = min(findings, key=lambda finding: finding.event_index)
            raise ReplayMismatch(first.round, first.decision, first.detail())

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "all_matched": self.all_matched,
                "counterfactual": self.counterfactual,
                "policies": {"depth": dict(self.depth_policy),
                             "budget": dict(self.budget_policy)},
                "num_rounds": self.num_rounds, "num_decisions": self.num_decisions,
                "num_observed": self.num_observed, "num_divergences": self.num_divergences,
                "first_divergence": _finding_dict(self.first_divergence),
                "recorded_policies_not_the_launchs": list(self.not_the_launchs),
                "lag": self.lag, "num_lag_violations": self.num_lag_violations,
                "first_lag_violation": _finding_dict(self.first_lag_violation)}

    def format_text(self) -> str:
        role = "counterfactual" if self.counterfactual else "recorded"
        lines = [f"replayed {self.num_decisions} decisions of {self.num_rounds} rounds with "
                 f"{self.num_observed} retired rounds observed ({role} policies: depth "
                 f"{_policy_text(self.depth_policy)}, budget {_policy_text(self.budget_policy)})"]
        lines += map(not_the_launchs_note, self.not_the_launchs)
        if self.num_decisions == 0:
            lines.append("no decision to check: the log records no round (its requests, if "
                         "any, ended at their prefill)")
        elif self.first_divergence is None:
            lines.append(f"all {self.num_decisions} decisions match the log")
        else:
            # A counterfactual policy is expected to differ; a recorded one never should.
            verdict = "DIFFERS" if self.counterfactual else "DIVERGED"
            lines.append(f"{verdict}: {self.num_divergences} of {self.num_decisions} "
                         f"decisions differ from the log; first: "
                         f"{self.first_divergence.describe()}")
        if self.first_lag_violation is None:
            lines.append(f"lag respected: decisions of round n saw feedback of rounds <= "
                         f"n-{self.lag}")
        else:
            plural = "" if self.num_lag_violations == 1 else "s"
            lines.append(f"LAG VIOLATED by {self.num_lag_violations} decision{plural}; first: "
                         f"{self.first_lag_violation.describe()}")
        return "\n".join(lines)


def not_the_launchs_note(role: str) -> str:
    """The report line for a ``role`` whose recorded policy the header's config does not
    make."""
    return (f"note: the recorded {role} policy is not the one the header's config makes; an "
            "embedder's own (RuntimeOptions) or an edited header")


def _finding_dict(finding: Divergence | LagViolation | None) -> dict[str, Any] | None:
    if finding is None:
        return None
    return {**asdict(finding), "message": finding.describe()}


def _policy_text(entry: Mapping[str, Any]) -> str:
    settings = entry["settings"]
    return str(entry["name"]) + (f" {json.dumps(settings, sort_keys=True)}" if settings else "")


def _recorded_policy(header: LogHeader, role: str, costs: CostBundle | None, path: str
                     ) -> Any:
    """A fresh instance of the ``role`` (depth or budget) policy the header names."""
    entry = header.policies[role]
    make = make_depth_policy if role == "depth" else make_budget_policy
    try:
        return make(entry["name"], entry["settings"], costs)
    except ConfigError as error:
        raise EventLogError(path, 1, f"header policies: {error}") from None


def _check_built_in_policies(header: LogHeader, costs: CostBundle | None, path: str) -> None:
    """A policy the header names from the registry must be one it builds (its settings, the
    cost table it needs); another name is an embedder's own policy, which only a replay given
    that policy can run."""
    for role, known in (("depth", DEPTH_POLICIES), ("budget", BUDGET_POLICIES)):
        if header.policies[role]["name"] in known:
            _recorded_policy(header, role, costs, path)


def recorded_costs(header: LogHeader) -> CostBundle | None:
    """The cost table the run installed, as its header carries it (None when it had none)."""
    table = header.cost_table
    if table is None:
        return None
    with key_prefix("cost_table."):
        return bundle_from_dict(table, source="the event log's header")


# --- the recorded run, checked ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordedRun:
    """What a checked event log says about its run."""

    launch: LaunchConfig  # rebuilt from the header's launch settings
    lag: int  # 2 with schedule overlap, 1 without
    costs: CostBundle | None  # the table the run installed (the header's)
    compatibility: Compatibility  # what a cost table must share with the run to price it
    context_limit: int  # the target's, from the header
    # The adaptive-depth settings of the run: its recorded policy's, else those its config
    # makes (the recorded depth policy is then another one); None when neither is adaptive.
    depth_settings: Mapping[str, Any] | None = None
    depth_settings_from: str = "the event log's header"  # which of the two, said in reports
    not_the_launchs: tuple[str, ...] = ()  # roles whose recorded policy its config does not make


def check_recorded_run(header: LogHeader, events: Sequence[Event], path: str
                       ) -> RecordedRun:
    """Check a log read by ``read_event_log`` as one run; ``EventLogError`` for the first
    problem, naming the line: the header's launch settings (as a launch checks them), its lag,
    a built-in target's context limit against its model card, the cost table and built-in
    policies against them, then every event (``log.check_run``)."""
    launch = _recorded_launch(header, path)
    lag = _recorded_lag(header, launch, path)
    _check_context_limit(header, path)
    _check_draft_identity(header, launch, path)
    costs = _header_costs(header, path)
    _check_built_in_policies(header, costs, path)
    run = _with_launch_policies(header, RecordedRun(
        launch=launch, lag=lag, costs=costs, compatibility=_compatibility(launch, header.models),
        context_limit=header.context_limit), path)
    if costs is not None:
        try:
            check_table_for_run(costs, run, "the header")
        except IncompatibleCostTable as error:
            where = {"target": "models", "draft": "models",
                     "context_limit": "context_limit"}.get(error.field, "config")
            raise EventLogError(path, 1, f"header cost_table disagrees with the header's "
                                f"{where}: {table_difference(error, 'the header')}") from None
    buckets = launch.prepared_request_buckets()
    check_run(events, RunShape(width=launch.num_speculative_tokens, lag=lag,
                               dp_size=launch.dp_size, request_buckets=buckets,
                               target_rows=launch.prepared_target_rows(),
                               max_bucket=launch.decode_batch_limit,
                               context_limit=run.context_limit,
                               unified=launch.enable_unified_mtp_graph,
                               tiers_only=launch.captures_tiers_only,
                               check_request=functools.partial(check_recorded_request,
                                                             launch=launch),
                               shard=launch.dp_rank),
              path)
    return run


def _with_launch_policies(header: LogHeader, run: RecordedRun, path: str) -> RecordedRun:
    """``run`` with the policies its config makes compared to the recorded ones, and the
    adaptive-depth settings a simulation of it runs with."""
    made = _launch_policies(header, run, path)
    recorded = header.policies["depth"]
    settings, where = None, "the event log's header"
    if recorded["name"] == "adaptive-depth":
        settings = recorded["settings"]
    elif made["depth"]["name"] == "adaptive-depth":
        settings = made["depth"]["settings"]
        where = (f"the event log's header config; the recorded depth policy is "
                 f"{_policy_text(recorded)}")
    return dataclasses.replace(
        run, depth_settings=settings, depth_settings_from=where,
        not_the_launchs=tuple(role for role in ("depth", "budget")
                              if made[role] != _recorded_entry(header.policies[role])))


def table_difference(error: IncompatibleCostTable, run: str) -> str:
    """What ``check_table_for_run`` found, said of the table and ``run`` (its name in the
    message): a compatibility field that differs, or a profile past the context limit."""
    if error.field == "context_limit":
        return (f"the table prices contexts of {error.saved} tokens, past the context limit "
                f"{error.launch} of {run}")
    return (f"{error.field} is {show_value(error.saved)} in the table but "
            f"{show_value(error.launch)} in {run}")


def check_table_for_run(table: CostBundle, run: RecordedRun, path: str) -> None:
    """``IncompatibleCostTable`` unless the table was saved by a launch like the run's, as a
    launch checks a saved table (``CostBundle.check_compatible``); a profile measured past
    the run's context limit is named as field ``context_limit``. A legacy table's axes are
    not held to the run's geometry (``CostBundle.check_geometry``): a run that one left
    unpriced verified those rounds at full width, which replay reproduces, and ``adaspec
    simulate`` takes no legacy table at all."""
    table.check_fields(run.compatibility.as_dict(), path)
    index = table.measured_past(run.context_limit)
    if index is not None:  # calibration never measures past the model's limit
        raise IncompatibleCostTable(path, "context_limit",
                                    table.profiles[index].context.max_kv_length,
                                    run.context_limit)


def _recorded_launch(header: LogHeader, path: str) -> LaunchConfig:
    """The launch the header's effective config describes, checked as a launch is: rebuilt
    from the settings that were given (not derived), which must then derive the rest."""
    settings, sources = _launch_section(header.config, path)
    _check_sources(settings, sources, path)
    given = {name: value for name, value in settings.items() if sources[name] != "derived"}
    try:
        launch = LaunchConfig(**given)
    except ConfigError as error:
        raise EventLogError(path, 1, f"header config.launch.settings: {error}") from None
    for name, value in settings.items():
        derived = effective_value(launch, name)
        if value != derived or type(value) is not type(derived):
            raise EventLogError(path, 1, f'header "config.launch.settings.{name}" expected '
                                f"{_brief(derived)} (what the other settings make it), got "
                                f"{_brief(value)}")
    _check_sections(header.config, launch, path)
    return launch


def _check_sources(settings: Mapping[str, Any], sources: Mapping[str, Any], path: str) -> None:
    """Sources as a launch records them: ``default`` for a setting left at its default,
    ``derived`` for one resolved from the others, and one label (``flag`` from the command
    line) for every setting that was given."""
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchConfig) if f.init}
    labels: dict[str, str] = {}
    for name, source in sources.items():
        if not isinstance(source, str) or not source.isprintable() or not source:
            raise EventLogError(path, 1, f'header "config.launch.sources.{name}" expected '
                                f"default, derived or the label of a given setting, got "
                                f"{_brief(source)}")
        value, default = settings[name], defaults[name]
        if source == "default" and (value != default or type(value) is not type(default)):
            raise EventLogError(path, 1, f'header "config.launch.settings.{name}" expected '
                                f"{_brief(default)} (its source says default), got "
                                f"{_brief(value)}")
        if source not in ("default", "derived"):
            labels.setdefault(source, name)
    if len(labels) > 1:
        (first, one), (second, other) = list(labels.items())[:2]
        raise EventLogError(path, 1, f'header "config.launch.sources" gives {one} as "{first}" '
                            f'and {other} as "{second}"; a launch gives every setting under one '
                            "label")


def _check_sections(config: Mapping[str, Any], launch: LaunchConfig, path: str) -> None:
    """The config's other sections as the launch makes them: the execution section's numbers
    equal (its words may be reworded by later versions), and the adaptive sections enabled
    as the launch's flags say (their settings come from files the replay does not read)."""
    unknown = sorted(set(config) - {"launch", "execution", "adaptive_draft_step",
                                    "adaptive_target_verify", "requests"})
    if unknown:
        raise EventLogError(path, 1, f'header "config" has unknown section "{unknown[0]}"')
    execution = config.get("execution")
    expected: dict[str, object] = {"execution": {
        **(execution if isinstance(execution, dict) else {}),
        **json.loads(json.dumps(execution_shape(launch)))}}
    for name, flag in (("adaptive_draft_step", launch.enable_adaptive_draft_step),
                       ("adaptive_target_verify", launch.enable_adaptive_target_verify)):
        section = config.get(name)
        expected[name] = {**(section if isinstance(section, dict) else {}), "enabled": flag}
    for name, value in expected.items():
        where, want, got = _first_difference(f"config.{name}", value, config.get(name))
        if where:
            raise EventLogError(path, 1, f'header "{where}" expected {_brief(want)} (what the '
                                f"launch settings make it), got {_brief(got)}")


def _first_difference(where: str, expected: object, got: object
                      ) -> tuple[str | None, object, object]:
    """The key path of the first value that differs, with both values (None: equal). Types
    count: ``true`` is not 1 and ``2.0`` is not 2, as everywhere JSON is read."""
    if _same(expected, got):
        return None, None, None
    if isinstance(expected, dict) and isinstance(got, dict):
        for key in (*expected, *(key for key in got if key not in expected)):
            if not _same(expected.get(key, _ABSENT), got.get(key, _ABSENT)):
                return _first_difference(f"{where}.{key}", expected.get(key, _ABSENT),
                                         got.get(key, _ABSENT))
    return where, expected, got


def _same(expected: object, got: object) -> bool:
    """Equal JSON values of equal types, at every depth."""
    if type(expected) is not type(got):
        return False
    if isinstance(expected, dict):
        assert isinstance(got, dict)
        return expected.keys() == got.keys() and all(_same(expected[k], got[k])
                                                      for k in expected)
    if isinstance(expected, list):
        assert isinstance(got, list)
        return len(expected) == len(got) and all(map(_same, expected, got))
    return expected == got


def _launch_section(config: Mapping[str, Any], path: str
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header's launch settings and their sources, both naming every launch setting."""
    launch = config.get("launch")
    names = launch_field_types()
    for key in ("settings", "sources"):
        section = launch.get(key) if isinstance(launch, dict) else None
        if not isinstance(section, dict):
            raise EventLogError(path, 1, f'header "config.launch.{key}" must be an object '
                                f"naming every launch setting, got {_brief(section)}")
        unknown = [name for name in section if name not in names]
        missing = [name for name in names if name not in section]
        if unknown or missing:
            what = f'unknown setting "{unknown[0]}"' if unknown else f'no "{missing[0]}"'
            raise EventLogError(path, 1, f'header "config.launch.{key}" has {what}; '
                                "expected every launch setting of this adaspec")
    assert isinstance(launch, dict)
    return launch["settings"], launch["sources"]


def _recorded_lag(header: LogHeader, launch: LaunchConfig, path: str) -> int:
    lag = 2 if launch.enable_schedule_overlap else 1
    given = header.lag
    if type(given) is not int or given != lag:
        raise EventLogError(path, 1, f'header "lag" expected {lag} (enable_schedule_overlap='
                            f"{show_value(launch.enable_schedule_overlap)} in its config), "
                            f"got {_brief(given)}")
    return lag


def _check_context_limit(header: LogHeader, path: str) -> None:
    """A built-in target's context limit is its model card's: a header that names the
    built-in target by its identity and records another limit describes a run that never
    was (its requests, tables and bounds would be judged against the wrong limit). Another
    target's limit is known only to its checkpoint; the events are still held to it."""
    known = builtin_target_limit(header.models["target"])
    if known is not None and header.context_limit != known[1]:
        model, limit = known
        raise EventLogError(path, 1, f'header "context_limit" expected {limit} (the '
                            f'built-in target {model}\'s, whose identity "models.target" '
                            f"records), got {_brief(header.context_limit)}")


def _check_draft_identity(header: LogHeader, launch: LaunchConfig, path: str) -> None:
    """A run drafts with a drafter exactly when its algorithm is not none (a start refuses a
    model set without the one its algorithm uses), and the header records "none" for no
    drafter: the two must agree, or the header describes a run that never was."""
    draft, algorithm = header.models["draft"], launch.speculative_algorithm
    drafting = algorithm != "none"
    if (draft == "none") == drafting:
        expected = "a drafter's identity" if drafting else '"none"'
        raise EventLogError(path, 1, f'header "models.draft" expected {expected} '
                            f"(speculative_algorithm={algorithm} in its config), got "
                            f"{_brief(draft)}")


def _header_costs(header: LogHeader, path: str) -> CostBundle | None:
    try:
        return recorded_costs(header)
    except ConfigError as error:
        raise EventLogError(path, 1, f"header {error}") from None


def _compatibility(launch: LaunchConfig, models: Mapping[str, str]) -> Compatibility:
    """The run's compatibility, as ``Runtime.compatibility`` makes it."""
    buckets = launch.prepared_request_buckets()
    return Compatibility(
        algorithm=launch.speculative_algorithm, draft_width=launch.num_speculative_tokens,
        dp_size=launch.dp_size, tp_size=launch.resolved.tp_size,
        unified=launch.enable_unified_mtp_graph, device=launch.device,
        target=models["target"], draft=models["draft"], request_buckets=buckets,
        target_rows=tuple(map(launch.legal_target_rows, buckets)))


_ABSENT = object()  # a key a section lacks


def _brief(value: object) -> str:
    if value is _ABSENT:
        return "no such key"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- replaying -------------------------------------------------------------------------


def replay(
    header: LogHeader,
    events: Iterable[Event],
    *,
    depth_policy: DepthPolicy | None = None,
    budget_policy: BudgetPolicy | None = None,
    path: str = "(in memory)",
) -> ReplayReport:
    """Check the log (``check_recorded_run``: ``path`` names it in errors), then walk
    ``events`` in order with the recorded policies, or with the ones given (fresh instances:
    replay feeds them the whole run from its first event)."""
    events = list(events)
    run = check_recorded_run(header, events, path)
    if depth_policy is None:  # the header's table is parsed once, by the check
        depth_policy = _recorded_policy(header, "depth", run.costs, path)
    if budget_policy is None:
        budget_policy = _recorded_policy(header, "budget", run.costs, path)
    return _replayed(header, events, run, depth_policy, budget_policy, path)


def _replayed(header: LogHeader, events: Sequence[Event], run: RecordedRun,
              depth_policy: DepthPolicy, budget_policy: BudgetPolicy, path: str
              ) -> ReplayReport:
    walk = _Walk(depth_policy, budget_policy, run.lag)
    for index, event in enumerate(events):
        walk.step(index, event)
    walk.observe_retired()
    return dataclasses.replace(walk.report(header.policies),
                               not_the_launchs=run.not_the_launchs)


def _launch_policies(header: LogHeader, run: RecordedRun, path: str
                     ) -> dict[str, dict[str, Any]]:
    """The policies the header's config makes, as the runtime makes them at start."""
    launch = run.launch
    depth: tuple[str, Mapping[str, Any]] = ("fixed", {})
    if launch.enable_adaptive_draft_step:
        section = header.config.get("adaptive_draft_step", {}).get("policy")
        given = section if isinstance(section, dict) else {}
        depth = ("adaptive-depth", {k: v for k, v in given.items() if k != "source"})
    budget: tuple[str, Mapping[str, Any]] = \
        ("adaptive-verify", {}) if launch.enable_adaptive_target_verify else ("full", {})
    made: dict[str, dict[str, Any]] = {}
    for role, (name, settings) in (("depth", depth), ("budget", budget)):
        make = make_depth_policy if role == "depth" else make_budget_policy
        try:
            made[role] = _entry(make(name, settings, run.costs))
        except ConfigError as error:
            raise EventLogError(path, 1, f"header config: the {role} policy it makes: "
                                f"{error}") from None
    return made


class _Walk:
    """The replay's running state; one ``step`` per event."""

    def __init__(self, depth_policy: DepthPolicy, budget_policy: BudgetPolicy,
                 lag: int) -> None:
        self.lag = lag
        self.depth_policy = depth_policy
        self.budget_policy = budget_policy
        self.newest_observed = -1  # newest round whose feedback the policies observed
        self.rounds: set[int] = set()
        self.num_decisions = 0
        self.num_observed = 0
        self.divergences: list[Divergence] = []
        self.lag_violations: list[LagViolation] = []
        self.retired: list[RoundFeedback] = []  # not yet observed

    def step(self, index: int, event: Event) -> None:
        if isinstance(event, RoundRetired | ShardRetired):
            self.retired.append(event.feedback)
            return
        if isinstance(event, DepthDecided | BudgetDecided):
            self.observe_retired()
        if isinstance(event, DepthDecided):
            replayed = self.depth_policy.decide(event.context)
            self._check(index, event.round, "depth", event.context.retired_through,
                        event.depth, replayed)
        elif isinstance(event, BudgetDecided):
            replayed = self.budget_policy.decide(event.context)
            self._check(index, event.round, "budget", event.context.retired_through,
                        event.num_rows, replayed)

    def _check(self, index: int, round: int, decision: Decision, retired_through: int,
               recorded: int, replayed: int) -> None:
        self.rounds.add(round)
        self.num_decisions += 1
        if recorded != replayed:
            self.divergences.append(Divergence(round=round, decision=decision, recorded=recorded,
                                               replayed=replayed, event_index=index))
        newest = max(retired_through, self.newest_observed)
        allowed = round - self.lag
        if newest >= 0 and newest > allowed:  # -1: no feedback seen yet
            self.lag_violations.append(LagViolation(
                round=round, decision=decision, newest_feedback=newest, allowed=allowed,
                from_context=retired_through > allowed, event_index=index))

    def observe_retired(self) -> None:
        """The policies observe what retired since the last decision as the runtime did: by
        round, then by shard. A DP shard logs its own round when it retires and the other
        shards' rounds when their turns arrive, but every rank observes them in that one
        order (one shard's log is in that order already)."""
        for feedback in sorted(self.retired, key=lambda f: (f.round, f.shard)):
            self.depth_policy.observe(feedback)
            self.budget_policy.observe(feedback)
            self.newest_observed = max(self.newest_observed, feedback.round)
            self.num_observed += 1
        self.retired.clear()

    def report(self, recorded: Mapping[str, Any]) -> ReplayReport:
        depth = _entry(self.depth_policy)
        budget = _entry(self.budget_policy)
        return ReplayReport(
            depth_policy=depth, budget_policy=budget,
            counterfactual=(depth, budget) != (_recorded_entry(recorded["depth"]),
                                               _recorded_entry(recorded["budget"])),
            num_rounds=len(self.rounds), num_decisions=self.num_decisions,
            num_observed=self.num_observed, num_divergences=len(self.divergences),
            first_divergence=self.divergences[0] if self.divergences else None,
            num_lag_violations=len(self.lag_violations),
            first_lag_violation=self.lag_violations[0] if self.lag_violations else None,
            lag=self.lag)


def _entry(policy: DepthPolicy | BudgetPolicy) -> dict[str, Any]:
    return _plain(policy.name, policy.settings())


def _recorded_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    return _plain(entry["name"], entry["settings"])


def _plain(name: object, settings: object) -> dict[str, Any]:
    """A policy as the log stores it (tuples become lists), so that a policy rebuilt from the
    header compares equal to the recorded one."""
    entry: dict[str, Any] = json.loads(json.dumps({"name": name, "settings": settings}))
    return entry


def replay_file(path: str) -> ReplayReport:
    """Read, check and replay the event log at ``path`` with its recorded policies."""
    header, events = read_event_log(path)
    run = check_recorded_run(header, events, path)
    return _replayed(header, events, run, _recorded_policy(header, "depth", run.costs, path),
                     _recorded_policy(header, "budget", run.costs, path), path)
