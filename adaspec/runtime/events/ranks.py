"""Whether the ranks of one run decided alike: their event logs compared round by round.

Every rank decides the draft depth d and the target graph rows G of every round itself, from
feedback the ranks share; a rank that decided otherwise would issue other collectives. Each
rank's log records its own decisions, so comparing the logs of one run says whether they
agreed, and where they first did not. The logs must each be sound on their own (the same
checks as ``replay``); request ids are not compared (DP shards decode different requests).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaspec.errors import EventLogError
from adaspec.runtime.events.log import read_event_log
from adaspec.runtime.events.replay import check_recorded_run
from adaspec.runtime.events.types import BudgetDecided, DepthDecided, Event

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
    """Read and check each log, then compare their decisions in order."""
    if len(set(paths)) != len(paths):
        raise EventLogError(paths[0], 1, "the same log is named twice; expected one log per "
                                         "rank")
    made = []
    for path in paths:
        header, events = read_event_log(path)
        check_recorded_run(header, events, path)
        made.append(decisions(events))
    first, reference = paths[0], made[0]
    for path, other in zip(paths[1:], made[1:], strict=True):
        difference = first_difference(reference, other, first, path)
        if difference is not None:
            return RankAgreement(tuple(paths), len(reference), difference)
    return RankAgreement(tuple(paths), len(reference), None)


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
