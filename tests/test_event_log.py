"""The event log: every event type survives a write and a read unchanged, the header says what
a replay needs, an existing file is never overwritten, and every way a log can be damaged
(cut short by a crash, edited by hand, from another version) is one error line naming the
file, the line number and what is wrong.

Damaged logs are written by hand from a good one, line by line.
"""

import json
import re
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from adaspec.errors import EventLogError
from adaspec.policies.base import BudgetContext, DepthContext, RoundFeedback
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.runtime.events.log import (
    FORMAT,
    VERSION,
    EventLogWriter,
    LogHeader,
    read_event_log,
)
from adaspec.runtime.events.types import (
    EVENT_TYPES,
    BudgetDecided,
    DepthDecided,
    Event,
    RequestArrived,
    RequestFinished,
    RoundFailed,
    RoundRetired,
    RoundSubmitted,
    ShardRetired,
    StageCompleted,
)

MODELS = {"target": "target-id", "draft": "mtp-id"}  # checkpoint identities
CONTEXT_LIMIT = 1024
CONFIG = {"num_speculative_tokens": 3, "device": "cpu"}
SEED = 7


def header() -> LogHeader:
    return LogHeader.of_run(config=CONFIG, cost_table=None, models=MODELS,
                            context_limit=CONTEXT_LIMIT, seed=SEED, lag=2,
                            depth_policy=FixedDepth(), budget_policy=FullBudget())


def one_of_each() -> list[Event]:
    """One event of every type, with tuples, nested contexts and feedback filled in."""
    feedback = RoundFeedback(round=0, num_reqs=2, num_reqs_bucket=2, width=3, depth=3,
                             num_rows=8, verify_lengths=(3, 2), num_accepted=(2, 0),
                             confidences=((0.9, 0.5, 0.25), (0.75, 0.125, 0.0)))
    return [
        RequestArrived(time=0.5, request_id=1, num_prompt_tokens=12,
                       sampling={"temperature": 0.0, "top_k": 0}),
        RoundSubmitted(time=1.0, round=0, slot=0, request_ids=(1, 2), num_reqs_bucket=2),
        DepthDecided(time=1.25, round=0, slot=0, depth=3,
                     context=DepthContext(round=0, num_reqs=2, num_reqs_bucket=2, width=3,
                                          retired_through=-1)),
        BudgetDecided(time=1.5, round=0, slot=0, num_rows=8, bound_rows=8,
                      context=BudgetContext(round=0, num_reqs=2, num_reqs_bucket=2, width=3,
                                            depth=3, legal_rows=(2, 4, 8), retired_through=-1)),
        StageCompleted(time=2.0, round=0, slot=0, stage="verify"),
        RoundRetired(time=2.5, round=0, slot=0, feedback=feedback),
        ShardRetired(time=2.75, round=0, slot=0, feedback=feedback),
        RoundFailed(time=3.0, round=1, slot=1, stage="sample", error="RuntimeError",
                    message="device lost", request_ids=(2,)),
        RequestFinished(time=3.5, request_id=1, reason="stop", num_tokens=9),
    ]


def write_log(path: Path, events: list[Event] | None = None) -> Path:
    with EventLogWriter(path, header()) as writer:
        for event in one_of_each() if events is None else events:
            writer.write(event)
    return path


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def damaged(tmp_path: Path, edit_lines: Any) -> Path:
    """A good log whose lines ``edit_lines(lines)`` rewrote in place."""
    path = write_log(tmp_path / "run.jsonl")
    lines = lines_of(path)
    edit_lines(lines)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def read_error(path: Path, line: int | None, reason: str) -> EventLogError:
    """Read ``path``; the error must name it, the line and match ``reason`` (a regex)."""
    where = re.escape(f"event log {path}") + ("" if line is None else f", line {line}")
    with pytest.raises(EventLogError, match=f"^{where}: {reason}$") as info:
        read_event_log(path)
    assert "\n" not in str(info.value)
    assert (info.value.path, info.value.line) == (str(path), line)
    return info.value


def test_every_event_type_round_trips_unchanged(tmp_path: Path) -> None:
    events = one_of_each()
    assert {event.kind for event in events} == set(EVENT_TYPES)
    log = read_event_log(write_log(tmp_path / "run.jsonl", events))
    assert log.events == events
    assert [type(event) for event in log.events] == [type(event) for event in events]


def test_header_comes_first_and_holds_what_replay_needs(tmp_path: Path) -> None:
    path = write_log(tmp_path / "run.jsonl")
    first = json.loads(lines_of(path)[0])
    assert list(first)[:2] == ["format", "version"]
    assert (first["format"], first["version"]) == (FORMAT, VERSION) == ("adaspec-event-log", 4)
    assert first["config"] == CONFIG
    assert first["cost_table"] is None
    assert first["seeds"] == {"run": SEED}
    assert first["policies"] == {"depth": {"name": "fixed", "settings": {}},
                                 "budget": {"name": "full", "settings": {}}}
    assert (first["models"], first["context_limit"], first["lag"]) == (MODELS, CONTEXT_LIMIT, 2)
    assert read_event_log(path).header.record() == first


