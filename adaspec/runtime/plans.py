"""What startup calibration will measure (``CalibrationPlan``) and where a launch's costs
come from, checked before any device work. Nothing here needs torch: ``adaspec config``
makes the same checks (``check_calibration``) without loading a model.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from adaspec.config.calibration import CalibrationConfig, ContextInterval
from adaspec.config.effective import EffectiveConfig
from adaspec.config.files import read_json_object
from adaspec.errors import ConfigError
from adaspec.policies.base import covering_tier
from adaspec.policies.bundles import Compatibility, CostBundle, load_bundle
from adaspec.policies.costs import grid_components
from adaspec.policies.grid import (
    Axis,
    ProbeGrid,
    effective_contexts,
    fitted_to_context,
    probe_grid,
)
from adaspec.runtime.devices.buckets import BucketGeometry


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What calibration will measure, checked before any sampling.

    ``over="rows"`` (adaptive target verify): the grid's points are (Bcap, G) at full depth.
    ``over="depth"`` (adaptive draft steps): they are (Bcap, d), each run at depth d with the
    tier verifying every drafted token, ``rows_at[(Bcap, d)]``; the fit then treats d as its
    second axis, so every depth gets its own measured full-cycle cost (the additive model
    on log seconds, see ``adaspec.policies.costs``). Those are full buckets; a batch of
    fewer requests verifies a smaller tier, so the plan also measures ``rows_points``,
    (Bcap, G) at full depth, fitted as a rows profile of the same interval: the tiers such
    batches verify and the full bucket's tiers at those depths, whose difference moves a
    depth's price to the rows the round runs (``CostBundle.depth_cost_ms``).
    """

    settings: CalibrationConfig
    grid: ProbeGrid
    contexts: tuple[ContextInterval, ...]  # effective intervals, one profile each
    over: Axis = "rows"
    rows_at: Mapping[tuple[int, int], int] = field(default_factory=dict)
    rows_points: tuple[tuple[int, int], ...] = ()  # depth plans: (Bcap, G) at full depth

    @property
    def points(self) -> list[tuple[Axis, int, int]]:
        """Every point measured, with the axis of the profile it is fitted to."""
        return ([(self.over, bucket, second) for bucket, second in self.grid.points]
                + [("rows", bucket, rows) for bucket, rows in self.rows_points])

    def shape(self, axis: Axis, bucket: int, second: int) -> tuple[int, int]:
        """(depth, G) a point runs at."""
        if axis == "depth":
            return second, self.rows_at[(bucket, second)]
        return self.grid.width, second

    @property
    def num_windows(self) -> int:
        return len(self.contexts) * len(self.points) * self.settings.windows_per_point

    def settings_dict(self) -> dict[str, object]:
        """The settings as used: the effective contexts and the sampled points included,
        ``points`` on the plan's own axis ([Bcap, G], or [Bcap, d] for a depth plan) and a
        depth plan's rows points apart (``rows_points``, [Bcap, G] at full depth), so no
        point can be read on the wrong axis."""
        settings = {**self.settings.as_dict(),
                    "contexts": [c.as_dict() for c in self.contexts],
                    "points": [[bucket, second] for bucket, second in self.grid.points]}
        if self.rows_points:
            settings["rows_points"] = [[bucket, rows] for bucket, rows in self.rows_points]
        return settings


def fitted(settings: CalibrationConfig, width: int, context_limit: int | None, prefix: str,
           unset: str) -> tuple[CalibrationConfig, tuple[ContextInterval, ...]]:
    """The settings fitted to a model of ``context_limit`` tokens, with their context
    intervals checked against it. None: the limit is not known yet (a checkpoint's, before it
    loads), and the plan is only checked: its settings stay as given, with no interval."""
    if context_limit is None:
        return settings, ()
    settings = fitted_to_context(settings, width, context_limit, unset)
    return settings, effective_contexts(settings, width, context_limit, prefix)


