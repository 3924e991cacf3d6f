"""The device kernels (allocation, packing, sampling, commit) against their plain-Python
references, element by element, and the rules each one pins."""

import ast
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_marks import needs_cuda

from adaspec.config.requests import SamplingParams
from adaspec.errors import HostReadError
from adaspec.models import load_reference_models
from adaspec.models.protocols import VerifyRows
from adaspec.runtime.devices import commit, packing, reference
from adaspec.runtime.devices.allocation import allocate_prefixes, emit_budget, verify_caps
from adaspec.runtime.devices.commit import (
    FINISHED_LENGTH,
    FINISHED_STOP,
    RUNNING,
    CommitResult,
    commit_rows,
    publication,
)
from adaspec.runtime.devices.hostreads import forbid_host_reads
from adaspec.runtime.devices.packing import PackedRows, pack_rows
from adaspec.runtime.devices.sampling import SamplingTensors, sample_rows, target_probs

DEVICES = Path(__file__).resolve().parents[1] / "adaspec" / "runtime" / "devices"
KERNEL_MODULES = ("allocation.py", "packing.py", "sampling.py", "commit.py")


def ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def flags(values: list[bool]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


# --- allocation --------------------------------------------------------------------------

def test_allocation_admits_the_top_survivals_across_the_batch() -> None:
    confidences = torch.tensor([[0.9, 0.5, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]])
    # Survivals: request 0: .9 .45 .225 .1125; request 1: .5 .25 .25 .25. G=6 leaves 4 rows.
    lengths = allocate_prefixes(confidences, 6, ints([4, 4]), flags([True, True]))
    assert lengths.tolist() == [2, 2]


def test_equal_survivals_go_to_the_lower_request_then_the_lower_position() -> None:
    confidences = torch.tensor([[0.5, 1.0, 1.0], [0.5, 1.0, 1.0], [0.5, 1.0, 1.0]])
    # Every candidate survives 0.5: four free rows go to request 0 (3 rows), then request 1.
    lengths = allocate_prefixes(confidences, 7, ints([3, 3, 3]), flags([True] * 3))
    assert lengths.tolist() == [3, 1, 0]


def test_allocation_gives_every_request_a_contiguous_prefix_within_its_cap() -> None:
    confidences = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.1, 1.0, 1.0, 1.0]])
    lengths = allocate_prefixes(confidences, 10, ints([2, 4]), flags([True, True]))
    assert lengths.tolist() == [2, 4]
    assert allocate_prefixes(confidences, 2, ints([4, 4]), flags([True, True])).tolist() == [0, 0]


def test_padding_entries_take_no_rows_and_do_not_count_as_anchors() -> None:
    confidences = torch.ones(3, 2)
    lengths = allocate_prefixes(confidences, 4, ints([2, 2, 2]), flags([True, False, True]))
    assert lengths.tolist() == [2, 0, 0]


def test_non_finite_confidences_count_as_zero_survival() -> None:
    confidences = torch.tensor([[float("nan"), 1.0], [0.2, 2.0]])
    lengths = allocate_prefixes(confidences, 3, ints([2, 2]), flags([True, True]))
    assert lengths.tolist() == [0, 1]


def test_budget_and_caps_respect_remaining_tokens_and_the_context_limit() -> None:
    budget = emit_budget(ints([10, 3, 1, 10, 10]), anchor_positions=ints([0, 0, 0, 1020, 1022]),
                         context_limit=1024)
    assert budget.tolist() == [10, 3, 1, 3, 1]
    caps = verify_caps(5, budget, req_valid=flags([True, True, True, True, False]))
    assert caps.tolist() == [5, 2, 0, 2, 0]


