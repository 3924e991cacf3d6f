"""Calibration and adaptive draft-step settings, as validated frozen dataclasses.

The defaults are the specification's built-in table. Checks that need only the values
themselves live here, so a config built from Python is held to the same rules as one read
from a file; checks against the launch (width, prepared buckets) live in the loader.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from adaspec.errors import ConfigError

CostModel = Literal["sps", "additive"]

MAX_TOKENS_IN_CONTEXT = 1 << 24
MAX_STEPS = 1_000_000
MAX_BATCH_ROWS = 1 << 20
DRAFT_STEP_DEFAULT_MAX_BUCKET = 128


def json_type(value: object) -> str:
    """The JSON name of a value's type, for messages about wrong types."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def require_int(setting: str, value: object, low: int, high: int) -> int:
    expected = f"expected an integer in {low}..{high}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(setting, value, f"{expected}, got {json_type(value)}")
    if not low <= value <= high:
        raise ConfigError(setting, value, expected)
    return value


def require_float(setting: str, value: object, low: float, high: float) -> float:
    """A finite number in ``low..high`` (an infinite bound leaves that side open)."""
    expected = f"expected {_number_range(low, high)}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(setting, value, f"{expected}, got {json_type(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        raise ConfigError(setting, value, expected) from None
    if not math.isfinite(number) or not low <= number <= high:
        raise ConfigError(setting, value, expected)
    return number


def _number_range(low: float, high: float) -> str:
    if math.isinf(low) and math.isinf(high):
        return "a finite number"
    if math.isinf(high):
        return "a finite number > 0" if low == math.ulp(0.0) else f"a finite number >= {low:g}"
    if math.isinf(low):
        return f"a number <= {high:g}"
    return f"a number in {low:g}..{high:g}"


def require_increasing(setting: str, values: object, high: int) -> tuple[int, ...]:
    """A non-empty, strictly increasing tuple of positive integers (buckets, rows)."""
    expected = f"expected a non-empty list of strictly increasing integers in 1..{high}"
    if not isinstance(values, tuple) or not values:
        raise ConfigError(setting, _as_list(values), expected)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ConfigError(setting, _as_list(values), expected)
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ConfigError(setting, _as_list(values), expected)
    return values


def _as_list(values: object) -> object:
    return list(values) if isinstance(values, tuple) else values


@contextmanager
def key_prefix(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from a nested section with its full key path."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(f"{prefix}{error.setting}", error.value, error.expected,
                          rule=error.rule) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextInterval:
    """One context range sampled by calibration: prompts of ``prefill_tokens``, decode
    intervals measured while the KV length lies in ``[min_kv_length, max_kv_length]``."""

    prefill_tokens: int
    min_kv_length: int
    max_kv_length: int

    def __post_init__(self) -> None:
        require_int("prefill_tokens", self.prefill_tokens, 1, MAX_TOKENS_IN_CONTEXT)
        require_int("min_kv_length", self.min_kv_length, 1, MAX_TOKENS_IN_CONTEXT)
        require_int("max_kv_length", self.max_kv_length, 1, MAX_TOKENS_IN_CONTEXT)
        if self.max_kv_length < self.min_kv_length:
            raise ConfigError("max_kv_length", self.max_kv_length,
                              f"expected at least min_kv_length={self.min_kv_length} "
                              f"(the interval is inverted)")
        if self.prefill_tokens < self.min_kv_length:
            raise ConfigError("prefill_tokens", self.prefill_tokens,
                              f"expected at least min_kv_length={self.min_kv_length} (windows "
                              "are measured from the prefill on: a shorter prompt prices KV "
                              "lengths outside the interval)")
        if self.prefill_tokens > self.max_kv_length:
            raise ConfigError("prefill_tokens", self.prefill_tokens,
                              f"expected at most max_kv_length={self.max_kv_length} (the "
                              f"prompt alone would leave the KV interval)")

    def overlaps(self, other: "ContextInterval") -> bool:
        return (self.min_kv_length <= other.max_kv_length
                and other.min_kv_length <= self.max_kv_length)

    def as_dict(self) -> dict[str, int]:
        return {"prefill_tokens": self.prefill_tokens, "min_kv_length": self.min_kv_length,
                "max_kv_length": self.max_kv_length}


DEFAULT_CONTEXTS = (ContextInterval(prefill_tokens=2048, min_kv_length=1, max_kv_length=4096),)


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    """The startup sampling grid, its coverage, measurement windows and cost model."""

    model: CostModel = "additive"
    """Cost model fitted to the samples: sps (steps per second over G) or additive."""

    draft_width: int
    """Draft width the costs belong to; always the launch's num_speculative_tokens."""

    request_buckets: tuple[int, ...]
    """Physical draft request buckets (Bcap) to sample; default: every prepared bucket."""

    target_graph_rows: tuple[int, ...] | None = None
    """Target graph rows G to sample; None: every legal prepared tier, full width included."""

    contexts: tuple[ContextInterval, ...] = DEFAULT_CONTEXTS
    """Context intervals to cover; default one interval, prefill 2048, KV 1..4096 (startup
    lowers the KV bound to what the model's context allows)."""

    warmup_steps: int = 8
    """Decode intervals discarded before measuring each grid point."""

    window_steps: int = 32
    """Complete decode intervals per measurement window."""

    windows_per_point: int = 3
    """Measurement windows per grid point."""

    token_seed: int = 1
    """Seed of the synthetic request tokens."""

    source: str = field(default="default", compare=False)
    """Where these settings came from: default, or the file's path."""

    def __post_init__(self) -> None:
        if self.model not in ("sps", "additive"):
            raise ConfigError("model", self.model, "expected sps or additive")
        require_int("draft_width", self.draft_width, 1, 64)
        require_increasing("request_buckets", self.request_buckets, MAX_BATCH_ROWS)
        if self.target_graph_rows is not None:
            require_increasing("target_graph_rows", self.target_graph_rows, MAX_BATCH_ROWS)
        require_int("warmup_steps", self.warmup_steps, 0, MAX_STEPS)
        require_int("window_steps", self.window_steps, 1, MAX_STEPS)
        require_int("windows_per_point", self.windows_per_point, 1, MAX_STEPS)
        require_int("token_seed", self.token_seed, 0, 2**63 - 1)
        self._check_contexts()

    def _check_contexts(self) -> None:
        if (not isinstance(self.contexts, tuple) or not self.contexts
                or not all(isinstance(c, ContextInterval) for c in self.contexts)):
            raise ConfigError("contexts", _as_list(self.contexts),
                              "expected a non-empty list of context intervals")
        check_disjoint(self.contexts)

    def as_dict(self) -> dict[str, object]:
        rows = None if self.target_graph_rows is None else list(self.target_graph_rows)
        return {
            "model": self.model,
            "draft_width": self.draft_width,
            "request_buckets": list(self.request_buckets),
            "target_graph_rows": rows if rows is not None else "all legal prepared tiers",
            "contexts": [c.as_dict() for c in self.contexts],
            "warmup_steps": self.warmup_steps,
            "window_steps": self.window_steps,
            "windows_per_point": self.windows_per_point,
            "token_seed": self.token_seed,
        }


def check_disjoint(contexts: Sequence[ContextInterval]) -> None:
    """Calibrated intervals never share a KV length: one length would be priced by two."""
    ordered = sorted(enumerate(contexts), key=lambda item: item[1].min_kv_length)
    for (_, low), (index, high) in zip(ordered, ordered[1:], strict=False):
        if low.overlaps(high):
            raise ConfigError(f"contexts[{index}]", high.as_dict(),
                              f"expected KV intervals that do not overlap; it overlaps "
                              f"{low.min_kv_length}..{low.max_kv_length}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftStepPolicyConfig:
    """How the adaptive draft-depth policy reads feedback and when it may switch depth."""

    window_size: int = 20
    """Completed batches in the per-position prefix-acceptance window."""

    update_interval: int = 5
    """Completed batches between two rescorings of the candidate depths."""

    switch_min_gain: float = 0.05
    """A depth change needs a predicted relative throughput gain strictly above this."""

    source: str = field(default="default", compare=False)
    """Where these settings came from: default, or the file's path."""

    def __post_init__(self) -> None:
        require_int("window_size", self.window_size, 1, MAX_STEPS)
        require_int("update_interval", self.update_interval, 1, MAX_STEPS)
        require_float("switch_min_gain", self.switch_min_gain, 0.0, 10.0)

    def as_dict(self) -> dict[str, object]:
        return {"window_size": self.window_size, "update_interval": self.update_interval,
                "switch_min_gain": self.switch_min_gain}


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftStepConfig:
    """The adaptive draft-step settings: the policy and the calibration of every depth."""

    policy: DraftStepPolicyConfig
    calibration: CalibrationConfig
