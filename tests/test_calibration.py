"""Startup calibration on the real pipeline: plans are refused before anything runs, a small
grid is measured from stable rounds in alternating passes and fitted before ready, the bundle
is saved and reloaded without sampling, and incompatible launches are refused."""

import asyncio
import json
import logging
import random
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import TINY_CALIBRATION

from adaspec.config import load_config
from adaspec.config.calibration import CalibrationConfig, ContextInterval
from adaspec.config.requests import SamplingParams
from adaspec.errors import ConfigError, IncompatibleCostTable
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.policies.base import BudgetContext, DepthContext, covering_rows
from adaspec.policies.bundles import Compatibility, CostBundle, bundle_from_dict
from adaspec.policies.costs import CostSample, grid_components
from adaspec.policies.grid import Axis
from adaspec.policies.verify import choose_rows
from adaspec.runtime.calibration import (
    ForcedBudget,
    ForcedDepth,
    PointMeasured,
    Samples,
    fit_bundle,
)
from adaspec.runtime.devices.buckets import BucketGeometry
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.types import BudgetDecided
from adaspec.runtime.plans import plan_calibration, plan_depth_calibration, smaller_batch_rows

LAUNCH = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
          "max_seqs_per_batch": 4, "enable_adaptive_target_verify": True}
GEOMETRY = BucketGeometry.of(load_config(LAUNCH).launch)
TINY = TINY_CALIBRATION
PROMPTS = [b"ROMEO.\nBut soft", b"Enter Hamlet", b"O"]
TINY_POINTS = [(1, 1), (1, 2), (1, 4), (1, 6), (2, 2), (2, 4), (2, 6), (2, 8), (2, 12)]


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


def small(**changes: object) -> CalibrationConfig:
    values: dict[str, object] = {"draft_width": 5, "request_buckets": (1, 2), "warmup_steps": 2,
                                 "window_steps": 3, "windows_per_point": 2}
    return CalibrationConfig(**(values | changes))  # type: ignore[arg-type]


def start_stop(flags: dict[str, object], models: ReferenceModels,
               outputs: list[tuple[int, ...]] | None = None,
               **options: Any) -> tuple[Runtime, list[PointMeasured]]:
    """Start a launch, decode ``PROMPTS`` greedily (their tokens go to ``outputs``), stop."""
    windows: list[PointMeasured] = []
    runtime = Runtime(load_config(flags), models=models,
                      options=RuntimeOptions(calibration_progress=windows.append, **options))

    async def run() -> None:
        await runtime.start()
        params = SamplingParams(temperature=0.0, max_tokens=16)
        handles = [runtime.submit(list(prompt), params) for prompt in PROMPTS]
        for handle in handles:
            result = await handle.result()
            if outputs is not None:
                outputs.append(result.token_ids)
        await runtime.stop()

    asyncio.run(run())
    return runtime, windows


def test_the_default_plan_samples_every_captured_bucket_and_fits_the_short_context() -> None:
    plan = plan_calibration(None, GEOMETRY, context_limit=1024)
    assert plan.grid.buckets == GEOMETRY.request_buckets
    assert (4, 24) in plan.grid.points
    (context,) = plan.contexts
    assert context.max_kv_length == 1024
    # Each window runs on fresh requests: 8 warmup + 32 measured + 2 in flight, w + 1 each.
    assert context.prefill_tokens == 1024 - (8 + 32 + 2) * 6


def test_built_in_settings_shrink_to_a_short_context_and_a_files_do_not() -> None:
    # (w // 4 + w + 2) rounds of 6 tokens within 199 positions: w = 25, 198 tokens.
    plan = plan_calibration(None, GEOMETRY, context_limit=200)
    assert (plan.settings.warmup_steps, plan.settings.window_steps) == (6, 25)
    assert plan.contexts[0].prefill_tokens == 2
    assert plan.settings_dict()["window_steps"] == 25
    depth = plan_depth_calibration(depth_settings(), ADS_GEOMETRY, 200)
    assert (depth.settings.warmup_steps, depth.settings.window_steps) == (6, 25)
    # Below (1 + 4 + 2) * 6 + 1 = 43 tokens nothing is left to shrink: the flag is named.
    with pytest.raises(ConfigError, match=r"^--adaptive_target_verify_calibration: not given, "
                                          "and the built-in calibration needs a context of at "
                                          "least 43 tokens at width 5, more than the model's "
                                          "limit of 42; give a file"):
        plan_calibration(None, GEOMETRY, context_limit=42)
    with pytest.raises(ConfigError, match=r"^--adaptive_draft_step_config: not given"):
        plan_depth_calibration(depth_settings(), ADS_GEOMETRY, 42)
    # A file's steps are the user's: kept, and the interval that cannot hold them is named.
    with pytest.raises(ConfigError, match=r"^--f=x\.json: contexts=built-in default: a context "
                                          "limit of 200 tokens cannot hold 252 tokens"):
        plan_calibration(small(warmup_steps=8, window_steps=32, source="x.json"), GEOMETRY,
                         200, prefix="--f=x.json: ")


