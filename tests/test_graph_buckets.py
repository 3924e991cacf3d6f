"""Graph buckets: prepared shapes, tiers, and a registry that never captures while serving."""

import pytest
import torch

from adaspec.config import LaunchConfig
from adaspec.errors import ConfigError, GraphBindingMissing
from adaspec.models import load_reference_models
from adaspec.models.protocols import TargetOutput, VerifyRows
from adaspec.policies.base import covering_tier
from adaspec.runtime.devices.buckets import Binding, BindingRegistry, BucketGeometry
from adaspec.runtime.devices.graphs import EagerBinding, binding_factory, padding_rows

DRAFT5 = BucketGeometry(width=5, request_buckets=(1, 2, 4, 8, 16),
                        target_rows=(1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96))


def test_geometry_comes_from_the_launch() -> None:
    launch = LaunchConfig(speculative_algorithm="DSpark", num_speculative_tokens=5,
                          max_seqs_per_batch=16)
    assert BucketGeometry.of(launch) == DRAFT5


def test_adaptive_draft_steps_prepare_every_depths_exact_rows() -> None:
    """On the ladder alone a depth-4 round of Draft5 pads to depth 5's rows; with adaptive
    draft steps every depth of every bucket verifies exactly Bcap * (d + 1) rows."""
    flags = {"speculative_algorithm": "MTP", "num_speculative_tokens": 5,
             "max_seqs_per_batch": 16}
    ladder = BucketGeometry.of(LaunchConfig(**flags))
    assert covering_tier(ladder.legal_rows(16), 16, 4) == 96
    adaptive = BucketGeometry.of(LaunchConfig(**flags, enable_adaptive_draft_step=True))
    for bucket in adaptive.request_buckets:
        for depth in range(1, 6):
            rows = covering_tier(adaptive.legal_rows(bucket), bucket, depth)
            assert rows == bucket * (depth + 1)
    assert set(ladder.target_rows) < set(adaptive.target_rows)


def test_draft5_tiers_for_eight_requests_are_8_16_32_48() -> None:
    assert DRAFT5.tiers(8) == (8, 16, 32, 48)


def test_tiers_use_the_padded_request_bucket_and_stay_legal() -> None:
    assert DRAFT5.request_bucket(5) == 8
    assert DRAFT5.tiers(5) == (8, 12, 24, 32)
    assert DRAFT5.tiers(1) == (1, 2, 4, 6)
    for num_reqs in range(1, 17):
        bucket = DRAFT5.request_bucket(num_reqs)
        assert set(DRAFT5.tiers(num_reqs)) <= set(DRAFT5.legal_rows(bucket))
        assert len(DRAFT5.tiers(num_reqs)) <= 4


def test_legal_rows_keep_anchor_rows_and_stop_at_full_width() -> None:
    assert DRAFT5.legal_rows(4) == (4, 6, 8, 12, 16, 24)
    assert DRAFT5.full_rows(16) == 96


def test_a_geometry_without_full_width_rows_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lack the full-width rows of request buckets \[2\]"):
        BucketGeometry(width=3, request_buckets=(1, 2), target_rows=(1, 2, 4))


def test_a_batch_beyond_the_largest_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="B=17 exceeds the largest prepared request bucket 16"):
        DRAFT5.request_bucket(17)


def test_unpadded_geometry_treats_every_shape_as_its_own_bucket() -> None:
    launch = LaunchConfig(speculative_algorithm="DSpark", num_speculative_tokens=5,
                          enable_graph=False, enable_schedule_overlap=False,
                          enable_task_pipeline=False)
    geometry = BucketGeometry.of(launch)
    assert geometry.request_bucket(5) == 5
    assert geometry.tiers(5) == (5, 10, 20, 30)


UNIFIED5 = LaunchConfig(speculative_algorithm="DSpark", num_speculative_tokens=5,
                        max_seqs_per_batch=16, enable_unified_mtp_graph=True,
                        enable_adaptive_target_verify=True)


def test_planned_bindings_per_mode() -> None:
    fixed = DRAFT5.planned_bindings(adaptive=False)
    assert fixed == ((1, 6), (2, 12), (4, 24), (8, 48), (16, 96))
    split = DRAFT5.planned_bindings(adaptive=True)
    assert (8, 12) in split
    assert (8, 48) in split
    assert (8, 6) not in split
    unified = BucketGeometry.of(UNIFIED5).planned_bindings(adaptive=True)
    assert {(8, g) for g in (8, 16, 32, 48)} <= set(unified)
    assert set(fixed) <= set(unified)
    assert set(unified) < set(split)


