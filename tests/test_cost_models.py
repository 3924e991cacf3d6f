"""Cost models recover known costs from noisy samples; bad probe grids are refused before any
sampling."""

import numpy as np
import pytest

from adaspec.config import LaunchConfig
from adaspec.config.calibration import ContextInterval
from adaspec.errors import ConfigError
from adaspec.policies.costs import (
    CostSample,
    FitError,
    LogAdditiveTable,
    SpsTable,
    UnpricedShape,
    fit,
    fit_additive,
    fit_sps,
    relative_errors,
    table_from_dict,
)
from adaspec.policies.grid import (
    check_contexts,
    default_contexts,
    probe_grid,
    sampling_progress,
)
from adaspec.runtime.devices.buckets import BucketGeometry

GEOMETRY = BucketGeometry.of(LaunchConfig(speculative_algorithm="DSpark",
                                          num_speculative_tokens=5, max_seqs_per_batch=16))
LEGAL = {b: GEOMETRY.legal_rows(b) for b in GEOMETRY.request_buckets}
NOISE = 0.02  # relative, Gaussian, seeded
# Predicted costs within 7 % of the true ones at every point, 1.5 % at the median (3 windows
# of 2 % noise per point). The true G term rises by steps of 0.04 ms per row that the fit
# levels until they add up to two standard errors of the difference (0.1 to 0.15 ms here), so
# the small shapes just below a new level carry the largest error.
TOLERANCE_MAX, TOLERANCE_MEDIAN = 0.07, 0.015


def true_seconds(bucket: int, rows: int) -> float:
    """A known additive cost: 2 ms, 0.1 ms per bucket entry, 0.04 ms per row with a step."""
    return 0.002 + 0.0001 * bucket + 0.00004 * rows + (0.0005 if rows > 32 else 0.0)


def samples(points: list[tuple[int, int]], seed: int = 0, windows: int = 3) -> list[CostSample]:
    rng = np.random.default_rng(seed)
    return [CostSample(b, g, true_seconds(b, g) * (1 + NOISE * rng.standard_normal()))
            for b, g in points for _ in range(windows)]


def all_points() -> list[tuple[int, int]]:
    return [(b, g) for b, rows in LEGAL.items() for g in rows]


def test_additive_fit_recovers_known_costs_from_noisy_samples() -> None:
    table = fit_additive(samples(all_points()))
    errors = [abs(table.seconds(b, g) - true_seconds(b, g)) / true_seconds(b, g)
              for b, g in all_points()]
    assert max(errors) < TOLERANCE_MAX
    assert float(np.median(errors)) < TOLERANCE_MEDIAN
    # The terms themselves, up to the gauge: alpha(16) - alpha(1) is 1.5 ms.
    assert table.alpha[-1] - table.alpha[0] == pytest.approx(0.0015, rel=0.1)
    assert table.residual_max_relative < 5 * NOISE


def test_price_steps_within_the_window_noise_are_levelled() -> None:
    """Flat true costs measured with 15 % window noise (a shared CPU): the fit prices every G
    of a bucket the same, so no tier looks cheaper than it is; a real step of 40 % is kept."""
    rng = np.random.default_rng(3)
    flat = [CostSample(b, g, (0.010 + 0.001 * b) * (1 + 0.15 * rng.standard_normal()))
            for b, rows in LEGAL.items() for g in rows for _ in range(3)]
    table = fit_additive(flat)
    for bucket, rows in LEGAL.items():
        assert len({table.cost_ms(bucket, g) for g in rows}) == 1, bucket
    stepped = [CostSample(s.num_reqs_bucket, s.num_rows,
                          s.seconds + (0.008 if s.num_rows > 32 else 0.0)) for s in flat]
    table = fit_additive(stepped)
    assert table.cost_ms(16, 48) - table.cost_ms(16, 32) == pytest.approx(8.0, rel=0.3)
    assert table.cost_ms(16, 32) == table.cost_ms(16, 16)