def test_a_request_at_the_context_limit_finishes_with_length_and_never_leaves_the_cache() -> None:
    # Anchor at 1020 of 1024: room for tokens at 1021..1023, whatever max_tokens says.
    budget = emit_budget(ints([10]), anchor_positions=ints([1020]), context_limit=1024)
    drafts = ints([7, 8, 9, 10, 11]).view(1, 5)
    caps = verify_caps(5, budget, flags([True]))
    lengths = allocate_prefixes(torch.ones(1, 5), 6, caps, flags([True]))
    packed = pack_rows(lengths, ints([1]), drafts, ints([0]), ints([1020]), flags([True]), 6)
    assert int(packed.rows.positions[packed.rows.row_valid].max()) <= 1023
    result = commit_rows(packed, ints([7, 8, 4, 0, 0, 0]), drafts, ints([[-1]]), budget,
                         flags([True]))
    assert result.token_ids.tolist() == [[7, 8, 4, -1, -1, -1]]  # positions 1021..1023
    assert result.finish.tolist() == [FINISHED_LENGTH]


def test_packing_refuses_a_budget_smaller_than_the_live_requests() -> None:
    drafts = ints([7, 8, 9]).view(3, 1)
    with pytest.raises(RuntimeError, match="the verify rows do not fit G=2 rows"):
        pack_rows(ints([0, 0, 0]), ints([1, 2, 3]), drafts, ints([0, 1, 2]), ints([5, 5, 5]),
                  flags([True, True, True]), num_rows=2)


# --- random cases through all four kernels ------------------------------------------------

@dataclass(frozen=True)
class Case:
    confidences: torch.Tensor  # [Bcap, width]
    caps: torch.Tensor
    req_valid: torch.Tensor
    num_rows: int
    anchors: torch.Tensor
    drafts: torch.Tensor  # [Bcap, width]
    kv_slots: torch.Tensor
    starts: torch.Tensor
    stops: torch.Tensor  # [Bcap, S]
    remaining: torch.Tensor
    params: list[SamplingParams]
    logits: torch.Tensor  # [G, vocab]
    uniforms: torch.Tensor  # [G]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and dtype (``torch.equal`` alone ignores the dtype)."""
    return a.dtype == b.dtype and torch.equal(a, b)


def random_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.3:
        return SamplingParams(temperature=0.0)
    return SamplingParams(temperature=rng.choice([0.5, 1.0, 1.7]),
                          top_k=rng.choice([0, 0, 1, 2, 5]),
                          top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
                          min_p=rng.choice([0.0, 0.0, 0.05, 0.3]))


def random_case(seed: int, without_drafts: bool = False) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_reqs, width, vocab = rng.randint(1, 9), rng.randint(1, 7), rng.choice([3, 8, 50])
    width = 0 if without_drafts else width
    valid = [rng.random() < 0.8 for _ in range(num_reqs)]
    valid[0] = True
    live = sum(valid)
    num_rows = rng.randint(live, num_reqs * (width + 1))
    # Quantised confidences make equal survivals common, so the tie rule is exercised.
    confidences = torch.randint(0, 5, (num_reqs, width), generator=gen).double() / 4
    remaining = [rng.choice([1, 2, 3, 50]) for _ in range(num_reqs)]
    caps = [rng.randint(0, width) for _ in range(num_reqs)]
    drafts = torch.randint(0, vocab, (num_reqs, width), generator=gen)
    logits = torch.randn(num_rows, vocab, generator=gen, dtype=torch.float64) * 2
    # Let greedy rows often agree with the drafts, so accepted runs are long.
    logits[:, 0] += rng.random() * 3
    drafts[torch.rand(num_reqs, width, generator=gen) < 0.5] = 0
    return Case(confidences=confidences, caps=ints(caps), req_valid=flags(valid),
                num_rows=num_rows, anchors=torch.randint(0, vocab, (num_reqs,), generator=gen),
                drafts=drafts, kv_slots=ints(list(range(num_reqs))),
                starts=ints([rng.randint(0, 100) for _ in range(num_reqs)]),
                stops=torch.tensor([[rng.choice([-1, 0, 1, 2]), -1] for _ in range(num_reqs)]),
                remaining=ints(remaining), params=[random_params(rng) for _ in range(num_reqs)],
                logits=logits, uniforms=torch.rand(num_rows, generator=gen, dtype=torch.float64))


