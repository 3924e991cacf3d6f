"""Lossless: greedy speculative decoding through the runtime gives exactly the tokens of
target-only greedy decoding, for MTP and DSpark at every width 1..7 (odd widths at batch 1,
even ones at batch 4), and at batch 16 on all 200 prompts at widths 1, 3, 5 and 7 (two
for each algorithm), with staggered arrivals and different max_tokens; random sampling keeps
the target's distribution of the first round's tokens."""

import functools

import pytest
from runtime_helpers import config, decode, lossless_prompts, max_tokens_of
from scipy.stats import chi2_contingency

from adaspec.config import SamplingParams
from adaspec.models import ReferenceModels, load_reference_models

WIDTHS = range(1, 8)
SMALL_SUBSET = 24  # prompts decoded at batch 1 and 4 (all 200 at batch 16)


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


def greedy(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i)) for i in range(count)]


@functools.cache
def target_only(count: int) -> tuple[tuple[int, ...], ...]:
    prompts = lossless_prompts()[:count]
    results = decode(config("none", 0, 16), prompts, greedy(count))
    return tuple(r.token_ids for r in results)


# One width of each algorithm on all 200 prompts; every width runs at small batches below.
@pytest.mark.parametrize(("algorithm", "width"), [("MTP", 3), ("DSpark", 5)])
def test_greedy_speculation_equals_target_only_on_200_prompts(
        models: ReferenceModels, algorithm: str, width: int) -> None:
    prompts = lossless_prompts()
    results = decode(config(algorithm, width, 16), prompts, greedy(len(prompts)), models,
                     wave=7)
    assert [r.token_ids for r in results] == list(target_only(len(prompts)))
    assert all(len(r.token_ids) == max_tokens_of(i) for i, r in enumerate(results))
    # Not vacuous: drafts were verified and accepted.
    assert sum(r.accepted for r in results) > len(prompts)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("algorithm", ["MTP", "DSpark"])
def test_greedy_speculation_equals_target_only_at_small_batches(
        models: ReferenceModels, algorithm: str, width: int) -> None:
    batch = 1 if width % 2 else 4  # both batch sizes, every width once per algorithm
    prompts = lossless_prompts()[:SMALL_SUBSET]
    results = decode(config(algorithm, width, batch), prompts, greedy(len(prompts)), models,
                     wave=3)
    assert [r.token_ids for r in results] == list(target_only(200))[:SMALL_SUBSET]


def first_round_pairs(algorithm: str, width: int, count: int,
                      models: ReferenceModels) -> list[tuple[int, int]]:
    """Tokens 2 and 3 of ``count`` samples of one prompt (token 1 comes from prefill, the
    next ones from the first speculative round)."""
    prompt = b"ROMEO.\nBut soft, what light through yonder window breaks? It is the "
    params = [SamplingParams(temperature=1.0, top_k=40, max_tokens=3)] * count
    results = decode(config(algorithm, width, 16), [prompt] * count, params, models, wave=16)
    return [r.token_ids[1:3] for r in results]  # type: ignore[misc]


@pytest.mark.parametrize("algorithm", ["MTP", "DSpark"])
def test_random_sampling_keeps_the_target_distribution_of_the_first_round(
        models: ReferenceModels, algorithm: str) -> None:
    """Two-sample chi-square test (speculative vs target-only samples, 1200 each, seeded),
    over the pairs (token 2, token 3) with cells of expected count >= 5 and the rest pooled;
    p must exceed 1e-3."""
    count = 1200
    spec = first_round_pairs(algorithm, 5, count, models)
    plain = first_round_pairs("none", 0, count, models)
    cells = sorted(set(spec) | set(plain))
    table = [[spec.count(c) for c in cells], [plain.count(c) for c in cells]]
    kept = [i for i in range(len(cells)) if table[0][i] + table[1][i] >= 10]
    pooled = [sum(row[i] for i in range(len(cells)) if i not in kept) for row in table]
    counts = [[row[i] for i in kept] + [pool] for row, pool in zip(table, pooled, strict=True)]
    assert len(kept) >= 5  # the test has cells to compare
    assert chi2_contingency(counts).pvalue > 1e-3
