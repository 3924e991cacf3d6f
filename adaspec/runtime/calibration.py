"""Startup calibration: measure full-cycle round times over the probe grid on the real
pipeline, then fit the cost table.

For each grid point (Bcap, G) the running runtime decodes Bcap seeded synthetic requests
with the verification budget forced to G. A sample is one window of ``window_steps``
complete decode intervals (the time between consecutive round retirements, two rounds in
flight) after ``warmup_steps``; only rounds whose batch is exactly the point's requests and
whose binding is the point's own G count, so a transient request set never pollutes a
sample. Nothing of this adds timing to normal serving: the times come from the retirement
events the runtime publishes anyway, read only while calibrating.
"""

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from adaspec.config.calibration import DEFAULT_CONTEXTS, CalibrationConfig, ContextInterval
from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError
from adaspec.policies.base import BudgetContext, PolicyStatistics, RoundFeedback, covering_rows
from adaspec.policies.costs import CostSample
from adaspec.policies.grid import (
    ProbeGrid,
    check_contexts,
    default_contexts,
    probe_grid,
    sampling_progress,
)
from adaspec.runtime.devices.buckets import BucketGeometry
from adaspec.runtime.events.types import BudgetDecided, Event, RoundRetired


class CalibrationError(AdaspecError):
    """A grid point could not be measured."""

    def __init__(self, bucket: int, rows: int, reason: str) -> None:
        super().__init__(bucket, rows, reason)
        self.bucket, self.rows, self.reason = bucket, rows, reason

    def __str__(self) -> str:
        return f"calibration of Bcap={self.bucket} G={self.rows} failed: {self.reason}"


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    """What calibration will measure, checked before any sampling."""

    settings: CalibrationConfig
    grid: ProbeGrid
    context: ContextInterval  # the interval sampled (the first one given)

    def as_dict(self) -> dict[str, object]:
        return {"settings": self.settings.as_dict(), "points": [list(p) for p in self.grid.points],
                "context": self.context.as_dict()}


def plan_calibration(settings: CalibrationConfig | None, geometry: BucketGeometry,
                     context_limit: int) -> CalibrationPlan:
    """The built-in defaults (every captured bucket, every legal tier, prefill 2048 and KV
    1..4096 capped by the model) or the given settings, checked against the geometry."""
    if settings is None:
        settings = CalibrationConfig(draft_width=geometry.width,
                                     request_buckets=geometry.request_buckets)
    progress = sampling_progress(geometry.width, settings.warmup_steps, settings.window_steps,
                                 settings.windows_per_point)
    if settings.contexts == DEFAULT_CONTEXTS:
        contexts = default_contexts(context_limit, progress)
    else:
        contexts = settings.contexts
        check_contexts(contexts, context_limit, progress)
    legal = {b: geometry.legal_rows(b) for b in settings.request_buckets
             if b in geometry.request_buckets}
    grid = probe_grid(geometry.width, settings.request_buckets, legal,
                      geometry.request_buckets, settings.target_graph_rows, settings.model)
    return CalibrationPlan(settings=settings, grid=grid, context=contexts[0])


class ForcedBudget:
    """Calibration's budget policy: the point's G whenever the batch is the point's requests
    (the smallest tier covering everything otherwise)."""

    name = "calibration-forced"

    def __init__(self) -> None:
        self.rows: int | None = None
        self._decisions = 0

    def decide(self, context: BudgetContext) -> int:
        self._decisions += 1
        if self.rows is not None and self.rows in context.tiers:
            return self.rows
        return covering_rows(context, context.depth)

    def observe(self, feedback: RoundFeedback) -> None:
        """Calibration learns from timings, not feedback."""

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(self.name, self._decisions, 0)

    def settings(self) -> dict[str, object]:
        return {}


@dataclass(slots=True)
class _Recorder:
    """Retirement times of the rounds that ran exactly the point's shape."""

    bucket: int
    rows: int
    bound: dict[int, int] = field(default_factory=dict)  # round -> bound G
    times: list[tuple[int, float, bool]] = field(default_factory=list)  # (round, t, stable)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, event: Event) -> None:
        if isinstance(event, BudgetDecided):
            self.bound[event.round] = event.bound_rows
        elif isinstance(event, RoundRetired):
            stable = (event.feedback.num_reqs == self.bucket
                      and self.bound.get(event.round) == self.rows)
            self.times.append((event.round, event.time, stable))
            self.wake.set()

    def stable_run(self) -> list[float]:
        """Times of the newest run of consecutive stable rounds."""
        run: list[float] = []
        last = None
        for number, time, stable in self.times:
            if not stable or (last is not None and number != last + 1):
                run = []
            if stable:
                run.append(time)
            last = number
        return run


def synthetic_prompt(seed: int, index: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(vocab) for _ in range(length)]


async def measure_point(runtime: Any, forced: ForcedBudget, plan: CalibrationPlan,
                        bucket: int, rows: int, first_id: int) -> list[CostSample]:
    """Samples of one grid point on a started runtime whose budget policy is ``forced``."""
    settings = plan.settings
    forced.rows = rows
    recorder = _Recorder(bucket=bucket, rows=rows)
    runtime.subscribe(recorder)
    vocab = runtime.vocab_size
    needed = settings.warmup_steps + settings.window_steps * settings.windows_per_point + 1
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    handles = [runtime.submit(synthetic_prompt(settings.token_seed, first_id + i,
                                               plan.context.prefill_tokens, vocab), params)
               for i in range(bucket)]
    try:
        while len(recorder.stable_run()) < needed:
            if all(handle.done for handle in handles):
                raise CalibrationError(bucket, rows, "its requests ended before the point "
                                       "was measured (is the G bound, and does the context "
                                       "hold the sampling progress?)")
            recorder.wake.clear()
            await recorder.wake.wait()
    finally:
        for handle in handles:
            handle.cancel()
        runtime.bus.unsubscribe(recorder)
        for handle in handles:
            await handle.result()
    times = recorder.stable_run()[settings.warmup_steps:]
    step = settings.window_steps
    return [CostSample(bucket, rows, (times[i + step] - times[i]) / step)
            for i in range(0, step * settings.windows_per_point, step)]


async def calibrate(runtime: Any, forced: ForcedBudget, plan: CalibrationPlan
                    ) -> list[CostSample]:
    """Every grid point in turn, on the runtime's real asynchronous pipeline."""
    samples: list[CostSample] = []
    first_id = 0
    for bucket, rows in plan.grid.points:
        samples += await measure_point(runtime, forced, plan, bucket, rows, first_id)
        first_id += bucket
    return samples