def plan_calibration(settings: CalibrationConfig | None, geometry: BucketGeometry,
                     context_limit: int | None, prefix: str = "calibration: ",
                     unset: str = "--adaptive_target_verify_calibration") -> CalibrationPlan:
    """The built-in defaults (every captured bucket, every legal G, prefill 2048 and KV
    1..4096 capped by the model) or the given settings, checked against the geometry (and
    the model's context, ``fitted``)."""
    if settings is None:
        settings = CalibrationConfig(draft_width=geometry.width,
                                     request_buckets=geometry.request_buckets)
    settings, contexts = fitted(settings, geometry.width, context_limit, prefix, unset)
    legal = {b: geometry.legal_rows(b) for b in settings.request_buckets
             if b in geometry.request_buckets}
    grid = probe_grid(geometry.width, settings.request_buckets, legal,
                      geometry.request_buckets, settings.target_graph_rows, settings.model,
                      prefix)
    return CalibrationPlan(settings=settings, grid=grid, contexts=contexts)


def plan_depth_calibration(settings: CalibrationConfig, geometry: BucketGeometry,
                           context_limit: int | None,
                           prefix: str = "draft-step calibration: ",
                           unset: str = "--adaptive_draft_step_config") -> CalibrationPlan:
    """Every captured bucket of the settings at every depth 1..w, checked before sampling
    (the contexts as ``fitted`` says)."""
    settings, contexts = fitted(settings, geometry.width, context_limit, prefix, unset)
    points, rows_at, rows_points = [], {}, []
    for bucket in settings.request_buckets:
        if bucket not in geometry.request_buckets:
            raise ConfigError(f"{prefix}request_buckets",
                              list(settings.request_buckets),
                              f"bucket {bucket} is not captured; captured buckets: "
                              f"{list(geometry.request_buckets)}")
        legal_rows = geometry.legal_rows(bucket)
        for depth in range(1, geometry.width + 1):
            points.append((bucket, depth))
            rows_at[(bucket, depth)] = covering_tier(legal_rows, bucket, depth)
        rows_points += [(bucket, rows) for rows in smaller_batch_rows(geometry, bucket)]
    if settings.model == "additive":
        rows_points = bridged(rows_points, geometry)
        pieces = grid_components(rows_points)
        if pieces > 1:
            raise ConfigError(f"{prefix}request_buckets",
                              list(settings.request_buckets),
                              f"the tiers that batches of fewer requests than their bucket "
                              f"verify fall into {pieces} groups with no G in common, which "
                              "the additive fit cannot join; sample buckets that share "
                              "tiers, or use model sps")
    return CalibrationPlan(settings=settings, grid=ProbeGrid(geometry.width, tuple(points)),
                           contexts=contexts, over="depth", rows_at=rows_at,
                           rows_points=tuple(sorted(rows_points)))


def smaller_batch_rows(geometry: BucketGeometry, bucket: int) -> tuple[int, ...]:
    """The tiers that rounds of fewer than ``bucket`` requests in this bucket verify at some
    depth (every drafted token: the tier covering B * (d + 1)) where that differs from the
    full bucket's tier, with the full bucket's tiers of those depths: what the rows profile
    of a depth plan must price. Empty when every batch of the bucket is full (bucket 1, or
    one just above the previous bucket)."""
    legal_rows = geometry.legal_rows(bucket)
    previous = max((b for b in geometry.request_buckets if b < bucket), default=0)
    rows: set[int] = set()
    for depth in range(1, geometry.width + 1):
        full = covering_tier(legal_rows, bucket, depth)
        smaller = {covering_tier(legal_rows, n, depth) for n in range(previous + 1, bucket)}
        if smaller - {full}:
            rows |= smaller | {full}
    return tuple(sorted(rows))