def run_kernels(case: Case, params: SamplingTensors | None = None
                ) -> tuple[torch.Tensor, PackedRows, torch.Tensor, CommitResult]:
    lengths = allocate_prefixes(case.confidences, case.num_rows, case.caps, case.req_valid)
    packed = pack_rows(lengths, case.anchors, case.drafts, case.kv_slots, case.starts,
                       case.req_valid, case.num_rows)
    if params is None:
        params = SamplingTensors.from_params(case.params, len(case.params))
    sampled = sample_rows(case.logits, packed.rows.row_reqs, params, case.uniforms)
    committed = commit_rows(packed, sampled, case.drafts, case.stops, case.remaining,
                            case.req_valid)
    return lengths, packed, sampled, committed


def check_against_reference(case: Case) -> None:
    lengths, packed, sampled, committed = run_kernels(case)
    valid = case.req_valid.tolist()
    expected_lengths = reference.allocate(case.confidences.tolist(), case.num_rows,
                                          case.caps.tolist(), valid)
    assert lengths.tolist() == expected_lengths
    ref_packed = reference.pack(expected_lengths, case.anchors.tolist(), case.drafts.tolist(),
                                valid, case.num_rows)
    rows = packed.rows
    assert rows.row_reqs.tolist() == ref_packed.row_reqs
    assert rows.row_offsets.tolist() == ref_packed.row_offsets
    assert rows.token_ids.tolist() == ref_packed.token_ids
    assert rows.row_valid.tolist() == ref_packed.row_valid
    assert packed.cu_num_rows[:-1].tolist() == ref_packed.first_rows
    owners = ref_packed.row_reqs
    per_row = [case.params[r] for r in owners]
    ref_sampled = reference.sample(case.logits.tolist(),
                                   [float(p.temperature or 0.0) for p in per_row],
                                   [p.top_k for p in per_row], [p.top_p for p in per_row],
                                   [p.min_p for p in per_row], case.uniforms.tolist())
    assert sampled.tolist() == ref_sampled
    ref_commit = reference.commit(ref_sampled, ref_packed, expected_lengths,
                                  case.drafts.tolist(), case.stops.tolist(),
                                  case.remaining.tolist(), valid)
    assert committed.num_accepted.tolist() == ref_commit.num_accepted
    emitted = [row[:n] for row, n in zip(committed.token_ids.tolist(),
                                         committed.num_emitted.tolist(), strict=True)]
    assert emitted == ref_commit.token_ids
    assert committed.finish.tolist() == ref_commit.finish


@pytest.mark.parametrize("seed", range(300))
def test_kernels_match_the_plain_python_reference(seed: int) -> None:
    check_against_reference(random_case(seed))


@pytest.mark.parametrize("seed", range(60))
def test_commit_without_stop_tokens_equals_commit_with_none_to_look_for(seed: int) -> None:
    # The fast path a round takes when no request in it has stop token ids.
    case = random_case(seed)
    _, packed, sampled, _ = run_kernels(case)
    no_stops = torch.full_like(case.stops, -1)
    looked = commit_rows(packed, sampled, case.drafts, no_stops, case.remaining, case.req_valid)
    skipped = commit_rows(packed, sampled, case.drafts, None, case.remaining, case.req_valid)
    for name in CommitResult.__dataclass_fields__:
        assert same(getattr(looked, name), getattr(skipped, name)), name


@pytest.mark.parametrize("seed", range(60))
def test_rounds_without_drafts_match_the_reference(seed: int) -> None:
    check_against_reference(random_case(seed, without_drafts=True))


