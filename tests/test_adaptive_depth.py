"""Adaptive MTP draft depth: censoring-aware prefix acceptance, switches only for a real gain,
no oscillation on stationary workloads, and a depth that follows a step change."""

import json
from pathlib import Path

import pytest
from cost_tables import depth_bundle
from runtime_helpers import TINY_CALIBRATION, config, decode, excerpt_prompts, max_tokens_of

from adaspec import cli
from adaspec.config import SamplingParams
from adaspec.config.calibration import DraftStepPolicyConfig
from adaspec.models import load_reference_models
from adaspec.policies.base import DepthContext, RoundFeedback
from adaspec.policies.bundles import CostBundle
from adaspec.policies.depth import AdaptiveDepth, bundle_pricing
from adaspec.policies.registry import make_depth_policy
from adaspec.policies.simulate import simulate
from adaspec.policies.workloads import shaped_tables, synthetic
from adaspec.runtime.calibration import PointMeasured
from adaspec.runtime.devices.buckets import BucketGeometry
from adaspec.runtime.engine import RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay
from adaspec.runtime.events.types import BudgetDecided, DepthDecided

TABLES = shaped_tables()

def depth_context(num_reqs: int, max_kv_length: int) -> DepthContext:
    return DepthContext(round=1, num_reqs=num_reqs, num_reqs_bucket=4, width=3,
                        retired_through=-1, max_kv_length=max_kv_length)


def decided(costs: CostBundle, context: DepthContext) -> int:
    """The depth the runtime's adaptive-depth policy (built as a launch builds it) chooses
    after batches whose prefix acceptance is 0.9, 0.8 and 0.7."""
    policy = make_depth_policy("adaptive-depth", {"window_size": 4, "update_interval": 1,
                                                  "switch_min_gain": 0.0}, costs)
    for number in range(4):
        policy.observe(RoundFeedback(
            round=number, num_reqs=10, num_reqs_bucket=16, width=3, depth=3, num_rows=40,
            verify_lengths=(3,) * 10, num_accepted=(3, 3, 3, 3, 3, 3, 3, 2, 1, 0)))
    return policy.decide(context)


def test_a_batch_is_priced_by_the_depth_profile_of_its_kv_length() -> None:
    costs = depth_bundle()
    # Full bucket (no rows to move): 1.9 / 12, 2.7 / 14 and 3.4 / 24 tokens per ms in the
    # short interval, 1.9 / 12, 2.7 / 30 and 3.4 / 60 in the long one.
    assert decided(costs, depth_context(4, 100)) == 2
    assert decided(costs, depth_context(4, 3000)) == 1
    price = bundle_pricing(costs)
    assert [price(depth_context(4, 3000), d) for d in (1, 2, 3)] == pytest.approx(
        [12.0, 30.0, 60.0])
    assert price(depth_context(4, 5000), 1) is None  # no interval covers it: unpriced
    assert decided(costs, depth_context(4, 5000)) == 3  # so the depth stays at full width


def test_an_unpriced_batch_runs_at_full_width_and_the_chosen_depth_waits() -> None:
    # Before, an unpriced batch kept whatever depth the policy had chosen, a shallow one
    # included; the specification gives batches outside the calibrated table full width.
    policy = make_depth_policy("adaptive-depth",
                               {"window_size": 4, "update_interval": 1, "switch_min_gain": 0.0},
                               depth_bundle())
    for number in range(4):
        policy.observe(RoundFeedback(
            round=number, num_reqs=10, num_reqs_bucket=16, width=3, depth=3, num_rows=40,
            verify_lengths=(3,) * 10, num_accepted=(3, 3, 3, 3, 3, 3, 3, 2, 1, 0)))
    assert policy.decide(depth_context(4, 3000)) == 1  # priced: deep drafts cost too much
    assert policy.decide(depth_context(4, 5000)) == 3  # past every interval: full width
    assert policy.decide(depth_context(4, 3000)) == 1  # the chosen depth is still there
    assert policy.statistics().values["unpriced"] == 1