def test_levelled_fits_of_very_noisy_grids_stay_on_the_measured_level_and_reload() -> None:
    # A tiny calibration on a busy machine: few points, two windows each, up to 9x apart
    # (80x on odd seeds).
    # Levelling once pulled the first G term so low that the smallest shape cost nothing,
    # a table every reader refuses.
    points = [(1, 1), (1, 2), (1, 4), (1, 6), (2, 2), (2, 4), (2, 6), (2, 8), (2, 12)]
    for seed in range(200):
        rng = np.random.default_rng(seed)
        noisy = [CostSample(b, g, 0.05 * float(np.exp(rng.uniform(-1.1, 1.1) * (1 + seed % 2))))
                 for b, g in points for _ in range(2)]
        table = fit_additive(noisy)
        assert table_from_dict(table.as_dict()) == table
        medians = {}
        for point in points:
            values = sorted(x.seconds for x in noisy if (x.num_reqs_bucket, x.num_rows) == point)
            medians[point] = float(np.median(values))
        priced = [table.seconds(b, g) for b, g in points]
        cheapest = min(medians.values())
        # The saved diagnostics describe the table as it prices, not the fit before the
        # repair and the levelling (which had them near 0 beside errors of 28 %).
        errors = [abs(medians[p] - price) / medians[p] for p, price in zip(points, priced,
                                                                          strict=True)]
        assert table.residual_max_relative == pytest.approx(max(errors), rel=1e-9)
        assert min(priced) >= cheapest * (1 - 1e-12)  # nothing under the cheapest measured
        if min(priced) > cheapest * (1 + 1e-9):  # not lifted: the mean is the measured one
            assert np.mean(priced) == pytest.approx(np.mean(list(medians.values())),
                                                    rel=1e-9)


def test_without_levelling_every_monotone_step_is_kept() -> None:
    """Without levelling (the depth profile's fit) a small real step stays a step."""
    points = [(b, g) for b, g in all_points() if b == 8]
    table = fit_additive(samples(points, windows=5), level=False)
    assert table.cost_ms(8, 12) > table.cost_ms(8, 8)


def served_depth_seconds(bucket: int, depth: int) -> float:
    """A depth cost shaped like the reference models' served rounds: each depth adds a share
    of the bucket's own cost (depth 5 is 1.64 times depth 1 at every bucket)."""
    return (0.008 + 0.0008 * bucket) * (1 + 0.16 * (depth - 1))


def depth_samples(seed: int = 0) -> list[CostSample]:
    rng = np.random.default_rng(seed)
    return [CostSample(b, d, served_depth_seconds(b, d) * (1 + NOISE * rng.standard_normal()))
            for b in (1, 2, 4, 8, 16) for d in range(1, 6) for _ in range(3)]


def test_a_depth_profile_prices_each_depth_as_a_share_of_its_bucket() -> None:
    """Seeded, 2 % window noise: the log fit keeps every bucket's depth-5 to depth-1 ratio
    within 5 % (about four standard errors); the fit in seconds, one depth term shared by
    all buckets, is over 10 % too steep at one request and too flat at sixteen."""
    table = fit("additive", depth_samples(), over="depth")
    assert isinstance(table, LogAdditiveTable)
    for bucket in (1, 2, 4, 8, 16):
        ratio = table.cost_ms(bucket, 5) / table.cost_ms(bucket, 1)
        assert ratio == pytest.approx(1.64, rel=0.05)
    assert table.residual_max_relative < 5 * NOISE
    seconds = fit_additive(depth_samples(), level=False)
    assert seconds.cost_ms(1, 5) / seconds.cost_ms(1, 1) > 1.1 * 1.64
    assert seconds.cost_ms(16, 5) / seconds.cost_ms(16, 1) < 1.64 / 1.1
    # SPS stays one table over the second axis, pooled over buckets.
    assert isinstance(fit("sps", depth_samples(), over="depth"), SpsTable)


def test_a_log_table_reloads_exactly_and_never_prices_a_depth_below_a_shallower_one() -> None:
    dip = [CostSample(1, 1, 0.010), CostSample(1, 2, 0.009), CostSample(1, 3, 0.012)]
    table = fit("additive", dip, over="depth")
    costs = [table.cost_ms(1, d) for d in (1, 2, 3)]
    assert costs == sorted(costs)
    assert table_from_dict(table.as_dict()) == table
    with pytest.raises(FitError, match="not positive"):
        fit("additive", [CostSample(1, 1, 0.0)], over="depth")
    with pytest.raises(UnpricedShape, match="d=6 lies above the largest measured d=3"):
        table.cost_ms(1, 6)


LOG_TABLE = {"kind": "log-additive", "bias": -5.0, "buckets": [1, 2], "alpha": [0.0, 0.5],
             "rows": [1, 2, 3], "theta": [0.0, 0.2, 0.4], "residual_rms": 0.0,
             "residual_max_relative": 0.0}