def check_width_0_kernels(args: tuple[Any, ...], sampled: torch.Tensor,
                          commits: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """pack_rows and commit_rows on ``args`` (a round without drafts) return exactly the
    general kernels' tensors, for each ``(budget, stop_token_ids)`` of ``commits``."""
    drafts, valid = args[2], args[5]
    fast, general = pack_rows(*args), packing._pack_general(*args)
    for name in PackedRows.__dataclass_fields__:
        if name != "rows":
            assert same(getattr(fast, name), getattr(general, name)), name
    for name in VerifyRows.__dataclass_fields__:
        assert same(torch.as_tensor(getattr(fast.rows, name)),
                    torch.as_tensor(getattr(general.rows, name))), name
    for budget, stops in commits:
        quick = commit_rows(fast, sampled, drafts, stops, budget, valid)
        slow = commit._commit_general(general, sampled, drafts, stops, budget, valid)
        for name in CommitResult.__dataclass_fields__:
            assert same(getattr(quick, name), getattr(slow, name)), name


@pytest.mark.parametrize("seed", range(60))
def test_the_width_0_kernels_give_exactly_what_the_general_ones_give(seed: int) -> None:
    # pack_rows and commit_rows take a shorter path when a round has no drafts (the
    # runtime without speculation); every tensor they return must be the general one's.
    case = random_case(seed, without_drafts=True)
    args = (case.caps * 0, case.anchors, case.drafts, case.kv_slots, case.starts, case.req_valid,
            case.num_rows)
    sampled = torch.randint(0, 3, (case.num_rows,), generator=torch.Generator().manual_seed(seed))
    budget = torch.where(case.req_valid, case.remaining, torch.tensor([0, 1])[seed % 2])
    check_width_0_kernels(args, sampled, [(budget, case.stops), (budget, None)])


@pytest.mark.parametrize(("live", "num_rows"), [(True, 1), (False, 1), (True, 3), (False, 2)])
def test_a_batch_of_one_entry_packs_and_commits_as_the_general_kernels_do(
        live: bool, num_rows: int) -> None:
    # One entry without drafts takes the shortest path (batch 1 without speculation).
    args = (torch.zeros(1, dtype=torch.int64), torch.tensor([7]),
            torch.zeros(1, 0, dtype=torch.int64), torch.tensor([3]), torch.tensor([11]),
            torch.tensor([live]), num_rows)
    check_width_0_kernels(args, torch.arange(num_rows) + 5,
                          [(torch.tensor([1]), None), (torch.tensor([4]), torch.tensor([[5]]))])


@pytest.mark.parametrize("seed", range(60))
def test_a_budget_that_holds_every_row_admits_exactly_the_caps(seed: int) -> None:
    # Why a round whose G covers Bcap * (depth + 1) rows skips prefix allocation.
    case = random_case(seed)
    num_reqs, width = case.drafts.shape
    caps = torch.where(case.req_valid, case.caps, 0)
    lengths = allocate_prefixes(case.confidences, num_reqs * (width + 1), caps, case.req_valid)
    assert torch.equal(lengths, caps)


# --- packing -------------------------------------------------------------------------------

def test_packing_lays_rows_out_request_by_request_with_padding_last() -> None:
    drafts = ints([10, 11, 12, 20, 21, 22, 30, 31, 32]).view(3, 3)
    packed = pack_rows(ints([2, 0, 3]), ints([1, 2, 3]), drafts, ints([4, 5, 6]),
                       ints([7, 8, 9]), flags([True, True, False]), num_rows=6)
    rows = packed.rows
    assert rows.token_ids.tolist() == [1, 10, 11, 2, 1, 1]
    assert rows.row_reqs.tolist() == [0, 0, 0, 1, 0, 0]
    assert rows.row_offsets.tolist() == [0, 1, 2, 0, 0, 0]
    assert rows.row_valid.tolist() == [True, True, True, True, False, False]
    assert rows.positions.tolist() == [7, 8, 9, 8, 7, 7]
    assert packed.cu_num_rows.tolist() == [0, 3, 4, 4]
    assert packed.verify_lengths.tolist() == [2, 0, 0]  # the padding entry verifies nothing
    assert packed.draft_indices.tolist() == [-1, 0, 1, -1, -1, -1]
    assert packed.grid_valid.tolist() == [[True, True, True, False], [True, False, False, False],
                                          [False, False, False, False]]
    assert packed.grid_rows[0].tolist() == [0, 1, 2, 3]


def test_packing_results_are_fresh_tensors_a_caller_may_write_into() -> None:
    drafts = ints([10, 11, 20, 21]).view(2, 2)

    def packed() -> PackedRows:
        return pack_rows(ints([2, 1]), ints([1, 2]), drafts, ints([0, 1]), ints([5, 6]),
                         flags([True, True]), num_rows=6)

    first = packed()
    for tensor in (first.rows.row_reqs, first.rows.row_offsets, first.draft_indices,
                   first.grid_rows, first.rows.token_ids):
        tensor.fill_(99)  # must not reach the constants the next round packs with
    again = packed()
    assert again.rows.row_reqs.tolist() == [0, 0, 0, 1, 1, 0]
    assert again.rows.row_offsets.tolist() == [0, 1, 2, 0, 1, 0]
    assert again.draft_indices.tolist() == [-1, 0, 1, -1, 2, -1]
    assert again.grid_rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert again.rows.token_ids.tolist() == [1, 10, 11, 2, 20, 1]


def test_packed_rows_verify_exactly_like_host_built_rows() -> None:
    target = load_reference_models().target
    target.allocate(3)
    prompts = [torch.tensor([72, 101, 108, 108]), torch.tensor([84, 104, 101])]
    target.prefill(prompts, ints([0, 1]))
    snapshot = [k.clone() for k in target._require_cache().keys]
    drafts = ints([111, 32, 119, 32, 119, 111]).view(2, 3)
    packed = pack_rows(ints([3, 1]), ints([111, 32]), drafts, ints([0, 1]), ints([4, 3]),
                       flags([True, True]), num_rows=8)
    device_out = target.verify(packed.rows)
    for layer, keys in enumerate(snapshot):
        target._require_cache().keys[layer].copy_(keys)
    host_rows = VerifyRows.from_requests([(0, 4, [111, 111, 32, 119]), (1, 3, [32, 32])],
                                         num_rows=8, num_reqs=2, rows_per_req=4,
                                         scratch_kv_slot=3)
    host_out = target.verify(host_rows)
    assert torch.equal(device_out.logits[:6], host_out.logits[:6])


def test_a_budget_narrower_than_the_launch_packs_a_narrower_grid_with_the_same_logits() -> None:
    # Width 5, one request verifying 2 drafts in G=4 rows: no request can hold more than 4
    # rows, so the attention grid has 4 columns, not w + 1 = 6; the verified logits match
    # those of the width-sized grid (the extra columns are masked keys, not new work).
    target = load_reference_models().target
    target.allocate(2)
    target.prefill([torch.tensor([72, 101, 108, 108])], ints([0]))
    snapshot = [k.clone() for k in target._require_cache().keys]
    drafts = ints([111, 32, 119, 111, 114]).view(1, 5)
    packed = pack_rows(ints([2]), ints([111]), drafts, ints([0]), ints([4]), flags([True]),
                       num_rows=4)
    assert packed.rows.rows_per_req == 4
    assert packed.width == 5  # the sampling grid keeps every draft position
    narrow = target.verify(packed.rows)
    for layer, keys in enumerate(snapshot):
        target._require_cache().keys[layer].copy_(keys)
    wide = target.verify(VerifyRows.from_requests([(0, 4, [111, 111, 32])], num_rows=4,
                                                  num_reqs=1, rows_per_req=6, scratch_kv_slot=1))
    torch.testing.assert_close(narrow.logits[:3], wide.logits[:3], rtol=1e-5, atol=1e-5)
    assert torch.equal(narrow.logits[:3].argmax(-1), wide.logits[:3].argmax(-1))


# --- sampling ------------------------------------------------------------------------------

def test_greedy_rows_take_the_first_argmax_and_ignore_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0], [5.0, 1.0, 0.0]])
    params = SamplingTensors.from_params([SamplingParams(temperature=0.0, top_k=1),
                                          SamplingParams(temperature=1.0)], 2)
    # Both rows belong to the greedy entry 0: the uniforms and its top_k play no part.
    tokens = sample_rows(logits, ints([0, 0]), params, torch.tensor([0.99, 0.99]))
    assert tokens.tolist() == [1, 0]
    # Owned by the random entry 1, u = 0.99 lands in each row's least likely tail.
    drawn = sample_rows(logits, ints([1, 1]), params, torch.tensor([0.99, 0.99]))
    assert drawn.tolist() == [0, 1]


