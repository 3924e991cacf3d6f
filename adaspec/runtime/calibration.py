"""Startup calibration: measure full-cycle round times over the probe grid on the real
pipeline, fit the cost table, and build the bundle the runtime installs before ready.

For each grid point (Bcap, G) a calibration pipeline (the runtime's own device context,
stream and prepared bindings, with the budget forced to the point) decodes Bcap seeded
synthetic greedy requests. A sample is one window of ``window_steps`` complete decode
intervals (the time between consecutive round retirements, two rounds in flight) after
``warmup_steps``; only rounds whose batch is exactly the point's requests and whose binding
is the point's own G count, so a transient request set never pollutes a sample. A window is
kept the moment its last round retires (``_Recorder``): with every draft accepted the
requests end right after it.

The ``windows_per_point`` windows of a point are taken in separate passes over the grid, each
on fresh requests, and each pass starts a further ``1 / windows_per_point`` of the way along
the grid (``pass_points``). A shared machine changes speed over seconds (other tenants,
frequency); spreading every point over the whole calibration lets those changes hit all
points alike instead of biasing whichever were measured during a slow spell, and the fit
takes each point's median window. The rotation keeps two windows of one point at least
two thirds of a pass apart (with three windows), so one slow spell cannot spoil two windows
of the same point (docs/costs.md tells how passes that turned back at the grid's end did).

Nothing of this adds timing to normal serving: the times come from the retirement events the
calibration pipeline publishes on its own bus, which is discarded when calibration ends.
"""

import asyncio
import functools
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from adaspec.config.calibration import CalibrationConfig, ContextInterval
from adaspec.config.launch import LaunchConfig
from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError
from adaspec.policies.base import (
    BudgetContext,
    DepthContext,
    PolicyStatistics,
    RoundFeedback,
    covering_rows,
)
from adaspec.policies.bundles import (
    Compatibility,
    CostBundle,
    CostProfile,
    fitted_bundle,
)
from adaspec.policies.costs import CostSample, fit
from adaspec.policies.grid import (
    Axis,
)
from adaspec.runtime.devices.buckets import BindingRegistry, BucketGeometry
from adaspec.runtime.devices.streams import DeviceStream
from adaspec.runtime.events.bus import EventBus
from adaspec.runtime.events.clock import MonotonicClock
from adaspec.runtime.events.types import BudgetDecided, DepthDecided, Event, RoundRetired
from adaspec.runtime.pipeline import Pipeline
from adaspec.runtime.plans import CalibrationPlan
from adaspec.runtime.ranks import ForcedPoint, RankLink
from adaspec.runtime.requests import Request
from adaspec.runtime.rounds import DeviceContext
from adaspec.runtime.states import RoundHooks

T = TypeVar("T")

LOG = logging.getLogger("adaspec.calibration")

class CalibrationError(AdaspecError):
    """A grid point could not be measured."""

    def __init__(self, bucket: int, rows: int, reason: str) -> None:
        super().__init__(bucket, rows, reason)
        self.bucket, self.rows, self.reason = bucket, rows, reason

    def __str__(self) -> str:
        return f"calibration of Bcap={self.bucket} G={self.rows} failed: {self.reason}"


class ForcedBudget:
    """Calibration's budget policy: the point's G when the batch is the point's request set
    (``bucket`` requests, a full bucket); any other, transient, set verifies at its full-width
    binding, the smallest tier covering every drafted token."""

    name = "calibration-forced"

    def __init__(self) -> None:
        self.rows: int | None = None
        self.bucket: int | None = None
        self._decisions = 0

    def decide(self, context: BudgetContext) -> int:
        self._decisions += 1
        if self.rows is not None and context.num_reqs == context.num_reqs_bucket == self.bucket \
                and self.rows in context.legal_rows:
            return self.rows
        return covering_rows(context, context.depth)

    def observe(self, feedback: RoundFeedback) -> None:
        """Calibration learns from timings, not feedback."""

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, 0)

    def settings(self) -> dict[str, object]:
        return {}


class ForcedDepth:
    """Calibration's depth policy: the point's depth when the batch is the point's request
    set (``bucket`` requests), full width otherwise (a transient set, or no point set)."""

    name = "calibration-forced-depth"

    def __init__(self) -> None:
        self.depth: int | None = None
        self.bucket: int | None = None
        self._decisions = 0

    def decide(self, context: DepthContext) -> int:
        self._decisions += 1
        if self.depth is not None and context.num_reqs == context.num_reqs_bucket == self.bucket:
            return self.depth
        return context.width

    def observe(self, feedback: RoundFeedback) -> None:
        """Calibration learns from timings, not feedback."""

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, 0)

    def settings(self) -> dict[str, object]:
        return {}


def apply_point(forced: ForcedBudget, forced_depth: ForcedDepth, point: ForcedPoint) -> None:
    """The point a calibration window measures, in both forced policies."""
    forced.rows, forced_depth.depth = point.rows, point.depth
    forced.bucket = forced_depth.bucket = point.bucket