@pytest.mark.parametrize(("table", "message"), [
    # 1000 / 5e-324 ms is infinite: every rate would be 0 and the smallest tier would win.
    ({"kind": "sps", "rows": [1, 2], "steps_per_second": [10.0, 5e-324]},
     r"^steps_per_second\[1\]=5e-324: expected every price in 1e-06\.\.3600 s; G=2 costs "
     r"inf s$"),
    # A picosecond per step: tokens per millisecond overflow the other way.
    ({"kind": "sps", "rows": [1, 2], "steps_per_second": [1e12, 10.0]},
     r"^steps_per_second\[0\]=1000000000000\.0: expected every price .* G=1 costs 1e-12 s$"),
    # exp(1000) overflows a float: the depth policy would crash on its first price.
    ({**LOG_TABLE, "theta": [0.0, 0.2, 1000.0]},
     r"^theta\[2\]=1000\.0: expected every price .* Bcap=2 d=3 costs inf s$"),
    ({**LOG_TABLE, "bias": -40.0},
     r"^bias=-40\.0: expected every price in 1e-06\.\.3600 s; Bcap=1 d=1 costs 4\.2"),
])
def test_a_table_pricing_a_shape_out_of_range_is_refused_naming_a_key(
        table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        table_from_dict(table)


def test_prices_in_range_load() -> None:
    assert table_from_dict(LOG_TABLE).cost_ms(2, 3) == pytest.approx(1000 * np.exp(-4.1))
    sps = {"kind": "sps", "rows": [1, 2], "steps_per_second": [1e6, 1 / 3600]}
    assert table_from_dict(sps).cost_ms(1, 2) == pytest.approx(3.6e6)


def test_sps_fit_recovers_steps_per_second_per_g() -> None:
    """Within 3 % of the true cost, or, where the passes do not agree on a small step
    (0.16 ms from G=12 to 16, under twice a window's noise), at the level of the G below."""
    points = [(8, g) for g in LEGAL[8]]
    table = fit_sps(samples(points, windows=5))
    levelled = 0
    for (_, below), (_, g) in zip([points[0], *points], points, strict=False):
        cost = table.cost_ms(8, g)
        if cost != pytest.approx(1000 * true_seconds(8, g), rel=0.03):
            assert cost == pytest.approx(1000 * true_seconds(8, below), rel=0.03)
            levelled += 1
    assert levelled <= 1
    # The large steps are kept: 0.64 ms from 24 to 32, 1.14 ms from 32 to 48.
    assert table.cost_ms(8, 48) > table.cost_ms(8, 32) > table.cost_ms(8, 24)


def test_a_step_that_the_passes_do_not_agree_on_is_levelled() -> None:
    """Seeded: bucket 16 at G=64 and 96 measured alone, three passes of 2 % noise, and one
    slow spell of the host (+30 %) over G=96 in two passes: its median rises by 30 %, far
    past the pooled noise, but the passes do not agree, so G=96 costs what G=64 does. A real
    30 % step, seen in every pass, is kept."""
    def windows(slow: tuple[float, float, float]) -> list[CostSample]:
        rng = np.random.default_rng(3)
        out = []
        for spell in slow:  # one pass over the grid
            for b, g in all_points():
                factor = 1 + NOISE * rng.standard_normal()
                if (b, g) == (16, 96):
                    factor *= spell
                out.append(CostSample(b, g, true_seconds(b, 64 if g == 96 else g) * factor))
        return out
    spell = fit_additive(windows((1.3, 1.3, 1.0)))
    assert spell.cost_ms(16, 96) == spell.cost_ms(16, 64)
    real = fit_additive(windows((1.3, 1.3, 1.3)))
    assert real.cost_ms(16, 96) > 1.2 * real.cost_ms(16, 64)


def test_an_unmeasured_shape_costs_what_the_next_larger_measured_one_costs() -> None:
    table = fit_additive(samples([(4, 8), (4, 24), (8, 24), (8, 48)]))
    assert table.cost_ms(4, 9) == table.cost_ms(4, 24)  # 9 rows are priced as 24
    assert table.cost_ms(3, 8) == table.cost_ms(4, 8)  # bucket 3 as bucket 4
    assert table.cost_ms(4, 7) == table.cost_ms(4, 8)  # never extrapolated down
    with pytest.raises(UnpricedShape, match="G=49 lies above the largest measured G=48"):
        table.cost_ms(8, 49)


def test_fitted_costs_never_fall_as_rows_grow() -> None:
    exact = [CostSample(8, g, s) for g, s in ((8, 0.010), (16, 0.009), (32, 0.012))]
    table = fit_additive(exact)
    costs = [table.cost_ms(8, g) for g in (8, 16, 32)]
    assert costs == sorted(costs)
    assert costs[1] == pytest.approx(costs[0])  # the dip is raised to its neighbour
    sps = fit_sps(exact)
    assert sps.cost_ms(8, 16) == pytest.approx(sps.cost_ms(8, 8))


def test_a_disconnected_sample_set_cannot_be_fitted_additively() -> None:
    with pytest.raises(FitError, match="form 2 groups with no G in common"):
        fit_additive(samples([(1, 2), (1, 6), (8, 16), (8, 48)]))


def test_held_out_errors_are_relative() -> None:
    table = fit_additive(samples(all_points()))
    errors = relative_errors(table, samples(all_points(), seed=9, windows=1))
    assert np.median(errors) < 2 * NOISE


# --- the probe grid ------------------------------------------------------------------------

def test_the_default_grid_covers_every_legal_tier_of_every_bucket() -> None:
    grid = probe_grid(5, GEOMETRY.request_buckets, LEGAL, GEOMETRY.request_buckets, None,
                      "additive")
    assert len(grid.points) == sum(len(rows) for rows in LEGAL.values())
    assert (8, 48) in grid.points


def test_an_uncaptured_bucket_is_refused() -> None:
    with pytest.raises(ConfigError, match="bucket 32 is not captured"):
        probe_grid(5, (8, 32), LEGAL, GEOMETRY.request_buckets, None, "additive")


def test_a_grid_without_full_width_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"must keep full width G=48 of bucket 8"):
        probe_grid(5, (8,), LEGAL, GEOMETRY.request_buckets, (8, 16, 32), "sps")


