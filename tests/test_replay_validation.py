"""``adaspec replay`` and ``adaspec simulate`` check a recorded log as one run before they
evaluate anything: a deleted, duplicated or moved retirement, a decision for a round that never
ran, feedback out of range and a header whose config disagrees with its events are each one
error line naming the file, the line, the field and the value (exit 2); simulate refuses a cost
table the recorded run's launch would have refused, naming the field; a FIFO, an unreadable
special file or a deeply nested line is one line too, never a hang or a traceback.

The recorded run is synthetic and written by hand: fixed policies on a DSpark launch of width 3
with request buckets 1, 2 and 4, B = 1, 2, 3 by turns, round n-2 retiring just before round n
is decided, as the two-slot pipeline does.
"""

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from logged_runs import MAX_TOKENS, stages, with_requests

from adaspec import cli
from adaspec.config.builtin import builtin_checkpoints
from adaspec.config.effective import load_config
from adaspec.config.flags import parse_argv
from adaspec.errors import EventLogError
from adaspec.policies.base import BudgetContext, DepthContext, RoundFeedback, covering_rows
from adaspec.policies.bundles import Compatibility, CostBundle
from adaspec.policies.costs import AdditiveTable
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.workloads import shaped_tables, synthetic
from adaspec.runtime.events.log import EventLogWriter, LogHeader, read_event_log
from adaspec.runtime.events.replay import replay, replay_file
from adaspec.runtime.events.types import (
    BudgetDecided,
    DepthDecided,
    Event,
    RoundRetired,
    RoundSubmitted,
)
from adaspec.runtime.states import STAGES

MODELS = {"target": "target-id", "draft": "dspark-id"}  # checkpoint identities
CONTEXT_LIMIT = 4096  # the staircase table prices contexts up to it
WIDTH = 3
LAUNCH = {"speculative_algorithm": "DSpark", "num_speculative_tokens": WIDTH,
          "max_seqs_per_batch": 4}
NUM_ROUNDS = 8
PROMPT = 23
"""Prompt tokens of every request: with the prefill's token and two rounds in flight of
w + 1 positions, the 32 every round prices (a bound the delivered tokens only raise)."""


def num_reqs(round: int) -> int:
    return 1 + round % 3  # B: 1, 2, 3, so buckets 1, 2 and 4


def bucket(round: int) -> int:
    return {1: 1, 2: 2, 3: 4}[num_reqs(round)]


def legal_rows(round: int) -> tuple[int, ...]:
    return load_config(LAUNCH).launch.legal_target_rows(bucket(round))


def contexts(round: int) -> tuple[DepthContext, BudgetContext]:
    shared: dict[str, Any] = {"round": round, "num_reqs": num_reqs(round),
                              "num_reqs_bucket": bucket(round), "width": WIDTH,
                              "retired_through": max(round - 2, -1), "max_kv_length": 32}
    return DepthContext(**shared), BudgetContext(
        **shared, depth=WIDTH, legal_rows=legal_rows(round),
        request_ids=tuple(range(num_reqs(round))))


def decided(round: int) -> list[Event]:
    """The round's decisions, its submission and its last stage (it retires later)."""
    depth, budget = contexts(round)
    rows = covering_rows(budget, WIDTH)
    slot = round % 2
    return [DepthDecided(round=round, slot=slot, context=depth, depth=WIDTH),
            BudgetDecided(round=round, slot=slot, context=budget, num_rows=rows,
                          bound_rows=rows),
            RoundSubmitted(round=round, slot=slot, request_ids=budget.request_ids,
                           num_reqs_bucket=bucket(round)), *stages(round)]


def retired(round: int) -> RoundRetired:
    batch = num_reqs(round)
    accepted = tuple((round + i) % (WIDTH + 1) for i in range(batch))
    return RoundRetired(round=round, slot=round % 2, feedback=RoundFeedback(
        round=round, num_reqs=batch, num_reqs_bucket=bucket(round), width=WIDTH, depth=WIDTH,
        num_rows=covering_rows(contexts(round)[1], WIDTH), verify_lengths=(WIDTH,) * batch,
        num_accepted=accepted, confidences=((0.9, 0.5, 0.25),) * batch,
        request_ids=tuple(range(batch))))


def recorded_run() -> list[Event]:
    events: list[Event] = []
    for round in range(NUM_ROUNDS):
        if round >= 2:
            events.append(retired(round - 2))
        events += decided(round)
    return with_requests([*events, retired(NUM_ROUNDS - 2), retired(NUM_ROUNDS - 1)],
                         max(map(num_reqs, range(NUM_ROUNDS))), lambda id: PROMPT)


def compatibility(**changes: object) -> dict[str, object]:
    """The synthetic launch's compatibility, as ``Runtime.compatibility`` would make it."""
    launch = load_config(LAUNCH).launch
    buckets = launch.prepared_request_buckets()
    fields = Compatibility(
        algorithm="DSpark", draft_width=WIDTH, dp_size=1, tp_size=1, unified=False,
        device="cpu", target="target-id", draft="dspark-id", request_buckets=buckets,
        target_rows=tuple(map(launch.legal_target_rows, buckets))).as_dict()
    return {**fields, **changes}


def table(**changes: object) -> CostBundle:
    """A staircase-priced table over the synthetic launch's largest bucket and its tiers,
    saved by that launch (or one differing so)."""
    staircase = shaped_tables()["staircase"]
    launch = load_config(LAUNCH).launch
    largest = launch.prepared_request_buckets()[-1]
    rows = launch.legal_target_rows(largest)
    priced = AdditiveTable(bias=0.01, buckets=(largest,), alpha=(0.0,), rows=rows,
                           theta=tuple(0.006 * (2 * i >= len(rows)) for i in range(len(rows))),
                           residual_rms=0.0, residual_max_relative=0.0)
    profile = dataclasses.replace(staircase.profiles[0], table=priced)
    return dataclasses.replace(staircase, compatibility=compatibility(**changes),
                               profiles=(profile,))


