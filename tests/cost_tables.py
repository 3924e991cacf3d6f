"""Cost tables the tests build: a DSpark bundle as calibration saves one, and an MTP bundle
of depth and rows profiles over two KV intervals."""

import json
import math
from pathlib import Path

from adaspec.config.calibration import ContextInterval
from adaspec.policies.bundles import Compatibility, CostBundle, CostProfile, fitted_bundle
from adaspec.policies.costs import AdditiveTable, CostSample, LogAdditiveTable, fit_additive

LAUNCH = Compatibility(
    algorithm="DSpark", draft_width=5, dp_size=1, tp_size=1, unified=False, device="cpu",
    target="target-id", draft="dspark-id", request_buckets=(1, 2),
    target_rows=((1, 2, 4, 6), (2, 4, 6, 8, 12)))
SAMPLES = tuple(CostSample(b, g, 0.004 + 0.001 * b + 0.0001 * g + 0.0001 * k)
                for b, rows in ((1, (1, 2, 4, 6)), (2, (2, 4, 6, 8, 12)))
                for g in rows for k in range(3))
CONTEXT = ContextInterval(prefill_tokens=772, min_kv_length=1, max_kv_length=1024)
SETTINGS = {"model": "additive", "draft_width": 5, "request_buckets": [1, 2],
            "target_graph_rows": "all legal prepared tiers", "contexts": [CONTEXT.as_dict()],
            "warmup_steps": 8, "window_steps": 32, "windows_per_point": 3, "token_seed": 1,
            "points": [[b, g] for b, rows in zip(LAUNCH.request_buckets, LAUNCH.target_rows,
                                                 strict=True) for g in rows]}
"""The settings as calibration records them (CalibrationPlan.settings_dict)."""


def bundle(compatibility: Compatibility = LAUNCH) -> CostBundle:
    profile = CostProfile(CONTEXT, fit_additive(SAMPLES), SAMPLES)
    return fitted_bundle(compatibility, SETTINGS, [profile],
                         "calibrated at startup from built-in defaults")


def saved(tmp_path: Path, data: object, name: str = "table.json") -> tuple[str, dict]:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path), json.loads(path.read_text())


SHORT = ContextInterval(prefill_tokens=256, min_kv_length=1, max_kv_length=512)
LONG = ContextInterval(prefill_tokens=1024, min_kv_length=513, max_kv_length=4096)
DEPTH_MS = {SHORT: (12.0, 14.0, 24.0), LONG: (12.0, 30.0, 60.0)}
"""Bucket 4's depth prices (d = 1, 2, 3), measured with 8, 12 and 16 rows: in the long
interval deep drafts cost much more."""
ROWS_MS = {6: 10.0, 8: 11.0, 12: 12.0, 16: 20.0}
"""Bucket 4 at full depth by rows G: 16 rows cost 8 ms more than 12."""


def depth_bundle(rows: bool = True) -> CostBundle:
    """What an adaptive-draft-step launch of MTP Draft3 with buckets 1, 2, 4 calibrates over
    two KV intervals: a depth profile per interval, and a rows profile per interval for the
    tiers a batch of three verifies (``rows=False``: a table from before those)."""
    compatibility = Compatibility(
        algorithm="MTP", draft_width=3, dp_size=1, tp_size=1, unified=False, device="cpu",
        target="synthetic", draft="synthetic", request_buckets=(1, 2, 4),
        target_rows=((1, 2, 3, 4), (2, 3, 4, 6, 8), (4, 6, 8, 12, 16)))
    profiles = []
    for context, (d1, d2, d3) in DEPTH_MS.items():
        depth = LogAdditiveTable(bias=math.log(d1 / 1000), buckets=(4,), alpha=(0.0,),
                                 rows=(1, 2, 3), theta=(0.0, math.log(d2 / d1),
                                                        math.log(d3 / d1)),
                                 residual_rms=0.0, residual_max_relative=0.0)
        profiles.append(CostProfile(context, depth, over="depth"))
        if rows:
            table = AdditiveTable(bias=ROWS_MS[6] / 1000, buckets=(4,), alpha=(0.0,),
                                  rows=tuple(ROWS_MS), theta=tuple(
                                      (ms - ROWS_MS[6]) / 1000 for ms in ROWS_MS.values()),
                                  residual_rms=0.0, residual_max_relative=0.0)
            profiles.append(CostProfile(context, table, over="rows"))
    return fitted_bundle(compatibility, {}, profiles, "synthetic table")