def test_a_context_without_a_kv_length_is_priced_as_logs_before_it_were() -> None:
    # Logs written before depth contexts recorded the KV length priced every batch with the
    # first depth profile and no rows correction (their tables had no rows profile).
    old = depth_bundle(rows=False)
    price = bundle_pricing(old)
    assert [price(depth_context(3, 0), d) for d in (1, 2, 3)] == pytest.approx(
        [12.0, 14.0, 24.0])
    assert decided(old, depth_context(4, 0)) == 2


def test_a_batch_smaller_than_its_bucket_is_priced_at_the_rows_it_verifies() -> None:
    costs = depth_bundle()
    price = bundle_pricing(costs)
    # Three requests in bucket 4 verify 6, 12 and 12 rows at depths 1..3 where a full bucket
    # verifies 8, 12 and 16: the depth price moves by what those rows cost at full depth.
    assert [price(depth_context(3, 100), d) for d in (1, 2, 3)] == pytest.approx(
        [12.0 - (11.0 - 10.0), 14.0, 24.0 - (20.0 - 12.0)])
    assert [price(depth_context(4, 100), d) for d in (1, 2, 3)] == pytest.approx(
        [12.0, 14.0, 24.0])
    # 3.4 / 16 beats 2.7 / 14 for three requests; at Bcap * (d + 1) rows it would not.
    assert decided(costs, depth_context(3, 100)) == 3
    assert decided(costs, depth_context(4, 100)) == 2
    # A table from before rows profiles prices the depth as measured.
    assert bundle_pricing(depth_bundle(rows=False))(depth_context(3, 100), 3) == (
        pytest.approx(24.0))


def feedback(round: int, lengths: tuple[int, ...], accepted: tuple[int, ...]) -> RoundFeedback:
    return RoundFeedback(round=round, num_reqs=len(lengths), num_reqs_bucket=8, width=5,
                         depth=max(lengths), num_rows=8, verify_lengths=lengths,
                         num_accepted=accepted)


def test_positions_a_round_did_not_verify_are_not_counted_as_rejected() -> None:
    policy = AdaptiveDepth(DraftStepPolicyConfig(), pricing=None)
    # Depth 2, every request accepted both drafts: nothing is known beyond position 2.
    for number in range(5):
        policy.observe(feedback(number, (2, 2, 2, 2), (2, 2, 2, 2)))
    acceptance = policy.prefix_acceptance(5)
    assert acceptance[:2] == [1.0, 1.0]
    assert acceptance[2:] == [1.0, 1.0, 1.0]  # borrowed, not zero
    # A deeper round that rejects at position 3 half the time moves position 3 only.
    policy.observe(feedback(5, (5, 5, 5, 5), (2, 2, 5, 5)))
    assert policy.prefix_acceptance(5)[2] == pytest.approx(0.5)


def test_conditional_acceptance_counts_only_requests_that_reached_the_position() -> None:
    policy = AdaptiveDepth(DraftStepPolicyConfig(), pricing=None)
    policy.observe(feedback(0, (5, 5, 5, 5), (0, 1, 3, 5)))
    # Position 1: 3 of 4 accepted. Position 2: reached by 3, accepted by 2. Position 4:
    # reached by 2 (accepted 3 and 5), accepted by 1.
    assert policy.prefix_acceptance(5)[0] == pytest.approx(3 / 4)
    assert policy.prefix_acceptance(5)[1] == pytest.approx(3 / 4 * 2 / 3)
    assert policy.prefix_acceptance(5)[3] == pytest.approx(3 / 4 * 2 / 3 * 1 * 1 / 2)


def test_a_position_last_seen_in_another_regime_follows_position_1() -> None:
    policy = AdaptiveDepth(DraftStepPolicyConfig(window_size=4), pricing=None)
    # Full width in a poor regime: half the requests accept position 1, none position 2.
    for number in range(4):
        policy.observe(feedback(number, (5, 5, 5, 5), (0, 0, 1, 1)))
    assert policy.prefix_acceptance(5)[1] == 0.0
    stale_third = AdaptiveDepth(DraftStepPolicyConfig(window_size=4), pricing=None)
    for number in range(4):
        stale_third.observe(feedback(number, (5, 5, 5, 5), (0, 2, 3, 3)))
    before = stale_third.prefix_acceptance(5)
    # Depth 1 in a better regime: every request accepts position 1; positions 2.. unseen.
    for number in range(4, 8):
        stale_third.observe(feedback(number, (1, 1, 1, 1), (1, 1, 1, 1)))
    after = stale_third.prefix_acceptance(5)
    assert after[0] == 1.0
    # Position 3's conditional (2 of 3 at the time) rises with position 1's logit, not left
    # at the old regime's value and not set to position 1's.
    conditional_before, conditional_after = before[2] / before[1], after[2] / after[1]
    assert conditional_before == pytest.approx(2 / 3)
    assert 2 / 3 < conditional_after < 1.0