def write_run(path: Path, *, cost_table: CostBundle | None = None,
              launch: dict[str, object] | None = None) -> Path:
    head = LogHeader.of_run(config=load_config(launch or LAUNCH).as_dict(), models=MODELS,
                            context_limit=CONTEXT_LIMIT,
                            cost_table=None if cost_table is None else cost_table.as_dict(),
                            seed=0, depth_policy=FixedDepth(), budget_policy=FullBudget(),
                            lag=2)
    with EventLogWriter(path, head) as writer:
        for event in recorded_run():
            writer.write(event)
    return path


Records = list[dict[str, Any]]


def damaged(tmp_path: Path, edit: Callable[[Records], None]) -> Path:
    """A good log whose parsed lines ``edit`` changed (the header is records[0])."""
    path = write_run(tmp_path / "run.jsonl")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    edit(records)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def at(records: Records, kind: str, round: int) -> int:
    """The index (file line - 1) of the ``kind`` event of ``round``."""
    return next(i for i, r in enumerate(records) if r.get("kind") == kind
                and r.get("round") == round)


def feedback_of(records: Records, round: int) -> Any:
    return records[at(records, "round_retired", round)]["feedback"]


def settings_of(records: Records) -> Any:
    return records[0]["config"]["launch"]["settings"]


def delete_retirement(records: Records) -> None:
    del records[at(records, "round_retired", 3)]


def delete_last_retirement(records: Records) -> None:
    del records[at(records, "round_retired", NUM_ROUNDS - 1)]


def duplicate_retirement(records: Records) -> None:
    index = at(records, "round_retired", 3)
    records.insert(index + 1, records[index])


def decide_a_round_that_never_runs(records: Records) -> None:
    records += [json.loads(json.dumps(e.record())) for e in decided(NUM_ROUNDS)[:2]]


def decide_a_round_twice(records: Records) -> None:
    records.insert(at(records, "stage_completed", 4) + 1,
                   records[at(records, "depth_decided", 4)])


def submit_without_decisions(records: Records) -> None:
    del records[at(records, "depth_decided", 4):at(records, "round_submitted", 4)]


def bucket_never_prepared(records: Records) -> None:
    records[at(records, "depth_decided", 4)]["context"]["num_reqs_bucket"] = 8


def retire_after_a_later_decision(records: Records) -> None:
    moved = records.pop(at(records, "round_retired", 3))
    records.insert(at(records, "depth_decided", 5) + 1, moved)


def confidence_above_1(records: Records) -> None:
    feedback_of(records, 4)["confidences"][1] = [0.9, 1.5, 0.25]


def accepted_above_width(records: Records) -> None:
    feedback_of(records, 4)["num_accepted"][0] = WIDTH + 2


def short_confidences(records: Records) -> None:
    feedback_of(records, 4)["confidences"][0] = [0.9, 0.5]


def confidences_dropped(records: Records) -> None:
    feedback_of(records, 4)["confidences"] = []


def nan_confidence(records: Records) -> None:
    feedback_of(records, 4)["confidences"][0] = [0.9, float("nan"), 0.25]


def feedback_rows_not_bound(records: Records) -> None:
    feedback_of(records, 4)["num_rows"] = 4


def context_behind_the_log(records: Records) -> None:
    # the log retired round 3 just before it
    records[at(records, "budget_decided", 5)]["context"]["retired_through"] = 2


def header_width_4(records: Records) -> None:
    records[0]["config"] = load_config({**LAUNCH, "num_speculative_tokens": WIDTH + 1}).as_dict()


def header_without_overlap(records: Records) -> None:
    records[0]["config"] = load_config({**LAUNCH, "enable_schedule_overlap": False}).as_dict()


def header_derived_setting_changed(records: Records) -> None:
    settings_of(records)["tp_size"] = 2  # derived: nnodes / (dp_size * cp_size) = 1


def header_execution_edited(records: Records) -> None:
    records[0]["config"]["execution"]["world_size"] = 2


def header_verify_section_enabled(records: Records) -> None:
    records[0]["config"]["adaptive_target_verify"] = {"enabled": True}


def header_unknown_setting(records: Records) -> None:
    settings_of(records)["num_draft_tokens"] = WIDTH


def request_event(records: Records, kind: str, id: int) -> int:
    """The index (file line - 1) of the ``kind`` event of request ``id``."""
    return next(i for i, r in enumerate(records) if r.get("kind") == kind
                and r.get("request_id") == id)


def delete_arrival(records: Records) -> None:
    del records[request_event(records, "request_arrived", 0)]


def duplicate_arrival(records: Records) -> None:
    index = request_event(records, "request_arrived", 1)
    records.insert(index + 1, records[index])


def finish_before_its_rounds(records: Records) -> None:
    moved = records.pop(request_event(records, "request_finished", 0))
    moved["num_tokens"] = 1  # cancelled once its prefill's token was out
    records.insert(request_event(records, "request_arrived", 2) + 1, moved)


def delete_last_finish(records: Records) -> None:
    del records[request_event(records, "request_finished", 2)]


def top_p_above_1(records: Records) -> None:
    records[request_event(records, "request_arrived", 0)]["sampling"]["top_p"] = 1.5


def prompt_past_the_context(records: Records) -> None:
    records[request_event(records, "request_arrived", 1)]["num_prompt_tokens"] = CONTEXT_LIMIT


def more_tokens_than_asked(records: Records) -> None:
    records[request_event(records, "request_finished", 1)]["num_tokens"] = MAX_TOKENS + 1


def feedback_ids_reordered(records: Records) -> None:
    feedback_of(records, 4)["request_ids"].reverse()


def skip_a_stage(records: Records) -> None:
    del records[next(i for i, r in enumerate(records) if r.get("kind") == "stage_completed"
                     and r["round"] == 4 and r["stage"] == "verify")]


