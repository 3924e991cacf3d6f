"""The state trace: one structlog JSON line per round transition, for debugging a run.

Each line names the round, its pipeline slot, the state it left and entered, the cause (the
trigger), the decision taken at that point (depth when leaving draft, G when leaving pack)
and the milliseconds since the round was submitted. It is off by default; when off, no hook
is registered and a transition costs nothing extra.
"""

import json
import sys
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO, cast

import structlog

from adaspec.config.environment import STDERR, trace_destination  # noqa: F401  # re-exported
from adaspec.errors import ConfigError, OutputWriteError
from adaspec.runtime.events.clock import Clock
from adaspec.runtime.events.outputs import ObserverFile, reason
from adaspec.runtime.events.types import (
    BudgetDecided,
    DepthDecided,
    Event,
    RoundSubmitted,
)
from adaspec.runtime.states import RoundMachine, RoundState

EventDict = MutableMapping[str, Any]

class StateTrace:
    """Receives round transitions (a ``RoundHooks`` hook) and the decision events (a bus
    subscriber), and renders them through structlog processors.

    The trace only watches: a write the system refuses (a full disk, a closed standard error)
    ends the trace, never the round, and ``close`` then raises ``OutputWriteError``."""

    def __init__(self, processors: list[Callable[[Any, str, EventDict], Any]],
                 file: ObserverFile | None, clock: Clock, *, setting: str = "trace",
                 path: str = STDERR) -> None:
        # structlog's PrintLogger writes each line and flushes it; the ObserverFile keeps a
        # failure of either for close.
        self._log = structlog.wrap_logger(structlog.PrintLogger(cast(TextIO, file)),
                                          processors=processors)
        self._clock = clock
        self._file = file
        self._rounds: dict[int, dict[str, Any]] = {}
        self._setting, self._path = setting, path

    @classmethod
    def to_file(cls, path: str, clock: Clock, setting: str = "trace") -> "StateTrace":
        """JSON lines into a new file (an existing one is never overwritten), or onto
        standard error for the path ``-``; ``setting`` is where the path was given, for
        errors."""
        render: list[Callable[[Any, str, EventDict], Any]] = [
            structlog.processors.JSONRenderer()]
        if path == STDERR:
            return cls(render, ObserverFile(sys.stderr, owned=False), clock, setting=setting)
        try:
            file = open(path, "x", encoding="utf-8")  # noqa: SIM115 - closed by close()
        except OSError as error:
            raise ConfigError(setting, path, f"cannot create the state trace file "
                              f"({error.strerror}); give a new path") from None
        return cls(render, ObserverFile(file), clock, setting=setting, path=path)

    @classmethod
    def to_list(cls, lines: list[dict[str, Any]], clock: Clock) -> "StateTrace":
        """Lines as dicts appended to ``lines`` (what ``capture_trace`` gives tests)."""
        def keep(logger: Any, name: str, event: EventDict) -> Any:
            lines.append(dict(event))
            raise structlog.DropEvent
        return cls([keep], None, clock)

    def observe(self, event: Event) -> None:
        """Remember each round's start and decisions until its transitions are traced."""
        if isinstance(event, RoundSubmitted):
            self._info(event.round)["start"] = event.time
        elif isinstance(event, DepthDecided):
            self._info(event.round)["depth"] = event.depth
        elif isinstance(event, BudgetDecided):
            self._info(event.round).update(rows=event.num_rows, bound_rows=event.bound_rows)

    def _info(self, round_index: int) -> dict[str, Any]:
        return self._rounds.setdefault(round_index, {})

    def hook(self, machine: RoundMachine, source: RoundState, target: RoundState,
             trigger: str) -> None:
        info = self._rounds.get(machine.round_index, {})
        decision: dict[str, Any] | None = None
        if source is RoundState.DRAFT and "depth" in info:
            decision = {"depth": info["depth"]}
        elif source is RoundState.PACK and "rows" in info:
            decision = {"G": info["rows"], "bound_G": info["bound_rows"]}
        start = info.get("start")
        elapsed = None if start is None else round((self._clock.now() - start) * 1e3, 3)
        self._log.info("transition", round=machine.round_index, slot=machine.slot,
                       **{"from": source.label, "to": target.label}, cause=trigger,
                       decision=decision, elapsed_ms=elapsed)
        if target in (RoundState.RETIRED, RoundState.FAILED):
            self._rounds.pop(machine.round_index, None)

    def close(self) -> None:
        """Close the file; raises ``OutputWriteError`` when a write or the close failed."""
        failure = None if self._file is None else self._file.close()
        if failure is not None:
            raise OutputWriteError(self._setting, self._path, "state trace", reason(failure))


@contextmanager
def capture_trace(runtime: Any) -> Iterator[list[dict[str, Any]]]:
    """Collect a runtime's trace lines as dicts while the block runs (for tests)."""
    lines: list[dict[str, Any]] = []
    trace = StateTrace.to_list(lines, runtime.clock)
    runtime.hooks.on_transition(trace.hook)
    runtime.bus.subscribe(trace.observe)
    try:
        yield lines
    finally:
        runtime.hooks.remove(trace.hook)
        runtime.bus.unsubscribe(trace.observe)


def read_trace(path: str) -> list[dict[str, Any]]:
    """The lines of a trace file, parsed."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
