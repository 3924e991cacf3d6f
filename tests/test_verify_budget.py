"""The budget decision maximises expected tokens per millisecond over every legal tier."""

import pytest

from adaspec.policies.base import BudgetContext, RoundFeedback
from adaspec.policies.verify import (
    FORGET_AFTER_ROUNDS,
    AdaptiveVerify,
    choose_rows,
    expected_tokens,
)

LEGAL_ROWS = (8, 16, 32, 48)  # Draft5, B = 8
HIGH = [0.9 ** (k + 1) for k in range(5)] * 8  # 40 drafted positions of 8 requests
LOW = [0.2 ** (k + 1) for k in range(5)] * 8


def test_expected_tokens_counts_one_per_request_and_the_best_survivals() -> None:
    assert expected_tokens(2, [0.9, 0.5, 0.1], 2) == 2
    assert expected_tokens(2, [0.9, 0.5, 0.1], 4) == pytest.approx(3.4)
    assert expected_tokens(2, [0.9, 0.5, 0.1], 12) == pytest.approx(3.5)  # padding adds none


def test_nearly_free_rows_are_all_verified() -> None:
    assert choose_rows(LEGAL_ROWS, [(8, LOW)], lambda g: 10.0 + 1e-6 * g, 48) == 48


def test_a_saturated_table_trims_when_acceptance_is_low() -> None:
    assert choose_rows(LEGAL_ROWS, [(8, LOW)], lambda g: 10.0 + 0.5 * g, 48) == 8
    assert choose_rows(LEGAL_ROWS, [(8, HIGH)], lambda g: 10.0 + 0.05 * g, 48) == 48


def test_the_argmax_is_global_not_the_first_dip() -> None:
    # 16 rows cost a step more than 8, but 48 pays off: a greedy walk would stop at 8.
    step = {8: 10.0, 16: 14.0, 32: 14.2, 48: 14.4}
    assert choose_rows(LEGAL_ROWS, [(8, HIGH)], step.__getitem__, 48) == 48


def test_equal_rates_go_to_the_smaller_tier_and_unpriced_tiers_keep_full_width() -> None:
    assert choose_rows(LEGAL_ROWS, [(8, [0.0] * 40)], lambda g: 10.0, 48) == 8
    assert choose_rows(LEGAL_ROWS, [(8, HIGH)], lambda g: None if g == 32 else 10.0, 48) == 48


# ---- the adaptive-verify policy on synthetic feedback ----------------------------------------

class Table:
    """A cost table priced by a formula over G; KV lengths above ``covered`` have no price."""

    def __init__(self, per_row_ms: float, covered: int = 4096) -> None:
        self.per_row_ms, self.covered = per_row_ms, covered

    def cost_ms(self, num_reqs_bucket: int, num_rows: int, kv_length: int) -> float | None:
        return None if kv_length > self.covered else 10.0 + self.per_row_ms * num_rows


def context(round: int, ids: tuple[int, ...] = tuple(range(8)), kv: int = 100
            ) -> BudgetContext:
    return BudgetContext(round=round, num_reqs=len(ids), num_reqs_bucket=8, width=5, depth=5,
                         legal_rows=LEGAL_ROWS, retired_through=round - 2, request_ids=ids,
                         max_kv_length=kv)


def feedback(round: int, conditional: float, ids: tuple[int, ...] = tuple(range(8))
             ) -> RoundFeedback:
    return RoundFeedback(round=round, num_reqs=len(ids), num_reqs_bucket=8, width=5, depth=5,
                         num_rows=48, verify_lengths=(5,) * len(ids),
                         num_accepted=(0,) * len(ids),
                         confidences=((conditional,) * 5,) * len(ids), request_ids=ids)


def test_without_retired_feedback_the_round_keeps_full_width() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5))
    assert policy.decide(context(0)) == 48
    assert policy.statistics().values["full_width_no_history"] == 1


def test_low_confidence_on_a_costly_table_trims_and_high_confidence_verifies_all() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5))
    policy.observe(feedback(0, 0.2))
    assert policy.decide(context(2)) == 8
    policy.observe(feedback(1, 0.95))
    assert policy.decide(context(3)) == 48
    assert policy.statistics().values["trimmed_rounds"] == 1


def test_nearly_free_rows_are_verified_whatever_the_confidence() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=1e-6))
    policy.observe(feedback(0, 0.05))
    assert policy.decide(context(2)) == 48