def test_plans_are_refused_before_any_sampling() -> None:
    with pytest.raises(ConfigError, match="bucket 8 is not captured"):
        plan_calibration(small(request_buckets=(1, 8)), GEOMETRY, 1024)
    with pytest.raises(ConfigError, match="must keep full width G=12 of bucket 2"):
        plan_calibration(small(target_graph_rows=(1, 2, 6)), GEOMETRY, 1024)
    beyond = (ContextInterval(prefill_tokens=100, min_kv_length=1, max_kv_length=2048),)
    with pytest.raises(ConfigError, match="expected at most the model's context limit 1024"):
        plan_calibration(small(contexts=beyond), GEOMETRY, 1024)


BEYOND = [{"prefill_tokens": 100, "min_kv_length": 1, "max_kv_length": 4096}]


@pytest.mark.parametrize(("launch", "flag", "document", "key"), [
    (LAUNCH, "adaptive_target_verify_calibration", TINY | {"contexts": BEYOND}, "contexts"),
    ({"speculative_algorithm": "MTP", "num_speculative_tokens": 3, "max_seqs_per_batch": 2,
      "enable_adaptive_draft_step": True}, "adaptive_draft_step_config",
     {"version": 1, "calibration": {"contexts": BEYOND}}, "calibration.contexts"),
])
def test_a_context_beyond_the_model_fails_start_before_any_device_work(
        tmp_path: Path, models: ReferenceModels, launch: dict[str, object], flag: str,
        document: dict[str, object], key: str) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(document))
    stages: list[str] = []
    runtime = Runtime(load_config(launch | {flag: str(calibration)}), models=models,
                      options=RuntimeOptions(stage_hook=lambda _round, stage: stages.append(stage)))
    # Named as the file's load-time errors are: flag, file and the full key path.
    with pytest.raises(ConfigError, match=f"^{re.escape(f'--{flag}={calibration}: {key}[0]')}"
                                          r"\.max_kv_length=4096: expected at most the model's "
                                          "context limit 1024$"):
        asyncio.run(runtime.start())
    assert stages == []
    assert not any(t.name.startswith("adaspec-cpu-") for t in threading.enumerate())
    assert runtime.costs is None


def test_startup_calibrates_a_small_grid_saves_it_and_a_reload_skips_sampling(
        tmp_path: Path, models: ReferenceModels, caplog: pytest.LogCaptureFixture) -> None:
    calibration, output = tmp_path / "calibration.json", tmp_path / "costs.json"
    calibration.write_text(json.dumps(TINY))
    flags = LAUNCH | {"adaptive_target_verify_calibration": str(calibration),
                      "adaptive_target_verify_cost_table_output": str(output)}
    with caplog.at_level(logging.INFO, logger="adaspec"):
        first, windows = start_stop(flags, models, event_log=str(tmp_path / "first.jsonl"))
    costs = first.costs
    assert costs is not None
    assert output.exists()
    assert costs.source == f"calibrated at startup from {calibration}"
    # Two passes, one window of every point each, the second starting half way along the grid
    # (never the same point twice in a row).
    order = [(w.num_reqs_bucket, w.num_rows) for w in windows]
    assert order == TINY_POINTS + TINY_POINTS[4:] + TINY_POINTS[:4]
    assert [w.window for w in windows] == [0] * 9 + [1] * 9
    assert [w.done for w in windows] == list(range(1, 19))
    assert windows[0].total == 18
    (profile,) = costs.profiles
    assert sorted((s.num_reqs_bucket, s.num_rows) for s in profile.samples) == \
        sorted(TINY_POINTS * 2)
    assert profile.table.cost_ms(2, 12) >= profile.table.cost_ms(1, 1) > 0
    # The effective configuration line names the source, the settings and the geometry.
    (line,) = [json.loads(r.message) for r in caplog.records if r.name == "adaspec"]
    assert line["costs"]["source"] == costs.source
    assert line["costs"]["settings"]["warmup_steps"] == 2
    assert line["captured_geometry"]["target_rows"]["4"] == [4, 6, 8, 12, 16, 24]
    assert line["config"]["launch"]["settings"]["num_speculative_tokens"] == 5

    reload = LAUNCH | {"adaptive_target_verify_cost_table": str(output)}
    second, windows = start_stop(reload, models, event_log=str(tmp_path / "second.jsonl"))
    assert windows == []  # no sampling, no fitting
    assert second.costs == costs
    assert second.costs.source == f"saved table {output}"
    headers = [read_event_log(tmp_path / name).header for name in ("first.jsonl",
                                                                      "second.jsonl")]
    assert headers[0].cost_table == headers[1].cost_table == json.loads(costs.to_json())
    # The reloaded launch decides every round exactly as the launch that saved the table.
    logged = [[(e.round, e.num_rows) for e in read_event_log(tmp_path / name).events
               if isinstance(e, BudgetDecided)] for name in ("first.jsonl", "second.jsonl")]
    assert logged[0] == logged[1]
    assert len(logged[0]) > 5
    saved_decisions = budget_decisions(costs)
    assert budget_decisions(second.costs) == saved_decisions
    assert len(set(saved_decisions)) > 1  # the table does drive the choice