def test_each_line_is_the_events_record_in_write_order(tmp_path: Path) -> None:
    # The writer encodes events without dataclasses.asdict (for speed); the text must still be
    # exactly record(), key order included.
    path = write_log(tmp_path / "run.jsonl")
    expected = [json.dumps(event.record(), separators=(",", ":")) + "\n"
                for event in one_of_each()]
    assert lines_of(path)[1:] == expected


def test_a_read_only_mapping_is_written_as_an_object(tmp_path: Path) -> None:
    arrived = RequestArrived(request_id=3, num_prompt_tokens=4,
                             sampling=MappingProxyType({"temperature": 0.5}))
    log = read_event_log(write_log(tmp_path / "run.jsonl", [arrived]))
    assert log.events == [arrived]


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("precious\n", encoding="utf-8")
    message = re.escape(f"event log {path}: already exists; an event log is never overwritten, "
                        "choose a new path")
    with pytest.raises(EventLogError, match=f"^{message}$"):
        EventLogWriter(path, header())
    assert path.read_text(encoding="utf-8") == "precious\n"


def test_close_is_idempotent_and_writing_after_it_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    writer = EventLogWriter(path, header())
    writer.close()
    writer.close()
    with pytest.raises(EventLogError, match=r"round_submitted event written after close\(\)$"):
        writer.write(one_of_each()[1])
    assert read_event_log(path).events == []


def test_the_header_reads_back_as_it_was_written(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    EventLogWriter(path, header()).close()
    assert read_event_log(path).header == header()


def test_a_missing_file(tmp_path: Path) -> None:
    read_error(tmp_path / "nope.jsonl", None, "no such file")


def test_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"")
    read_error(path, None, "empty file; expected a header line first")


def test_a_first_line_that_is_not_a_header(tmp_path: Path) -> None:
    path = damaged(tmp_path, lambda lines: lines.pop(0))
    read_error(path, 1, re.escape('not an event log header; expected a JSON object with '
                                  '"format": "adaspec-event-log"'))


