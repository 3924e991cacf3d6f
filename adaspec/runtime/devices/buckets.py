"""Graph buckets: the prepared (Bcap, G) shapes of verification, and their bindings.

A batch of B requests is padded to a request bucket Bcap and verifies G padded rows. Both
come from fixed ladders prepared at startup, so the cost of a round is a step function of
its padded shape and the device never sees a new shape while serving. A binding is the
prepared entry point for one shape: a CUDA (or ACL) graph on an accelerator, a prewarmed
fixed-shape eager call on the CPU. Bindings are keyed by (slot, width, Bcap, G); the width
is fixed at startup, so Draft5 and Draft7 never share one. A shape that was not prepared is
never captured while serving: lookup falls back to the full-width binding of the request
bucket, which startup always prepares. With two rounds in flight the runtime keeps one registry per
pipeline slot, because a graph's output buffers are overwritten by its next replay.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from adaspec.config.launch import LaunchConfig, prepared_rows, tiers_among
from adaspec.errors import GraphBindingMissing

Binding = Any
"""A prepared entry point: the draft, pack and verify of a split round
(``adaspec.runtime.split.SplitBinding``), a whole round (``RoundWork -> RetiredRound``,
``adaspec.runtime.unified``) in unified mode, or a bare target verify."""


@dataclass(frozen=True, slots=True)
class BucketGeometry:
    """The prepared request buckets and target rows of one launch (per DP shard)."""

    width: int  # w: drafted tokens per round; a request verifies at most w + 1 rows
    request_buckets: tuple[int, ...]  # prepared Bcap values, ascending; () when unpadded
    target_rows: tuple[int, ...]  # the ladder of G values, ascending; () when unpadded
    tiers_only: bool = False  # a bucket prepares only its counts' tiers (unified adaptive)

    def __post_init__(self) -> None:
        # Full width is every bucket's fallback binding; without it a lookup could fail.
        missing = [b for b in self.request_buckets if self.full_rows(b) not in self.target_rows]
        if missing:
            raise ValueError(f"target_rows {list(self.target_rows)} lack the full-width rows "
                             f"of request buckets {missing} (width {self.width})")

    @classmethod
    def of(cls, launch: LaunchConfig) -> "BucketGeometry":
        return cls(width=launch.num_speculative_tokens,
                   request_buckets=launch.prepared_request_buckets(),
                   target_rows=launch.prepared_target_rows(),
                   tiers_only=launch.captures_tiers_only)

    @property
    def padded(self) -> bool:
        """False without graphs: eager shapes are exact, so every (B, G) is its own bucket."""
        return bool(self.request_buckets)

    def request_bucket(self, num_reqs: int) -> int:
        """Bcap for B live requests: the first prepared bucket that holds them."""
        if not self.padded:
            return num_reqs
        for bucket in self.request_buckets:
            if bucket >= num_reqs:
                return bucket
        raise ValueError(f"B={num_reqs} exceeds the largest prepared request bucket "
                         f"{self.request_buckets[-1]}")

    def full_rows(self, bucket: int) -> int:
        """G of full-width verification for request bucket ``bucket``."""
        return bucket * (self.width + 1)

    def legal_rows(self, bucket: int) -> tuple[int, ...]:
        """Prepared G values for ``bucket`` (``LaunchConfig.legal_target_rows``): each entry
        keeps its anchor row (G >= Bcap) and none verifies past the width (G <= Bcap *
        (w + 1)); with ``tiers_only``, just the tiers of the counts the bucket holds."""
        if not self.padded:
            return tuple(range(bucket, self.full_rows(bucket) + 1))
        return prepared_rows(self.target_rows, self.request_buckets, bucket, self.width,
                             tiers_only=self.tiers_only)

    def tiers(self, num_reqs: int) -> tuple[int, ...]:
        """The tiers for B: the first legal G covering B, 2B, 4B and B * (w + 1) rows."""
        return tiers_among(self.legal_rows(self.request_bucket(num_reqs)), num_reqs, self.width)

    def planned_bindings(self, *, adaptive: bool) -> tuple[tuple[int, int], ...]:
        """The (Bcap, G) shapes startup prepares: full width only for a fixed-width round,
        every legal G of every bucket for an adaptive one (under unified adaptive
        verification the legal G are the tiers). Full width is always included."""
        pairs = {(b, self.full_rows(b)) for b in self.request_buckets}
        if adaptive:
            pairs |= {(b, g) for b in self.request_buckets for g in self.legal_rows(b)}
        return tuple(sorted(pairs))


@dataclass(frozen=True, slots=True)
class BindingChoice:
    """The binding a round runs and the shape it was prepared for."""

    num_reqs: int  # Bcap
    num_rows: int  # G actually verified: the requested one, or full width on fallback
    fell_back: bool  # the requested G had no prepared binding
    binding: Binding = field(repr=False, compare=False)


def preparation_order(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(Bcap, G) pairs the largest G first: graphs sharing a memory pool are best captured in
    decreasing size."""
    return sorted(pairs, key=lambda pair: (-pair[1], -pair[0]))