def test_unified_draft5_adaptive_verify_starts_on_its_prepared_tiers_and_stays_lossless(
        tmp_path: Path, models: ReferenceModels, caplog: pytest.LogCaptureFixture) -> None:
    """Unified adaptive verification prepares only each count's tiers; calibration measures
    those, the log reports those, and no round is offered a G it would have to pad."""
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(TINY))
    unified = LAUNCH | {"enable_unified_mtp_graph": True,
                        "adaptive_target_verify_calibration": str(calibration)}
    outputs: list[list[tuple[int, ...]]] = [[], []]
    with caplog.at_level(logging.INFO, logger="adaspec"):
        runtime, windows = start_stop(unified, models, outputs[0],
                                      event_log=str(tmp_path / "u.jsonl"))
    # Bucket 2 holds only two requests, so it lacks G=6 (no count of two needs it).
    prepared = {"1": [1, 2, 4, 6], "2": [2, 4, 8, 12], "4": [4, 6, 8, 12, 16, 24]}
    (line,) = [json.loads(r.message) for r in caplog.records if r.name == "adaspec"]
    assert line["captured_geometry"]["target_rows"] == prepared
    measured = {(w.num_reqs_bucket, w.num_rows) for w in windows}
    assert measured == {(b, g) for b in (1, 2) for g in prepared[str(b)]}
    assert runtime.costs is not None
    decided = [e for e in read_event_log(tmp_path / "u.jsonl").events
               if isinstance(e, BudgetDecided)]
    assert decided
    assert all(e.bound_rows == e.num_rows for e in decided)
    start_stop({"speculative_algorithm": "none", "max_seqs_per_batch": 4}, models, outputs[1])
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) == len(PROMPTS)


def budget_decisions(costs: CostBundle) -> list[int]:
    """The budget chosen for every bucket, batch size, KV length around the coverage edge and
    40 seeded survival profiles (from all-rejected to all-accepted)."""
    rng = random.Random(3)
    profiles = [[rng.random() ** (3 * k / 40) for _ in range(5 * 4)] for k in range(40)]
    decisions = []
    for bucket in GEOMETRY.request_buckets:
        legal_rows = GEOMETRY.legal_rows(bucket)
        for num_reqs in range(1, bucket + 1):
            for kv_length in (1, 900, 1024, 1025):
                for survivals in profiles:
                    decisions.append(choose_rows(
                        legal_rows, [(num_reqs, survivals[:5 * num_reqs])],
                        lambda g, b=bucket, kv=kv_length: costs.cost_ms(b, g, kv),
                        bucket * 6))
    return decisions