def stages_reversed(records: Records) -> None:
    first = at(records, "stage_completed", 4)
    records[first:first + 7] = records[first:first + 7][::-1]


def tiers_cut_to_the_choice(records: Records) -> None:
    budget = records[at(records, "budget_decided", 4)]
    budget["context"]["legal_rows"] = [budget["num_rows"]]


def budget_depth_other_than_decided(records: Records) -> None:
    records[at(records, "budget_decided", 4)]["context"]["depth"] = WIDTH - 1


def cancelled_with_fewer_tokens_than_delivered(records: Records) -> None:
    records[request_event(records, "request_finished", 0)]["num_tokens"] = 1


def failure_message_on_two_lines(records: Records) -> None:
    # Round 7 fails in its last stage, retire: every stage before it completed.
    index = at(records, "round_retired", NUM_ROUNDS - 1)
    records[index] = {"kind": "round_failed", "time": 0.0, "round": NUM_ROUNDS - 1,
                      "slot": (NUM_ROUNDS - 1) % 2, "stage": "retire", "error": "RuntimeError",
                      "message": "device lost\nat step 3",
                      "request_ids": list(range(num_reqs(NUM_ROUNDS - 1)))}
    del records[next(i for i, r in enumerate(records) if r.get("kind") == "stage_completed"
                     and r.get("round") == NUM_ROUNDS - 1 and r.get("stage") == "retire")]


def failed_in(stage: str, completed: int) -> Callable[[Records], None]:
    """Round 7 fails naming ``stage`` after its first ``completed`` stages completed."""
    def edit(records: Records) -> None:
        index = at(records, "round_retired", NUM_ROUNDS - 1)
        records[index] = {"kind": "round_failed", "time": 0.0, "round": NUM_ROUNDS - 1,
                          "slot": (NUM_ROUNDS - 1) % 2, "stage": stage, "error": "ValueError",
                          "message": "boom", "request_ids": list(range(num_reqs(NUM_ROUNDS - 1)))}
        records[:] = [r for r in records if not (
            r.get("kind") == "stage_completed" and r.get("round") == NUM_ROUNDS - 1
            and STAGES.index(r["stage"]) >= completed)]
    return edit


def source_under_a_second_label(records: Records) -> None:
    records[0]["config"]["launch"]["sources"]["num_speculative_tokens"] = "bogus"


def default_source_of_a_given_value(records: Records) -> None:
    records[0]["config"]["launch"]["sources"]["num_speculative_tokens"] = "default"


def unknown_header_field(records: Records) -> None:
    records[0]["adaspec_version"] = "0.1.0"


def stray_policy_setting(records: Records) -> None:
    records[0]["policies"]["budget"]["settings"] = {"bogus": 1}


def adaptive_policy_without_costs(records: Records) -> None:
    records[0]["policies"]["budget"]["name"] = "adaptive-verify"


def third_policy(records: Records) -> None:
    records[0]["policies"]["extra"] = {"name": "x", "settings": {}}


def stray_key_of_a_policy(records: Records) -> None:
    records[0]["policies"]["depth"]["extra"] = 5


def no_drafter_recorded(records: Records) -> None:
    records[0]["models"]["draft"] = "none"


def shard_sizes_of_one_shard(records: Records) -> None:
    context = records[at(records, "budget_decided", 4)]["context"]
    context["shard_sizes"] = [context["num_reqs"]]


def budget_context_without_ids(records: Records) -> None:
    records[at(records, "budget_decided", 4)]["context"]["request_ids"] = []


def seventeen_stop_tokens(records: Records) -> None:
    records[request_event(records, "request_arrived", 0)]["sampling"]["stop"] = [1] * 17


def first_round_numbered_3(records: Records) -> None:
    records[at(records, "depth_decided", 0)]["round"] = 3


def time_going_back(records: Records) -> None:
    records[at(records, "round_submitted", 4)]["time"] = -1.0


def finished_by_length_early(records: Records) -> None:
    finish = records[request_event(records, "request_finished", 0)]
    finish["reason"], finish["num_tokens"] = "length", 1


def stopped_without_stop_tokens(records: Records) -> None:
    records[request_event(records, "request_finished", 0)]["reason"] = "stop"


def fed_back_after_it_stopped(records: Records) -> None:
    # Request 2 (in rounds 2 and 5 only) stops decoding before round 4 retires; round 5,
    # submitted before that, must then leave it out of its feedback.
    records[request_event(records, "request_arrived", 2)]["sampling"]["stop"] = [10]
    finish = records.pop(request_event(records, "request_finished", 2))
    finish["reason"] = "stop"
    records.insert(at(records, "round_retired", 4), finish)


def running_request_left_out(records: Records) -> None:
    feedback = feedback_of(records, 4)
    for key in ("verify_lengths", "num_accepted", "confidences", "request_ids"):
        feedback[key] = feedback[key][:1]
    feedback["num_reqs"] = 1


def prompt_longer_than_priced(records: Records) -> None:
    # 24 + the prefill's token + two rounds of w + 1 = 33 positions, one past the 32 priced
    records[request_event(records, "request_arrived", 0)]["num_prompt_tokens"] = 24


def more_tokens_than_fed_back(records: Records) -> None:
    records[request_event(records, "request_finished", 2)]["num_tokens"] = 64


def kv_bound_raised(records: Records) -> None:
    # Round 0 knows each prompt and its prefill's token only: 23 + 1 + 1 + 2 * 4 = 33 at most.
    for kind in ("depth_decided", "budget_decided"):
        records[at(records, kind, 0)]["context"]["max_kv_length"] = 34


def max_tokens_below_what_rounds_gave(records: Records) -> None:
    # Request 2 is fed back by rounds 2 and 5; a max_tokens of 3 would have capped them.
    records[request_event(records, "request_arrived", 2)]["sampling"]["max_tokens"] = 3