def test_probes_stop_where_no_acceptance_could_make_a_deeper_depth_pay() -> None:
    # Saturated rows: at low acceptance even perfect deeper positions would lose to depth 1.
    saturated = simulate("adaptive-depth", synthetic("low", rounds=600, seed=3),
                         TABLES["saturated"])
    assert saturated.decisions[-1][0] == 1
    assert saturated.probes == 0
    # Staircase rows: deeper steps are cheap enough that a better position 2 could pay.
    staircase = simulate("adaptive-depth", synthetic("low", rounds=600, seed=3),
                         TABLES["staircase"])
    assert staircase.depth_switches == 1  # full width to depth 1, then probes only
    assert staircase.probes >= 600 // 60 - 1


def test_batches_where_nobody_reached_a_position_still_count_for_it() -> None:
    # Full width, easy and hard batches alternating (two DP shards out of phase, say): the
    # pooled prefix acceptance is one half at every position. A window of only the batches
    # that reached position 2 (the easy ones) must not read as a regime change.
    policy = AdaptiveDepth(DraftStepPolicyConfig(), pricing=None)
    for number in range(10):
        policy.observe(feedback(number, (5, 5, 5, 5), (5, 5, 5, 5)))
        policy.observe(feedback(number, (5, 5, 5, 5), (0, 0, 0, 0)))
    assert policy.prefix_acceptance(5) == pytest.approx([0.5] * 5)


def test_a_switch_needs_a_gain_above_the_threshold() -> None:
    costs = {1: 10.0, 2: 10.4, 3: 10.8, 4: 11.2, 5: 11.6}
    policy = AdaptiveDepth(DraftStepPolicyConfig(switch_min_gain=0.5),
                           pricing=lambda context, depth: costs[depth])
    context = DepthContext(round=1, num_reqs=4, num_reqs_bucket=4, width=5, retired_through=-1)
    for number in range(10):
        policy.observe(feedback(number, (5, 5, 5, 5), (0, 0, 1, 0)))
    assert policy.decide(context) == 5  # depth 1 is better, but not by more than 50 %
    eager = AdaptiveDepth(DraftStepPolicyConfig(switch_min_gain=0.05),
                          pricing=lambda context, depth: costs[depth])
    for number in range(10):
        eager.observe(feedback(number, (5, 5, 5, 5), (0, 0, 1, 0)))
    assert eager.decide(context) == 1


@pytest.mark.parametrize("table_name", ["staircase", "saturated"])
@pytest.mark.parametrize("kind", ["high", "low"])
def test_no_oscillation_on_a_stationary_workload(table_name: str, kind: str) -> None:
    result = simulate("adaptive-depth", synthetic(kind, rounds=2000, seed=1),
                      TABLES[table_name])
    assert result.depth_switches * 1000 / result.rounds <= 1.0  # at most the initial settle
    fixed = max(simulate(f"fixed:{k}", synthetic(kind, rounds=2000, seed=1),
                         TABLES[table_name]).tokens_per_second for k in range(1, 6))
    assert result.tokens_per_second >= 0.97 * fixed


def test_the_depth_follows_a_step_change_and_beats_every_fixed_width() -> None:
    workload = synthetic("step", rounds=2000, seed=1)
    result = simulate("adaptive-depth", workload, TABLES["staircase"])
    depths = [depth for depth, _ in result.decisions]
    assert depths[900] == 5  # high acceptance: full width
    assert max(depths[1500:]) <= 2  # low acceptance: shallow (probes one step deeper)
    fixed = max(simulate(f"fixed:{k}", workload, TABLES["staircase"]).tokens_per_second
                for k in range(1, 6))
    assert result.tokens_per_second > 1.1 * fixed