def test_unified_adaptive_verify_prepares_and_offers_only_the_tiers_of_each_count() -> None:
    """A unified binding captures a whole round, so a bucket holds the tiers of the request
    counts that pad to it and nothing else: the policies, the calibration grid and the log all
    read these rows, so no round falls back from a G it was offered."""
    geometry = BucketGeometry.of(UNIFIED5)
    assert geometry.tiers_only
    assert geometry.legal_rows(1) == (1, 2, 4, 6)
    assert geometry.legal_rows(2) == (2, 4, 8, 12)  # not 6: no count of bucket 2 needs it
    assert geometry.legal_rows(8) == (8, 12, 16, 24, 32, 48)  # counts 5..8
    for num_reqs in range(1, 17):
        bucket = geometry.request_bucket(num_reqs)
        assert geometry.tiers(num_reqs) == DRAFT5.tiers(num_reqs)
        assert set(geometry.tiers(num_reqs)) <= set(geometry.legal_rows(bucket))
    for launch in (UNIFIED5, LaunchConfig(speculative_algorithm="DSpark",
                                          num_speculative_tokens=5, max_seqs_per_batch=16,
                                          enable_adaptive_target_verify=True)):
        of_launch = BucketGeometry.of(launch)
        assert [launch.legal_target_rows(b) for b in of_launch.request_buckets] == \
            [of_launch.legal_rows(b) for b in of_launch.request_buckets]
        assert {(b, g) for b in of_launch.request_buckets for g in of_launch.legal_rows(b)} == \
            set(of_launch.planned_bindings(adaptive=True))


class CountingFactory:
    """Records what the registry asks to prepare (the point of the test: capture calls)."""

    def __init__(self) -> None:
        self.made: list[tuple[int, int]] = []

    def __call__(self, num_reqs: int, num_rows: int) -> Binding:
        self.made.append((num_reqs, num_rows))

        def binding(rows: VerifyRows) -> TargetOutput:
            raise AssertionError("not run in this test")
        return binding


def test_lookup_falls_back_to_full_width_and_never_prepares_while_serving() -> None:
    factory = CountingFactory()
    registry = BindingRegistry(DRAFT5, factory, slot=1)
    registry.prepare([(8, 16), (8, 48)])
    assert not registry.sealed
    registry.seal()
    assert registry.sealed
    exact = registry.lookup(8, 16)
    assert (exact.num_rows, exact.fell_back) == (16, False)
    fallback = registry.lookup(8, 32)
    assert (fallback.num_reqs, fallback.num_rows, fallback.fell_back) == (8, 48, True)
    assert factory.made == [(8, 48), (8, 16)]  # largest first, nothing since
    with pytest.raises(RuntimeError, match="sealed"):
        registry.prepare([(8, 32)])
    assert factory.made == [(8, 48), (8, 16)]
    with pytest.raises(GraphBindingMissing, match="slot=1 width=5 Bcap=4 G=8 nor its "
                                                  "full-width"):
        registry.lookup(4, 8)


def test_binding_keys_name_slot_and_width_and_each_slot_prepares_its_own() -> None:
    """Two rounds in flight replay graphs whose outputs live until the next replay, so each
    pipeline slot has bindings of its own, and a width's bindings never serve another."""
    factories = [CountingFactory(), CountingFactory()]
    registries = [BindingRegistry(DRAFT5, factories[slot], slot=slot) for slot in (0, 1)]
    for registry in registries:
        registry.prepare([(2, 12), (2, 4)])
        registry.seal()
    assert registries[0].keys == ((0, 5, 2, 4), (0, 5, 2, 12))
    assert registries[1].keys == ((1, 5, 2, 4), (1, 5, 2, 12))
    assert registries[0].lookup(2, 4).binding is not registries[1].lookup(2, 4).binding
    assert [f.made for f in factories] == [[(2, 12), (2, 4)]] * 2
    assert registries[1].prepared_rows() == {1: (), 2: (4, 12), 4: (), 8: (), 16: ()}
    draft7 = BucketGeometry(width=7, request_buckets=(1, 2), target_rows=(1, 2, 4, 8, 16))
    other = BindingRegistry(draft7, CountingFactory())
    other.prepare([(2, 16)])
    assert other.keys == ((0, 7, 2, 16),)


def test_illegal_shapes_are_refused_at_preparation() -> None:
    registry = BindingRegistry(DRAFT5, CountingFactory())
    with pytest.raises(ValueError, match=r"\(Bcap=8, G=6\) is not a legal prepared shape"):
        registry.prepare([(8, 6)])


def test_eager_bindings_run_only_their_shape_and_match_plain_verify() -> None:
    target = load_reference_models().target
    target.allocate(2)
    make = binding_factory(target, width=3, device="cpu")
    binding = make(2, 8)
    assert isinstance(binding, EagerBinding)
    rows = VerifyRows.from_requests([(0, 0, [72, 105]), (1, 0, [72])], num_rows=8, num_reqs=2,
                                    rows_per_req=4, scratch_kv_slot=2)
    out = binding(rows)
    assert out.logits.shape == (8, target.vocab_size)
    with pytest.raises(ValueError, match=r"prepared for \(2, 8, 4\)"):
        binding(padding_rows(2, 4, 4, 2, "cpu"))
    assert torch.isfinite(out.logits).all()


def test_graph_bindings_on_npu_are_refused_at_startup_with_the_flag_named() -> None:
    target = load_reference_models().target
    with pytest.raises(ConfigError, match="--python_graph_backend=aclgraph: graph capture on "
                                          "npu is not built yet"):
        binding_factory(target, width=3, device="npu")