@dataclass(slots=True)
class _Recorder:
    """Retirement times of the rounds that ran exactly the point's shape, until ``needed``
    consecutive ones make the window.

    The window is kept the moment it is complete: the rounds that retire after it, before
    the measuring coroutine next runs (several may retire in one go), cannot undo it. When
    every draft is accepted the point's requests reach their context end right after the
    window (the context holds just the sampling progress), and the last rounds then retire
    without them, which would otherwise break the run the window was measured on."""

    bucket: int
    rows: int
    depth: int
    needed: int  # consecutive stable retirements a window takes
    bound: dict[int, int] = field(default_factory=dict)  # round -> bound G
    depths: dict[int, int] = field(default_factory=dict)  # round -> depth run
    run: list[float] = field(default_factory=list)  # times of the newest stable run
    last: int | None = None  # the round retired last
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return len(self.run) >= self.needed

    def __call__(self, event: Event) -> None:
        if self.complete:
            return
        if isinstance(event, BudgetDecided):
            self.bound[event.round] = event.bound_rows
        elif isinstance(event, DepthDecided):
            self.depths[event.round] = event.depth
        elif isinstance(event, RoundRetired):
            stable = (event.feedback.num_reqs == self.bucket
                      and self.bound.get(event.round) == self.rows
                      and self.depths.get(event.round) == self.depth)
            if not stable or (self.last is not None and event.round != self.last + 1):
                self.run = []
            if stable:
                self.run.append(event.time)
            self.last = event.round
            self.wake.set()


@dataclass(frozen=True, slots=True)
class PointMeasured:
    """One window measured (what progress reporting shows)."""

    done: int  # windows measured so far, this one included
    total: int  # windows calibration measures in all
    context: int  # index of the context interval
    window: int  # pass over the grid (0-based)
    num_reqs_bucket: int
    num_rows: int
    seconds: float
    depth: int

    def log_line(self) -> str:
        return json.dumps({"event": "calibration_window", "done": self.done,
                           "total": self.total, "context": self.context,
                           "window": self.window, "Bcap": self.num_reqs_bucket,
                           "G": self.num_rows, "depth": self.depth,
                           "ms": round(1000 * self.seconds, 4)})


Progress = Callable[[PointMeasured], None]


def log_progress(measured: PointMeasured) -> None:
    """The default reporter: one structured log line per window."""
    LOG.info(measured.log_line())


def synthetic_prompt(seed: int, index: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(vocab) for _ in range(length)]


class CalibrationDriver:
    """Submits synthetic requests to a calibration pipeline and reads its retirements."""

    def __init__(self, pipeline: Pipeline, bus: EventBus, vocab_size: int,
                 forced: ForcedBudget, forced_depth: ForcedDepth, shards: int = 1) -> None:
        self.pipeline, self.bus, self.vocab_size = pipeline, bus, vocab_size
        self.forced, self.forced_depth = forced, forced_depth
        self._next_id = 0
        # Request buckets are per-shard capacities: a window of bucket 4 with two DP shards
        # decodes eight requests, four on each (the front assigns them to the least loaded).
        self.shards = shards

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        request = Request(id=self._next_id, prompt=tuple(prompt), params=params)
        self._next_id += 1
        self.pipeline.add(request)
        return request

    def cancel(self, request: Request) -> None:
        if request.running:
            self.pipeline.cancel(request)


async def measure_window(driver: CalibrationDriver, settings: CalibrationConfig,
                         context: ContextInterval, bucket: int, depth: int, rows: int,
                         first_id: int) -> float:
    """Seconds per complete decode interval of one window at (Bcap, d, G), on fresh
    synthetic requests."""
    driver.pipeline.force(ForcedPoint(bucket=bucket, depth=depth, rows=rows))
    needed = settings.warmup_steps + settings.window_steps + 1
    recorder = _Recorder(bucket=bucket, rows=rows, depth=depth, needed=needed)
    driver.bus.subscribe(recorder)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    requests = [driver.submit(synthetic_prompt(settings.token_seed, first_id + i,
                                               context.prefill_tokens, driver.vocab_size),
                              params) for i in range(bucket * driver.shards)]
    # Requests that all ended (their context filled, or a fault failed them) retire no more
    # rounds, so the wait also ends when they do.
    all_ended = asyncio.ensure_future(asyncio.gather(*(r.done.wait() for r in requests)))
    try:
        while not recorder.complete and not all_ended.done():
            recorder.wake.clear()
            woke = asyncio.ensure_future(recorder.wake.wait())
            try:
                await asyncio.wait((woke, all_ended), return_when=asyncio.FIRST_COMPLETED)
            finally:
                woke.cancel()  # also when the start is cancelled during the wait
    finally:
        for request in requests:
            driver.cancel(request)
        driver.bus.unsubscribe(recorder)
        await all_ended
    failed = next((r.error for r in requests if r.error is not None), None)
    if failed is not None:
        raise CalibrationError(bucket, rows, str(failed))
    times = recorder.run
    if not recorder.complete:
        raise CalibrationError(bucket, rows, "its requests ended before the point was "
                               "measured (is the G bound, and does the context hold the "
                               "sampling progress?)")
    start = settings.warmup_steps
    step = settings.window_steps
    return (times[start + step] - times[start]) / step