def test_a_new_request_borrows_the_newest_rounds_mean_survivals() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5))
    policy.observe(feedback(0, 0.2, ids=(0, 1, 2, 3)))
    # Requests 4..7 arrived since: no history of their own, the low mean stands in.
    assert policy.decide(context(2)) == 8


def test_an_uncovered_kv_length_keeps_full_width() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5, covered=1024))
    policy.observe(feedback(0, 0.2))
    assert policy.decide(context(2, kv=1025)) == 48
    assert policy.statistics().values["full_width_unpriced"] == 1
    assert policy.decide(context(3, kv=1024)) == 8


def test_ended_requests_are_forgotten() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5))
    policy.observe(feedback(0, 0.2, ids=(0,)))
    for number in range(1, FORGET_AFTER_ROUNDS + 2):
        policy.observe(feedback(number, 0.9, ids=(1,)))
    assert set(policy._survivals) == {(0, 1)}  # (shard, request)


def test_the_same_calls_make_the_same_decisions() -> None:
    def run() -> list[int]:
        policy = AdaptiveVerify(Table(per_row_ms=0.3))
        decisions = []
        for number in range(40):
            if number >= 2:
                policy.observe(feedback(number - 2, 0.1 + 0.02 * number))
            decisions.append(policy.decide(context(number)))
        return decisions

    first = run()
    assert first == run()
    assert len(set(first)) > 1


# ---- DP shards: one common G from the same lagged metadata --------------------------------

def dp_context(round: int, sizes: tuple[int, ...]) -> BudgetContext:
    ids = tuple(i for size in sizes for i in range(size))  # every shard numbers from 0
    return BudgetContext(round=round, num_reqs=max(sizes), num_reqs_bucket=8, width=5,
                         depth=5, legal_rows=LEGAL_ROWS, retired_through=round - 2, request_ids=ids,
                         max_kv_length=100, shard_sizes=sizes)


def shard_feedback(round: int, conditional: float, shard: int) -> RoundFeedback:
    ids = tuple(range(8))
    return RoundFeedback(round=round, num_reqs=8, num_reqs_bucket=8, width=5, depth=5,
                         num_rows=48, verify_lengths=(5,) * 8, num_accepted=(0,) * 8,
                         confidences=((conditional,) * 5,) * 8, request_ids=ids, shard=shard)


def test_dp_shards_share_one_g_that_maximises_their_summed_tokens() -> None:
    table = Table(per_row_ms=0.5)
    shards = [AdaptiveVerify(table), AdaptiveVerify(table)]  # one policy per shard
    for policy in shards:  # every shard observes every shard's retired feedback, in order
        policy.observe(shard_feedback(0, 0.9, shard=0))
        policy.observe(shard_feedback(0, 0.1, shard=1))
    chosen = [policy.decide(dp_context(2, (8, 8))) for policy in shards]
    assert chosen[0] == chosen[1]
    # The argmax of (tau_0(G) + tau_1(G)) / cost(G), each shard filling its own G rows.
    high = [0.9 ** (k + 1) for k in range(5)] * 8
    low = [0.1 ** (k + 1) for k in range(5)] * 8
    expected = max(LEGAL_ROWS, key=lambda g: (expected_tokens(8, sorted(high, reverse=True), g)
                                              + expected_tokens(8, sorted(low, reverse=True), g))
                   / table.cost_ms(8, g, 100))  # type: ignore[operator]
    assert chosen[0] == expected == 32
    # Each shard alone would pick another graph: neither local choice is the common one.
    alone = [choose_rows(LEGAL_ROWS, [(8, survivals)], lambda g: table.cost_ms(8, g, 100), 48)
             for survivals in (high, low)]
    assert alone == [48, 8]


def test_dp_request_histories_are_kept_per_shard() -> None:
    policy = AdaptiveVerify(Table(per_row_ms=0.5))
    policy.observe(shard_feedback(0, 0.97, shard=0))
    policy.observe(shard_feedback(0, 0.05, shard=1))  # the same ids 0..7, another shard
    # Shard 0 alone (shard 1 idle this round) still reads its own high survivals.
    assert policy.decide(dp_context(2, (8, 0))) == 48
    assert policy.decide(dp_context(3, (0, 8))) == 8
