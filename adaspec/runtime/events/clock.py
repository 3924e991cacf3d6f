"""Time is injected: the runtime reads a ``Clock`` to stamp events and never calls ``time``
itself, so tests drive time by hand and never wait for real.

Policies never read a clock (replay ignores event times); only timing and traces do.
"""

import math
import numbers
import time
from typing import Protocol

from adaspec.errors import MISSING, ConfigError, show_value


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
                                     f"{type(error).__name__}: {_text(error)}")
            return
        if type(value) is float and math.isfinite(value) and value >= self._last:  # usual
            self._last = value
            return
        try:
            self._last = self._seconds(value)
        except ConfigError as error:
            self.fault = error
        except Exception as error:  # a number type broken beyond reading
            self.fault = ConfigError(self._setting, MISSING, f"now() returned a "
                                     f"{type(value).__name__} that could not be read as "
                                     f"seconds ({type(error).__name__})")

    def _seconds(self, value: object) -> float:
        """``value`` as seconds after ``self._last``; a ConfigError says why it is none."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(self._setting, _text(value), f"expected now() to return seconds "
                              f"as a real number; it returned a {type(value).__name__}")
        try:
            seconds = float(value)
        except (OverflowError, ValueError):
            seconds = math.inf
        except Exception as error:  # a Real whose own __float__ is broken
            raise ConfigError(self._setting, MISSING, f"expected now() to return seconds as a "
                              f"real number; float() of its {type(value).__name__} raised "
                              f"{type(error).__name__}: {_text(error)}") from None
        if not math.isfinite(seconds):
            raise ConfigError(self._setting, _text(value), "expected now() to return seconds "
                              "as a finite number")
        if seconds < self._last:
            raise ConfigError(self._setting, _text(value), f"expected now() never to go back; "
                              f"it read {self._last} before")
        return seconds


def _text(value: object) -> str:
    """``value`` as a message shows it, even when its own ``__str__`` is broken: the fault is
    rendered long after the reading, where raising would leave requests without an end."""
    try:
        return show_value(value)
    except Exception:
        return f"<a {type(value).__name__}>"


def clock_fault(clock: Clock) -> ConfigError | None:
    """The error of a checked clock that read something other than seconds; None for any
    other clock, or one whose readings were all good."""
    return clock.fault if isinstance(clock, CheckedClock) else None
