"""Speculative rounds keep the target distribution exactly.

A toy target over a 5-token vocabulary gives each context (the whole prefix) its own random
logits; a toy drafter proposes a fixed token per context. Thousands of requests decode three
tokens each through the real kernels (allocation with a random budget, packing, sampling,
commit), several rounds apiece, and the empirical distribution of the 125 possible outputs
is compared with the exact one computed from the plain-Python filter reference. Drafts with
zero target probability, and drafts the filters remove, are planted on purpose.

Bound: seeded, 40 000 sequences per case; a chi-square test over cells with an expected
count of at least 5 (the rest pooled) must give p > 1e-3, and no output of exact probability
zero may occur at all. A sampler that ignores the filters fails the same test (last test),
so it has the power to catch a wrong rule.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from adaspec.config.requests import SamplingParams
from adaspec.runtime.devices import reference
from adaspec.runtime.devices.allocation import allocate_prefixes, emit_budget, verify_caps
from adaspec.runtime.devices.commit import commit_rows
from adaspec.runtime.devices.packing import pack_rows
from adaspec.runtime.devices.sampling import SamplingTensors, sample_rows, target_probs

VOCAB = 5
LENGTH = 3  # tokens generated per request
NUM_SEQUENCES = 40_000
MIN_P_VALUE = 1e-3
BASE = VOCAB + 1
START = 1  # the code of the one-token prompt [0]


def extend(codes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Context code after appending ``tokens``; codes identify whole prefixes."""
    return codes * BASE + tokens + 1


@dataclass(frozen=True)
class ToyModels:
    target_logits: torch.Tensor  # [num_codes, VOCAB]
    draft_tokens: torch.Tensor  # [num_codes]

    @classmethod
    def build(cls, seed: int, width: int) -> "ToyModels":
        gen = torch.Generator().manual_seed(seed)
        num_codes = BASE ** (1 + LENGTH + width)
        logits = torch.randn(num_codes, VOCAB, generator=gen, dtype=torch.float64) * 1.5
        drafts = torch.randint(0, VOCAB, (num_codes,), generator=gen)
        kind = torch.rand(num_codes, generator=gen)
        # A third of contexts: the draft token is impossible under the target.
        impossible = kind < 1 / 3
        logits[impossible, drafts[impossible]] = -torch.inf
        # Another third: the draft is the target's least likely token, which filters remove.
        unlikely = (kind >= 1 / 3) & (kind < 2 / 3)
        drafts[unlikely] = logits[unlikely].argmin(dim=1)
        return cls(target_logits=logits, draft_tokens=drafts)


RowHook = Callable[[torch.Tensor, torch.Tensor, SamplingTensors, torch.Generator], torch.Tensor]


def decode(models: ToyModels, params: list[SamplingParams], width: int, seed: int,
           sampler_params: list[SamplingParams] | None = None,
           wrong_rule: RowHook | None = None) -> torch.Tensor:
    """[N, LENGTH] outputs of speculative decoding, a round at a time."""
    num = len(params)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.full((num,), START, dtype=torch.int64)
    outputs = torch.full((num, LENGTH), -1, dtype=torch.int64)
    generated = torch.zeros(num, dtype=torch.int64)
    tensors = SamplingTensors.from_params(sampler_params or params, num)
    while bool((generated < LENGTH).any()):
        live = generated < LENGTH
        grid = [codes]
        for _ in range(width):
            grid.append(extend(grid[-1], models.draft_tokens[grid[-1]]))
        grid_codes = torch.stack(grid, dim=1)  # [N, width + 1]
        drafts = models.draft_tokens[grid_codes[:, :-1]]
        remaining = emit_budget(LENGTH - generated, generated, 100)
        caps = verify_caps(width, remaining, live)
        num_live = int(live.sum())
        num_rows = int(torch.randint(num_live, num * (width + 1) + 1, (1,), generator=gen))
        confidences = torch.rand(num, width, generator=gen)
        lengths = allocate_prefixes(confidences, num_rows, caps, live)
        packed = pack_rows(lengths, torch.zeros(num, dtype=torch.int64), drafts,
                           torch.arange(num), generated, live, num_rows)
        rows = packed.rows
        logits = models.target_logits[grid_codes[rows.row_reqs, rows.row_offsets]]
        uniforms = torch.rand(num_rows, generator=gen, dtype=torch.float64)
        sampled = sample_rows(logits, rows.row_reqs, tensors, uniforms)
        if wrong_rule is not None:
            proposals = drafts.flatten()[packed.draft_indices.roll(-1).clamp(min=0)]
            sampled = wrong_rule(sampled, proposals, logits_params(tensors, rows.row_reqs,
                                                                   logits), gen)
        result = commit_rows(packed, sampled, drafts, torch.full((num, 1), -1), remaining, live)
        for j in range(width + 1):
            emitted = j < result.num_emitted
            slot = (generated + j).clamp(max=LENGTH - 1)
            outputs[emitted, slot[emitted]] = result.token_ids[emitted, j]
            codes = torch.where(emitted, extend(codes, result.token_ids[:, j]), codes)
        generated = generated + result.num_emitted
    return outputs