def test_an_unknown_format(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[0] = lines[0].replace('"adaspec-event-log"', '"other-log"')

    read_error(damaged(tmp_path, edit), 1,
               re.escape('unknown format "other-log"; expected "adaspec-event-log"'))


@pytest.mark.parametrize(("number", "reason"), [
    ("1e400", "time: 1e400 is beyond a double; expected a finite number"),
    ("5E-400", "time: 5E-400 is a nonzero number below the smallest double; expected 0 or a "
               "number a double can hold"),
    # Shown in part: before, the line held the whole number.
    ("1" * 4000 + ".5", "time: " + "1" * 30 + "\\.\\.\\." + "1" * 18 + "\\.5 \\(4002 "
     "characters\\) is beyond a double; expected a finite number"),
], ids=["1e400", "5E-400", "4002-characters"])
def test_a_number_a_double_cannot_be_is_refused(tmp_path: Path, number: str,
                                                reason: str) -> None:
    def edit(lines: list[str]) -> None:
        lines[1] = lines[1].replace('"time":0.5', f'"time":{number}')

    read_error(damaged(tmp_path, edit), 2, reason)


def test_another_version_names_both_versions(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[0] = lines[0].replace("\"version\":4", "\"version\":2")

    read_error(damaged(tmp_path, edit), 1, "log version 2, but this adaspec reads version 4 only")


def test_a_header_with_malformed_policies(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        first = json.loads(lines[0])
        first["policies"]["budget"] = "full"
        lines[0] = json.dumps(first) + "\n"

    read_error(damaged(tmp_path, edit), 1, re.escape(
        'header "policies.budget" must be {"name": string, "settings": object}, got "full"'))


def test_a_truncated_last_line_says_it_was_cut_short(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[-1] = lines[-1][:25]

    read_error(damaged(tmp_path, edit), 10,
               r"invalid JSON: Unterminated string starting at: column \d+; the last line is "
               r"cut short "
               r"\(did the run stop before closing the log\?\)")


def test_garbage_in_the_middle(tmp_path: Path) -> None:
    read_error(damaged(tmp_path, lambda lines: lines.insert(2, "}garbage{\n")), 3,
               "invalid JSON: Expecting value: column 1")


def test_a_blank_line(tmp_path: Path) -> None:
    read_error(damaged(tmp_path, lambda lines: lines.insert(4, "\n")), 5,
               "blank line; expected one JSON object per line")


def test_an_unknown_event_kind(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[5] = lines[5].replace('"stage_completed"', '"stage_started"')

    read_error(damaged(tmp_path, edit), 6, re.escape(
        'unknown event kind "stage_started"; expected one of request_arrived, '
        "request_finished, round_submitted, depth_decided, budget_decided, stage_completed, "
        "round_retired, shard_retired, round_failed"))


def test_a_missing_field(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[6] = lines[6].replace('"slot":0,', "")

    read_error(damaged(tmp_path, edit), 7, 'round_retired event: missing field "slot"')


def test_a_missing_nested_field_names_its_path(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        record = json.loads(lines[6])
        del record["feedback"]["num_accepted"]
        lines[6] = json.dumps(record) + "\n"

    read_error(damaged(tmp_path, edit), 7,
               'round_retired event: missing field "feedback.num_accepted"')


def test_an_extra_field(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[3] = lines[3].replace('"depth":3}', '"depth":3,"why":"hand edit"}')

    read_error(damaged(tmp_path, edit), 4, 'depth_decided event: unexpected field "why"')


def test_a_wrong_type(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[2] = lines[2].replace('"round":0', '"round":"0"')

    read_error(damaged(tmp_path, edit), 3,
               'round_submitted event: field "round" expected an integer, got "0"')


def test_a_wrong_type_deep_in_an_array(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        record = json.loads(lines[6])
        record["feedback"]["confidences"][1][2] = "high"
        lines[6] = json.dumps(record) + "\n"

    read_error(damaged(tmp_path, edit), 7, re.escape(
        'round_retired event: field "feedback.confidences[1][2]" expected a number, '
        'got "high"'))


def test_an_event_that_is_not_an_object(tmp_path: Path) -> None:
    read_error(damaged(tmp_path, lambda lines: lines.insert(1, "[1, 2]\n")), 2,
               re.escape("expected a JSON object (one event), got [1, 2]"))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(tmp_path: Path, constant: str) -> None:
    def edit(lines: list[str]) -> None:
        lines[6] = lines[6].replace('"time":2.5', f'"time":{constant}')

    read_error(damaged(tmp_path, edit), 7,
               f"invalid JSON: {constant} is not JSON; expected a finite number")


def test_a_key_given_twice_in_one_object(tmp_path: Path) -> None:
    def edit(lines: list[str]) -> None:
        lines[3] = lines[3].replace('"depth":3}', '"depth":3,"depth":1}')

    read_error(damaged(tmp_path, edit), 4,
               re.escape('invalid JSON: key "depth" appears twice in one object'))


def test_a_deeply_nested_line(tmp_path: Path) -> None:
    read_error(damaged(tmp_path, lambda lines: lines.insert(2, "[" * 100_000 + "]" * 100_000
                                                                + "\n")),
               3, "invalid JSON: nested too deeply; expected one event object per line")


def test_an_integer_past_pythons_digit_limit_is_named_in_the_users_terms(
        tmp_path: Path) -> None:
    """Before, json's advice to call sys.set_int_max_str_digits() was the message."""
    digits = sys.get_int_max_str_digits() + 1
    read_error(damaged(tmp_path, lambda lines: lines.insert(2, f'{{"round": {"1" * digits}}}\n')),
               3, f"invalid JSON: a number of more than {digits - 1} digits; no value of the "
                  "file is that long")


@pytest.mark.parametrize("line", [1, 3])
def test_a_byte_order_mark_is_named_as_the_workload_reader_names_it(
        tmp_path: Path, line: int) -> None:
    def edit(lines: list[str]) -> None:
        lines[line - 1] = "\ufeff" + lines[line - 1]

    read_error(damaged(tmp_path, edit), line,
               "starts with a byte-order mark; expected UTF-8 JSON lines without one")


def test_a_directory_is_not_a_log(tmp_path: Path) -> None:
    read_error(tmp_path, None, "a directory, not a regular file; expected an event log file")


def test_an_event_with_nan_is_refused_by_the_writer_and_nothing_is_written(
        tmp_path: Path) -> None:
    from adaspec.policies.base import RoundFeedback
    from adaspec.runtime.events.log import EventLogWriter
    from adaspec.runtime.events.types import RoundRetired

    path = tmp_path / "nan.jsonl"
    writer = EventLogWriter(str(path), header())
    feedback = RoundFeedback(round=0, num_reqs=1, num_reqs_bucket=1, width=2, depth=2,
                             num_rows=3, verify_lengths=(2,), num_accepted=(1,),
                             confidences=((float("nan"), 0.5),), request_ids=(0,))
    with pytest.raises(ValueError, match="Out of range float values"):
        writer.write(RoundRetired(round=0, slot=0, feedback=feedback))
    writer.close()
    assert len(path.read_text().splitlines()) == 1  # the header alone