def test_an_explicit_g_that_no_sampled_bucket_captures_is_refused() -> None:
    with pytest.raises(ConfigError, match="G=64 is not a captured tier of any sampled"):
        probe_grid(5, (8,), LEGAL, GEOMETRY.request_buckets, (16, 48, 64), "sps")


def test_a_disconnected_additive_grid_is_refused_but_sps_accepts_it() -> None:
    buckets, rows = (1, 8), (1, 6, 8, 48)  # bucket 1: G 1, 6; bucket 8: G 8, 48
    with pytest.raises(ConfigError, match="falls into 2 groups of buckets with no G in common"):
        probe_grid(5, buckets, LEGAL, GEOMETRY.request_buckets, rows, "additive")
    assert probe_grid(5, buckets, LEGAL, GEOMETRY.request_buckets, rows, "sps").points


def test_contexts_beyond_the_model_or_without_room_for_progress_are_refused() -> None:
    progress = sampling_progress(5, warmup_steps=8, window_steps=32)
    assert progress == (8 + 32 + 2) * 6
    with pytest.raises(ConfigError, match=r"contexts\[0\]\.max_kv_length=4096: expected at "
                                          "most the model's context limit 1024"):
        check_contexts([ContextInterval(prefill_tokens=10, min_kv_length=1,
                                        max_kv_length=4096)], 1024, progress)
    with pytest.raises(ConfigError, match=r"contexts\[0\]\.prefill_tokens=800: expected at "
                                          "most 772"):
        check_contexts([ContextInterval(prefill_tokens=800, min_kv_length=1,
                                        max_kv_length=1024)], 1024, progress)
    # An interval too short for any prefill names its own length, not an impossible prefill.
    with pytest.raises(ConfigError, match=r"contexts\[0\]\.max_kv_length=100: expected at "
                                          "least 253: measuring a point adds up to 252 tokens"):
        check_contexts([ContextInterval(prefill_tokens=1, min_kv_length=1,
                                        max_kv_length=100)], 1024, progress)


def test_default_contexts_shrink_the_prefill_for_a_short_context() -> None:
    progress = sampling_progress(5, 8, 32)
    (context,) = default_contexts(1024, progress)
    assert (context.prefill_tokens, context.min_kv_length, context.max_kv_length) == \
        (1024 - progress, 1, 1024)
    (long,) = default_contexts(32768, progress)
    assert (long.prefill_tokens, long.max_kv_length) == (2048, 4096)
    with pytest.raises(ConfigError, match="cannot hold 252 tokens of sampling progress"):
        default_contexts(250, progress)


def test_a_rate_of_zero_is_refused_as_not_positive() -> None:
    with pytest.raises(ConfigError, match=r"^steps_per_second\[1\]=0\.0: expected a finite "
                       r"number > 0$"):
        table_from_dict({"kind": "sps", "rows": [1, 2], "steps_per_second": [10.0, 0.0]})