def test_sampler_is_deterministic_for_given_uniforms() -> None:
    case = random_case(7)
    lengths, packed, sampled, _ = run_kernels(case)
    gen = torch.Generator().manual_seed(3)
    params = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * len(case.params),
                                         len(case.params))
    first = sample_rows(case.logits, packed.rows.row_reqs, params,
                        torch.rand(case.num_rows, generator=gen, dtype=torch.float64))
    gen.manual_seed(3)
    again = sample_rows(case.logits, packed.rows.row_reqs, params,
                        torch.rand(case.num_rows, generator=gen, dtype=torch.float64))
    assert torch.equal(first, again)


def test_filters_keep_the_usual_sets() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))

    def kept(**kwargs: float) -> list[bool]:
        values = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0} | kwargs
        tensors = {k: torch.tensor([v]) for k, v in values.items()}
        probs = target_probs(logits, tensors["temperature"], tensors["top_k"].long(),
                             tensors["top_p"].double(), tensors["min_p"].double())
        return (probs[0] > 0).tolist()

    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.7
    assert kept(top_p=0.85) == [True, True, True, False]
    assert kept(min_p=0.4) == [True, True, False, False]  # below 0.4 * 0.5 goes
    assert kept(min_p=0.2) == [True, True, True, False]
    # Top-p applies to the top-k distribution renormalised: 0.8 of 0.95 reaches 0.82.
    assert kept(top_p=0.82) == [True, True, True, False]
    assert kept(top_k=3, top_p=0.82) == [True, True, False, False]


