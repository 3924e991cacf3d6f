"""Graph buckets: prepared shapes, tiers, and a registry that never captures while serving."""

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from runtime_helpers import (
    CyclingDepth,
    config,
    decode,
    lossless_prompts,
    max_tokens_of,
    run_staggered,
)

from adaspec.config import LaunchConfig, SamplingParams, load_config
from adaspec.errors import ConfigError, GraphBindingMissing
from adaspec.models import load_reference_models
from adaspec.models.protocols import TargetOutput, VerifyRows
from adaspec.policies.base import covering_tier
from adaspec.policies.fixed import FixedDepth
from adaspec.runtime.devices.buckets import Binding, BindingRegistry, BucketGeometry
from adaspec.runtime.devices.graphs import (
    BoundCall,
    EagerBinding,
    binding_factory,
    padding_rows,
)
from adaspec.runtime.engine import Runtime, RuntimeOptions, adaptive_budget
from adaspec.runtime.kv_slots import KvSlotStates
from adaspec.runtime.rounds import pack_block
from adaspec.runtime.split import SplitBinding, SplitBindings

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


def test_a_bound_call_refuses_arguments_unlike_its_example() -> None:
    """A copy into a graph's buffer would broadcast a smaller tensor silently: refused."""
    call = BoundCall("draft binding (Bcap=2, depth=3)", lambda x: x + 1, (torch.zeros(2),))
    assert torch.equal(call(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(ValueError, match=r"draft binding \(Bcap=2, depth=3\): arguments "
                                         r"\(\(\(1,\), torch.float32\),\); this binding was "
                                         r"prepared for \(\(\(2,\), torch.float32\),\)"):
        call(torch.ones(1))
    with pytest.raises(ValueError, match="prepared for"):
        call(torch.ones(2, dtype=torch.int64))


@pytest.mark.parametrize("seed", range(6))
def test_a_pack_given_its_depth_on_the_device_packs_what_the_int_depth_packs(seed: int
                                                                             ) -> None:
    """A captured pack takes the depth as a device value and always allocates; the eager one
    skips allocation at full width. Both must lay out the same rows for every G."""
    generator = torch.Generator().manual_seed(seed)
    num_reqs, width = 4, 5
    models = load_reference_models()
    ctx = SimpleNamespace(context_limit=models.target.context_limit)
    for depth in range(1, width + 1):
        rows = KvSlotStates(
            anchor_ids=torch.randint(0, 100, (num_reqs,), generator=generator),
            anchor_positions=torch.randint(1, 40, (num_reqs,), generator=generator),
            hidden=torch.zeros(num_reqs, 0),
            remaining=torch.randint(1, 8, (num_reqs,), generator=generator),
            live=torch.rand(num_reqs, generator=generator) < 0.8)
        drafts = torch.randint(0, 100, (num_reqs, width), generator=generator)
        confidences = torch.rand(num_reqs, width, generator=generator)
        kv_slots = torch.arange(num_reqs)
        for num_rows in (num_reqs, num_reqs * 2, num_reqs * (depth + 1), num_reqs * (width + 1)):
            eager = pack_block(ctx, rows, drafts, confidences, kv_slots, depth, num_rows)
            bound = pack_block(ctx, rows, drafts, confidences, kv_slots, torch.tensor(depth),
                               num_rows)
            assert torch.equal(eager[0], bound[0])
            for name in ("verify_lengths", "num_entry_rows", "cu_num_rows", "draft_indices"):
                assert torch.equal(getattr(eager[1], name), getattr(bound[1], name)), name
            for name in ("token_ids", "row_reqs", "row_offsets", "row_valid"):
                assert torch.equal(getattr(eager[1].rows, name), getattr(bound[1].rows, name))


def _split_registries(runtime: Runtime) -> list[BindingRegistry]:
    registries = runtime._pipeline.registries  # type: ignore[union-attr]  # what start prepared
    assert registries is not None
    return registries


@pytest.mark.parametrize(("algorithm", "width", "policy", "depths"), [
    ("MTP", 3, CyclingDepth, (1, 2, 3)), ("MTP", 3, None, (3,)), ("DSpark", 5, CyclingDepth, (5,))])
def test_split_rounds_run_prepared_draft_pack_and_verify_bindings(
        algorithm: str, width: int, policy: type[FixedDepth] | None, depths: tuple[int, ...],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Split mode prepares, per slot, a draft binding per (Bcap, depth) (every depth when a
    policy may pick any and the drafter's work depends on it; the width alone otherwise) and
    a pack and verify binding per (Bcap, G); every round runs them, and the output stays the
    target's alone."""
    calls: Counter[str] = Counter()
    bound_call = BoundCall.__call__

    def counted(self: BoundCall, *args: object) -> object:  # a spy: which bindings ran
        calls[self.name.split(" (")[0]] += 1
        return bound_call(self, *args)

    monkeypatch.setattr(BoundCall, "__call__", counted)
    prompts = lossless_prompts()[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i))
              for i in range(len(prompts))]
    models = load_reference_models()
    options = RuntimeOptions(depth_policy=policy()) if policy else None
    runtime = Runtime(config(algorithm, width, 4), models=models, options=options)
    outputs = asyncio.run(run_staggered(runtime, prompts, params, wave=3))
    monkeypatch.undo()
    target = decode(config("none", 0, 4), prompts, params, models=models)
    assert [r.token_ids for r in outputs] == [r.token_ids for r in target]
    rounds = runtime.statistics().rounds_submitted
    assert rounds > 10
    assert calls == {"draft binding": rounds, "pack binding": rounds}
    registries = _split_registries(runtime)
    assert len(registries) == 2
    for slot, registry in enumerate(registries):
        assert registry.sealed
        bindings = {key: registry.lookup(key[2], key[3]).binding for key in registry.keys}
        assert all(isinstance(b, SplitBinding) for b in bindings.values())
        make = registry._make
        assert isinstance(make, SplitBindings)
        buckets = registry.geometry.request_buckets
        assert make.draft_keys == tuple((slot, width, b, d) for b in buckets for d in depths)
        for (_, _, bucket, rows), binding in bindings.items():
            assert binding.key == (slot, width, bucket, rows)
            assert binding.pack.shape == (bucket, rows)
            full = registry.geometry.full_rows(bucket)
            assert binding.drafts is bindings[(slot, width, bucket, full)].drafts
    first, second = (r.lookup(1, width + 1).binding for r in registries)
    assert first.drafts[depths[-1]] is not second.drafts[depths[-1]]
    if depths == (3,):
        with pytest.raises(GraphBindingMissing, match="no prepared draft binding for slot=0 "
                                                      "width=3 Bcap=1 depth=2"):
            first.draft(2)


@pytest.mark.parametrize("flags", [
    {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5},
    {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
     "enable_adaptive_target_verify": True},
    {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
     "enable_adaptive_target_verify": True, "enable_unified_mtp_graph": True},
    {"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
     "enable_adaptive_draft_step": True},
    {"speculative_algorithm": "none", "num_speculative_tokens": 0}])
def test_the_effective_config_lists_the_bindings_startup_prepares(flags: dict[str, object]
                                                                   ) -> None:
    """Before anything runs, ``adaspec config`` says which G each bucket gets a binding for:
    what startup then prepares (full width alone for a fixed width, the tiers under unified
    adaptive verification)."""
    effective = load_config({**flags, "max_seqs_per_batch": 4})
    launch = effective.launch
    planned: dict[str, list[int]] = {}
    for bucket, rows in BucketGeometry.of(launch).planned_bindings(
            adaptive=adaptive_budget(launch)):
        planned.setdefault(str(bucket), []).append(rows)
    assert effective.as_dict()["execution"]["prepared_bindings"] == planned