Samples = dict[Axis, list[CostSample]]
"""One context interval's samples, by the axis of the profile they are fitted to."""


async def calibrate(driver: CalibrationDriver, plan: CalibrationPlan,
                    progress: Progress | None = None) -> list[Samples]:
    """Samples of every context interval: passes over the grid (``pass_points``), one window
    of every point per pass. A sample's second coordinate is its axis's: G, or the depth."""
    settings, points = plan.settings, plan.points
    report = progress or log_progress
    done, first_id = 0, 0
    per_context: list[Samples] = []
    for index, context in enumerate(plan.contexts):
        samples: Samples = {}
        for window in range(settings.windows_per_point):
            for axis, bucket, second in pass_points(points, window,
                                                    settings.windows_per_point):
                depth, rows = plan.shape(axis, bucket, second)
                seconds = await measure_window(driver, settings, context, bucket, depth, rows,
                                               first_id)
                first_id += bucket * driver.shards
                done += 1
                samples.setdefault(axis, []).append(CostSample(bucket, second, seconds))
                report(PointMeasured(done, plan.num_windows, index, window, bucket, rows,
                                     seconds, depth))
        per_context.append(samples)
    return per_context


def pass_points(points: Sequence[T], window: int, windows: int) -> list[T]:
    """The grid's order in pass ``window`` of ``windows``: rotated by that share of the grid,
    so a point's windows lie far apart in time and each sits at a different place in its
    pass."""
    shift = (window * len(points)) // max(windows, 1)
    return list(points[shift:]) + list(points[:shift])


def fit_bundle(plan: CalibrationPlan, samples: Sequence[Samples],
               compatibility: Compatibility, source: str) -> CostBundle:
    """One fitted profile per context interval and axis (a depth plan's depth profile, then
    its rows profile when it measured one), on CPU."""
    axes: tuple[Axis, ...] = ("depth", "rows") if plan.over == "depth" else ("rows",)
    profiles = [CostProfile(context, fit(plan.settings.model, by_axis[axis], over=axis),
                            tuple(by_axis[axis]), over=axis)
                for context, by_axis in zip(plan.contexts, samples, strict=True)
                for axis in axes if axis in by_axis]
    return fitted_bundle(compatibility, plan.settings_dict(), profiles, source)


@dataclass(frozen=True, slots=True)
class CalibrationRun:
    """What a calibration pipeline shares with the runtime it calibrates."""

    launch: LaunchConfig
    ctx: DeviceContext
    stream: DeviceStream
    geometry: BucketGeometry
    registries: list[BindingRegistry] | None
    seed: int
    link: RankLink | None = None  # several ranks: the front measures, the others follow it


async def calibrate_on_stream(run: CalibrationRun, plan: CalibrationPlan,
                              compatibility: Compatibility, progress: Progress | None = None
                              ) -> CostBundle | None:
    """Drive a calibration pipeline (the runtime's device context, stream and bindings, its
    own bus and a real clock) over ``plan`` and fit the bundle. A rank behind the front runs
    the front's windows in lockstep until the front stops them, and fits nothing (None):
    every rank installs the front's table."""
    forced, forced_depth, bus = ForcedBudget(), ForcedDepth(), EventBus()
    pipeline = Pipeline(
        launch=run.launch, ctx=run.ctx, stream=run.stream, geometry=run.geometry,
        registries=run.registries, depth_policy=forced_depth, budget_policy=forced, bus=bus,
        clock=MonotonicClock(), hooks=RoundHooks(), seed=run.seed, link=run.link)
    pipeline.apply_point = functools.partial(apply_point, forced, forced_depth)
    task = asyncio.get_running_loop().create_task(pipeline.run())
    if run.link is not None and not run.link.front:
        await task
        if pipeline.fault is not None:
            raise pipeline.fault
        return None
    try:
        driver = CalibrationDriver(pipeline, bus, run.ctx.target.vocab_size, forced,
                                   forced_depth,
                                   shards=1 if run.link is None else run.link.dp_size)
        samples = await calibrate(driver, plan, progress)
    finally:
        pipeline.stop()
        await task
    if pipeline.fault is not None:
        raise pipeline.fault
    settings = plan.settings
    source = ("calibrated at startup from built-in defaults" if settings.source == "default"
              else f"calibrated at startup from {settings.source}")
    return fit_bundle(plan, samples, compatibility, source)
