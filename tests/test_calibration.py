"""Startup calibration on the real pipeline: plans are checked before sampling, and a small
grid is measured from stable rounds only."""

import asyncio

import pytest

from adaspec.config import load_config
from adaspec.config.calibration import CalibrationConfig, ContextInterval
from adaspec.errors import ConfigError
from adaspec.models import load_reference_models
from adaspec.policies.costs import fit_additive
from adaspec.runtime.calibration import ForcedBudget, calibrate, plan_calibration
from adaspec.runtime.devices.buckets import BucketGeometry
from adaspec.runtime.engine import Runtime, RuntimeOptions

LAUNCH = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
          "max_seqs_per_batch": 4, "enable_adaptive_target_verify": True}
GEOMETRY = BucketGeometry.of(load_config(LAUNCH).launch)


def small(**changes: object) -> CalibrationConfig:
    values: dict[str, object] = {"draft_width": 5, "request_buckets": (1, 2), "warmup_steps": 2,
                                 "window_steps": 3, "windows_per_point": 2}
    return CalibrationConfig(**(values | changes))  # type: ignore[arg-type]


def test_the_default_plan_samples_every_captured_bucket_and_fits_the_short_context() -> None:
    plan = plan_calibration(None, GEOMETRY, context_limit=1024)
    assert plan.grid.buckets == GEOMETRY.request_buckets
    assert (4, 24) in plan.grid.points
    assert plan.context.max_kv_length == 1024
    assert plan.context.prefill_tokens == 1024 - (8 + 96 + 2) * 6


def test_plans_are_refused_before_any_sampling() -> None:
    with pytest.raises(ConfigError, match="bucket 8 is not captured"):
        plan_calibration(small(request_buckets=(1, 8)), GEOMETRY, 1024)
    with pytest.raises(ConfigError, match="must keep full width G=12 of bucket 2"):
        plan_calibration(small(target_graph_rows=(1, 2, 6)), GEOMETRY, 1024)
    beyond = (ContextInterval(prefill_tokens=100, min_kv_length=1, max_kv_length=2048),)
    with pytest.raises(ConfigError, match="expected at most the model's context limit 1024"):
        plan_calibration(small(contexts=beyond), GEOMETRY, 1024)


def test_a_small_grid_is_measured_on_the_real_pipeline_and_fitted() -> None:
    forced = ForcedBudget()
    runtime = Runtime(load_config(LAUNCH), models=load_reference_models(),
                      options=RuntimeOptions(budget_policy=forced))

    async def run() -> list[object]:
        await runtime.start()
        plan = plan_calibration(small(), runtime.geometry, runtime.context_limit)
        samples = await calibrate(runtime, forced, plan)
        await runtime.stop()
        return list(samples)

    samples = asyncio.run(run())
    points = {(s.num_reqs_bucket, s.num_rows) for s in samples}  # type: ignore[attr-defined]
    assert points == {(1, 1), (1, 2), (1, 4), (1, 6), (2, 2), (2, 4), (2, 6), (2, 8), (2, 12)}
    assert len(samples) == 2 * len(points)  # windows_per_point samples per point
    assert all(s.seconds > 0 for s in samples)  # type: ignore[attr-defined]
    table = fit_additive(samples)  # type: ignore[arg-type]
    assert table.cost_ms(2, 12) >= table.cost_ms(1, 1) > 0
