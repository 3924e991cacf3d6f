"""The typed events of the runtime: every cause of a round transition, every decision, and
the arrival and end of requests. Each is a frozen dataclass with a ``kind`` name; ``record``
and ``event_from_record`` turn it into a JSON-ready dict and back for the event log.

Events carry host values only. ``time`` is the runtime clock's reading when the event was
made; replay never looks at it.
"""

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from adaspec.policies.base import BudgetContext, DepthContext, RoundFeedback

if TYPE_CHECKING:
    from adaspec.runtime.requests import Request


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    kind: ClassVar[str] = "event"
    time: float = 0.0

    def record(self) -> dict[str, Any]:
        """A JSON-ready dict: ``kind`` then every field (nested records as dicts)."""
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestArrived(Event):
    kind: ClassVar[str] = "request_arrived"
    request_id: int
    num_prompt_tokens: int
    sampling: Mapping[str, Any]  # the request's SamplingParams as a dict

    @classmethod
    def of(cls, request: "Request", time: float) -> "RequestArrived":
        return cls(time=time, request_id=request.id, num_prompt_tokens=len(request.prompt),
                   sampling=asdict(request.params))


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request_finished"
    request_id: int
    reason: str  # stop | length | cancelled | failed
    num_tokens: int  # tokens generated


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSubmitted(Event):
    """Round ``round`` was enqueued on pipeline slot ``slot`` with these requests (batch order)."""

    kind: ClassVar[str] = "round_submitted"
    round: int
    slot: int
    request_ids: tuple[int, ...]
    num_reqs_bucket: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DepthDecided(Event):
    kind: ClassVar[str] = "depth_decided"
    round: int
    slot: int
    context: DepthContext
    depth: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetDecided(Event):
    """The budget policy chose ``num_rows``; ``bound_rows`` is what ran (the full-width binding
    when the chosen G had no prepared binding)."""

    kind: ClassVar[str] = "budget_decided"
    round: int
    slot: int
    context: BudgetContext
    num_rows: int
    bound_rows: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCompleted(Event):
    """The device finished one stage of a round. A round's stages arrive together, in order,
    from its one completion (the default, and unified mode), so their times differ by the
    host's own work only; with the task pipeline off each arrives as its stage ends."""

    kind: ClassVar[str] = "stage_completed"
    round: int
    slot: int
    stage: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundRetired(Event):
    """The round's feedback reached the host; the policies observe it now."""

    kind: ClassVar[str] = "round_retired"
    round: int
    slot: int
    feedback: RoundFeedback


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardRetired(Event):
    """Another DP shard's round retired (its feedback came with that shard's turn): every
    shard's policies observe it now, after the rounds and shards before it."""

    kind: ClassVar[str] = "shard_retired"
    round: int
    slot: int
    feedback: RoundFeedback


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundFailed(Event):
    kind: ClassVar[str] = "round_failed"
    round: int
    slot: int
    stage: str
    error: str  # exception type
    message: str
    request_ids: tuple[int, ...]


EVENT_TYPES: dict[str, type[Event]] = {cls.kind: cls for cls in (
    RequestArrived, RequestFinished, RoundSubmitted, DepthDecided, BudgetDecided,
    StageCompleted, RoundRetired, ShardRetired, RoundFailed)}

def event_from_record(record: Mapping[str, Any]) -> Event:
    """Rebuild an event from ``Event.record`` output. Raises ``KeyError`` for an unknown kind
    or a missing field and ``TypeError`` for a wrong field set (the log reader turns both into
    a message naming the line)."""
    cls = EVENT_TYPES[record["kind"]]
    values: dict[str, Any] = {}
    for item in fields(cls):
        value = record[item.name]
        if item.name == "context":
            value = (DepthContext if cls is DepthDecided else BudgetContext)(**_tuples(value))
        elif item.name == "feedback":
            value = RoundFeedback.from_dict(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[item.name] = value
    return cls(**values)


def _tuples(data: Mapping[str, Any]) -> dict[str, Any]:
    return {key: tuple(value) if isinstance(value, list) else value
            for key, value in data.items()}
