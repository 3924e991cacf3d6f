"""Time is injected: the runtime reads a ``Clock`` to stamp events and never calls ``time``
itself, so tests drive time by hand and never wait for real.

Policies never read a clock (replay ignores event times); only timing and traces do.
"""

import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic source of seconds. Only differences between readings mean anything."""

    def now(self) -> float: ...


class MonotonicClock:
    """The real clock: ``time.perf_counter``, monotonic and high resolution."""

    def now(self) -> float:
        return time.perf_counter()


class VirtualClock:
    """A clock that moves only when told to: tests advance it explicitly, nothing sleeps."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; going backwards would break the monotonic promise."""
        if seconds < 0:
            raise ValueError(f"a virtual clock only moves forward; got advance({seconds})")
        self._now += seconds