class BindingRegistry:
    """Prepared bindings of one pipeline slot; filled at startup, then sealed.

    A binding's key is (slot, width, Bcap, G): a graph's output buffers belong to the slot
    whose round replayed it last, and a graph captured for one width never serves another."""

    def __init__(self, geometry: BucketGeometry, make: Callable[[int, int], Binding],
                 slot: int = 0) -> None:
        self.geometry = geometry
        self.slot = slot
        self._make = make
        self._bindings: dict[tuple[int, int, int, int], Binding] = {}
        self._sealed = False

    def prepare(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Build (capture or prewarm) the binding of every (Bcap, G) not prepared yet, in
        ``preparation_order``."""
        if self._sealed:
            raise RuntimeError("bindings are prepared at startup only; this registry is sealed")
        for num_reqs, num_rows in preparation_order(pairs):
            if num_rows not in self.geometry.legal_rows(num_reqs):
                raise ValueError(f"(Bcap={num_reqs}, G={num_rows}) is not a legal prepared "
                                 f"shape for width {self.geometry.width}")
            key = self._key(num_reqs, num_rows)
            if key not in self._bindings:
                self._bindings[key] = self._make(num_reqs, num_rows)

    def seal(self) -> None:
        """From now on nothing is captured: serving only looks bindings up."""
        self._sealed = True

    @property
    def sealed(self) -> bool:
        return self._sealed

    @property
    def keys(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(sorted(self._bindings))

    def prepared_rows(self) -> dict[int, tuple[int, ...]]:
        """The G values prepared for each request bucket: the captured geometry."""
        rows: dict[int, list[int]] = {b: [] for b in self.geometry.request_buckets}
        for _, _, num_reqs, num_rows in self.keys:
            rows[num_reqs].append(num_rows)
        return {bucket: tuple(found) for bucket, found in rows.items()}

    def _key(self, num_reqs: int, num_rows: int) -> tuple[int, int, int, int]:
        return (self.slot, self.geometry.width, num_reqs, num_rows)

    def lookup(self, num_reqs: int, num_rows: int) -> BindingChoice:
        """The binding for (Bcap, G), or the bucket's full-width binding when G was not
        prepared (never a capture); ``GraphBindingMissing`` when neither exists."""
        found = self._bindings.get(self._key(num_reqs, num_rows))
        if found is not None:
            return BindingChoice(num_reqs, num_rows, False, found)
        full = self.geometry.full_rows(num_reqs)
        fallback = self._bindings.get(self._key(num_reqs, full))
        if fallback is None:
            raise GraphBindingMissing(self._key(num_reqs, num_rows), len(self._bindings))
        return BindingChoice(num_reqs, full, True, fallback)
