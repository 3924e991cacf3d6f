"""Adaptive target verify end to end on the reference models: the installed table drives the
budget, output stays equal to target-only greedy output, and the event log replays exactly."""

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from runtime_helpers import TINY_CALIBRATION, config, decode, excerpt_prompts, max_tokens_of
from torch import Tensor

from adaspec import cli
from adaspec.config import SamplingParams
from adaspec.models import MtpStep, ReferenceModels, load_reference_models
from adaspec.runtime.engine import RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay
from adaspec.runtime.events.types import BudgetDecided, RequestFinished, RoundRetired

PROMPTS = excerpt_prompts(12)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i))
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


@pytest.mark.parametrize("algorithm", ["DSpark", "MTP"])
def test_adaptive_verify_is_lossless_and_replays_bit_exactly(
        tmp_path: Path, models: ReferenceModels, algorithm: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    calibration, log = tmp_path / "tiny.json", tmp_path / "run.jsonl"
    calibration.write_text(json.dumps(TINY_CALIBRATION | {"request_buckets": [1, 2, 4]}))
    adaptive = decode(
        config(algorithm, 5, 4, enable_adaptive_target_verify=True,
               adaptive_target_verify_calibration=str(calibration)),
        PROMPTS, PARAMS, models=models, wave=3,
        options=RuntimeOptions(event_log=str(log), calibration_progress=lambda _: None))
    target_only = decode(config("none", 0, 4), PROMPTS, PARAMS, models=models, wave=3)
    assert [r.token_ids for r in adaptive] == [r.token_ids for r in target_only]
    header, events = read_event_log(log)
    assert header.policies["budget"]["name"] == "adaptive-verify"
    assert header.cost_table is not None
    assert header.cost_table["compatibility"]["algorithm"] == algorithm
    budgets = [e for e in events if isinstance(e, BudgetDecided)]
    assert budgets
    assert all(e.context.request_ids and e.context.max_kv_length > 0 for e in budgets)
    report = replay(header, events)
    report.check()
    assert report.num_decisions == 2 * len(budgets)
    # The recorded run is also a workload: simulate re-evaluates it under other policies
    # with the table its header carries.
    assert cli.run(["simulate", "--workload", str(log), "--policy", "fixed:5",
                    "--policy", "adaptive-verify", "--policy", "oracle", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    retired = [e for e in events if isinstance(e, RoundRetired) and e.feedback.num_reqs]
    assert simulated["rounds"] == len(retired)
    assert simulated["cost_table"] == "the event log's header"
    assert simulated["policies"][2]["vs_oracle"] == 1.0


DISTORTIONS: tuple[Callable[[Tensor], Tensor], ...] = (
    lambda p: p * 5 + 1, lambda p: p - 2, lambda p: torch.full_like(p, float("nan")))
"""Above 1, below 0 and NaN: one of them on each draft step, in turn."""


class DistortedMtp:
    """The reference MTP head with its probs pushed out of [0, 1], each step by the next of
    ``DISTORTIONS``: a drafter's bug, faked because it is what the test is about."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.steps = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        out = self._inner.step(hidden, token_ids, positions, kv_slots)
        distort = DISTORTIONS[self.steps % len(DISTORTIONS)]
        self.steps += 1
        return MtpStep(hidden=out.hidden, token_ids=out.token_ids, probs=distort(out.probs),
                       logits=out.logits)


def test_confidences_outside_0_1_are_clamped_before_feedback_and_log_so_the_log_replays(
        tmp_path: Path, models: ReferenceModels) -> None:
    calibration, log = tmp_path / "tiny.json", tmp_path / "run.jsonl"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    mtp = DistortedMtp(models.mtp)
    distorted = SimpleNamespace(target=models.target, mtp=mtp, dspark=None)
    results = decode(
        config("MTP", 5, 2, enable_adaptive_target_verify=True,
               adaptive_target_verify_calibration=str(calibration)),
        PROMPTS[:3], PARAMS[:3], models=distorted, wave=2,  # type: ignore[arg-type]
        options=RuntimeOptions(event_log=str(log), calibration_progress=lambda _: None))
    target_only = decode(config("none", 0, 2), PROMPTS[:3], PARAMS[:3], models=models, wave=2)
    assert [r.token_ids for r in results] == [r.token_ids for r in target_only]
    assert mtp.steps > len(DISTORTIONS)  # every kind of bad confidence was drafted
    header, events = read_event_log(log)  # the whole run: the log writer was never dropped
    retired = [e for e in events if isinstance(e, RoundRetired)]
    assert len({e.request_id for e in events if isinstance(e, RequestFinished)}) == 3
    assert all(0.0 <= c <= 1.0 for e in retired for row in e.feedback.confidences
               for c in row)
    replay(header, events).check()