def verify_length_cut_short(records: Records) -> None:
    # Round 2 verified 3 drafts of request 0, as prefix allocation of its recorded
    # confidences within G gives; 2 contradicts the round's own record.
    fed_back = feedback_of(records, 2)
    fed_back["verify_lengths"][0] -= 1
    fed_back["num_accepted"][0] = min(fed_back["num_accepted"][0],
                                      fed_back["verify_lengths"][0])


def execution_size_as_true(records: Records) -> None:
    records[0]["config"]["execution"]["world_size"] = True  # equal to 1, but no integer


def execution_binding_edited(records: Records) -> None:
    records[0]["config"]["execution"]["prepared_bindings"]["4"] = [8, 16]


def execution_bucket_as_float(records: Records) -> None:
    buckets = records[0]["config"]["execution"]["prepared_request_buckets"]
    buckets[-1] = float(buckets[-1])


def seeds_renamed(records: Records) -> None:
    records[0]["seeds"] = {"sampling": 0}


def seeds_added(records: Records) -> None:
    records[0]["seeds"]["calibration"] = 3


def seed_too_large(records: Records) -> None:
    records[0]["seeds"]["run"] = 1 << 40


def request_id_past_int64(records: Records, past: int = 2**63) -> None:
    for record in records:
        if record.get("request_id") == 2:
            record["request_id"] = past
    for record in records:
        for ids in (record.get("request_ids"), record.get("context", {}).get("request_ids"),
                    record.get("feedback", {}).get("request_ids")):
            if ids is not None:
                ids[:] = [past if id == 2 else id for id in ids]


def request_id_of_4000_digits(records: Records) -> None:
    request_id_past_int64(records, int("1" * 4000))


IN_ORDER = ("(a round's stages complete once each, in the order draft, consensus, pack, "
            "verify, sample, commit, retire)")

