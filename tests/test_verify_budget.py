"""The budget decision maximises expected tokens per millisecond over every legal tier."""

import pytest

from adaspec.policies.verify import choose_rows, expected_tokens

TIERS = (8, 16, 32, 48)  # Draft5, B = 8
HIGH = [0.9 ** (k + 1) for k in range(5)] * 8  # 40 drafted positions of 8 requests
LOW = [0.2 ** (k + 1) for k in range(5)] * 8


def test_expected_tokens_counts_one_per_request_and_the_best_survivals() -> None:
    assert expected_tokens(2, [0.9, 0.5, 0.1], 2) == 2
    assert expected_tokens(2, [0.9, 0.5, 0.1], 4) == pytest.approx(3.4)
    assert expected_tokens(2, [0.9, 0.5, 0.1], 12) == pytest.approx(3.5)  # padding adds none


def test_nearly_free_rows_are_all_verified() -> None:
    assert choose_rows(TIERS, 8, LOW, lambda g: 10.0 + 1e-6 * g, 48) == 48


def test_a_saturated_table_trims_when_acceptance_is_low() -> None:
    assert choose_rows(TIERS, 8, LOW, lambda g: 10.0 + 0.5 * g, 48) == 8
    assert choose_rows(TIERS, 8, HIGH, lambda g: 10.0 + 0.05 * g, 48) == 48


def test_the_argmax_is_global_not_the_first_dip() -> None:
    # 16 rows cost a step more than 8, but 48 pays off: a greedy walk would stop at 8.
    step = {8: 10.0, 16: 14.0, 32: 14.2, 48: 14.4}
    assert choose_rows(TIERS, 8, HIGH, step.__getitem__, 48) == 48


def test_equal_rates_go_to_the_smaller_tier_and_unpriced_tiers_keep_full_width() -> None:
    assert choose_rows(TIERS, 8, [0.0] * 40, lambda g: 10.0, 48) == 8
    assert choose_rows(TIERS, 8, HIGH, lambda g: None if g == 32 else 10.0, 48) == 48