def bridged(points: Sequence[tuple[int, int]], geometry: BucketGeometry
            ) -> list[tuple[int, int]]:
    """``points`` joined into one connected grid, which the additive fit needs: a bucket
    whose tiers share none with the smaller buckets' also measures the largest of their G
    that it may verify (a legal tier of its own). The rows profile prices only differences
    within a bucket, so a bridge just puts every bucket's points on one scale."""
    out = list(points)
    seen: set[int] = set()
    for bucket in sorted({b for b, _ in points}):
        own = {g for b, g in points if b == bucket}
        legal = [g for g in sorted(seen) if g in geometry.legal_rows(bucket)]
        if seen and not own & seen and legal:
            out.append((bucket, legal[-1]))
        seen |= own
    return out


def cost_source(config: EffectiveConfig, compatibility: Compatibility,
                geometry: BucketGeometry, context_limit: int
                ) -> tuple[CalibrationPlan | None, CostBundle | None]:
    """Where a launch's costs come from, checked before any device work: the calibration
    plan it runs at start, or the saved table (checked against ``compatibility``); neither
    without an adaptive control."""
    plan = launch_plan(config, geometry, context_limit)
    path = config.launch.adaptive_target_verify_cost_table
    if plan is not None or path is None or not config.launch.enable_adaptive_target_verify:
        return plan, None
    saved = load_bundle(path, read_json_object("adaptive_target_verify_cost_table", path))
    saved.check_compatible(compatibility, path, context_limit=context_limit)
    return None, saved


def check_calibration(config: EffectiveConfig, context_limit: int | None) -> None:
    """Refuse the calibration ``config``'s launch would run at start as the start refuses it,
    without a model: its grid against the launch's geometry, its contexts against
    ``context_limit`` where that is known (a built-in target's, from its model card)."""
    launch_plan(config, BucketGeometry.of(config.launch), context_limit)


def launch_plan(config: EffectiveConfig, geometry: BucketGeometry, context_limit: int | None
                ) -> CalibrationPlan | None:
    """The calibration plan ``config``'s launch runs at start, checked; None without one."""
    source = calibration_source(config)
    if source is None:
        return None
    if source.over == "depth":
        assert source.settings is not None  # the launch's rules require a draft-step config
        return plan_depth_calibration(source.settings, geometry, context_limit, source.prefix,
                                      source.unset)
    return plan_calibration(source.settings, geometry, context_limit, source.prefix,
                            source.unset)


@dataclass(frozen=True, slots=True)
class CalibrationSource:
    """The calibration a launch runs at start: its settings (None: the built-in ones), the
    axis it measures, what leads a key path in an error about them (``prefix``), and what
    to name for settings no file gave (``unset``)."""

    settings: CalibrationConfig | None
    over: Axis
    prefix: str
    unset: str


def calibration_source(config: EffectiveConfig) -> CalibrationSource | None:
    """The calibration ``config``'s launch runs at start; None when it runs none (no
    adaptive control, or adaptive verify priced by a saved table)."""
    launch = config.launch
    if launch.enable_adaptive_draft_step:
        path = launch.adaptive_draft_step_config
        prefix = _file_prefix("adaptive_draft_step_config", path, "calibration.",
                              "draft-step calibration: ")
        unset = ("--adaptive_draft_step_config" if path is None
                 else f"--adaptive_draft_step_config={path}: calibration")
        settings = None if config.draft_step is None else config.draft_step.calibration
        return CalibrationSource(settings, "depth", prefix, unset)
    if not launch.enable_adaptive_target_verify or \
            launch.adaptive_target_verify_cost_table is not None:
        return None
    prefix = _file_prefix("adaptive_target_verify_calibration",
                          launch.adaptive_target_verify_calibration, "", "calibration: ")
    return CalibrationSource(config.target_verify_calibration, "rows", prefix,
                             "--adaptive_target_verify_calibration")


def _file_prefix(flag: str, path: str | None, section: str, built_in: str) -> str:
    """What leads a key path in an error about calibration settings checked against the
    model at start: the flag and file, as the file's load-time errors name them, and the
    section the settings sit in; ``built_in`` for settings no file gave."""
    return built_in if path is None else f"--{flag}={path}: {section}"