def test_adaptive_depth_runs_lossless_on_the_runtime_and_replays_bit_exactly(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings, log = tmp_path / "draft-steps.json", tmp_path / "run.jsonl"
    settings.write_text(json.dumps({
        "version": 1, "policy": {"window_size": 4, "update_interval": 2, "switch_min_gain": 0.0},
        "calibration": TINY_CALIBRATION | {"request_buckets": [1, 2, 4]}}))
    windows: list[PointMeasured] = []
    models = load_reference_models()
    prompts = excerpt_prompts(12)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i))
              for i in range(len(prompts))]
    launch = config("MTP", 3, 4, enable_adaptive_draft_step=True,
                    adaptive_draft_step_config=str(settings))
    geometry = BucketGeometry.of(launch.launch)
    adaptive = decode(launch, prompts, params, models=models, wave=3,
                      options=RuntimeOptions(event_log=str(log),
                                             calibration_progress=windows.append))
    target_only = decode(config("none", 0, 4), prompts, params, models=models, wave=3)
    assert [r.token_ids for r in adaptive] == [r.token_ids for r in target_only]
    # Every bucket was calibrated at every depth, each with the rows of its full width; and,
    # at full depth, the rows a batch of three verifies in bucket 4 (6 at depth 1, 12 at
    # depth 3) with the full bucket's rows at those depths (8 and 16).
    assert {(w.num_reqs_bucket, w.depth, w.num_rows) for w in windows} == {
        (b, d, next(g for g in geometry.legal_rows(b) if g >= b * (d + 1)))
        for b in (1, 2, 4) for d in (1, 2, 3)} | {(4, 3, g) for g in (6, 8, 12, 16)}
    header, events = read_event_log(log)
    assert header.policies["depth"]["name"] == "adaptive-depth"
    assert header.cost_table is not None
    assert [(p["over"], p["table"]["kind"]) for p in header.cost_table["profiles"]] == [
        ("depth", "log-additive"),  # the additive model on log seconds: depths scale a bucket
        ("rows", "additive")]
    decisions = [e for e in events if isinstance(e, DepthDecided)]
    assert {e.depth for e in decisions} <= {1, 2, 3}
    # Depth contexts carry the KV bound of their budget context, and batches of three in
    # bucket 4 were decided (priced at their own rows).
    kv = {e.round: e.context.max_kv_length for e in events if isinstance(e, BudgetDecided)}
    assert all(e.context.max_kv_length == kv[e.round] > 0 for e in decisions)
    assert any((e.context.num_reqs, e.context.num_reqs_bucket) == (3, 4) for e in decisions)
    replay(header, events).check()
    # The recorded run re-evaluated offline with the per-depth table its header carries.
    assert cli.run(["simulate", "--workload", str(log), "--policy", "fixed:1", "--policy",
                    "fixed:3", "--policy", "adaptive-depth", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in report["policies"]] == ["fixed:1", "fixed:3", "adaptive-depth"]
    assert all(p["predicted_cost_ms_per_round"] > 0 for p in report["policies"])


def test_alternating_phases_beat_every_fixed_width_and_near_the_depth_oracle() -> None:
    # Seeded: phases of 100 rounds between acceptance 0.85 and 0.35 on the staircase table,
    # where the best depth alternates between 5 and 1. Measured 1.12x / 0.94x (3 seeds).
    workload = synthetic("alternating", rounds=1000, seed=4)
    table = TABLES["staircase"]
    adaptive = simulate("adaptive-depth", workload, table).tokens_per_second
    fixed = max(simulate(f"fixed:{k}", workload, table).tokens_per_second for k in range(1, 6))
    assert adaptive > 1.05 * fixed
    assert adaptive >= 0.9 * simulate("oracle-depth", workload, table).tokens_per_second


def test_the_depth_oracle_bounds_every_depth_policy() -> None:
    workload = synthetic("alternating", rounds=600, seed=2)
    table = TABLES["staircase"]
    oracle = simulate("oracle-depth", workload, table).tokens_per_second
    for spec in ("fixed:1", "fixed:3", "fixed:5", "adaptive-depth"):
        assert simulate(spec, workload, table).tokens_per_second <= oracle
