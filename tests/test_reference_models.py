"""The shipped reference models: serving paths agree with plain decoding, KV stays consistent
after rejections, drafters are deterministic, and quality holds at long positions."""

import numpy as np
import pytest
import torch
from conftest import serving_models
from cuda_marks import needs_cuda

from adaspec.models.checkpoint import (
    FILES,
    ReferenceModels,
    checkpoint_identity,
    load_model_card,
    load_reference_models,
    own_state,
    shipped_folder,
)
from adaspec.models.protocols import (
    ContextRows,
    DSparkDrafter,
    MtpDrafter,
    TargetModel,
    VerifyRows,
)
from adaspec.models.quality import encode
from adaspec.models.report import heldout_excerpt
from adaspec.models.target import PREFILL_PADDING, PREFILL_SLACK, length_groups
from adaspec.runtime.devices.graphs import CapturedVerify, prewarm

ATOL = 1e-4  # float32 sums in a different order; logits are O(10)


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return serving_models(8)


@pytest.fixture(scope="module")
def text() -> bytes:
    return heldout_excerpt()["play"].encode()


def prompt(text: bytes, start: int, length: int) -> torch.Tensor:
    return encode(text[start:start + length])


def decode_one(models: ReferenceModels, slot: int, position: int, token: int) -> torch.Tensor:
    """Plain one-token decoding of a single request (one row, one batch entry)."""
    rows = VerifyRows.from_requests([(slot, position, [token])], num_rows=1, num_reqs=1,
                                    rows_per_req=1, scratch_kv_slot=models.target.num_kv_slots)
    return models.target.verify(rows).logits[0]


def test_models_implement_the_runtime_protocols(models: ReferenceModels) -> None:
    assert isinstance(models.target, TargetModel)
    assert isinstance(models.mtp, MtpDrafter)
    assert isinstance(models.dspark, DSparkDrafter)
    assert models.target.context_limit >= 1024


def test_packed_verification_equals_step_by_step_decoding(models: ReferenceModels,
                                                          text: bytes) -> None:
    # Ragged prompts (one beyond the attention window, one near the context limit), ragged
    # verify lengths, padding rows and a padding batch entry.
    lengths, verify_lengths = [5, 300, 1000], [8, 1, 4]
    prompts = [prompt(text, 100 * i, n) for i, n in enumerate(lengths)]
    suffixes = [prompt(text, 4000 + 50 * i, k).tolist() for i, k in enumerate(verify_lengths)]
    target = models.target
    target.prefill(prompts, torch.tensor([0, 1, 2]))
    rows = VerifyRows.from_requests(
        [(slot, n, s) for slot, (n, s) in enumerate(zip(lengths, suffixes, strict=True))],
        num_rows=16, num_reqs=4, rows_per_req=8, scratch_kv_slot=target.num_kv_slots)
    packed = target.verify(rows).logits
    target.prefill(prompts, torch.tensor([3, 4, 5]))
    row = 0
    for slot, (n, suffix) in enumerate(zip(lengths, suffixes, strict=True), start=3):
        for j, token in enumerate(suffix):
            step = decode_one(models, slot, n + j, token)
            torch.testing.assert_close(packed[row], step, atol=ATOL, rtol=0)
            row += 1


def test_verification_near_the_context_limit_equals_a_whole_sequence_forward(
        models: ReferenceModels, text: bytes) -> None:
    # An anchor at 1016 fills positions up to 1023 (the last one); the comparison is with
    # the independent whole-sequence attention path, not with the grid again.
    target = models.target
    long_context, short_context = prompt(text, 0, 1016), prompt(text, 2000, 30)
    long_rows, short_rows = prompt(text, 5000, 8).tolist(), prompt(text, 6000, 3).tolist()
    target.prefill([long_context, short_context], torch.tensor([0, 1]))
    rows = VerifyRows.from_requests([(0, 1016, long_rows), (1, 30, short_rows)], num_rows=16,
                                    num_reqs=4, rows_per_req=8, scratch_kv_slot=target.num_kv_slots)
    packed = target.verify(rows).logits
    for offset, (context, suffix) in ((0, (long_context, long_rows)),
                                      (8, (short_context, short_rows))):
        whole, _ = target(torch.cat([context, torch.tensor(suffix)])[None])
        expected = whole[0, len(context):]
        torch.testing.assert_close(packed[offset:offset + len(suffix)], expected, atol=ATOL,
                                   rtol=0)