# (edit, line of the error, the rest of the message after "line N: ")
DAMAGE: dict[str, tuple[Callable[[Records], None], int, str]] = {
    "deleted retirement": (
        delete_retirement, 58, "depth_decided event of round 5: decided before round 3 "
        "(submitted at line 39) retired; rounds <= n-2 retire before round n is decided"),
    "deleted last retirement": (
        # Requests 0..2 end cancelled with the tokens of round 7 too, which never retired.
        delete_last_retirement, 92, 'request_finished event of request 0: field "num_tokens" '
        "expected at most 17: the prefill's token and accepted + 1 of each round fed back "
        "before it ended (cancelled), got 21"),
    "duplicated retirement": (
        duplicate_retirement, 59, "round_retired event of round 3: round 3 already retired or "
        "failed at line 58; a round ends once"),
    "decision for a round that never ran": (
        decide_a_round_that_never_runs, 97, "the log ends before the round_submitted event "
        "of round 8"),
    "decision for a round already decided": (
        decide_a_round_twice, 52, "depth_decided event of round 4: decided after round 4; "
        "expected rounds numbered in increasing order"),
    "submission without its decisions": (
        submit_without_decisions, 48, "round_submitted event of round 4: no budget_decided "
        "event of its round just before it (a round's depth_decided, budget_decided and "
        "round_submitted follow each other)"),
    "bucket never prepared": (
        bucket_never_prepared, 48, 'depth_decided event of round 4: field '
        '"context.num_reqs_bucket" expected one of the prepared request buckets [1, 2, 4], '
        "got 8"),
    "retirement moved after a later decision": (
        retire_after_a_later_decision, 58, "depth_decided event of round 5: decided before "
        "round 3 (submitted at line 39) retired; rounds <= n-2 retire before round n is "
        "decided"),
    "confidence 1.5": (
        confidence_above_1, 69, 'round_retired event of round 4: field '
        '"feedback.confidences[1][1]" expected a number in 0..1, got 1.5'),
    "accepted greater than the width": (
        accepted_above_width, 69, 'round_retired event of round 4: field '
        '"feedback.num_accepted[0]" expected an integer in 0..3 (at most its verify '
        'length), got 5'),
    "short confidence list": (
        short_confidences, 69, 'round_retired event of round 4: field '
        '"feedback.confidences[0]" expected 3 confidences (one per drafted position), '
        'got [0.9, 0.5]'),
    "feedback G other than the round's": (
        feedback_rows_not_bound, 69, 'round_retired event of round 4: field '
        '"feedback.num_rows" expected 8 (its budget decision\'s bound_rows), got 4'),
    "context behind the retirements logged": (
        context_behind_the_log, 60, 'budget_decided event of round 5: field '
        '"context.retired_through" expected 3, the newest round the log retired before this '
        "line, got 2"),
    "NaN confidence": (
        nan_confidence, 69, "invalid JSON: NaN is not JSON; expected a finite number"),
    "deleted arrival": (
        delete_arrival, 6, "round_submitted event of round 0: request 0 never arrived (no "
        "request_arrived event for it before this line)"),
    "duplicated arrival": (
        duplicate_arrival, 4, "request_arrived event of request 1: already arrived at line "
        "3; a request arrives once"),
    "request finished before its rounds": (
        finish_before_its_rounds, 8, "round_submitted event of round 0: request 0 already "
        "finished at line 5"),
    "request that never finishes": (
        delete_last_finish, 4, "request 2 arrived here but never finished (expected a "
        "request_finished event for it; every request ends before the runtime stops; was "
        "the log cut short?)"),
    "top_p above 1": (
        top_p_above_1, 2, "request_arrived event of request 0: sampling: request field "
        "top_p=1.5: expected a number in (0, 1]"),
    "prompt filling the context": (
        prompt_past_the_context, 3, 'request_arrived event of request 1: field '
        f'"num_prompt_tokens" expected an integer in 1..{CONTEXT_LIMIT - 1}, got '
        f"{CONTEXT_LIMIT}"),
    "more tokens than max_tokens": (
        more_tokens_than_asked, 94, 'request_finished event of request 1: field "num_tokens" '
        f"expected an integer in 0..{MAX_TOKENS}, got {MAX_TOKENS + 1}"),
    "feedback request ids reordered": (
        feedback_ids_reordered, 69, 'round_retired event of round 4: field '
        '"feedback.request_ids" expected ids of the round\'s live requests, in the order '
        "submitted [0, 1], got [1, 0]"),
    "a stage skipped": (
        skip_a_stage, 54, 'stage_completed event of round 4: field "stage" expected verify '
        f'{IN_ORDER}, got "sample"'),
    "stages in reverse": (
        stages_reversed, 51, 'stage_completed event of round 4: field "stage" expected draft '
        f'{IN_ORDER}, got "retire"'),
    "tiers cut to the G chosen": (
        tiers_cut_to_the_choice, 49, 'budget_decided event of round 4: field "context.legal_rows" '
        "expected the legal rows [2, 4, 8] of bucket 2, got [8]"),
    "budget depth other than the depth decided": (
        budget_depth_other_than_decided, 49, 'budget_decided event of round 4: field '
        '"context.depth" expected 3 (the depth decided for the round), got 2'),
    "cancelled with fewer tokens than its rounds delivered": (
        cancelled_with_fewer_tokens_than_delivered, 93, 'request_finished event of request 0: '
        'field "num_tokens" expected at least 21: the prefill\'s token and accepted + 1 of each '
        "round fed back before it finished, got 1"),
    "failure message on two lines": (
        failure_message_on_two_lines, 91, 'round_failed event of round 7: field "message" '
        "expected one line: the first of the exception's message, got \"device lost\\nat "
        'step 3"'),
    "failure named after a later stage than the one that ran": (
        failed_in("retire", 5), 90, 'round_failed event of round 7: field "stage" expected '
        '"commit" (the stage after the 5 that completed), got "retire"'),
    "a split round's failure naming the whole round": (
        failed_in("round", 6), 91, 'round_failed event of round 7: field "stage" expected '
        '"retire" (the stage after the 6 that completed), got "round"'),
    "unknown header field": (
        unknown_header_field, 1, 'header has unknown field "adaspec_version"; expected '
        '"config", "cost_table", "models", "context_limit", "seeds", "lag", "policies"'),
    # A built-in policy the header could not have recorded; an embedder's own name passes.
    "stray setting of a built-in policy": (
        stray_policy_setting, 1, "header policies: budget_policy full settings={'bogus': 1}: "
        "bogus is not a setting of full; expected none"),
    "adaptive policy without a cost table": (
        adaptive_policy_without_costs, 1, "header policies: budget_policy=adaptive-verify: "
        "needs a cost table (calibrated at start, or the one an event log's header carries)"),
    # Before, each of these five replayed as "all decisions match": a third policy and a
    # stray key were never read, a drafting run said it had no drafter, a one-shard batch gave
    # DP sizes (which lifted the KV bound check), a policy saw no request ids.
    "third header policy": (
        third_policy, 1, 'header "policies" must hold exactly "depth" and "budget", got '
        '["depth", "budget", "extra"]'),
    "stray key of a header policy": (
        stray_key_of_a_policy, 1, 'header "policies.depth" must be {"name": string, '
        '"settings": object}, got {"name": "fixed", "settings": {}, "extra": 5}'),
    "no drafter recorded for a drafting run": (
        no_drafter_recorded, 1, 'header "models.draft" expected a drafter\'s identity '
        '(speculative_algorithm=DSpark in its config), got "none"'),
    "DP shard sizes in a one-shard run": (
        shard_sizes_of_one_shard, 49, 'budget_decided event of round 4: field '
        '"context.shard_sizes" expected [] with one DP shard (the header\'s dp_size=1), got '
        "[2]"),
    "budget context without request ids": (
        budget_context_without_ids, 49, 'budget_decided event of round 4: field '
        '"context.request_ids" expected 2 ids, got []'),
    "seventeen stop tokens": (
        seventeen_stop_tokens, 2, "request_arrived event of request 0: sampling: request "
        "field stop=17 token ids: expected at most 16 stop token ids"),
    "confidences dropped": (
        confidences_dropped, 69, 'round_retired event of round 4: field "feedback.confidences" '
        "expected 2 entries (num_reqs), got []"),
    "first round not numbered 0": (
        first_round_numbered_3, 5, "depth_decided event of round 3: the first round decided; "
        "expected round 0"),
    "time going back": (
        time_going_back, 50, 'round_submitted event of round 4: field "time" expected a '
        "number >= 0.0 (the runtime's clock, which never goes back), got -1.0"),
    "length finish short of max_tokens": (
        finished_by_length_early, 93, 'request_finished event of request 0: field '
        f'"num_tokens" expected {MAX_TOKENS} (max_tokens) or 4073 (the context\'s end) for '
        "reason length, got 1"),
    "stop finish without stop tokens": (
        stopped_without_stop_tokens, 93, 'request_finished event of request 0: field '
        '"reason" expected a reason other than stop: the request has no stop tokens, got '
        '"stop"'),
    "feedback for a request that stopped": (
        fed_back_after_it_stopped, 81, "round_retired event of round 5: feedback.request_ids "
        "holds request 2, which stopped decoding at line 69, before the retirement of an "
        "earlier round"),
    "running request left out of the feedback": (
        running_request_left_out, 69, 'round_retired event of round 4: field '
        '"feedback.request_ids" expected every request of the round still running (request 1 '
        "is), got [0]"),
    "prompt longer than the context priced": (
        prompt_longer_than_priced, 7, "round_submitted event of round 0: request 0 has a "
        "prompt of 24 tokens, so its decisions price a KV length of at least 33, not 32 "
        "(context.max_kv_length)"),
    "more tokens than the rounds fed back": (
        more_tokens_than_fed_back, 95, 'request_finished event of request 2: field '
        '"num_tokens" expected at most 6: the prefill\'s token and accepted + 1 of each round '
        "fed back before it ended (cancelled), got 64"),
    "header width disagreeing with its events": (
        header_width_4, 5, 'depth_decided event of round 0: field "context.width" expected '
        "4 (the header's num_speculative_tokens), got 3"),
    "header without schedule overlap but lag 2": (
        header_without_overlap, 1, 'header "lag" expected 1 (enable_schedule_overlap=false '
        "in its config), got 2"),
    "header with a derived setting the others do not derive": (
        header_derived_setting_changed, 1, 'header "config.launch.settings.tp_size" expected '
        "1 (what the other settings make it), got 2"),
    "header whose execution section its launch does not make": (
        header_execution_edited, 1, 'header "config.execution.world_size" expected 1 (what '
        "the launch settings make it), got 2"),
    "header enabling adaptive target verify that its launch leaves off": (
        header_verify_section_enabled, 1, 'header "config.adaptive_target_verify.enabled" '
        "expected false (what the launch settings make it), got true"),
    "KV bound raised past what the tokens give": (
        kv_bound_raised, 7, 'round_submitted event of round 0: field "context.max_kv_length" '
        "expected at most 33: the longest prompt and the tokens fed back so far, plus the "
        "prefill's token and the positions the rounds in flight and this one write (lag 2, "
        "w + 1 = 4 each), got 34"),
    "max_tokens below what the rounds gave": (
        # The room that max_tokens leaves already caps request 2's verification at round 2.
        max_tokens_below_what_rounds_gave, 47, "round_retired event of round 2: field "
        "\"feedback.verify_lengths\" expected [3, 3, 1], what prefix allocation of G=16 gives "
        "the recorded confidences within each request's room [3, 3, 1], got [3, 3, 3]"),
    "a verify length cut short of the allocation": (
        verify_length_cut_short, 47, "round_retired event of round 2: field "
        "\"feedback.verify_lengths\" expected [3, 3, 3], what prefix allocation of G=16 gives "
        "the recorded confidences within each request's room [3, 3, 3], got [2, 3, 3]"),
    "an execution size given as true": (
        execution_size_as_true, 1, 'header "config.execution.world_size" expected 1 (what the '
        "launch settings make it), got true"),
    "an execution bucket given as a float": (
        execution_bucket_as_float, 1, 'header "config.execution.prepared_request_buckets" '
        "expected [1, 2, 4] (what the launch settings make it), got [1, 2, 4.0]"),
    "an execution binding edited": (
        execution_binding_edited, 1, 'header "config.execution.prepared_bindings.4" expected '
        "[16] (what the launch settings make it), got [8, 16]"),
    "seeds under another name": (
        seeds_renamed, 1, 'header "seeds" must be {"run": integer in 0..1099511627775} (the '
        'run seed), got {"sampling": 0}'),
    "seeds with an extra name": (
        seeds_added, 1, 'header "seeds" must be {"run": integer in 0..1099511627775} (the '
        'run seed), got {"run": 0, "calibration": 3}'),
    "seed past the launch's range": (
        seed_too_large, 1, 'header "seeds" must be {"run": integer in 0..1099511627775} (the '
        'run seed), got {"run": 1099511627776}'),
    "request id past a signed 64-bit integer": (
        request_id_past_int64, 4, 'request_arrived event of request 9223372036854775808: '
        'field "request_id" expected an integer in 2..9223372036854775807 (requests arrive in '
        "increasing id order), got 9223372036854775808"),
    # Shown in part: before, the line held the whole number, twice.
    "request id of 4000 digits": (
        request_id_of_4000_digits, 4, f'request_arrived event of request {"1" * 57}...: field '
        '"request_id" expected an integer in 2..9223372036854775807 (requests arrive in '
        f'increasing id order), got {"1" * 57}...'),
    "a setting given under a second label": (
        source_under_a_second_label, 1, 'header "config.launch.sources" gives '
        'speculative_algorithm as "flag" and num_speculative_tokens as "bogus"; a launch gives '
        "every setting under one label"),
    "a given setting claimed as its default": (
        default_source_of_a_given_value, 1, 'header "config.launch.settings.'
        'num_speculative_tokens" expected 0 (its source says default), got 3'),
    "header with an unknown launch setting": (
        header_unknown_setting, 1, 'header "config.launch.settings" has unknown setting '
        '"num_draft_tokens"; expected every launch setting of this adaspec'),
}