def logits_params(tensors: SamplingTensors, row_reqs: torch.Tensor,
                  logits: torch.Tensor) -> torch.Tensor:
    """[G, VOCAB] each row's filtered target distribution (for the deliberately wrong rule)."""
    return target_probs(logits, tensors.temperature[row_reqs], tensors.top_k[row_reqs],
                        tensors.top_p[row_reqs], tensors.min_p[row_reqs])


def conditional(models: ToyModels, code: int, params: SamplingParams) -> dict[int, float]:
    logits = models.target_logits[code].tolist()
    if not params.temperature:
        return {max(range(VOCAB), key=lambda t: (logits[t], -t)): 1.0}
    kept = reference.filtered_distribution(logits, params.temperature, params.top_k,
                                           params.top_p, params.min_p)
    total = math.fsum(p for _, p in kept)
    return {token: p / total for token, p in kept}


def exact_distribution(models: ToyModels, params: SamplingParams) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {}
    for sequence in itertools.product(range(VOCAB), repeat=LENGTH):
        code, p = START, 1.0
        for token in sequence:
            p *= conditional(models, code, params).get(token, 0.0)
            code = code * BASE + token + 1
        probs[sequence] = p
    return probs


def chi_square_p_value(outputs: torch.Tensor, exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for row in outputs.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    impossible = [seq for seq in counts if exact.get(seq, 0.0) == 0.0]
    assert impossible == [], f"outputs of probability zero: {impossible[:5]}"
    total = len(outputs)
    observed, expected = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for sequence, p in exact.items():
        if p * total >= 5:
            observed.append(counts.get(sequence, 0))
            expected.append(p * total)
        else:
            pooled_obs += counts.get(sequence, 0)
            pooled_exp += p * total
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    if len(observed) == 1:
        return 1.0
    scale = sum(observed) / sum(expected)  # absorb float rounding in the expected total
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


CASES = {
    "plain": SamplingParams(temperature=1.0),
    "cold_top_k": SamplingParams(temperature=0.7, top_k=2),
    "hot_top_p": SamplingParams(temperature=1.3, top_p=0.7),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
    "all_filters": SamplingParams(temperature=0.9, top_k=3, top_p=0.8, min_p=0.1),
}


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_random_targets_keep_the_exact_target_distribution(name: str, width: int) -> None:
    models = ToyModels.build(seed=width, width=width)
    params = CASES[name]
    outputs = decode(models, [params] * NUM_SEQUENCES, width, seed=17)
    assert chi_square_p_value(outputs, exact_distribution(models, params)) > MIN_P_VALUE


def test_mixed_batches_keep_each_requests_distribution_and_greedy_stays_greedy() -> None:
    width = 3
    models = ToyModels.build(seed=5, width=width)
    kinds = [SamplingParams(temperature=0.0), CASES["cold_top_k"], CASES["all_filters"]]
    params = [kinds[i % 3] for i in range(3 * 20_000)]
    outputs = decode(models, params, width, seed=23)
    greedy = exact_distribution(models, kinds[0])
    (greedy_sequence,) = [seq for seq, p in greedy.items() if p == 1.0]
    assert (outputs[0::3] == torch.tensor(greedy_sequence)).all()
    for offset in (1, 2):
        exact = exact_distribution(models, kinds[offset])
        assert chi_square_p_value(outputs[offset::3], exact) > MIN_P_VALUE


def test_the_distribution_test_rejects_a_sampler_that_skips_the_filters() -> None:
    width = 3
    models = ToyModels.build(seed=width, width=width)
    params = CASES["cold_top_k"]
    unfiltered = SamplingParams(temperature=params.temperature)
    outputs = decode(models, [params] * NUM_SEQUENCES, width, seed=17,
                     sampler_params=[unfiltered] * NUM_SEQUENCES)
    with pytest.raises(AssertionError, match="outputs of probability zero"):
        chi_square_p_value(outputs, exact_distribution(models, params))
    # Compared with its own (unfiltered) law the same outputs pass: only the rule differed.
    assert chi_square_p_value(outputs, exact_distribution(models, unfiltered)) > MIN_P_VALUE


def test_the_distribution_test_rejects_a_residual_that_can_repeat_the_draft() -> None:
    """A public bug class: after a mismatch, drawing the replacement from the whole target
    distribution (draft included) instead of the residual. Here a rejected row redraws from
    the full distribution, and a redraw equal to the draft then counts as acceptance."""
    width = 3
    models = ToyModels.build(seed=width, width=width)
    params = CASES["plain"]

    def redraw_rejected(sampled: torch.Tensor, proposals: torch.Tensor,
                        probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        redrawn = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        return torch.where(sampled == proposals, sampled, redrawn)

    outputs = decode(models, [params] * NUM_SEQUENCES, width, seed=17,
                     wrong_rule=redraw_rejected)
    assert chi_square_p_value(outputs, exact_distribution(models, params)) < MIN_P_VALUE