def test_prewarming_buckets_leaves_every_request_untouched(models: ReferenceModels,
                                                           text: bytes) -> None:
    target = models.target
    target.prefill([prompt(text, 0, 200)], torch.tensor([0]))
    cache = target.cache
    assert cache is not None
    before = [k[:target.num_kv_slots].clone() for k in cache.keys]
    prewarm(target, [(1, 8), (4, 16), (8, 64)], rows_per_req=8, device="cpu")
    for old, keys in zip(before, cache.keys, strict=True):
        assert torch.equal(old, keys[:target.num_kv_slots])


def test_prefill_equals_whole_sequence_forward(models: ReferenceModels, text: bytes) -> None:
    prompts = [prompt(text, 0, 700), prompt(text, 900, 40)]
    out = models.target.prefill(prompts, torch.tensor([0, 1]))
    for index, tokens in enumerate(prompts):
        logits, _ = models.target(tokens[None])
        torch.testing.assert_close(out.last.logits[index], logits[0, -1], atol=ATOL, rtol=0)


def test_prompts_of_unlike_lengths_prefill_in_groups_and_come_back_in_order(
        models: ReferenceModels, text: bytes) -> None:
    target = models.target
    lengths = [30, 600, 35, 300, 620, 32]  # three groups, interleaved on purpose
    prompts = [prompt(text, 97 * i, n) for i, n in enumerate(lengths)]
    assert length_groups(lengths, PREFILL_PADDING) == [[4, 1], [3], [2, 5, 0]]
    out = target.prefill(prompts, torch.tensor([5, 4, 3, 2, 1, 0]))
    cache = target.cache
    assert cache is not None
    grouped = [(k[:6].clone(), v[:6].clone()) for k, v in zip(cache.keys, cache.values,
                                                                strict=True)]
    assert out.lengths.tolist() == lengths
    assert out.hidden.shape[:2] == (6, 620)
    for index, tokens in enumerate(prompts):  # each alone, in the same KV slot
        alone = target.prefill([tokens], torch.tensor([5 - index]))
        torch.testing.assert_close(out.last.logits[index], alone.last.logits[0], atol=ATOL,
                                   rtol=0)
        torch.testing.assert_close(out.hidden[index, :len(tokens)], alone.hidden[0],
                                   atol=ATOL, rtol=0)
        for (keys, values), layer_keys, layer_values in zip(grouped, cache.keys, cache.values,
                                                            strict=True):
            slot, length = 5 - index, len(tokens)
            torch.testing.assert_close(keys[slot, :length], layer_keys[slot, :length],
                                       atol=ATOL, rtol=0)
            torch.testing.assert_close(values[slot, :length], layer_values[slot, :length],
                                       atol=ATOL, rtol=0)


@pytest.mark.parametrize("lengths", [[], [1], [5, 5, 5], [10, 200, 11, 199, 12, 1000, 3],
                                     list(range(1, 60)), [1, 2, 40, 41, 700, 3]])
def test_length_groups_cover_every_prompt_once_within_the_padding(lengths: list[int]) -> None:
    groups = length_groups(lengths, PREFILL_PADDING)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert lengths[group[0]] == longest  # longest first
        real = sum(lengths[i] for i in group)
        assert len(group) == 1 or longest * len(group) <= max(PREFILL_PADDING * real,
                                                              real + PREFILL_SLACK)
    assert [lengths[g[0]] for g in groups] == sorted((lengths[g[0]] for g in groups),
                                                     reverse=True)