def test_incompatible_launches_refuse_a_saved_table_before_warmup(
        tmp_path: Path, models: ReferenceModels) -> None:
    calibration, output = tmp_path / "calibration.json", tmp_path / "draft5.json"
    calibration.write_text(json.dumps(TINY | {"request_buckets": [1]}))
    start_stop(LAUNCH | {"adaptive_target_verify_calibration": str(calibration),
                         "adaptive_target_verify_cost_table_output": str(output)}, models)
    cases = [({"num_speculative_tokens": 7},
              "draft_width is 5 in the saved table but 7 in this launch"),
             ({"speculative_algorithm": "MTP"},
              "algorithm is DSpark in the saved table but MTP in this launch"),
             ({"max_seqs_per_batch": 8}, r"request_buckets is \[1, 2, 4\] in the saved table "
                                         r"but \[1, 2, 4, 8\] in this launch")]
    stages: list[str] = []
    for change, message in cases:
        runtime = Runtime(load_config(LAUNCH | change | {
            "adaptive_target_verify_cost_table": str(output)}), models=models,
            options=RuntimeOptions(stage_hook=lambda _round, stage: stages.append(stage)))
        with pytest.raises(IncompatibleCostTable, match=message):
            asyncio.run(runtime.start())
    assert stages == []
    assert not any(t.name.startswith("adaspec-cpu-") for t in threading.enumerate())
    # The hook does see the rounds of a launch the table fits.
    start_stop(LAUNCH | {"adaptive_target_verify_cost_table": str(output)}, models,
               stage_hook=lambda _round, stage: stages.append(stage))
    assert "verify" in stages


def test_a_start_that_fails_after_warmup_leaves_nothing_running(
        tmp_path: Path, models: ReferenceModels) -> None:
    calibration, folder = tmp_path / "calibration.json", tmp_path / "results"
    calibration.write_text(json.dumps(TINY | {"request_buckets": [1]}))
    folder.mkdir()
    config = load_config(LAUNCH | {"adaptive_target_verify_calibration": str(calibration),
                                   "adaptive_target_verify_cost_table_output":
                                   str(folder / "costs.json")})
    folder.rmdir()  # gone by the time calibration saves
    runtime = Runtime(config, models=models,
                      options=RuntimeOptions(calibration_progress=lambda _: None))
    with pytest.raises(ConfigError, match="costs.json: expected a writable file"):
        asyncio.run(runtime.start())
    assert not any(t.name.startswith("adaspec-cpu-") for t in threading.enumerate())


@pytest.mark.parametrize("algorithm", ["DSpark", "MTP"])
def test_serving_after_startup_calibration_stays_lossless(
        tmp_path: Path, models: ReferenceModels, algorithm: str) -> None:
    """Calibration runs on the same KV slots and drafter state that serving then uses."""
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(TINY))
    prompts = [b"ROMEO.\nBut soft", b"Enter Hamlet", b"O"]

    def decode(flags: dict[str, object]) -> list[tuple[int, ...]]:
        runtime = Runtime(load_config(flags), models=models,
                          options=RuntimeOptions(calibration_progress=lambda _: None))

        async def run() -> list[tuple[int, ...]]:
            await runtime.start()
            params = SamplingParams(temperature=0.0, max_tokens=24)
            handles = [runtime.submit(list(p), params) for p in prompts]
            results = [(await h.result()).token_ids for h in handles]
            await runtime.stop()
            return results

        return asyncio.run(run())

    adaptive = decode(LAUNCH | {"speculative_algorithm": algorithm,
                                "adaptive_target_verify_calibration": str(calibration)})
    target_only = decode({"speculative_algorithm": "none", "max_seqs_per_batch": 4})
    assert adaptive == target_only


def budget_context(num_reqs: int, bucket: int) -> BudgetContext:
    return BudgetContext(round=0, num_reqs=num_reqs, num_reqs_bucket=bucket, width=5, depth=5,
                         legal_rows=GEOMETRY.legal_rows(bucket), retired_through=-1)


def test_only_the_points_request_set_is_forced_and_transient_sets_verify_at_full_width(
        ) -> None:
    budget, depth = ForcedBudget(), ForcedDepth()
    budget.rows, budget.bucket, depth.depth, depth.bucket = 8, 4, 2, 4
    assert budget.decide(budget_context(4, 4)) == 8
    full = covering_rows(budget_context(3, 4), 5)
    assert full == 24  # the smallest tier holding 3 * 6 rows: the full-width binding
    assert budget.decide(budget_context(3, 4)) == full  # a set still filling or draining
    assert budget.decide(budget_context(2, 2)) == covering_rows(budget_context(2, 2), 5)
    assert depth.decide(DepthContext(round=0, num_reqs=4, num_reqs_bucket=4, width=5,
                                     retired_through=-1)) == 2
    assert depth.decide(DepthContext(round=0, num_reqs=3, num_reqs_bucket=4, width=5,
                                     retired_through=-1)) == 5
    assert ForcedDepth().decide(DepthContext(round=0, num_reqs=4, num_reqs_bucket=4, width=5,
                                             retired_through=-1)) == 5