def test_inverse_cdf_never_draws_a_removed_or_impossible_token() -> None:
    logits = torch.tensor([[0.0, -torch.inf, 0.0, -torch.inf]], dtype=torch.float64)
    params = SamplingTensors.from_params([SamplingParams(temperature=1.0)], 1)
    for u in (0.0, 0.4999, 0.5, 1.0 - 1e-16):
        token = sample_rows(logits, ints([0]), params, torch.tensor([u], dtype=torch.float64))
        assert token.item() in (0, 2)


# --- commit ------------------------------------------------------------------------------

def commit_case(target_tokens: list[int], lengths: list[int], drafts: list[list[int]],
                stops: list[list[int]], remaining: list[int]) -> CommitResult:
    num_reqs = len(lengths)
    valid = flags([True] * num_reqs)
    draft_ids = ints([t for row in drafts for t in row]).view(num_reqs, -1)
    packed = pack_rows(ints(lengths), ints([0] * num_reqs), draft_ids,
                       ints(list(range(num_reqs))), ints([5] * num_reqs), valid,
                       num_rows=len(target_tokens))
    return commit_rows(packed, ints(target_tokens), draft_ids, ints(
        [s for row in stops for s in row]).view(num_reqs, -1), ints(remaining), valid)


def test_commit_emits_the_accepted_run_then_the_residual_token() -> None:
    result = commit_case([7, 8, 5, 6], [3], [[7, 8, 9]], [[-1]], [50])
    assert result.num_accepted.tolist() == [2]
    assert result.token_ids.tolist() == [[7, 8, 5, -1]]  # 5 is the residual token
    assert result.next_anchor_ids.tolist() == [5]
    assert result.last_rows.tolist() == [2]
    assert result.row_committed.tolist() == [True, True, True, False]
    assert result.row_next_token_ids.tolist() == [7, 8, 5, -1]


def test_commit_adds_the_bonus_token_when_every_verified_draft_matched() -> None:
    result = commit_case([7, 8, 4, 0], [2], [[7, 8, 9]], [[-1]], [50])
    assert result.num_accepted.tolist() == [2]
    assert result.token_ids[0, :3].tolist() == [7, 8, 4]  # 4: the bonus token
    assert result.finish.tolist() == [RUNNING]


def test_a_stop_token_inside_the_accepted_run_ends_it_there() -> None:
    result = commit_case([7, 8, 9, 1], [3], [[7, 8, 9]], [[8, -1]], [50])
    assert result.num_accepted.tolist() == [3]  # acceptance is reported before the stop
    assert result.num_emitted.tolist() == [2]
    assert result.token_ids.tolist() == [[7, 8, -1, -1]]
    assert result.finish.tolist() == [FINISHED_STOP]


