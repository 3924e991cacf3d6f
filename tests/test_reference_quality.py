"""The reference models meet the quality bar the runtime's figures depend on, as recorded in
the model card and as re-measured here on the packaged held-out excerpt."""

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from adaspec.models.checkpoint import load_model_card, load_reference_models
from adaspec.models.quality import BATCH, encode, trace_contexts
from adaspec.models.report import heldout_excerpt, measure_excerpt


@pytest.fixture(scope="module")
def quality() -> dict[str, Any]:
    card: dict[str, Any] = load_model_card()
    return card["quality"]


def test_mtp_first_position_greedy_acceptance_is_at_least_0_6(quality: dict[str, Any]) -> None:
    assert quality["mtp"]["temperature_0"]["conditional"][0] >= 0.6


def test_dspark_width7_greedy_acceptance_length_is_at_least_2_5(
        quality: dict[str, Any]) -> None:
    assert quality["dspark"]["temperature_0"]["acceptance_length"] >= 2.5


def test_acceptance_is_high_first_and_decays(quality: dict[str, Any]) -> None:
    # Like real drafters: most first positions accepted, deep positions far less often.
    for drafter in ("mtp", "dspark"):
        prefix = quality[drafter]["temperature_0"]["prefix"]
        assert prefix[0] >= 0.6
        assert prefix[-1] <= 0.7 * prefix[0]


def test_confidence_calibration_improves_and_ends_within_0_05(quality: dict[str, Any]) -> None:
    confidence = quality["dspark"]["confidence"]
    assert confidence["ece_after_scaling"] <= 0.05
    assert confidence["ece_after_scaling"] < confidence["ece_before_scaling"]
    assert confidence["auc_prefix_survival"] > 0.7


def spread(quality: dict[str, Any], drafter: str, temperature: str) -> float:
    """Acceptance length of the easiest held-out domain minus that of the hardest."""
    by_domain = quality[drafter]["by_domain"].values()
    lengths = [d[temperature]["acceptance_length"] for d in by_domain]
    return float(max(lengths) - min(lengths))


def test_drafters_accept_differently_across_domains(quality: dict[str, Any]) -> None:
    # Adaptivity needs something to adapt to. With 512 contexts per domain the standard
    # error of a domain's acceptance length is about 0.1 at temperature 0 and 0.06 at 1.
    # DSpark's greedy acceptance differs by domain; both drafters' do at temperature 1.
    # (MTP's greedy acceptance is flat across domains: the card records it.)
    assert spread(quality, "dspark", "temperature_0") >= 0.3
    for drafter in ("mtp", "dspark"):
        assert spread(quality, drafter, "temperature_1") >= 0.15


def test_target_loss_is_flat_across_a_1024_context(quality: dict[str, Any]) -> None:
    # Measured by training on 64 chunks of 1024 bytes per domain.
    for domain, quarters in quality["target"]["loss_by_position_quarter_of_1024"].items():
        assert max(quarters[1:]) <= quarters[0] + 0.05, domain


def test_random_target_accepts_less_than_greedy(quality: dict[str, Any]) -> None:
    for drafter in ("mtp", "dspark"):
        greedy = quality[drafter]["temperature_0"]["acceptance_length"]
        sampled = quality[drafter]["temperature_1"]["acceptance_length"]
        assert 1.0 < sampled < greedy


def test_excerpt_remeasurement_agrees_with_the_card(quality: dict[str, Any]) -> None:
    # 32 seeded contexts per domain (128 in all): the standard error of a position-1 rate
    # near 0.7 is about 0.04, so a 0.15 band is over three standard errors.
    measured = measure_excerpt(load_reference_models(), contexts_per_domain=32)
    for drafter in ("mtp", "dspark"):
        rates = [m[drafter]["prefix"][0] for m in measured.values()]
        card_rate = quality[drafter]["temperature_0"]["prefix"][0]
        assert abs(sum(rates) / len(rates) - card_rate) <= 0.15, (drafter, rates, card_rate)


def test_models_command_prints_identities_and_quality_as_json() -> None:
    done = subprocess.run([sys.executable, "-m", "adaspec", "models", "--json"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert (done.returncode, done.stderr) == (0, "")
    report = json.loads(done.stdout)
    assert set(report["models"]) == {"target", "mtp", "dspark"}
    assert report["models"]["target"]["context_limit"] >= 1024
    assert report["models"]["target"]["parameters"] < 5_000_000
    assert len(report["quality"]["mtp"]["temperature_1"]["conditional"]) == 7
    assert "ece_before_scaling" in report["quality"]["dspark"]["confidence"]
    # What each drafter costs beside a target step at one request (the figure itself is a
    # speed and is read in the README, not bounded here).
    cost = report["drafter_cost"]
    assert cost["batch"] == 1
    assert set(cost["ms"]) == {"target_step", "target_verify", "dspark_block", "mtp_step"}
    assert all(value > 0 for value in cost["ms"].values())
    assert cost["dspark_over_target_step"] == pytest.approx(
        cost["ms"]["dspark_block"] / cost["ms"]["target_step"], rel=0.01)


def test_models_command_rejects_unknown_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "adaspec", "models", "--jsn"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == "adaspec models: error: --jsn: unknown flag; did you mean --json?\n"


def test_models_command_refuses_a_bad_stream_setting_in_one_line() -> None:
    environ = {**os.environ, "ADASPEC_CPU_STREAM": "bogus", "ADASPEC_CPU_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "adaspec", "models"], capture_output=True,
                          text=True, check=False, timeout=300, env=environ)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("adaspec models: error: ADASPEC_CPU_STREAM=bogus: expected ")
    assert done.stderr.count("\n") == 1


def test_models_table_states_the_acceptance_length_convention(
        capsys: pytest.CaptureFixture[str]) -> None:
    from adaspec.cli import run

    assert run(["models"]) == 0
    table = capsys.readouterr().out
    assert "AL = accepted + 1 (residual or bonus)" in table
    assert "drafter cost at one request" in table
    lines = table.splitlines()
    assert lines[0] == "builtin:target and its drafts"
    assert lines[3].startswith("target ")


def test_acceptance_holds_at_long_positions() -> None:
    # An anchor-position bug shows as acceptance collapsing at long context. 24 seeded
    # contexts per domain and length class (96 each): the standard error of the difference
    # of two position-1 rates near 0.8 is about 0.06, so 0.2 is over three of them.
    models = load_reference_models()
    models.target.allocate(BATCH)
    models.mtp.allocate(BATCH)
    rng = np.random.default_rng(7)
    first_rates: dict[str, list[float]] = {"short": [], "long": []}
    for text in heldout_excerpt().values():
        tokens = encode(text.encode())
        for label, (low, high) in (("short", (32, 256)), ("long", (800, 1016))):
            contexts = []
            for _ in range(24):
                length = int(rng.integers(low, high + 1))
                start = int(rng.integers(0, len(tokens) - length))
                contexts.append(tokens[start:start + length])
            traces = trace_contexts(models.target, models.mtp, models.dspark, contexts, 7)
            first_rates[label] += [float(t.greedy_accept[:, 0].mean()) for t in traces.values()]
    short, long = np.mean(first_rates["short"]), np.mean(first_rates["long"])
    assert long >= short - 0.2, (short, long)
