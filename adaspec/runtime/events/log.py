"""The event log: a self-describing JSON-lines file, written while the runtime serves and read
back by ``adaspec replay``.

Line 1 is the header: ``format`` and ``version`` first, then what a replay needs to rebuild
the run's decisions (the effective configuration, the cost table's identity, the seeds and the
policies by name and settings) and, from the runtime, the checkpoint identities of the models
(``models``) and the target's ``context_limit``, so a cost table and the requests can be
checked against the run that a log records. Every later line is one event's ``record()``, in
publish order.

The reader trusts nothing: a log may be truncated by a crash, edited by hand or come from
another version, and each such problem is one ``EventLogError`` line naming the file, the line
number and what is wrong there. ``read_event_log`` checks each line on its own (strict JSON, the
fields and their types); ``check_run`` then checks the events as one run: their order and the
ranges of their values, against what the header's launch fixes (``RunShape``).
"""

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, get_args, get_origin

from adaspec.config.files import UnheldNumber, check_doubles, json_fault, marked_double
from adaspec.config.launch import prepared_rows
from adaspec.config.paths import NotRegularFile, open_regular
from adaspec.config.requests import MAX_REQUEST_ID, MAX_SEED, SamplingParams, check_room
from adaspec.errors import EventLogError, OutputWriteError, RequestError
from adaspec.policies.base import (
    BudgetContext,
    BudgetPolicy,
    DepthContext,
    DepthPolicy,
    RoundFeedback,
)
from adaspec.runtime.events.outputs import ObserverFile, reason
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
    event_from_record,
)
from adaspec.runtime.states import STAGES

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT = "adaspec-event-log"
VERSION = 4
"""Bumped whenever a line's meaning changes; a reader accepts exactly its own version."""

HEADER_KEYS = ("config", "cost_table", "models", "context_limit", "seeds", "lag", "policies")
"""What every header holds besides ``format`` and ``version`` (``cost_table`` may be null)."""
SEED_NAME = "run"
"""The one entry of the header's ``seeds``: the run seed every draw derives from."""

_BUFFER_BYTES = 1 << 16  # a few hundred events per write(2); close() flushes the rest


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogHeader:
    """The first line of an event log: what the run's decisions and requests are checked
    against. Written by ``record`` and read by ``parse``, nowhere else."""

    config: Mapping[str, Any]  # the effective configuration (``EffectiveConfig.as_dict``)
    cost_table: Mapping[str, Any] | None  # the bundle the run installed, if any
    models: Mapping[str, str]  # checkpoint identities: target, and draft ("none": no drafter)
    context_limit: int  # the target's
    seed: int  # the run seed every draw derives from
    lag: int  # 2 with schedule overlap, 1 without
    policies: Mapping[str, Mapping[str, Any]]  # depth and budget: {name, settings}

    @classmethod
    def of_run(cls, *, config: Mapping[str, Any], cost_table: Mapping[str, Any] | None,
               models: Mapping[str, str], context_limit: int, seed: int, lag: int,
               depth_policy: DepthPolicy, budget_policy: BudgetPolicy) -> "LogHeader":
        """A run's header, its policies as replay rebuilds them (name and ``settings()``)."""
        return cls(config=dict(config), cost_table=cost_table, models=dict(models),
                   context_limit=context_limit, seed=seed, lag=lag,
                   policies={"depth": _policy_entry(depth_policy),
                             "budget": _policy_entry(budget_policy)})

    def record(self) -> dict[str, Any]:
        """The header line's JSON object."""
        return {"format": FORMAT, "version": VERSION, "config": dict(self.config),
                "cost_table": self.cost_table, "models": dict(self.models),
                "context_limit": self.context_limit, "seeds": {SEED_NAME: self.seed},
                "lag": self.lag, "policies": dict(self.policies)}

    @classmethod
    def parse(cls, name: str, raw: bytes) -> "LogHeader":
        """The header of line 1 of log ``name``; ``EventLogError`` naming what is wrong."""
        data = _json_line(name, 1, raw)
        if not isinstance(data, dict) or "format" not in data:
            raise EventLogError(name, 1, "not an event log header; expected a JSON object "
                                f'with "format": "{FORMAT}"')
        if data["format"] != FORMAT:
            raise EventLogError(name, 1, f'unknown format {_show(data["format"])}; expected '
                                f'"{FORMAT}"')
        if "version" not in data:
            raise EventLogError(name, 1, f'header lacks "version"; this adaspec reads '
                                f"version {VERSION}")
        version = data["version"]
        if type(version) is not int or version != VERSION:
            raise EventLogError(name, 1, f"log version {_show(version)}, but this adaspec "
                                f"reads version {VERSION} only")
        problem = _header_problem(data)
        if problem:
            raise EventLogError(name, 1, problem)
        return cls(config=data["config"], cost_table=data["cost_table"],
                   models=data["models"], context_limit=data["context_limit"],
                   seed=data["seeds"][SEED_NAME], lag=data["lag"], policies=data["policies"])


def _policy_entry(policy: DepthPolicy | BudgetPolicy) -> dict[str, Any]:
    return {"name": policy.name, "settings": policy.settings()}


class EventLogWriter:
    """Writes one run's event log; ``write`` is the bus subscriber (``bus.subscribe(w.write)``).

    The file must not exist: a log is evidence of one run and is never overwritten. Writes are
    buffered and reach the disk at ``close()`` (idempotent; also on leaving a ``with`` block).
    A write the system refuses (a full disk) stops the log, never the run: later events are
    dropped and ``close()`` raises ``OutputWriteError`` saying the log is incomplete, naming
    the setting as ``RuntimeOptions`` does (``event_log``; a command names its flag).
    """

    def __init__(self, path: str | os.PathLike[str], header: LogHeader) -> None:
        self.path = os.fspath(path)
        # Encode before creating the file, so a bad header leaves no empty log behind.
        first = _dumps(header.record())
        try:
            # Mode "x": creating fails when the file exists, with no window for a race.
            self._file = ObserverFile(open(  # noqa: SIM115 - closed by close()
                self.path, "x", encoding="utf-8", buffering=_BUFFER_BYTES))
        except FileExistsError:
            raise EventLogError(self.path, None, "already exists; an event log is never "
                                "overwritten, choose a new path") from None
        except OSError as error:
            raise EventLogError(self.path, None, f"cannot create it: {reason(error)}") \
                from None
        self._file.write(first)

    def write(self, event: Event) -> None:
        """Append one event (a bus subscriber: runs synchronously inside ``publish``)."""
        if self._file.closed:
            raise EventLogError(self.path, None, f"{event.kind} event written after close()")
        self._file.write(_dumps(event))

    def flush(self) -> None:
        """Push buffered events to the operating system (say, before a risky operation)."""
        self._file.flush()

    def close(self) -> None:
        """Write what is buffered and close; ``OutputWriteError`` when any write failed."""
        failure = self._file.close()
        if failure is not None:
            raise OutputWriteError("event_log", self.path, "event log", reason(failure))

    def __enter__(self) -> "EventLogWriter":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _dumps(value: object) -> str:
    return _ENCODER.encode(value) + "\n"


