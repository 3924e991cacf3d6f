"""Whether the ranks of one run decided alike: their event logs compared round by round.

Every rank decides the draft depth d and the target graph rows G of every round itself, from
feedback the ranks share; a rank that decided otherwise would issue other collectives. Each
rank's log records its own decisions, so comparing the logs of one run says whether they
agreed, and where they first did not. The logs must each be sound on their own (the same
checks as ``replay``). Ranks of one DP shard must have served the same requests; shards
decode different ones, so their logs are compared by decisions only.
"""

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaspec.config.launch import PER_RANK_SETTINGS
from adaspec.errors import EventLogError
from adaspec.runtime.events.log import LogHeader, read_event_log
from adaspec.runtime.events.replay import check_recorded_run
from adaspec.runtime.events.types import BudgetDecided, DepthDecided, Event, RequestArrived

Decision = tuple[str, int, int]
"""(what, round, value): ``depth`` with d, or ``G`` with the rows the round was bound to."""


@dataclass(frozen=True, slots=True)
class RankAgreement:
    """The decisions of every rank's log, compared in order; ``ok`` when all agree."""

    paths: tuple[str, ...]
    num_decisions: int  # of the first log
    first_difference: str | None  # what differs first, in words

    @property
    def ok(self) -> bool:
        return self.first_difference is None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "logs": list(self.paths), "num_decisions": self.num_decisions,
                "first_difference": self.first_difference}

    def format_text(self) -> str:
        if self.first_difference is None:
            return (f"all {len(self.paths)} ranks made the same {self.num_decisions} decisions "
                    "(depth and G, round by round)")
        return f"RANKS DISAGREE: {self.first_difference}"


def decisions(events: Sequence[Event]) -> list[Decision]:
    """Every decision a log records, in log order."""
    made: list[Decision] = []
    for event in events:
        if isinstance(event, DepthDecided):
            made.append(("depth", event.round, event.depth))
        elif isinstance(event, BudgetDecided):
            made.append(("G", event.round, event.bound_rows))
    return made


def compare_ranks(paths: Sequence[str]) -> RankAgreement:
    """Read and check each log, check they are the logs of distinct ranks of one run, then
    compare their decisions in order."""
    made, runs = [], []
    for path in paths:
        header, events = read_event_log(path)
        recorded = check_recorded_run(header, events, path)
        made.append(decisions(events))
        runs.append(_run_of(header, events, recorded.launch.dp_rank))
    _check_one_run(paths, runs)
    first, reference = paths[0], made[0]
    for path, other in zip(paths[1:], made[1:], strict=True):
        difference = first_difference(reference, other, first, path)
        if difference is not None:
            return RankAgreement(tuple(paths), len(reference), difference)
    return RankAgreement(tuple(paths), len(reference), None)


@dataclass(frozen=True, slots=True)
class _RankRun:
    rank: int
    nnodes: int
    shard: int  # its DP shard
    shared: str  # the header's config but the per-rank settings, models and seed, as JSON
    arrivals: str  # every request_arrived event but its time, as JSON


def _run_of(header: LogHeader, events: Sequence[Event], shard: int) -> _RankRun:
    config = json.loads(json.dumps(header.config))
    launch = config["launch"]
    rank, nnodes = launch["settings"]["node_rank"], launch["settings"]["nnodes"]
    for section in ("settings", "sources"):
        for name in PER_RANK_SETTINGS:
            launch[section].pop(name, None)
    shared = json.dumps({"config": config, "models": dict(header.models),
                         "seed": header.seed, "lag": header.lag}, sort_keys=True)
    arrivals = json.dumps([{**event.record(), "time": None} for event in events
                           if isinstance(event, RequestArrived)], sort_keys=True)
    return _RankRun(rank=rank, nnodes=nnodes, shard=shard, shared=shared, arrivals=arrivals)


def _check_one_run(paths: Sequence[str], runs: Sequence[_RankRun]) -> None:
    """The logs come from distinct ranks of one multi-rank launch, and ranks of one DP shard
    served the same requests (its TP ranks all decode every request of the shard)."""
    first, reference = paths[0], runs[0]
    if reference.nnodes < 2:
        raise EventLogError(first, 1, "a log of a one-rank run (--nnodes=1); expected the "
                                      "logs of the ranks of one multi-rank run")
    if len(paths) > reference.nnodes:
        raise EventLogError(first, 1, f"{len(paths)} logs of a run of --nnodes="
                                      f"{reference.nnodes} ranks; expected one log per rank")
    seen: dict[int, str] = {}
    shards: dict[int, tuple[str, _RankRun]] = {}
    for path, run in zip(paths, runs, strict=True):
        if run.rank in seen:
            raise EventLogError(path, 1, f"a log of rank {run.rank} again ({seen[run.rank]} "
                                         "is one); expected one log per rank")
        seen[run.rank] = path
        if run.shared != reference.shared:
            raise EventLogError(path, 1, f"another run's log: its header's launch, models or "
                                         f"seed differ from {first}'s beyond the per-rank "
                                         f"--node_rank, --host and --port")
        other, same_shard = shards.setdefault(run.shard, (path, run))
        if run.arrivals != same_shard.arrivals:
            raise EventLogError(path, 1, f"another run's log: its requests differ from "
                                         f"{other}'s (the ranks of one DP shard serve the "
                                         "same requests)")


def first_difference(reference: list[Decision], other: list[Decision], first: str,
                      path: str) -> str | None:
    for index, (mine, theirs) in enumerate(zip(reference, other, strict=False)):
        if mine != theirs:
            return (f"decision {index + 1}: {first} has {_text(mine)}, {path} has "
                    f"{_text(theirs)}")
    if len(reference) != len(other):
        return (f"{first} records {len(reference)} decisions, {path} {len(other)}: the ranks "
                "did not run the same rounds")
    return None


def _text(decision: Decision) -> str:
    what, number, value = decision
    return f"{what}={value} in round {number}"