def test_max_tokens_inside_the_accepted_run_cuts_it_and_finishes() -> None:
    result = commit_case([7, 8, 9, 1], [3], [[7, 8, 9]], [[-1]], [2])
    assert result.token_ids.tolist() == [[7, 8, -1, -1]]
    assert result.finish.tolist() == [FINISHED_LENGTH]
    stop_last = commit_case([7, 8, 9, 1], [3], [[7, 8, 9]], [[8]], [2])
    assert stop_last.finish.tolist() == [FINISHED_STOP]  # a stop token at the budget: stop


def test_publication_writes_committed_rows_and_sends_the_rest_to_scratch() -> None:
    drafts = ints([7, 8, 9, 4, 5, 6]).view(2, 3)
    valid = flags([True, True])
    packed = pack_rows(ints([3, 1]), ints([1, 2]), drafts, ints([0, 1]), ints([10, 20]),
                       valid, num_rows=7)
    result = commit_rows(packed, ints([7, 3, 0, 0, 9, 9, 0]), drafts, ints([[-1], [-1]]),
                         ints([50, 50]), valid)
    next_ids, positions, kv_slots = publication(packed, result, scratch_kv_slot=5)
    # Request 0 accepted 7 then got residual 3; request 1 got residual 9 at once.
    assert result.token_ids.tolist() == [[7, 3, -1, -1], [9, -1, -1, -1]]
    assert kv_slots.tolist() == [0, 0, 5, 5, 1, 5, 5]
    assert positions[:5].tolist() == [10, 11, 12, 13, 20]
    assert next_ids.tolist()[:5] == [7, 3, 0, 0, 9]


def test_each_request_commits_from_its_own_rows() -> None:
    result = commit_case([1, 2, 3, 4, 5, 6], [2, 2], [[1, 2], [9, 5]], [[-1], [-1]], [9, 9])
    assert result.token_ids.tolist() == [[1, 2, 3], [4, -1, -1]]
    assert result.num_emitted.tolist() == [3, 1]


# --- no host reads -----------------------------------------------------------------------

SYNCING_CALLS = {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "unique",
                 "repeat_interleave", "bincount"}


@needs_cuda
def test_a_whole_round_of_kernels_never_synchronises_a_cuda_stream() -> None:
    case = random_case(11)
    moved = Case(**{name: value.cuda() if isinstance(value, torch.Tensor) else value
                    for name, value in vars(case).items()})
    params = SamplingTensors.from_params(case.params, len(case.params), "cuda")
    with forbid_host_reads("cuda"):
        _, _, _, committed = run_kernels(moved, params)
    expected = run_kernels(case)[3]
    assert torch.equal(committed.token_ids.cpu(), expected.token_ids)


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_modules_call_nothing_that_reads_back_to_the_host(module: str) -> None:
    tree = ast.parse((DEVICES / module).read_text())
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert calls & SYNCING_CALLS == set()


def test_a_whole_round_of_kernels_runs_with_host_reads_forbidden() -> None:
    case = random_case(11)
    with forbid_host_reads():
        result = run_kernels(case)
    assert result[3].num_emitted.shape == (len(case.params),)


def test_a_whole_round_of_kernels_runs_on_the_meta_device() -> None:
    """Meta tensors have shapes but no values: any data-dependent shape (a boolean mask,
    nonzero, a size taken from a tensor) or value read fails here, which the method-name
    scan and the CPU guard cannot see."""
    case = random_case(11)
    meta = Case(**{name: value.to("meta") if isinstance(value, torch.Tensor) else value
                   for name, value in vars(case).items()})
    params = SamplingTensors.from_params(case.params, len(case.params), "meta")
    lengths, packed, sampled, committed = run_kernels(meta, params)
    assert committed.token_ids.device.type == "meta"
    assert packed.rows.token_ids.shape == (case.num_rows,)
    assert committed.token_ids.shape == (len(case.params), case.drafts.shape[1] + 1)


def test_the_host_read_guard_catches_reads_and_restores_tensor() -> None:
    value = torch.tensor(3)
    with forbid_host_reads(), pytest.raises(HostReadError, match=r"Tensor.item read a \(\)"):
        value.item()
    assert value.item() == 3
    assert bool(value)
