"""The kernels driving the real reference models: greedy speculative decoding with an
adaptive row budget, filled by the DSpark confidence head or by the MTP selected-token
probability (with the MTP context published from committed rows), gives exactly the tokens
of target-only greedy decoding through the same verify path."""

import pytest
import torch
from conftest import serving_models

from adaspec.config.requests import SamplingParams
from adaspec.models import ContextRows, ReferenceModels
from adaspec.models.quality import encode
from adaspec.models.report import heldout_excerpt
from adaspec.runtime.devices.allocation import allocate_prefixes, emit_budget, verify_caps
from adaspec.runtime.devices.commit import RUNNING, commit_rows, publication
from adaspec.runtime.devices.packing import pack_rows
from adaspec.runtime.devices.sampling import SamplingTensors, sample_rows

WIDTH = 5
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return serving_models(8)


def draft_block(models: ReferenceModels, drafter: str, hidden: torch.Tensor,
                anchors: torch.Tensor, positions: torch.Tensor,
                kv_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafted tokens and confidences ``[B, WIDTH]``: the DSpark confidence head, or the MTP
    selected-token probability of each sequential step."""
    if drafter == "dspark":
        block = models.dspark.draft(hidden, anchors, positions - 1, kv_slots, WIDTH)
        return block.token_ids, block.confidences
    tokens, probs = [], []
    state, token = hidden, anchors
    limit = models.target.context_limit
    for step in range(WIDTH):
        # The first step sits at the position of the row that produced the anchor. Steps past
        # the context limit draft tokens that are never verified (the caps see to that), so
        # they run on the scratch KV slot instead of writing outside the cache.
        step_positions = positions - 1 + step
        inside = step_positions < limit
        out = models.mtp.step(state, token, step_positions.clamp(max=limit - 1),
                              torch.where(inside, kv_slots, models.target.num_kv_slots))
        state, token = out.hidden, out.token_ids
        tokens.append(token)
        probs.append(out.probs)
    return torch.stack(tokens, 1), torch.stack(probs, 1)


def decode(models: ReferenceModels, prompts: list[torch.Tensor], kv_slots: list[int],
           speculate: bool, drafter: str = "dspark") -> tuple[list[list[int]], int, int]:
    """Greedy outputs, verify rounds run, and drafted tokens accepted."""
    target = models.target
    num = len(prompts)
    prefill = target.prefill(prompts, torch.tensor(kv_slots))
    anchors = prefill.last.logits.argmax(-1)
    models.mtp.publish(ContextRows.of_prompts(prefill, prompts, torch.tensor(kv_slots), anchors))
    hidden = prefill.last.hidden
    positions = prefill.lengths.clone()
    outputs = [[token] for token in anchors.tolist()]
    remaining = torch.full((num,), MAX_TOKENS - 1)  # the first token came from prefill
    live = torch.ones(num, dtype=torch.bool)
    params = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * num, num)
    rounds = accepted = 0
    while bool(live.any()):
        drafts, confidences = draft_block(models, drafter, hidden, anchors, positions,
                                          torch.tensor(kv_slots))
        budget = emit_budget(remaining, positions, target.context_limit)
        caps = verify_caps(WIDTH, budget, live)
        # Half the drafted tokens fit: allocation must choose among them by confidence.
        num_rows = num + (num * WIDTH // 2 if speculate else 0)
        lengths = allocate_prefixes(confidences, num_rows, caps, live)
        packed = pack_rows(lengths, anchors, drafts, torch.tensor(kv_slots), positions, live,
                           num_rows)
        out = target.verify(packed.rows)
        sampled = sample_rows(out.logits, packed.rows.row_reqs, params,
                              torch.zeros(num_rows, dtype=torch.float64))
        result = commit_rows(packed, sampled, drafts, torch.full((num, 1), -1), budget, live)
        next_token_ids, row_positions, row_slots = publication(packed, result,
                                                               target.num_kv_slots)
        models.mtp.publish(ContextRows(token_ids=packed.rows.token_ids, hidden=out.hidden,
                                       next_token_ids=next_token_ids, positions=row_positions,
                                       kv_slots=row_slots))
        for index, (row, count) in enumerate(zip(result.token_ids.tolist(),
                                                 result.num_emitted.tolist(), strict=True)):
            outputs[index] += row[:count]
        anchors = torch.where(live, result.next_anchor_ids, anchors)
        hidden = torch.where(live[:, None], out.hidden[result.last_rows], hidden)
        positions = positions + result.num_emitted
        remaining = remaining - result.num_emitted
        live = live & (result.finish == RUNNING)
        rounds += 1
        accepted += int(result.num_accepted.sum())
    return outputs, rounds, accepted


@pytest.mark.parametrize("drafter", ["dspark", "mtp"])
def test_greedy_speculation_through_the_kernels_equals_target_only_greedy(
        models: ReferenceModels, drafter: str) -> None:
    text = heldout_excerpt()["play"].encode()
    # The last prompt ends 24 positions before the context limit, which ends it early.
    prompts = [encode(text[start:start + length])
               for start, length in ((0, 40), (900, 300), (2500, 120), (100, 1000))]
    spec, spec_rounds, accepted = decode(models, prompts, [0, 1, 2, 3], True, drafter)
    plain, plain_rounds, _ = decode(models, prompts, [4, 5, 6, 7], speculate=False)
    assert spec == plain
    assert [len(tokens) for tokens in spec] == [MAX_TOKENS] * 3 + [1024 - 1000]
    # Not vacuous: drafts were accepted and speculation needed fewer verify rounds.
    assert accepted > MAX_TOKENS
    assert spec_rounds < plain_rounds