def one_error_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    prefix = f"adaspec {command}: error: "
    assert err.startswith(prefix)
    return err[len(prefix):-1]


def test_the_synthetic_run_is_a_valid_log_that_replays_and_simulates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path / "run.jsonl", cost_table=table())
    assert cli.run(["replay", str(path)]) == 0
    assert "all 16 decisions match the log" in capsys.readouterr().out
    assert cli.run(["simulate", "--workload", str(path), "--policy", "fixed:3",
                    "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rounds"] == NUM_ROUNDS


def test_a_log_whose_header_mentions_the_workload_format_simulates_as_a_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A checkpoint's or a cost table's file name may hold the words: the header's parsed
    # format decides what the file is, not its text.
    name = "ck/adaspec-workload-target"
    path = write_run(tmp_path / "run.jsonl", cost_table=table(target=name))
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["models"]["target"] = name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert cli.run(["simulate", "--workload", str(path), "--policy", "fixed:3",
                    "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == NUM_ROUNDS


def test_a_launch_without_graphs_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Its effective config derives a graph batch limit that the launch itself may not be
    # given: the header is rebuilt from the settings given, the derived ones then compared.
    # Its shapes are unpadded: a round's bucket is its B, and every G up to B(w + 1) legal.
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "bucket", num_reqs)
    monkeypatch.setattr(module, "legal_rows", lambda round: tuple(
        range(num_reqs(round), num_reqs(round) * (WIDTH + 1) + 1)))
    path = write_run(tmp_path / "run.jsonl", launch={**LAUNCH, "enable_graph": False})
    assert cli.run(["replay", str(path)]) == 0
    assert "all 16 decisions match the log" in capsys.readouterr().out


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_replay_refuses_a_damaged_log_in_one_line_naming_its_line(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, line, message = DAMAGE[damage]
    path = damaged(tmp_path, edit)
    assert cli.run(["replay", str(path)]) == 2
    assert one_error_line(capsys, "replay") == f"event log {path}, line {line}: {message}"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_simulate_reads_recorded_feedback_through_the_same_checks(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, line, message = DAMAGE[damage]
    path = damaged(tmp_path, edit)
    table().save(str(tmp_path / "costs.json"))
    assert cli.run(["simulate", "--workload", str(path), "--cost_table",
                    str(tmp_path / "costs.json"), "--policy", "fixed:3"]) == 2
    # Named as a workload's own faults are: the flag, the file and the line.
    assert one_error_line(capsys, "simulate") == f"--workload={path}:{line}: {message}"


def test_the_library_replay_checks_the_log_before_replaying(tmp_path: Path) -> None:
    header, events = read_event_log(damaged(tmp_path, duplicate_retirement))
    with pytest.raises(EventLogError, match=r"^event log run\.jsonl, line 59: round_retired "
                                            r"event of round 3: round 3 already retired"):
        replay(header, events, path="run.jsonl")


def test_a_header_cost_table_disagreeing_with_its_config_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path / "run.jsonl", cost_table=table(draft_width=5))
    assert cli.run(["replay", str(path)]) == 2
    assert one_error_line(capsys, "replay") == (
        f"event log {path}, line 1: header cost_table disagrees with the header's config: "
        "draft_width is 5 in the table but 3 in the header")


@pytest.mark.parametrize(("field", "value", "shown", "recorded"), [
    ("algorithm", "MTP", "MTP", "DSpark"),
    ("draft_width", 5, "5", "3"),
    ("target", "another-target", "another-target", "target-id"),
    ("device", "cuda", "cuda", "cpu"),
])
def test_simulate_refuses_a_table_incompatible_with_the_recorded_run(
        field: str, value: object, shown: str, recorded: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    log = write_run(tmp_path / "run.jsonl", cost_table=table())  # it records the identities
    saved = tmp_path / "costs.json"
    table(**{field: value}).save(str(saved))
    assert cli.run(["simulate", "--workload", str(log), "--cost_table", str(saved),
                    "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate") == (
        f"--cost_table={saved}: {field} is {shown} in the table but {recorded} in the "
        f"recorded run {log}; expected a table saved by a launch like the run's")


def test_simulate_checks_a_table_against_the_models_the_log_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_run(tmp_path / "run.jsonl")  # no table; the header still names the models
    table(target="any-target").save(str(tmp_path / "other.json"))
    assert cli.run(["simulate", "--workload", str(log), "--cost_table",
                    str(tmp_path / "other.json"), "--policy", "fixed:3"]) == 2
    assert "target is any-target in the table but target-id in the recorded run" in \
        capsys.readouterr().err
    table(draft_width=5).save(str(tmp_path / "wide.json"))
    assert cli.run(["simulate", "--workload", str(log), "--cost_table",
                    str(tmp_path / "wide.json"), "--policy", "fixed:3"]) == 2
    assert "draft_width is 5 in the table but 3 in the recorded run" in capsys.readouterr().err


def test_replay_refuses_a_header_table_measured_past_its_context_limit(
        tmp_path: Path) -> None:
    path = write_run(tmp_path / "run.jsonl", cost_table=table())
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["context_limit"] = 16  # the staircase table prices contexts beyond it
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    with pytest.raises(EventLogError, match="header cost_table disagrees with the header's "
                       "context_limit: the table prices contexts of 4096 tokens, past the "
                       "context limit 16 of the header$"):
        replay_file(str(path))


def with_context_limit(path: Path, limit: object) -> Path:
    """``path`` with its header's context_limit edited, written next to it."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["context_limit"] = limit
    edited = path.with_name(f"limit-{limit}.jsonl")
    edited.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return edited


def test_a_built_in_targets_log_must_record_its_model_cards_context_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The header names the built-in target by its identity, whose limit is its model
    card's: before, any integer the events fit under replayed ("all N decisions match")."""
    mtp = ["--speculative_algorithm=MTP", "--num_speculative_tokens=3"]
    log = tmp_path / "run.jsonl"
    assert cli.run(["generate", *mtp, "--prompt=hi", "--max_tokens=20", "--temperature=0",
                    f"--event_log={log}"]) == 0
    known = builtin_checkpoints(load_config(parse_argv(mtp)).launch)
    assert known is not None
    card_limit = known[1]
    capsys.readouterr()
    assert cli.run(["replay", str(with_context_limit(log, card_limit))]) == 0
    capsys.readouterr()
    for limit in (2000, 10**30, card_limit - 1):
        edited = with_context_limit(log, limit)
        reason = (f'header "context_limit" expected {card_limit} (the built-in target '
                  f'builtin:target\'s, whose identity "models.target" records), got {limit}')
        _refused_by_replay_and_simulate(capsys, edited, 1, reason)


def test_the_context_limit_of_a_target_no_model_card_names_is_left_to_its_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # "target-id" is no built-in target: only its checkpoint knows its limit.
    log = with_context_limit(write_run(tmp_path / "run.jsonl"), 10**30)
    assert cli.run(["replay", str(log)]) == 0
    assert "decisions match the log" in capsys.readouterr().out


def test_a_log_that_records_no_round_says_it_has_no_decision_to_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Requests that end at their prefill (max_tokens 1) run no round: nothing to compare.
    path = write_run(tmp_path / "run.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    kept = [records[0], *(r for r in records[1:]
                          if r["kind"] in ("request_arrived", "request_finished"))]
    for record in kept[1:]:
        if record["kind"] == "request_finished":
            record["num_tokens"] = 1  # the prefill's token alone
    path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    assert cli.run(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no decision to check: the log records no round" in out
    assert "match" not in out



# ---- files that are not plain logs --------------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real entry point in a child process: a reader that blocks fails the test by its
    timeout instead of hanging the suite."""
    return subprocess.run([sys.executable, "-m", "adaspec", *argv], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_at_once_by_replay_and_simulate(tmp_path: Path) -> None:
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)  # nobody ever writes it: opening it for reading would wait forever
    replayed = run_cli("replay", str(fifo))
    assert (replayed.returncode, replayed.stdout) == (2, "")
    assert replayed.stderr == (f"adaspec replay: error: event log {fifo}: a FIFO, not a "
                               "regular file; expected an event log file\n")
    simulated = run_cli("simulate", "--workload", str(fifo), "--policy", "fixed:3")
    assert (simulated.returncode, simulated.stdout) == (2, "")
    assert simulated.stderr == (f"adaspec simulate: error: --workload={fifo}: expected a "
                                "regular workload file, got a FIFO\n")


def test_a_device_is_refused_by_replay_and_simulate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(["replay", os.devnull]) == 2
    assert one_error_line(capsys, "replay") == (f"event log {os.devnull}: a character device, "
                                                "not a regular file; expected an event log file")
    assert cli.run(["simulate", "--workload", os.devnull, "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate") == (f"--workload={os.devnull}: expected a "
                                                  "regular workload file, got a character "
                                                  "device")


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_an_unreadable_special_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # /proc/self/mem passes for a regular file, but reading its first page fails (EIO).
    assert cli.run(["replay", "/proc/self/mem"]) == 2
    assert one_error_line(capsys, "replay") == ("event log /proc/self/mem: cannot read it: "
                                                "Input/output error")
    assert cli.run(["simulate", "--workload", "/proc/self/mem", "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate") == ("--workload=/proc/self/mem: cannot be read "
                                                  "(Input/output error)")


DEEP = "[" * 100_000 + "]" * 100_000 + "\n"


def test_a_deeply_nested_line_in_a_log_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path / "run.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text(lines[0] + DEEP + "".join(lines[1:]), encoding="utf-8")
    message = "invalid JSON: nested too deeply; expected one event object per line"
    _refused_by_replay_and_simulate(capsys, path, 2, message)


def _refused_by_replay_and_simulate(capsys: pytest.CaptureFixture[str], log: Path, line: int,
                                    reason: str) -> None:
    """Both readers of a recorded run refuse ``log`` in one line naming ``line``."""
    assert cli.run(["replay", str(log)]) == 2
    assert one_error_line(capsys, "replay") == f"event log {log}, line {line}: {reason}"
    assert cli.run(["simulate", "--workload", str(log), "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate") == f"--workload={log}:{line}: {reason}"


def test_a_deeply_nested_line_in_a_workload_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.jsonl"
    first = synthetic("high", rounds=2).as_lines()[0]
    path.write_text(first + "\n" + DEEP, encoding="utf-8")
    shaped_tables()["staircase"].save(str(tmp_path / "costs.json"))
    assert cli.run(["simulate", "--workload", str(path), "--cost_table",
                    str(tmp_path / "costs.json"), "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate") == (
        f"--workload={path}:2: expected one JSON object per line (this one is nested too "
        "deeply)")


def test_simulate_names_its_own_flag_for_a_damaged_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_run(tmp_path / "run.jsonl")
    saved = tmp_path / "costs.json"
    data = table().as_dict()
    data["profiles"][0]["table"]["bias"] = -1.0  # type: ignore[index]
    saved.write_text(json.dumps(data), encoding="utf-8")
    assert cli.run(["simulate", "--workload", str(log), "--cost_table", str(saved),
                    "--policy", "fixed:3"]) == 2
    assert one_error_line(capsys, "simulate").startswith(f"--cost_table={saved}: profiles[0]")


def test_a_header_policy_with_a_setting_it_does_not_have_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_run(tmp_path / "run.jsonl")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["policies"]["budget"]["settings"] = {"bogus": 1}  # dropped silently before
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert cli.run(["replay", str(path)]) == 2
    assert "bogus is not a setting of full; expected none" in one_error_line(capsys, "replay")


def test_a_run_of_an_embedders_own_policy_simulates_and_replays_only_given_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The runtime records an own policy by its name; its feedback is as good as any run's.
    path = write_run(tmp_path / "run.jsonl")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["policies"]["budget"]["name"] = "my-budget"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    table().save(str(tmp_path / "costs.json"))
    assert cli.run(["simulate", "--workload", str(path), "--cost_table",
                    str(tmp_path / "costs.json"), "--policy", "fixed:3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == NUM_ROUNDS
    assert cli.run(["replay", str(path)]) == 2
    assert "budget_policy=my-budget: expected one of" in one_error_line(capsys, "replay")
    header, events = read_event_log(str(path))
    report = replay(header, events, budget_policy=FullBudget(), path=str(path))
    assert report.ok


def test_replay_notes_a_recorded_policy_the_headers_config_does_not_make(
        tmp_path: Path) -> None:
    # An embedder's own policy (RuntimeOptions) is recorded as the run used it; so is an
    # edited header. Neither is the launch's: the replay says so rather than nothing.
    assert replay_file(str(write_run(tmp_path / "plain.jsonl"))).not_the_launchs == ()
    path = write_run(tmp_path / "run.jsonl")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    records[0]["policies"]["budget"]["name"] = "my-budget"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    header, events = read_event_log(str(path))
    report = replay(header, events, budget_policy=FullBudget(), path=str(path))
    assert report.ok
    assert report.not_the_launchs == ("budget",)
    assert report.as_dict()["recorded_policies_not_the_launchs"] == ["budget"]
    assert report.format_text().splitlines()[1] == (
        "note: the recorded budget policy is not the one the header's config makes; an "
        "embedder's own (RuntimeOptions) or an edited header")