def test_rejected_suffix_leaves_kv_as_if_never_verified(models: ReferenceModels,
                                                        text: bytes) -> None:
    target, n = models.target, 400
    context = prompt(text, 0, n)
    block = prompt(text, 2000, 8).tolist()  # anchor + 7 drafts
    target.prefill([context, context], torch.tensor([0, 1]))
    scratch = target.num_kv_slots

    def verify(slot: int, start: int, tokens: list[int]) -> torch.Tensor:
        rows = VerifyRows.from_requests([(slot, start, tokens)], num_rows=8, num_reqs=1,
                                        rows_per_req=8, scratch_kv_slot=scratch)
        return target.verify(rows).logits[:len(tokens)]

    verify(0, n, block)  # slot 0 verifies all 7 drafts, then only 2 are accepted
    verify(1, n, block[:3])  # slot 1 never sees the rejected suffix
    # Two rows: slot 0 still holds stale keys of the rejected drafts at n+5 .. n+7, and the
    # new rows must not read them.
    next_round = prompt(text, 3000, 2).tolist()
    after_rejection = verify(0, n + 3, next_round)
    never_verified = verify(1, n + 3, next_round)
    torch.testing.assert_close(after_rejection, never_verified, atol=ATOL, rtol=0)
    cache = target.cache
    assert cache is not None
    for keys in cache.keys:
        torch.testing.assert_close(keys[0, :n + 5], keys[1, :n + 5], atol=1e-6, rtol=0)
        assert not torch.equal(keys[0, n + 5:n + 8], keys[1, n + 5:n + 8])  # stale is there


def test_mtp_serving_step_matches_its_teacher_forced_forward(models: ReferenceModels,
                                                              text: bytes) -> None:
    # Beyond the attention window, so the sliding window and the published context are
    # exercised; an off-by-one in the anchor position would show here.
    tokens = prompt(text, 0, 601)
    context, anchor = tokens[:600], tokens[600:]
    with torch.no_grad():
        _, hidden = models.target(tokens[None])
        expected = models.mtp.head.logits(models.mtp(hidden[:, :600], tokens[None, 1:]))[0, -1]
    out = models.target.prefill([context], torch.tensor([2]))
    models.mtp.publish(ContextRows.of_prompts(out, [context], torch.tensor([2]), anchor))
    step = models.mtp.step(out.last.hidden, anchor, torch.tensor([599]), torch.tensor([2]))
    torch.testing.assert_close(step.logits[0], expected, atol=ATOL, rtol=0)
    probs = step.logits.softmax(-1)[0]
    assert step.probs[0].item() == pytest.approx(probs.max().item(), abs=1e-6)


@pytest.mark.parametrize("shape", [(1, 128), (6, 128), (3, 8, 128), (64, 7, 128)])
def test_serving_norm_equals_the_training_norm_bit_for_bit(models: ReferenceModels,
                                                           shape: tuple[int, ...]) -> None:
    norm = models.target.norm
    x = 5 * torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    with torch.enable_grad():
        trained = norm(x).detach()
    with torch.no_grad():
        assert torch.equal(norm(x), trained)


@pytest.mark.parametrize("length", [1, 4, 8])
def test_causal_attention_from_position_zero_equals_the_masked_sequence_path(
        models: ReferenceModels, length: int) -> None:
    block = models.dspark.blocks[0]
    seeded = torch.Generator().manual_seed(7)
    x = torch.randn(3, length, models.target.hidden_size, generator=seeded)
    positions = torch.arange(length).expand(3, length)
    with torch.no_grad():
        expected, _, _ = block.sequence(x, positions)
        assert torch.equal(block.causal(x), expected)


def test_causal_attention_refuses_more_positions_than_its_window(models: ReferenceModels) -> None:
    attn = models.dspark.blocks[0].attn
    with pytest.raises(ValueError, match=f"exceeds the window of {attn.window}"):
        attn.causal(torch.zeros(1, attn.window + 1, models.target.hidden_size))


def test_drafters_are_deterministic(models: ReferenceModels, text: bytes) -> None:
    context = [prompt(text, 0, 200), prompt(text, 500, 90)]

    def run() -> tuple[torch.Tensor, ...]:
        kv_slots = torch.tensor([0, 1])
        out = models.target.prefill(context, kv_slots)
        anchor = out.last.logits.argmax(-1)
        block = models.dspark.draft(out.last.hidden, anchor, out.lengths - 1, kv_slots, 7)
        models.mtp.publish(ContextRows.of_prompts(out, context, kv_slots, anchor))
        state, token, drafted = out.last.hidden, anchor, []
        for step in range(7):
            result = models.mtp.step(state, token, out.lengths - 1 + step, kv_slots)
            state, token = result.hidden, result.token_ids
            drafted += [result.token_ids, result.probs]
        return block.token_ids, block.confidences, *drafted

    for first, second in zip(run(), run(), strict=True):
        assert torch.equal(first, second)


