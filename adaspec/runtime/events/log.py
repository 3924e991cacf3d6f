"""The event log: a self-describing JSON-lines file, written while the runtime serves and read
back by ``adaspec replay``.

Line 1 is the header: ``format`` and ``version`` first, then what a replay needs to rebuild
the run's decisions (the effective configuration, the cost table's identity, the seeds and the
policies by name and settings). Every later line is one event's ``record()``, in publish order.

The reader trusts nothing: a log may be truncated by a crash, edited by hand or come from
another version, and each such problem is one ``EventLogError`` line naming the file, the line
number and what is wrong there.
"""

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple, get_args, get_origin

from adaspec.errors import EventLogError
from adaspec.policies.base import BudgetPolicy, DepthPolicy
from adaspec.runtime.events.types import EVENT_TYPES, Event, event_from_record

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT = "adaspec-event-log"
VERSION = 1
"""Bumped whenever a line's meaning changes; a reader accepts exactly its own version."""

HEADER_KEYS = ("config", "cost_table", "seeds", "policies")
"""What every header holds besides ``format`` and ``version`` (``cost_table`` may be null)."""

_BUFFER_BYTES = 1 << 16  # a few hundred events per write(2); close() flushes the rest


def log_header(
    *,
    config: Mapping[str, Any],
    cost_table: Mapping[str, Any] | None,
    seeds: Mapping[str, int],
    depth_policy: DepthPolicy,
    budget_policy: BudgetPolicy,
    **extra: Any,
) -> dict[str, Any]:
    """The header fields of a run, with the policies as replay rebuilds them (name and
    ``settings()``). ``extra`` adds fields such as the adaspec version or the geometry."""
    return {"config": dict(config), "cost_table": cost_table, "seeds": dict(seeds),
            "policies": {"depth": _policy_entry(depth_policy),
                         "budget": _policy_entry(budget_policy)},
            **extra}


def _policy_entry(policy: DepthPolicy | BudgetPolicy) -> dict[str, Any]:
    return {"name": policy.name, "settings": policy.settings()}


class EventLogWriter:
    """Writes one run's event log; ``write`` is the bus subscriber (``bus.subscribe(w.write)``).

    The file must not exist: a log is evidence of one run and is never overwritten. Writes are
    buffered and reach the disk at ``close()`` (idempotent; also on leaving a ``with`` block).
    """

    def __init__(self, path: str | os.PathLike[str], header: Mapping[str, Any]) -> None:
        self.path = os.fspath(path)
        # Encode before creating the file, so a bad header leaves no empty log behind.
        first = _dumps({"format": FORMAT, "version": VERSION, **self._checked(header)})
        try:
            # Mode "x": creating fails when the file exists, with no window for a race.
            self._file: IO[str] | None = open(
                self.path, "x", encoding="utf-8", buffering=_BUFFER_BYTES)
        except FileExistsError:
            raise EventLogError(self.path, None, "already exists; an event log is never "
                                "overwritten, choose a new path") from None
        except OSError as error:
            reason = f"cannot create it: {_os_reason(error)}"
            raise EventLogError(self.path, None, reason) from None
        self._file.write(first)

    def _checked(self, header: Mapping[str, Any]) -> Mapping[str, Any]:
        missing = [key for key in HEADER_KEYS if key not in header]
        if missing:
            raise EventLogError(self.path, 1, f"header lacks {_names(missing)}")
        clashing = [key for key in ("format", "version") if key in header]
        if clashing:
            raise EventLogError(self.path, 1, f"header must not set {_names(clashing)}; "
                                "the writer sets them")
        return header

    def write(self, event: Event) -> None:
        """Append one event (a bus subscriber: runs synchronously inside ``publish``)."""
        if self._file is None:
            raise EventLogError(self.path, None, f"{event.kind} event written after close()")
        self._file.write(_dumps(event))

    def flush(self) -> None:
        """Push buffered events to the operating system (say, before a risky operation)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

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
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_plain)  # one, not one per line


class EventLog(NamedTuple):
    """A log as read back: its header (``format`` and ``version`` included) and its events
    in file order (event ``i`` is on line ``i + 2``)."""

    header: dict[str, Any]
    events: list[Event]


def read_event_log(path: str | os.PathLike[str]) -> EventLog:
    """Read and check a whole event log; any problem is one ``EventLogError`` line."""
    name = os.fspath(path)
    try:
        file = open(name, "rb")  # bytes: a bad UTF-8 sequence is reported with its line
    except FileNotFoundError:
        raise EventLogError(name, None, "no such file") from None
    except OSError as error:
        raise EventLogError(name, None, f"cannot open it: {_os_reason(error)}") from None
    with file:
        lines: Iterator[bytes] = iter(file)
        first = next(lines, None)
        if first is None:
            raise EventLogError(name, None, "empty file; expected a header line first")
        header = _header(name, first)
        events = [_event(name, number, raw) for number, raw in enumerate(lines, start=2)]
    return EventLog(header, events)


def _os_reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


# --- lines -------------------------------------------------------------------------------


def _json_line(name: str, number: int, raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise EventLogError(name, number, f"not UTF-8 text (byte {error.start + 1})") from None
    if not text.strip():
        raise EventLogError(name, number, "blank line; expected one JSON object per line")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        hint = "" if raw.endswith(b"\n") else (
            "; the last line is cut short (did the run stop before closing the log?)")
        # json's own wording ("Expecting value: line 1 column 5"), the line being ours
        raise EventLogError(name, number, f"invalid JSON: {error.msg}: column "
                            f"{error.colno}{hint}") from None


def _header(name: str, raw: bytes) -> dict[str, Any]:
    data = _json_line(name, 1, raw)
    if not isinstance(data, dict) or "format" not in data:
        raise EventLogError(name, 1, f"not an event log header; expected a JSON object with "
                            f'"format": "{FORMAT}"')
    if data["format"] != FORMAT:
        raise EventLogError(name, 1, f'unknown format {_show(data["format"])}; expected '
                            f'"{FORMAT}"')
    if "version" not in data:
        raise EventLogError(name, 1, f'header lacks "version"; this adaspec reads version '
                            f"{VERSION}")
    version = data["version"]
    if type(version) is not int or version != VERSION:
        raise EventLogError(name, 1, f"log version {_show(version)}, but this adaspec reads "
                            f"version {VERSION} only")
    problem = _header_problem(data)
    if problem:
        raise EventLogError(name, 1, problem)
    return data


def _header_problem(data: Mapping[str, Any]) -> str | None:
    missing = [key for key in HEADER_KEYS if key not in data]
    if missing:
        return f"header lacks {_names(missing)}"
    for key, allowed in (("config", (dict,)), ("cost_table", (dict, type(None))),
                         ("seeds", (dict,)), ("policies", (dict,))):
        if not isinstance(data[key], allowed):
            return f'header "{key}" must be an object, got {_show(data[key])}'
    for role in ("depth", "budget"):
        entry = data["policies"].get(role)
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("settings"), dict)):
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
        problem = _value_problem(data[key], annotation, prefix + key)
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
