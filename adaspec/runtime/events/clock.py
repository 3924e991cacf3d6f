"""Time is injected: the runtime reads a ``Clock`` to stamp events and never calls ``time``
itself, so tests drive time by hand and never wait for real.

Policies never read a clock (replay ignores event times); only timing and traces do.
"""

import math
import numbers
import time
from typing import Protocol

from adaspec.errors import MISSING, ConfigError


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
    """An embedder's clock whose readings are checked: seconds as a finite real number that
    never goes back. A reading that is none (or a ``now()`` that raises) is never handed on:
    the last good reading stands in for it and for every reading after it, so whatever was
    being stamped completes, and ``fault`` holds the one-line error naming ``setting``. The
    runtime raises it where failing is safe: at the start, and at the top of its round loop,
    which then fails every request with it."""

    def __init__(self, clock: Clock, setting: str = "RuntimeOptions.clock") -> None:
        self._clock = clock
        self._setting = setting
        self._last = -math.inf
        self.fault: ConfigError | None = None

    def now(self) -> float:
        if self.fault is None:
            self._read()
        return self._last if math.isfinite(self._last) else 0.0

    def _read(self) -> None:
        try:
            value: object = self._clock.now()
        except Exception as error:  # the embedder's clock failed: named, never propagated
            self.fault = ConfigError(self._setting, MISSING, f"now() raised "
                                     f"{type(error).__name__}: {error}")
            return
        if type(value) is float and math.isfinite(value) and value >= self._last:  # usual
            self._last = value
            return
        self.fault = self._refusal(value)
        if self.fault is None:
            self._last = float(value)  # type: ignore[arg-type]

    def _refusal(self, value: object) -> ConfigError | None:
        """Why ``value`` is no reading after ``self._last``; None when it is one."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return ConfigError(self._setting, value, f"expected now() to return seconds as a "
                               f"real number; it returned a {type(value).__name__}")
        try:
            seconds = float(value)
        except (OverflowError, ValueError):
            seconds = math.inf
        if not math.isfinite(seconds):
            return ConfigError(self._setting, value, "expected now() to return seconds as a "
                               "finite number")
        if seconds < self._last:
            return ConfigError(self._setting, value, f"expected now() never to go back; it "
                               f"read {self._last} before")
        return None


def clock_fault(clock: Clock) -> ConfigError | None:
    """The error of a checked clock that read something other than seconds; None for any
    other clock, or one whose readings were all good."""
    return clock.fault if isinstance(clock, CheckedClock) else None