def test_dspark_narrower_block_is_a_prefix_of_the_wider_one(models: ReferenceModels,
                                                            text: bytes) -> None:
    kv_slots = torch.tensor([0])
    out = models.target.prefill([prompt(text, 0, 300)], kv_slots)
    anchor = out.last.logits.argmax(-1)
    positions = out.lengths - 1
    wide = models.dspark.draft(out.last.hidden, anchor, positions, kv_slots, 7)
    narrow = models.dspark.draft(out.last.hidden, anchor, positions, kv_slots, 5)
    assert torch.equal(narrow.token_ids, wide.token_ids[:, :5])
    torch.testing.assert_close(narrow.confidences, wide.confidences[:, :5])
    assert ((wide.confidences > 0) & (wide.confidences < 1)).all()
    with pytest.raises(ValueError, match="width=8: expected 1..7"):
        models.dspark.draft(out.last.hidden, anchor, positions, kv_slots, 8)


def test_quality_holds_at_long_positions(models: ReferenceModels) -> None:
    # The next byte after a 1023-byte context (positions far beyond the 512 trained on) is
    # predicted as well as after only its last 256 bytes. Paired over 32 seeded positions per
    # domain, the standard error of the mean difference is under 0.01 nats/byte here, so
    # 0.05 is a loose bound that a position bug (RoPE tables, cache offsets) would break.
    rng = np.random.default_rng(0)
    for domain, excerpt in heldout_excerpt().items():
        tokens = encode(excerpt.encode())
        ends = rng.integers(1023, len(tokens) - 1, 32)
        differences = []
        for batch in (ends[:8], ends[8:16], ends[16:24], ends[24:]):
            long = models.target.prefill([tokens[e - 1023:e] for e in batch],
                                         torch.arange(8)).last.logits.log_softmax(-1)
            short = models.target.prefill([tokens[e - 256:e] for e in batch],
                                          torch.arange(8)).last.logits.log_softmax(-1)
            labels = tokens[torch.as_tensor(batch)][:, None]
            differences += (short.gather(1, labels) - long.gather(1, labels))[:, 0].tolist()
        assert abs(float(np.mean(differences))) <= 0.05, domain


def test_weights_load_offline_and_identities_match_the_card(models: ReferenceModels) -> None:
    card = load_model_card()
    described = card["models"]
    assert isinstance(described, dict)
    for name, module in (("target", models.target), ("mtp", models.mtp),
                         ("dspark", models.dspark)):
        assert module.identity == described[name]["identity"]
    total = sum((shipped_folder() / f).stat().st_size for f in FILES.values())
    assert total < 8 * 2**20


def test_identity_changes_with_any_weight(models: ReferenceModels) -> None:
    config = models.target.config.as_dict()
    state = own_state(models.target)
    before = checkpoint_identity(config, state)
    changed = dict(state)
    changed["norm.weight"] = state["norm.weight"] + 1e-3
    assert checkpoint_identity(config, changed) != before
    assert checkpoint_identity(config, state) == before
    assert checkpoint_identity({**config, "window": 128}, state) != before


@needs_cuda
def test_cuda_placement_matches_cpu(models: ReferenceModels, text: bytes) -> None:
    on_gpu = load_reference_models("cuda")
    on_gpu.target.allocate(2)
    tokens = [prompt(text, 0, 300)]
    cpu = models.target.prefill(tokens, torch.tensor([0])).last.logits
    gpu = on_gpu.target.prefill(tokens, torch.tensor([0], device="cuda")).last.logits
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-3, rtol=0)


@needs_cuda
def test_verify_replays_as_a_cuda_graph_with_new_inputs(text: bytes) -> None:
    gpu = load_reference_models("cuda")
    gpu.target.allocate(4)
    gpu.target.prefill([prompt(text, 0, 300).cuda(), prompt(text, 500, 40).cuda()],
                       torch.tensor([0, 1], device="cuda"))
    captured = CapturedVerify(gpu.target, num_reqs=2, num_rows=8, rows_per_req=8)
    for requests in ([(0, 300, [1, 2, 3]), (1, 40, [4])], [(1, 40, [9, 8, 7, 6, 5])]):
        rows = VerifyRows.from_requests(requests, num_rows=8, num_reqs=2, rows_per_req=8,
                                        scratch_kv_slot=4, device="cuda")
        replayed = captured(rows).logits.clone()
        eager = gpu.target.verify(rows).logits
        valid = rows.row_valid
        torch.testing.assert_close(replayed[valid], eager[valid], atol=1e-4, rtol=0)