def _plain(value: object) -> object:
    """What JSON cannot write natively, made plain.

    An event becomes exactly its ``record()`` (``kind``, then its fields), but without the deep
    copy ``dataclasses.asdict`` makes: JSON already writes tuples as arrays, so only dataclasses
    (the event, its context or feedback) and read-only mappings need converting, one level at a
    time as the encoder reaches them. This makes a retired round's line several times cheaper.
    """
    if isinstance(value, Event):
        return {"kind": value.kind, **_fields_of(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_of(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable in an event log")


def _fields_of(value: "DataclassInstance") -> dict[str, object]:
    names = _FIELD_NAMES.get(type(value))
    if names is None:
        names = _FIELD_NAMES[type(value)] = tuple(f.name for f in dataclasses.fields(value))
    return {name: getattr(value, name) for name in names}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
# One encoder, not one per line. NaN and infinities are refused (ValueError) rather than
# written: the reader refuses them, so a log with one could never be replayed.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_plain, allow_nan=False)


class EventLog(NamedTuple):
    """A log as read back: its header and its events in file order (event ``i`` is on line
    ``i + 2``)."""

    header: LogHeader
    events: list[Event]


def read_event_log(path: str | os.PathLike[str]) -> EventLog:
    """Read and check every line of an event log; any problem is one ``EventLogError`` line.
    The events' order and ranges are ``check_run``'s to check."""
    name = os.fspath(path)
    try:
        file = open_regular(name)  # bytes: a bad UTF-8 sequence is reported with its line
    except FileNotFoundError:
        raise EventLogError(name, None, "no such file") from None
    except NotRegularFile as error:
        raise EventLogError(name, None, f"{error.strerror}; expected an event log "
                            "file") from None
    except OSError as error:
        raise EventLogError(name, None, f"cannot open it: {reason(error)}") from None
    with file:
        try:
            return _read_lines(name, file)
        except OSError as error:  # a special file that passes for a regular one (/proc)
            raise EventLogError(name, None, f"cannot read it: {reason(error)}") from None


MAX_LINE_BYTES = 64 * 2**20
"""No event or header line comes near this (a header with a large cost table is a few hundred
KB); a longer one is not an event log, and reading it whole could exhaust memory (a /proc file
that reads without end passes for a regular file)."""


def _bounded_lines(name: str, file: BinaryIO) -> Iterator[bytes]:
    """The file's lines, each refused once it passes ``MAX_LINE_BYTES``."""
    number = 0
    while raw := file.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise EventLogError(name, number, f"longer than {MAX_LINE_BYTES // 2**20} MiB; "
                                "expected one JSON object per line")
        yield raw


def _read_lines(name: str, file: BinaryIO) -> EventLog:
    lines = _bounded_lines(name, file)
    first = next(lines, None)
    if first is None:
        raise EventLogError(name, None, "empty file; expected a header line first")
    header = LogHeader.parse(name, first)
    events = [_event(name, number, raw) for number, raw in enumerate(lines, start=2)]
    return EventLog(header, events)




# --- lines -------------------------------------------------------------------------------


def _json_line(name: str, number: int, raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EventLogError(name, number, f"not UTF-8 text (byte {error.start + 1})") from None
    if not text.strip():
        raise EventLogError(name, number, "blank line; expected one JSON object per line")
    if text.startswith("\ufeff"):  # as the workload reader says it, not in json's words
        raise EventLogError(name, number, "starts with a byte-order mark; expected UTF-8 JSON "
                            "lines without one")
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                          parse_float=marked_double)
        check_doubles(data)
        return data
    except json.JSONDecodeError as error:
        hint = "" if raw.endswith(b"\n") else (
            "; the last line is cut short (did the run stop before closing the log?)")
        # json's own wording ("Expecting value: line 1 column 5"), the line being ours
        raise EventLogError(name, number, f"invalid JSON: {error.msg}: column "
                            f"{error.colno}{hint}") from None
    except UnheldNumber as error:  # valid JSON, with a number no double holds
        raise EventLogError(name, number, str(error)) from None
    except ValueError as error:  # a repeated key, NaN, an integer past Python's digits
        raise EventLogError(name, number, f"invalid JSON: {json_fault(error)}") from None
    except RecursionError:
        raise EventLogError(name, number, "invalid JSON: nested too deeply; expected one "
                            "event object per line") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all distinct: with a repeated key, json keeps the last value
    silently, so a hand-edited line could say two things at once."""
    data = dict(pairs)
    if len(data) != len(pairs):  # comparing sizes keeps the common case free of a loop
        keys = [key for key, _ in pairs]
        repeated = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"key {_show(repeated)} appears twice in one object")
    return data


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON; expected a finite number")


def _header_problem(data: Mapping[str, Any]) -> str | None:
    missing = [key for key in HEADER_KEYS if key not in data]
    if missing:
        return f"header lacks {_names(missing)}"
    unknown = [key for key in data if key not in ("format", "version", *HEADER_KEYS)]
    if unknown:
        return (f"header has unknown field {_names(unknown[:1])}; expected "
                f"{_names(list(HEADER_KEYS))}")
    for key, allowed in (("config", (dict,)), ("cost_table", (dict, type(None))),
                         ("seeds", (dict,)), ("policies", (dict,))):
        if not isinstance(data[key], allowed):
            return f'header "{key}" must be an object, got {_show(data[key])}'
    models = data["models"]
    if not (isinstance(models, dict) and set(models) == {"target", "draft"}
            and all(isinstance(value, str) and value for value in models.values())):
        return (f'header "models" must be {{"target": string, "draft": string}} (the '
                "checkpoint identities; draft \"none\" without a drafter), got "
                f"{_show(models)}")
    seeds = data["seeds"]
    if set(seeds) != {SEED_NAME} or type(seeds[SEED_NAME]) is not int \
            or not 0 <= seeds[SEED_NAME] < MAX_SEED:
        return (f'header "seeds" must be {{"{SEED_NAME}": integer in 0..{MAX_SEED - 1}}} (the '
                f"run seed), got {_show(seeds)}")
    limit = data["context_limit"]
    if type(limit) is not int or limit < 2:
        return (f'header "context_limit" must be an integer >= 2 (the target\'s context '
                f"limit), got {_show(limit)}")
    return _policies_problem(data["policies"])


def _policies_problem(policies: Mapping[str, Any]) -> str | None:
    if set(policies) != {"depth", "budget"}:  # a third entry would be kept and never read
        return (f'header "policies" must hold exactly "depth" and "budget", got '
                f"{_show(list(policies))}")
    for role in ("depth", "budget"):
        entry = policies[role]
        if not (isinstance(entry, dict) and set(entry) == {"name", "settings"}
                and isinstance(entry["name"], str) and isinstance(entry["settings"], dict)):
            return (f'header "policies.{role}" must be {{"name": string, "settings": '
                    f"object}}, got {_show(entry)}")
    return None


def _event(name: str, number: int, raw: bytes) -> Event:
    data = _json_line(name, number, raw)
    if not isinstance(data, dict):
        raise EventLogError(name, number, f"expected a JSON object (one event), got "
                            f"{_show(data)}")
    kind = data.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        what = "no event kind" if kind is None else f"unknown event kind {_show(kind)}"
        raise EventLogError(name, number, f"{what}; expected one of {', '.join(EVENT_TYPES)}")
    problem = _record_problem(data, cls, "", extra=("kind",))
    if problem:
        raise EventLogError(name, number, f"{cls.kind} event: {problem}")
    try:
        return event_from_record(data)
    except (KeyError, TypeError, ValueError) as error:  # the schema check should prevent it
        raise EventLogError(name, number, f"{cls.kind} event: cannot rebuild it "
                            f"({type(error).__name__}: {error})") from None


# --- field checks: names and cheap JSON types, from the dataclass annotations ---------------


def _record_problem(
    data: object, cls: type, prefix: str, extra: tuple[str, ...] = ()
) -> str | None:
    if not isinstance(data, dict):
        return f'field "{prefix[:-1]}" expected an object, got {_show(data)}'
    declared = _declared(cls)
    missing = [prefix + key for key in declared if key not in data]
    if missing:
        return f"missing field {_names(missing)}"
    unexpected = [prefix + key for key in data if key not in declared and key not in extra]
    if unexpected:
        return f"unexpected field {_names(unexpected)}"
    for key, annotation in declared.items():
        problem = key in data and _value_problem(data[key], annotation, prefix + key)
        if problem:
            return problem
    return None


@functools.cache
def _declared(cls: type) -> dict[str, object]:
    """Field name -> annotation (``types.py`` annotates with real types, not strings)."""
    return {item.name: item.type for item in dataclasses.fields(cls)}


_SCALARS: dict[object, tuple[str, Callable[[object], bool]]] = {
    int: ("an integer", lambda value: type(value) is int),
    float: ("a number", lambda value: type(value) in (int, float)),
    str: ("a string", lambda value: type(value) is str),
}


def _value_problem(value: object, annotation: object, where: str) -> str | None:
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _record_problem(value, annotation, where + ".")
    origin = get_origin(annotation)
    if origin is tuple:
        return _array_problem(value, get_args(annotation)[0], where)
    if origin is Mapping:
        return None if isinstance(value, dict) else (
            f'field "{where}" expected an object, got {_show(value)}')
    if annotation in _SCALARS:
        expected, conforms = _SCALARS[annotation]
        if not conforms(value):
            return f'field "{where}" expected {expected}, got {_show(value)}'
    return None  # an annotation this check does not model: event_from_record decides


def _array_problem(value: object, item: object, where: str) -> str | None:
    if not isinstance(value, list):
        return f'field "{where}" expected an array, got {_show(value)}'
    scalar = _SCALARS.get(item)
    if scalar is not None and all(map(scalar[1], value)):
        return None  # the common case (counts, confidences) without a call per element
    for index, element in enumerate(value):
        problem = _value_problem(element, item, f"{where}[{index}]")
        if problem:
            return problem
    return None


def _names(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _show(value: object, limit: int = 60) -> str:
    """A parsed JSON value as it appears in the file, cut short for a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the run: the order of its events and the ranges of their values -----------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunShape:
    """What a run's launch fixes about its events (``replay.check_recorded_run`` derives it
    from the header's config, so a config that disagrees with its events is found)."""

    width: int  # w: drafted tokens per request
    lag: int  # the decisions of round n follow the retirement of every round <= n - lag
    dp_size: int
    request_buckets: tuple[int, ...]  # prepared Bcap, ascending; () when shapes are unpadded
    target_rows: tuple[int, ...]  # prepared G, ascending; () when shapes are unpadded
    max_bucket: int  # most requests one shard's round holds
    context_limit: int  # the target's: every prompt leaves room for one generated token
    unified: bool  # a round runs as one unit (its failure names no stage)
    check_request: Callable[[SamplingParams], None]  # RequestError for what it cannot run
    shard: int = 0  # the DP shard whose rank wrote the log
    tiers_only: bool = False  # unified adaptive verification prepares only tiers

    def legal_rows(self, bucket: int) -> Sequence[int]:
        """The G a round of bucket Bcap may verify (``BucketGeometry.legal_rows``): every
        request keeps its anchor row, none verifies past the width."""
        if not self.request_buckets:
            # Unpadded: every G; a range, never a long list.
            return range(bucket, bucket * (self.width + 1) + 1)
        return prepared_rows(self.target_rows, self.request_buckets, bucket, self.width,
                             tiers_only=self.tiers_only)

    @property
    def min_depth(self) -> int:
        return 0 if self.width == 0 else 1  # without drafts every round has depth 0


def check_run(events: Sequence[Event], shape: RunShape, path: str) -> None:
    """Check the events as one run of the pipeline; the first problem is one
    ``EventLogError`` naming the line (event ``i`` is on line ``i + 2``).

    Each round is decided (depth, then budget) and submitted in three consecutive events,
    rounds numbered from 0, increasing; its stages then complete in order, and every submitted
    round retires (after its last stage) or fails exactly once, in submission order; rounds
    <= n - lag retire before round n is decided. Requests arrive once, in increasing id
    order, with sampling parameters the launch accepts; a round holds only requests that
    arrived and have not finished, and feeds back every one still running; each finishes
    once, with a reason its tokens bear out and no more tokens than its rounds fed back. The
    clock never goes back. A decision
    that saw more feedback than the lag allows is not refused here: that is a finding of the
    replay (its lag check), not damage to the log.
    """
    walk = _RunWalk(shape, path)
    for index, event in enumerate(events):
        walk.step(index + 2, event)
    walk.finish(len(events) + 1)  # the last event's line


@dataclasses.dataclass(slots=True)
class _Request:
    """A request that arrived, as the checks of its rounds and its end need it."""

    line: int  # of its request_arrived event
    prompt: int  # tokens
    params: SamplingParams
    finished: int | None = None  # line of its request_finished event
    event: RequestFinished | None = None
    retired_before: int = 0  # rounds retired before it finished
    most_tokens: int = 1  # the prefill's token, and accepted + 1 of each round it was fed back
    least_tokens: int = 0  # what the rounds fed back before it finished delivered in full


@dataclasses.dataclass(slots=True)
class _Round:
    """A submitted round, as the checks after its submission need it."""

    line: int  # of its round_submitted event
    slot: int
    num_reqs: int  # B
    bucket: int  # Bcap
    request_ids: tuple[int, ...]
    depth: int  # d its budget context says it runs
    num_rows: int  # G it was bound to (bound_rows)
    stages: int = 0  # how many of STAGES completed so far, in their order


class _RunWalk:
    """``check_run``'s state; one ``step`` per event."""

    def __init__(self, shape: RunShape, path: str) -> None:
        self.shape, self.path = shape, path
        self.in_flight: dict[int, _Round] = {}  # submitted, not ended; in submission order
        self.ended: dict[int, int] = {}  # round -> line of its round_retired or round_failed
        self.newest_ended = -1
        self.last_round = -1  # the newest round decided
        self.deciding: DepthDecided | BudgetDecided | None = None  # a round not yet submitted
        self.requests: dict[int, _Request] = {}  # by id, in arrival order
        # DP: every round decided here, as another shard's feedback of it must match, and
        # the (round, shard) pairs whose feedback arrived already.
        self.decided: dict[int, tuple[_Round, BudgetContext]] = {}
        self.shard_retired: set[tuple[int, int]] = set()
        self.retirements = 0  # round_retired events so far
        # Requests of a failed round: what it committed on the device is unknown.
        self.in_failed_rounds: set[int] = set()
        self.decided_at = 0  # line of the newest depth_decided event
        self.last_time = -math.inf
        self.handlers: dict[type[Event], Callable[[int, Any], None]] = {
            DepthDecided: self._depth, BudgetDecided: self._budget,
            RoundSubmitted: self._submitted, StageCompleted: self._stage,
            RoundRetired: self._retired, RoundFailed: self._failed,
            ShardRetired: self._shard_retired,
            RequestArrived: self._arrived, RequestFinished: self._finished}

    def fail(self, line: int, event: Event, reason: str) -> EventLogError:
        number = getattr(event, "round", None)
        subject = event.kind if number is None else \
            f"{event.kind} event of round {_show(number)}"
        if isinstance(event, RequestArrived | RequestFinished):
            subject = f"{event.kind} event of request {_show(event.request_id)}"
        return EventLogError(self.path, line, f"{subject}: {reason}")

    def step(self, line: int, event: Event) -> None:
        if not math.isfinite(event.time) or event.time < self.last_time:
            low = "a finite number" if self.last_time == -math.inf else \
                f"a number >= {self.last_time}"
            raise self.fail(line, event, _field("time", event.time, f"{low} (the runtime's "
                                                "clock, which never goes back)"))
        self.last_time = event.time
        self._check_sequence(line, event)
        self.handlers[type(event)](line, event)

    def finish(self, line: int) -> None:
        if self.deciding is not None:
            expected = _NEXT[type(self.deciding)]
            raise EventLogError(self.path, line, f"the log ends before the {expected} "
                                f"event of round {self.deciding.round}")
        if self.in_flight:
            round, entry = next(iter(self.in_flight.items()))
            raise EventLogError(self.path, entry.line, f"round {round} was submitted here but "
                                "never retired nor failed (expected a round_retired or "
                                "round_failed event for it; was the log cut short?)")
        for id, request in self.requests.items():
            if request.event is not None and request.event.num_tokens > request.most_tokens:
                raise EventLogError(self.path, request.finished, f"request_finished event of "
                                    f"request {id}: " + _field(
                                        "num_tokens", request.event.num_tokens,
                                        f"at most {request.most_tokens}: the prefill's token "
                                        "and accepted + 1 of each round that fed it back"))
        running = [(id, request) for id, request in self.requests.items()
                   if request.finished is None]
        if running:
            id, request = running[0]
            raise EventLogError(self.path, request.line, f"request {id} arrived here but never "
                                "finished (expected a request_finished event for it; every "
                                "request ends before the runtime stops; was the log cut "
                                "short?)")

    def _check_sequence(self, line: int, event: Event) -> None:
        """A round's two decisions and its submission are logged together."""
        together = ("(a round's depth_decided, budget_decided and round_submitted follow "
                    "each other)")
        if isinstance(event, RequestArrived | RequestFinished):
            return  # a handler may submit or cancel while a round is being decided
        if self.deciding is None:
            if type(event) in _PREVIOUS:
                raise self.fail(line, event, f"no {_PREVIOUS[type(event)]} event of its round "
                                f"just before it {together}")
            return
        expected, round = _NEXT[type(self.deciding)], self.deciding.round
        if event.kind != expected or getattr(event, "round", None) != round:
            got = event.kind + (f" of round {event.round}" if hasattr(event, "round") else "")
            raise EventLogError(self.path, line, f"expected the {expected} event of round "
                                f"{round} next {together}, got {got}")

    # --- decisions and submission -------------------------------------------------------

    def _depth(self, line: int, event: DepthDecided) -> None:
        if self.last_round < 0 and event.round != 0:
            raise self.fail(line, event, "the first round decided; expected round 0")
        if event.round <= self.last_round:
            # Numbers may skip: an idle loop retires rounds early and numbers the next past
            # them, so that no decision ever sees feedback newer than the lag allows.
            raise self.fail(line, event, f"decided after round {self.last_round}; expected "
                            "rounds numbered in increasing order")
        self._check_slot(line, event)
        self._check_context(line, event)
        self._check_value(line, event, "depth", event.depth, self.shape.min_depth,
                          self.shape.width)
        self._check_value(line, event, "context.max_kv_length", event.context.max_kv_length, 1,
                          self.shape.context_limit)
        self._check_retired(line, event)
        self.last_round, self.deciding, self.decided_at = event.round, event, line

    def _budget(self, line: int, event: BudgetDecided) -> None:
        context = event.context
        self._check_slot(line, event)
        self._check_context(line, event)
        assert isinstance(self.deciding, DepthDecided)  # _check_sequence saw to it
        for name in ("num_reqs", "num_reqs_bucket"):  # one batch, both decisions
            self._expect(line, event, f"context.{name}", getattr(context, name),
                         getattr(self.deciding.context, name), "as in its depth context")
        self._expect(line, event, "context.max_kv_length", context.max_kv_length,
                     self.deciding.context.max_kv_length, "as in its depth context")
        self._expect(line, event, "context.depth", context.depth, self.deciding.depth,
                     "the depth decided for the round")
        self._check_retired(line, event)
        self._check_value(line, event, "context.depth", context.depth, self.shape.min_depth,
                          self.shape.width)
        self._check_legal_rows(line, event)
        self._check_batch_ids(line, event, context)
        self.deciding = event

    def _submitted(self, line: int, event: RoundSubmitted) -> None:
        assert isinstance(self.deciding, BudgetDecided)  # _check_sequence saw to it
        context = self.deciding.context
        self._check_slot(line, event)
        self._expect(line, event, "num_reqs_bucket", event.num_reqs_bucket,
                     context.num_reqs_bucket, "the bucket of its decisions")
        batches = dict(context.batches())
        own = batches.get(self.shape.shard, ())
        self._expect(line, event, "request_ids", list(event.request_ids), list(own),
                     "the request ids of its budget context" + (
                         f" for shard {self.shape.shard}" if context.shard_sizes else ""))
        count = len(own) if context.shard_sizes else context.num_reqs
        if len(set(event.request_ids)) != len(event.request_ids) or \
                len(event.request_ids) != count:
            raise self.fail(line, event, _field("request_ids", list(event.request_ids),
                                                f"{count} distinct ids (B of its "
                                                "decisions)"))
        entry = _Round(line, event.slot, count, event.num_reqs_bucket, event.request_ids,
                       depth=context.depth, num_rows=self.deciding.bound_rows)
        self.decided[event.round] = (entry, context)
        self.deciding = None
        if not event.request_ids:  # an idle DP shard: the other shards run the round
            self.ended[event.round] = line
            self.newest_ended = max(self.newest_ended, event.round)
            return
        for id in event.request_ids:
            # A request cancelled (or failed) while its round was being decided is still
            # submitted with it; the round then drops its tokens.
            self._check_running(line, event, id, ended_after=self.decided_at)
        self._check_kv_bound(line, event, context)
        self.in_flight[event.round] = entry

    def _check_kv_bound(self, line: int, event: RoundSubmitted, context: BudgetContext
                        ) -> None:
        """The runtime prices with the longest context the host knows of, plus the prefill's
        token and what the rounds in flight and this one write, within the context limit.
        The host knows each prompt and at most the tokens fed back so far, so the bound lies
        between what the prompts alone give and what the delivered tokens can give."""
        ahead = 1 + self.shape.lag * (self.shape.width + 1)
        limit, bound = self.shape.context_limit, context.max_kv_length
        for id in event.request_ids:
            prompt = self.requests[id].prompt
            low = min(prompt + ahead, limit)
            if bound < low:
                raise self.fail(line, event, f"request {id} has a prompt of {prompt} tokens, "
                                f"so its decisions price a KV length of at least {low}, not "
                                f"{bound} (context.max_kv_length)")
        high = max(min(self.requests[id].prompt + self.requests[id].most_tokens + ahead, limit)
                   for id in event.request_ids)
        if bound > high and not context.shard_sizes:  # DP: another shard's may be longer
            raise self.fail(line, event, _field(
                "context.max_kv_length", bound, f"at most {high}: the longest prompt and the "
                "tokens fed back so far, plus the prefill's token and the positions the "
                f"rounds in flight and this one write (lag {self.shape.lag}, "
                f"w + 1 = {self.shape.width + 1} each)"))

    def _check_slot(self, line: int, event: DepthDecided | BudgetDecided | RoundSubmitted
                    ) -> None:
        expected = event.round % 2 if self.shape.lag == 2 else 0
        self._expect(line, event, "slot", event.slot, expected,
                     f"round % 2 with the lag of {self.shape.lag}" if self.shape.lag == 2
                     else "0 without schedule overlap (lag 1)")

    def _check_context(self, line: int, event: DepthDecided | BudgetDecided) -> None:
        context: DepthContext | BudgetContext = event.context
        self._expect(line, event, "context.round", context.round, event.round,
                     "the event's round")
        self._expect(line, event, "context.width", context.width, self.shape.width,
                     "the header's num_speculative_tokens")
        bucket, buckets = context.num_reqs_bucket, self.shape.request_buckets
        if buckets and bucket not in buckets:
            raise self.fail(line, event, _field("context.num_reqs_bucket", bucket, "one of the "
                            f"prepared request buckets {list(buckets)}"))
        self._check_value(line, event, "context.num_reqs_bucket", bucket, 1,
                          self.shape.max_bucket)
        self._check_value(line, event, "context.num_reqs", context.num_reqs, 1, bucket)
        self._check_value(line, event, "context.retired_through", context.retired_through,
                          -1)

    def _check_retired(self, line: int, event: DepthDecided | BudgetDecided) -> None:
        """Rounds <= n - lag retired before round n was decided, and the context says which
        round retired last (unless either is past the lag: the replay's lag finding)."""
        allowed = event.round - self.shape.lag
        if self.in_flight:
            oldest, entry = next(iter(self.in_flight.items()))
            if oldest <= allowed:
                raise self.fail(line, event, f"decided before round {oldest} (submitted at "
                                f"line {entry.line}) retired; rounds <= n-{self.shape.lag} "
                                "retire before round n is decided")
        told = event.context.retired_through
        if told <= allowed and self.newest_ended <= allowed and told != self.newest_ended:
            raise self.fail(line, event, _field(
                "context.retired_through", told, f"{self.newest_ended}, the newest round "
                "the log retired before this line"))

    def _check_legal_rows(self, line: int, event: BudgetDecided) -> None:
        context, legal = event.context, self.shape.legal_rows(event.context.num_reqs_bucket)
        legal_rows = list(context.legal_rows)
        if legal_rows != list(legal):  # the runtime offers the policy every legal G
            raise self.fail(line, event, _field("context.legal_rows", legal_rows, f"the legal rows "
                            f"{_rows(legal)} of bucket {context.num_reqs_bucket}"))
        if event.num_rows not in legal_rows:
            raise self.fail(line, event, _field("num_rows", event.num_rows,
                                                f"one of the legal rows {legal_rows}"))
        if event.bound_rows not in legal:
            raise self.fail(line, event, _field("bound_rows", event.bound_rows,
                                                f"one of the legal rows {_rows(legal)}"))

    def _check_batch_ids(self, line: int, event: BudgetDecided, context: BudgetContext
                         ) -> None:
        sizes, shards = context.shard_sizes, self.shape.dp_size
        if shards == 1 and sizes:  # one shard decides for its own batch: no sizes to give
            raise self.fail(line, event, _field("context.shard_sizes", list(sizes), "[] with "
                            "one DP shard (the header's dp_size=1)"))
        if shards > 1 and (len(sizes) != shards or max(sizes) != context.num_reqs):
            raise self.fail(line, event, _field("context.shard_sizes", list(sizes), f"one B "
                            f"per DP shard ({shards}), the largest B={context.num_reqs}"))
        # The runtime gives every decision its batch's ids; without them a policy that pools
        # per-request history would be replayed from other inputs than the run's.
        count = sum(sizes) if sizes else context.num_reqs
        if len(context.request_ids) != count:
            raise self.fail(line, event, _field("context.request_ids",
                                                list(context.request_ids), f"{count} ids"))

    # --- stages and retirement ----------------------------------------------------------

    def _stage(self, line: int, event: StageCompleted) -> None:
        entry = self._submission(line, event)
        self._expect(line, event, "slot", event.slot, entry.slot, "the slot it was submitted on")
        following = STAGES[entry.stages] if entry.stages < len(STAGES) else "none"
        if event.stage != following:
            raise self.fail(line, event, _field("stage", event.stage, f"{following} (a round's "
                                                f"stages complete once each, in the order "
                                                f"{', '.join(STAGES)})"))
        entry.stages += 1

    def _submission(self, line: int, event: StageCompleted | RoundRetired | RoundFailed
                    ) -> _Round:
        entry = self.in_flight.get(event.round)
        if entry is not None:
            return entry
        if event.round in self.ended:
            raise self.fail(line, event, f"round {event.round} already retired or failed at "
                            f"line {self.ended[event.round]}; a round ends once")
        raise self.fail(line, event, f"round {event.round} was never submitted")

    def _end(self, line: int, event: RoundRetired | RoundFailed) -> _Round:
        entry = self._submission(line, event)
        oldest = next(iter(self.in_flight))
        if oldest != event.round:
            raise self.fail(line, event, f"ends before round {oldest} (submitted at line "
                            f"{self.in_flight[oldest].line}); rounds retire in the order "
                            "they were submitted")
        self._expect(line, event, "slot", event.slot, entry.slot, "the slot it was submitted on")
        del self.in_flight[event.round]
        self.ended[event.round] = line
        # An idle DP shard's round ended at its submission, maybe after this one.
        self.newest_ended = max(self.newest_ended, event.round)
        return entry

    def _failed(self, line: int, event: RoundFailed) -> None:
        entry = self._end(line, event)
        self.in_failed_rounds.update(entry.request_ids)
        # A unified round is one unit: its failure names the round. A split round's stages
        # complete in order up to the one that failed, which the failure names.
        if entry.stages == len(STAGES) and not self.shape.unified:
            raise self.fail(line, event, f"every stage of round {event.round} completed; such "
                            "a round retires, it cannot fail")
        failing = "round" if self.shape.unified else STAGES[entry.stages]
        why = ("a unified round fails as one unit" if self.shape.unified else
               f"the stage after the {entry.stages} that completed" if entry.stages else
               "the first stage: none completed")
        self._expect(line, event, "stage", event.stage, failing, why)
        self._expect(line, event, "request_ids", list(event.request_ids),
                     list(entry.request_ids), "the request ids it was submitted with")
        if not event.error.isidentifier():
            raise self.fail(line, event, _field("error", event.error, "an exception's type "
                                                "name"))
        if len(event.message.splitlines()) > 1:
            raise self.fail(line, event, _field("message", event.message, "one line: the "
                                                "first of the exception's message"))

    def _retired(self, line: int, event: RoundRetired) -> None:
        entry = self._end(line, event)
        if entry.stages != len(STAGES):
            raise self.fail(line, event, f"retired before its {STAGES[entry.stages]} stage "
                            "completed (a round retires after its last stage, "
                            f"{STAGES[-1]})")
        problem = _feedback_problem(event.feedback, self.shape, entry)
        if problem is not None:
            raise self.fail(line, event, problem)
        self._expect(line, event, "feedback.round", event.feedback.round, event.round,
                     "the event's round")
        self._expect(line, event, "feedback.shard", event.feedback.shard, self.shape.shard,
                     "the shard of the rank that wrote the log")
        self._check_fed_back(line, event, entry)
        allocated = self._allocation(event)  # from the tokens of the rounds before this one
        self._count_tokens(line, event)
        if allocated is not None and list(event.feedback.verify_lengths) != allocated[0]:
            raise self.fail(line, event, _field(
                "feedback.verify_lengths", list(event.feedback.verify_lengths),
                f"{allocated[0]}, what prefix allocation of G={event.feedback.num_rows} gives "
                f"the recorded confidences within each request's room {allocated[1]}"))
        self.retirements += 1

    def _shard_retired(self, line: int, event: ShardRetired) -> None:
        """Another DP shard's feedback of a round decided here: its shard's part of the
        round's budget context, once per round and shard."""
        feedback, shape = event.feedback, self.shape
        if shape.dp_size == 1:
            raise self.fail(line, event, "a run with one DP shard (dp_size 1) has no other "
                            "shard to retire rounds")
        if event.round not in self.decided:
            raise self.fail(line, event, f"round {event.round} was never decided here (every "
                            "shard decides every round)")
        if not 0 <= feedback.shard < shape.dp_size or feedback.shard == shape.shard:
            raise self.fail(line, event, _field("feedback.shard", feedback.shard, "another "
                                                f"shard than {shape.shard} in "
                                                f"{_range(0, shape.dp_size - 1)}"))
        if (event.round, feedback.shard) in self.shard_retired:
            raise self.fail(line, event, f"shard {feedback.shard} retired round {event.round} "
                            "already; a round ends once on each shard")
        decided, context = self.decided[event.round]
        self._expect(line, event, "slot", event.slot, decided.slot, "the round's slot")
        self._expect(line, event, "feedback.round", feedback.round, event.round,
                     "the event's round")
        ids = dict(context.batches()).get(feedback.shard, ())
        entry = dataclasses.replace(decided, num_reqs=len(ids), request_ids=ids)
        problem = _feedback_problem(feedback, shape, entry)
        if problem is not None:
            raise self.fail(line, event, problem)
        self.shard_retired.add((event.round, feedback.shard))

    def _check_fed_back(self, line: int, event: RoundRetired, entry: _Round) -> None:
        """The feedback holds every request of the round still running, and none that
        stopped decoding (by length or a stop token) before an earlier retirement: the
        device no longer decodes those. A cancelled or failed request may still be in it."""
        ids = event.feedback.request_ids
        for id in ids:
            request = self.requests[id]
            if request.event is not None and request.event.reason in ("length", "stop") \
                    and request.retired_before < self.retirements:
                raise self.fail(line, event, f"feedback.request_ids holds request {id}, which "
                                f"stopped decoding at line {request.finished}, before the "
                                "retirement of an earlier round")
        running = [id for id in entry.request_ids
                   if self.requests[id].finished is None and id not in ids]
        if running:
            raise self.fail(line, event, _field("feedback.request_ids", list(ids),
                                                f"every request of the round still running "
                                                f"(request {running[0]} is)"))

    def _allocation(self, event: RoundRetired) -> tuple[list[int], list[int]] | None:
        """The verify lengths prefix allocation gives (the top G - B survivals of the
        recorded confidences, each request within the room it had: what it may still emit
        and its context, which the tokens fed back before tell exactly), with the rooms.
        None where that is not known: no drafts, or a request that was in a failed round
        (what that round committed on the device is unknown)."""
        feedback = event.feedback
        if not feedback.confidences or not feedback.num_reqs:
            return None
        if not self.in_failed_rounds.isdisjoint(feedback.request_ids):
            return None
        requests = [self.requests[id] for id in feedback.request_ids]
        if any(r.event is not None and r.event.reason == "failed" for r in requests):
            return None
        caps = [room_cap(r.prompt, r.most_tokens, r.params.max_tokens,
                         self.shape.context_limit, feedback.depth) for r in requests]
        return prefix_lengths(feedback.confidences, caps, feedback.num_rows), caps

    def _count_tokens(self, line: int, event: RoundRetired) -> None:
        """Bound each fed-back request's tokens: a round emits at most accepted + 1, and
        exactly that when it did not end the request (it finished after this retirement);
        being fed back at all means its prefill's token was delivered. The device caps every
        round's verification by what the request may still emit, so the prefill's token and
        accepted + 1 of each round never pass its ``max_tokens``."""
        feedback = event.feedback
        for id, accepted in zip(feedback.request_ids, feedback.num_accepted, strict=True):
            request = self.requests[id]
            request.most_tokens += accepted + 1
            if request.finished is None:
                request.least_tokens = max(request.least_tokens, 1) + accepted + 1
            if request.most_tokens > request.params.max_tokens:
                raise self.fail(line, event, f"feedback.num_accepted gives request {id} "
                                f"{request.most_tokens} tokens (the prefill's and accepted + 1 "
                                "of each round fed back), past its max_tokens="
                                f"{request.params.max_tokens}: a round never verifies more "
                                "than a request may still emit")

    # --- requests -----------------------------------------------------------------------

    def _arrived(self, line: int, event: RequestArrived) -> None:
        id = event.request_id
        if id in self.requests:
            raise self.fail(line, event, "already arrived at line "
                            f"{self.requests[id].line}; a request arrives once")
        newest = next(reversed(self.requests), -1)
        if not newest < id <= MAX_REQUEST_ID:
            raise self.fail(line, event, _field("request_id", id, f"an integer in {newest + 1}"
                                                f"..{MAX_REQUEST_ID} (requests arrive in "
                                                "increasing id order)"))
        self._check_value(line, event, "num_prompt_tokens", event.num_prompt_tokens, 1,
                          self.shape.context_limit - 1)
        params = _sampling(event.sampling)
        if isinstance(params, str):
            raise self.fail(line, event, params)
        try:
            self.shape.check_request(params)  # what this launch refuses to decode
            check_room(self.shape.context_limit, event.num_prompt_tokens, params.max_tokens)
        except RequestError as error:
            raise self.fail(line, event, f"sampling: {error}") from None
        self.requests[id] = _Request(line, event.num_prompt_tokens, params)

    def _finished(self, line: int, event: RequestFinished) -> None:
        entry = self._check_running(line, event, event.request_id)
        self._check_value(line, event, "num_tokens", event.num_tokens, 0,
                          entry.params.max_tokens)
        if event.reason not in _REASONS:
            raise self.fail(line, event, _field("reason", event.reason, ", ".join(_REASONS)))
        problem = _reason_problem(event, entry, self.shape.context_limit)
        if problem is not None:
            raise self.fail(line, event, problem)
        if event.num_tokens < entry.least_tokens:
            raise self.fail(line, event, _field(
                "num_tokens", event.num_tokens, f"at least {entry.least_tokens}: the prefill's "
                "token and accepted + 1 of each round fed back before it finished"))
        if event.reason in ("cancelled", "failed") and event.num_tokens > entry.most_tokens:
            # A cancelled or failed request keeps what was delivered before its end; the
            # rounds in flight that retire after drop its tokens.
            raise self.fail(line, event, _field(
                "num_tokens", event.num_tokens, f"at most {entry.most_tokens}: the prefill's "
                "token and accepted + 1 of each round fed back before it ended "
                f"({event.reason})"))
        entry.finished, entry.event, entry.retired_before = line, event, self.retirements

    def _check_running(self, line: int, event: Event, id: int, *,
                       ended_after: int | None = None) -> _Request:
        """The request ``id`` arrived and has not finished before this line (or, given
        ``ended_after``, was cancelled or failed after that line)."""
        who = "" if isinstance(event, RequestFinished) else f"request {id} "  # else the subject
        entry = self.requests.get(id)
        if entry is None:
            raise self.fail(line, event, f"{who}never arrived (no request_arrived event for "
                            "it before this line)")
        ended_since = ended_after is not None and entry.finished is not None and \
            entry.finished > ended_after and entry.event is not None and \
            entry.event.reason in ("cancelled", "failed")
        if entry.finished is not None and not ended_since:
            raise self.fail(line, event, f"{who}already finished at line {entry.finished}")
        return entry

    # --- helpers ------------------------------------------------------------------------

    def _check_value(self, line: int, event: Event, where: str, value: int, low: int,
                     high: int | None = None) -> None:
        if value < low or (high is not None and value > high):
            raise self.fail(line, event, _field(where, value, _range(low, high)))

    def _expect(self, line: int, event: Event, where: str, value: object, expected: object,
                why: str) -> None:
        if value != expected:
            raise self.fail(line, event, _field(where, value, f"{_show(expected)} ({why})"))


_NEXT: dict[type[Event], str] = {DepthDecided: BudgetDecided.kind,
                                 BudgetDecided: RoundSubmitted.kind}
"""The event that must follow each decision of a round."""
_PREVIOUS: dict[type[Event], str] = {BudgetDecided: DepthDecided.kind,
                                     RoundSubmitted: BudgetDecided.kind}

_REASONS = ("stop", "length", "cancelled", "failed")


def _reason_problem(event: RequestFinished, request: _Request, context_limit: int
                    ) -> str | None:
    """What is wrong with a finish reason given the request's tokens: "length" ends at
    max_tokens or at the context's end, "stop" needs a stop token to have been emitted."""
    tokens, params = event.num_tokens, request.params
    if event.reason == "length" and tokens != params.max_tokens \
            and request.prompt + tokens != context_limit:
        return _field("num_tokens", tokens, f"{params.max_tokens} (max_tokens) or "
                      f"{context_limit - request.prompt} (the context's end) for reason length")
    if event.reason == "stop" and (not params.stop or tokens < 1):
        return _field("reason", "stop", "a reason other than stop: the request "
                      + ("has no stop tokens" if not params.stop else "emitted no token"))
    return None


def _sampling(fields: Mapping[str, Any]) -> SamplingParams | str:
    """A request's recorded sampling parameters, or what is wrong with them: every field of
    ``SamplingParams``, each within the range a request may have."""
    names = [item.name for item in dataclasses.fields(SamplingParams)]
    if sorted(fields) != sorted(names):
        return _field("sampling", dict(fields), f"an object with exactly {_names(names)}")
    try:
        return SamplingParams.from_request(fields)
    except RequestError as error:
        return f"sampling: {error}"


def room_cap(prompt: int, generated: int, max_tokens: int, context_limit: int,
             depth: int) -> int:
    """The most drafts a request verifies in a round (the device's ``verify_caps``): one less
    than it may still emit (max_tokens, and the context after its newest token), at most
    the depth."""
    anchor = prompt + generated - 1
    budget = min(max_tokens - generated, context_limit - 1 - anchor)
    return max(0, min(budget - 1, depth))


def prefix_lengths(confidences: Sequence[Sequence[float]], caps: Sequence[int],
                   num_rows: int) -> list[int]:
    """Verify lengths by the device's prefix allocation (``runtime.devices.allocation``):
    survivals as running float64 products, positions within each cap eligible, the top
    G - B admitted with ties to the lower request, then position."""
    candidates = []
    for request, (row, cap) in enumerate(zip(confidences, caps, strict=True)):
        survival = 1.0
        for position in range(cap):
            survival *= min(max(row[position], 0.0), 1.0)
            candidates.append((-survival, request, position))
    candidates.sort()
    admitted = {(request, position)
                for _, request, position in candidates[:max(0, num_rows - len(caps))]}
    lengths = []
    for request, cap in enumerate(caps):
        length = 0
        while length < cap and (request, length) in admitted:
            length += 1
        lengths.append(length)
    return lengths


def _feedback_problem(feedback: RoundFeedback, shape: RunShape, entry: _Round) -> str | None:
    """What is wrong with a retired round's feedback, given the round it retires, or None."""
    for where, value, expected, why in (
            ("width", feedback.width, shape.width, "the header's num_speculative_tokens"),
            ("num_reqs_bucket", feedback.num_reqs_bucket, entry.bucket, "its submission's"),
            ("depth", feedback.depth, entry.depth, "its budget context's"),
            ("num_rows", feedback.num_rows, entry.num_rows, "its budget decision's bound_rows")):
        if value != expected:
            return _field(f"feedback.{where}", value, f"{expected} ({why})")
    for where, value, low, high in (("num_reqs", feedback.num_reqs, 0, entry.num_reqs),
                                    ("shard", feedback.shard, 0, shape.dp_size - 1)):
        if not low <= value <= high:
            return _field(f"feedback.{where}", value, _range(low, high))
    return _entries_problem(feedback, entry.request_ids)


def _entries_problem(feedback: RoundFeedback, request_ids: tuple[int, ...]) -> str | None:
    """The per-request columns: one entry per live request, each within its bounds."""
    count = feedback.num_reqs
    for where, column, optional in (("verify_lengths", feedback.verify_lengths, False),
                                    ("num_accepted", feedback.num_accepted, False),
                                    # a round that drafts reports each draft's confidence
                                    ("confidences", feedback.confidences,
                                     feedback.width == 0),
                                    ("request_ids", feedback.request_ids, False)):
        if len(column) != count and not (optional and not column):
            return _field(f"feedback.{where}", list(column), f"{count} entries (num_reqs)"
                          + (" or none" if optional else ""))
    for index, (length, accepted) in enumerate(zip(feedback.verify_lengths,
                                                   feedback.num_accepted, strict=True)):
        if not 0 <= length <= feedback.depth:
            return _field(f"feedback.verify_lengths[{index}]", length,
                          f"{_range(0, feedback.depth)} (at most the depth)")
        if not 0 <= accepted <= length:
            return _field(f"feedback.num_accepted[{index}]", accepted,
                          f"{_range(0, length)} (at most its verify length)")
    if sum(feedback.verify_lengths) + count > feedback.num_rows:  # each also has its anchor
        return _field("feedback.verify_lengths", list(feedback.verify_lengths), "at most "
                      f"G - B = {feedback.num_rows - count} verified drafts in all")
    submitted = iter(request_ids)
    if not all(id in submitted for id in feedback.request_ids):  # consumes: in order, once
        return _field("feedback.request_ids", list(feedback.request_ids),
                      f"ids of the round's live requests, in the order submitted "
                      f"{list(request_ids)}")
    return _confidences_problem(feedback.confidences, feedback.width)


def _confidences_problem(rows: tuple[tuple[float, ...], ...], width: int) -> str | None:
    for index, row in enumerate(rows):
        if len(row) != width:
            return _field(f"feedback.confidences[{index}]", list(row),
                          f"{width} confidences (one per drafted position)")
        if all(0.0 <= value <= 1.0 for value in row):  # False for NaN as well
            continue
        position = next(p for p, value in enumerate(row) if not 0.0 <= value <= 1.0)
        return _field(f"feedback.confidences[{index}][{position}]", row[position],
                      "a number in 0..1")
    return None


def _field(where: str, value: object, expected: str) -> str:
    return f'field "{where}" expected {expected}, got {_show(value)}'


def _rows(legal: Sequence[int]) -> str:
    if isinstance(legal, range):
        return f"{legal.start}..{legal.stop - 1}"
    return str(list(legal))


def _range(low: int, high: int | None) -> str:
    return f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
