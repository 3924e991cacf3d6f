"""Time is injected: the runtime reads a ``Clock`` to stamp events and never calls ``time``
itself, so tests drive time by hand and never wait for real.

Policies never read a clock (replay ignores event times); only timing and traces do.
"""

import math
import numbers
import time
from typing import Protocol

from adaspec.errors import ConfigError


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


class CheckedClock:
    """An embedder's clock whose readings are checked: seconds as a finite number that never
    goes back. The first reading that is none fails what read it (the start, a round, a
    request's arrival) naming ``setting``, instead of stamping events replay refuses or the
    event log cannot hold; from then on the last good reading stands, so the failure itself
    is stamped and every request still ends."""

    def __init__(self, clock: Clock, setting: str = "RuntimeOptions.clock") -> None:
        self._clock = clock
        self._setting = setting
        self._last = -math.inf
        self._failed = False

    def now(self) -> float:
        if self._failed and math.isfinite(self._last):
            return self._last
        value: object = self._clock.now()
        if type(value) is float and math.isfinite(value) and value >= self._last:  # usual
            self._last = value
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            self._failed = True
            raise ConfigError(self._setting, value, f"expected now() to return seconds as a "
                              f"real number; it returned a {type(value).__name__}")
        if not math.isfinite(value):
            self._failed = True
            raise ConfigError(self._setting, value, "expected now() to return seconds as a "
                              "finite number")
        if float(value) < self._last:
            self._failed = True
            raise ConfigError(self._setting, value, f"expected now() never to go back; it "
                              f"read {self._last} before")
        self._last = float(value)
        return self._last