ADS = {"speculative_algorithm": "MTP", "num_speculative_tokens": 5, "max_seqs_per_batch": 16,
       "enable_adaptive_draft_step": True}
ADS_GEOMETRY = BucketGeometry.of(load_config(ADS).launch)


def depth_settings(**changes: object) -> CalibrationConfig:
    values: dict[str, object] = {"draft_width": 5, "request_buckets": (1, 2, 4, 8, 16)}
    return CalibrationConfig(**(values | changes))  # type: ignore[arg-type]


def test_a_depth_plan_also_measures_the_rows_smaller_batches_verify() -> None:
    plan = plan_depth_calibration(depth_settings(), ADS_GEOMETRY, 8192)
    # Full buckets at every depth, each verifying Bcap * (d + 1) rows.
    assert {(b, d, plan.rows_at[(b, d)]) for b, d in plan.grid.points} == {
        (b, d, b * (d + 1)) for b in (1, 2, 4, 8, 16) for d in range(1, 6)}
    # Bucket 4 holds batches of three: at depths 1..5 they verify 6, 10 (9 rows), 12,
    # 16 (15 rows) and 20 (18 rows) where a full bucket verifies 8, 12, 16, 20 and 24.
    assert smaller_batch_rows(ADS_GEOMETRY, 4) == (6, 8, 10, 12, 16, 20, 24)
    assert smaller_batch_rows(ADS_GEOMETRY, 1) == smaller_batch_rows(ADS_GEOMETRY, 2) == ()
    rows_points = [point for point in plan.points if point[0] == "rows"]
    assert rows_points == [("rows", b, g) for b in (4, 8, 16)
                           for g in smaller_batch_rows(ADS_GEOMETRY, b)]
    assert all(plan.shape(*point) == (5, point[2]) for point in rows_points)  # full depth
    assert plan.num_windows == len(plan.points) * 3
    # Fitted: per interval a depth profile, then the rows profile that moves its prices.
    axes: tuple[Axis, ...] = ("depth", "rows")
    samples: list[Samples] = [{axis: [
        CostSample(b, s, 0.01 + 0.001 * b + 0.0001 * s + 0.00001 * k)
        for k in range(3) for a, b, s in plan.points if a == axis] for axis in axes}]
    compatibility = Compatibility(
        algorithm="MTP", draft_width=5, dp_size=1, tp_size=1, unified=False, device="cpu",
        target="t", draft="d", request_buckets=ADS_GEOMETRY.request_buckets,
        target_rows=tuple(map(ADS_GEOMETRY.legal_rows, ADS_GEOMETRY.request_buckets)))
    costs = fit_bundle(plan, samples, compatibility, "test")
    assert [(p.over, p.table.kind) for p in costs.profiles] == [("depth", "log-additive"),
                                                                 ("rows", "additive")]
    assert bundle_from_dict(json.loads(costs.to_json()), "reloaded") == costs


def test_a_depth_plan_bridges_buckets_whose_rows_share_no_tier() -> None:
    geometry = BucketGeometry.of(load_config(ADS | {"num_speculative_tokens": 2}).launch)
    settings = depth_settings(draft_width=2)
    rows = {b: smaller_batch_rows(geometry, b) for b in geometry.request_buckets}
    assert not set(rows[4]) & set(rows[8])  # bucket 4's rows end below bucket 8's
    plan = plan_depth_calibration(settings, geometry, 8192)
    points = [(b, s) for a, b, s in plan.points if a == "rows"]
    # Bucket 8 also measures 8 rows, the largest of bucket 4's it may verify: one grid.
    assert set(points) == {(b, g) for b in rows for g in rows[b]} | {(8, 8)}
    assert grid_components(points) == 1
    # SPS fits every G alone: nothing to bridge.
    sps = plan_depth_calibration(depth_settings(draft_width=2, model="sps"), geometry, 8192)
    assert (8, 8) not in [(b, s) for a, b, s in sps.points if a == "rows"]
    # Buckets 4 and 16 share no tier at all: refused before sampling, not after it.
    with pytest.raises(ConfigError, match=r"draft-step calibration: request_buckets=\[4, 16\]: "
                                          "the tiers that batches of fewer requests than their "
                                          "bucket verify fall into 2 groups"):
        plan_depth_calibration(depth_settings(draft_width=2, request_buckets=(4, 16)),
                               geometry, 8192)
