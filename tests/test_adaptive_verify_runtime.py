"""Adaptive target verify end to end on the reference models: the installed table drives the
budget, output stays equal to target-only greedy output, and the event log replays exactly."""

import json
from pathlib import Path

import pytest
from runtime_helpers import TINY_CALIBRATION, config, decode, excerpt_prompts, max_tokens_of

from adaspec import cli
from adaspec.config import SamplingParams
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.runtime.engine import RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import replay
from adaspec.runtime.events.types import BudgetDecided, RoundRetired

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
