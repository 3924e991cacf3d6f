"""Replay tells what the run it read was: its lag (a run without schedule overlap has lag 1,
and its report must not claim the n-2 rule of an overlapped run) and its models (a cost table
measured on other models is refused for it)."""

import asyncio
import dataclasses
from pathlib import Path

import pytest
from cost_tables import bundle
from runtime_helpers import config, decode

from adaspec.config import SamplingParams
from adaspec.errors import IncompatibleCostTable
from adaspec.models import load_reference_models
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import (
    check_recorded_run,
    check_table_for_run,
    replay,
    replay_file,
)
from adaspec.runtime.events.types import BudgetDecided, Event, RequestArrived, RoundSubmitted


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
    assert header.models == {"target": models.target.identity,
                             "draft": models.dspark.identity}
    run = check_recorded_run(header, events, str(log))
    table = dataclasses.replace(bundle(), compatibility={**run.compatibility.as_dict(),
                                                         "target": "another-target"})
    with pytest.raises(IncompatibleCostTable, match="target is another-target in the saved "
                                                    "table but "):
        check_table_for_run(table, run, "costs.json")


@pytest.mark.parametrize("cancel_on", [RoundSubmitted, BudgetDecided])
def test_a_log_records_events_in_the_order_they_happened_whatever_handlers_do(
        tmp_path: Path, cancel_on: type[Event]) -> None:
    # An engine's handler, subscribed before the start (so before the log's writer), cancels
    # a request as its round is submitted and submits another as one arrives: the log must
    # still hold each event before those it caused, and so replay.
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("MTP", 3, 4), options=RuntimeOptions(event_log=str(log)))
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    handles = []

    def react(event: Event) -> None:
        if isinstance(event, RequestArrived) and event.request_id == 0:
            handles.append(runtime.submit(list(b"JULIET."), greedy))
        if isinstance(event, cancel_on) and getattr(event, "round", None) == 3:
            handles[0].cancel()

    async def run() -> list[str]:
        runtime.bus.subscribe(react)
        await runtime.start()
        handles.insert(0, runtime.submit(list(b"ROMEO."), greedy))
        reasons = [(await handle.result()).finish_reason for handle in handles]
        await runtime.stop()
        return reasons

    assert asyncio.run(run()) == ["cancelled", "length"]
    assert replay_file(str(log)).ok
