"""Replay tells what the run it read was: its lag (a run without schedule overlap has lag 1,
and its report must not claim the n-2 rule of an overlapped run) and its models (a cost table
measured on other models is refused for it)."""

import dataclasses
import json
from pathlib import Path

import pytest
from cost_tables import bundle
from runtime_helpers import config, decode

from adaspec.config import SamplingParams
from adaspec.errors import IncompatibleCostTable
from adaspec.models import load_reference_models
from adaspec.runtime.engine import RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import check_recorded_run, check_table_for_run, replay
from adaspec.runtime.events.types import DepthDecided


@pytest.mark.parametrize(("overlap", "lag"), [("true", 2), ("false", 1)])
def test_replay_reports_the_recorded_runs_own_lag(tmp_path: Path, overlap: str,
                                                  lag: int) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 3, 2, enable_schedule_overlap=overlap), [b"ROMEO.", b"JULIET."],
           [SamplingParams(temperature=0.0, max_tokens=12)] * 2,
           options=RuntimeOptions(event_log=str(log)))
    header, events = read_event_log(log)
    report = replay(header, events, path=str(log))
    assert report.ok
    assert report.lag == lag
    assert report.as_dict()["lag"] == lag
    assert f"saw feedback of rounds <= n-{lag}" in report.format_text()


def test_a_log_records_its_models_and_a_table_of_other_models_is_refused(
        tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 3, 2), [b"ROMEO."], [SamplingParams(temperature=0.0, max_tokens=8)],
           options=RuntimeOptions(event_log=str(log)))
    header, events = read_event_log(log)
    models = load_reference_models()
    assert header["models"] == {"target": models.target.identity,
                                "draft": models.dspark.identity}
    run = check_recorded_run(header, events, str(log))
    assert {"target", "draft"} <= set(run.known)
    table = dataclasses.replace(bundle(), compatibility={**run.compatibility.as_dict(),
                                                         "target": "another-target"})
    with pytest.raises(IncompatibleCostTable, match="target is another-target in the saved "
                                                    "table but "):
        check_table_for_run(table, run, "costs.json")


def test_a_log_written_before_depth_contexts_recorded_their_kv_length_still_reads(
        tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    decode(config("DSpark", 3, 2), [b"ROMEO."], [SamplingParams(temperature=0.0, max_tokens=8)],
           options=RuntimeOptions(event_log=str(log)))
    lines = log.read_text().splitlines()
    old = [json.loads(line) for line in lines]
    for record in old[1:]:
        if record["kind"] == "depth_decided":
            del record["context"]["max_kv_length"]  # as logs were written before the field
    log.write_text("".join(json.dumps(record) + "\n" for record in old))
    header, events = read_event_log(log)
    depths = [event for event in events if isinstance(event, DepthDecided)]
    assert depths
    assert all(event.context.max_kv_length == 0 for event in depths)  # the default
    assert replay(header, events, path=str(log)).ok
