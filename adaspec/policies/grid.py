"""The calibration probe grid and its checks, all made before any sampling starts.

Startup measures every (Bcap, G) point of the grid. The grid is refused up front when a
measurement could not be used: an uncaptured bucket or G (calibration never captures a
shape), a bucket without its full-width G (the fallback every round may take), an additive
grid in several pieces (the fit would not be unique), context intervals that overlap or that
the model, its cache, or the worst-case progress of the rounds in flight in both pipeline
slots cannot hold.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from adaspec.config.calibration import DEFAULT_CONTEXTS, CalibrationConfig, ContextInterval
from adaspec.errors import MISSING, ConfigError
from adaspec.policies.costs import grid_components

DEFAULT_PREFILL = 2048
DEFAULT_MAX_KV = 4096

Axis = Literal["rows", "depth"]

MIN_FITTED_WINDOW_STEPS = 4
"""The fewest window steps built-in settings shrink to for a short context; below it a
window would time too few intervals to mean anything."""


@dataclass(frozen=True, slots=True)
class ProbeGrid:
    """The (Bcap, G) points calibration measures, ascending."""

    width: int
    points: tuple[tuple[int, int], ...]

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self.points}))

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sorted({g for _, g in self.points}))


def probe_grid(width: int, request_buckets: Sequence[int],
               legal_rows: Mapping[int, Sequence[int]], captured_buckets: Sequence[int],
               target_graph_rows: Sequence[int] | None, model: str,
               prefix: str = "calibration: ") -> ProbeGrid:
    """The grid of a calibration config against the captured geometry, checked.

    ``legal_rows[b]`` lists the captured G a bucket b may run (its tiers, full width
    included); ``target_graph_rows`` restricts them when the config gives it. ``prefix``
    leads each key path in an error: the flag and file the settings came from, and the
    section they sit in (``--adaptive_draft_step_config=F: calibration.``).
    """
    for bucket in request_buckets:
        if bucket not in captured_buckets:
            raise ConfigError(f"{prefix}request_buckets", list(request_buckets),
                              f"bucket {bucket} is not captured; captured buckets: "
                              f"{list(captured_buckets)}")
    points = []
    for bucket in request_buckets:
        rows = list(legal_rows[bucket])
        if target_graph_rows is not None:
            rows = [g for g in rows if g in target_graph_rows]
        full = bucket * (width + 1)
        if full not in rows:
            raise ConfigError(f"{prefix}target_graph_rows", _shown(target_graph_rows),
                              f"must keep full width G={full} of bucket {bucket} (Bcap * "
                              f"(w + 1)); every round may fall back to it")
        points += [(bucket, g) for g in rows]
    grid = ProbeGrid(width=width, points=tuple(sorted(points)))
    _check_used(grid, target_graph_rows, prefix)
    if model == "additive":
        check_connected(grid, request_buckets, target_graph_rows, prefix)
    return grid


def _shown(rows: Sequence[int] | None) -> object:
    return "all legal tiers" if rows is None else list(rows)


def _check_used(grid: ProbeGrid, target_graph_rows: Sequence[int] | None,
                prefix: str) -> None:
    """Every explicit G must be a captured tier of some sampled bucket."""
    if target_graph_rows is None:
        return
    unused = [g for g in target_graph_rows if g not in grid.rows]
    if unused:
        raise ConfigError(f"{prefix}target_graph_rows", list(target_graph_rows),
                          f"G={unused[0]} is not a captured tier of any sampled bucket")


def check_connected(grid: ProbeGrid, request_buckets: Sequence[int],
                    target_graph_rows: Sequence[int] | None, prefix: str) -> None:
    """An additive fit is unique only when all buckets and G connect through shared G.
    Refused naming the key that chose them: the G given, or else the buckets whose legal
    tiers do not meet."""
    pieces = grid_components(grid.points)
    if pieces <= 1:
        return
    if target_graph_rows is not None:
        raise ConfigError(f"{prefix}target_graph_rows", list(target_graph_rows),
                          f"the additive grid falls into {pieces} groups of buckets with no "
                          "G in common; add a G that the groups share, or use model sps")
    raise ConfigError(f"{prefix}request_buckets", list(request_buckets),
                      f"the additive grid of their legal tiers (G {list(grid.rows)}) falls "
                      f"into {pieces} groups of buckets with no G in common; sample buckets "
                      "that share a tier, give target_graph_rows, or use model sps")


def sampling_progress(width: int, warmup_steps: int, window_steps: int) -> int:
    """Most tokens one synthetic request can gain while one window is measured (each window
    runs on fresh requests): every decode interval commits up to w + 1 tokens, and two
    rounds are in flight."""
    rounds = warmup_steps + window_steps + 2
    return rounds * (width + 1)


def default_contexts(context_limit: int, progress: int, prefix: str = "calibration: "
                     ) -> tuple[ContextInterval, ...]:
    """The built-in interval (prefill 2048, KV 1..4096) capped by the model's context. For a
    short context the prefill shrinks so the measured progress still fits."""
    max_kv = min(DEFAULT_MAX_KV, context_limit)
    prefill = min(DEFAULT_PREFILL, max_kv - progress)
    if prefill < 1:
        raise ConfigError(f"{prefix}contexts", "built-in default",
                          f"a context limit of {context_limit} tokens cannot hold "
                          f"{progress} tokens of sampling progress; expected fewer "
                          "warmup_steps or window_steps, or contexts that fit")
    return (ContextInterval(prefill_tokens=prefill, min_kv_length=1, max_kv_length=max_kv),)


def check_contexts(contexts: Sequence[ContextInterval], context_limit: int, progress: int,
                   prefix: str = "calibration: ") -> None:
    """Each interval fits the model, and its prompts plus the sampling progress stay in it.
    (Overlap is checked when the config is built.)"""
    for index, context in enumerate(contexts):
        if context.max_kv_length > context_limit:
            raise ConfigError(f"{prefix}contexts[{index}].max_kv_length",
                              context.max_kv_length,
                              f"expected at most the model's context limit {context_limit}")
        room = context.max_kv_length - progress
        if room < 1:  # not even a one-token prefill fits: the interval is what is too short
            raise ConfigError(f"{prefix}contexts[{index}].max_kv_length",
                              context.max_kv_length,
                              f"expected at least {progress + 1}: measuring a point adds up "
                              f"to {progress} tokens after a prefill of at least one")
        if context.prefill_tokens > room:
            raise ConfigError(f"{prefix}contexts[{index}].prefill_tokens",
                              context.prefill_tokens,
                              f"expected at most {room}: measuring a point adds up to "
                              f"{progress} tokens, which must stay within max_kv_length="
                              f"{context.max_kv_length}")


def effective_contexts(settings: CalibrationConfig, width: int, context_limit: int,
                       prefix: str) -> tuple[ContextInterval, ...]:
    """The default interval fitted to the model, or the given ones checked against it
    (``prefix`` leads each key path in an error, as ``probe_grid``'s)."""
    progress = sampling_progress(width, settings.warmup_steps, settings.window_steps)
    if settings.contexts == DEFAULT_CONTEXTS:
        return default_contexts(context_limit, progress, prefix)
    check_contexts(settings.contexts, context_limit, progress, prefix)
    return settings.contexts


def fitted_to_context(settings: CalibrationConfig, width: int, context_limit: int,
                      unset: str) -> CalibrationConfig:
    """Settings no file gave, shortened for a model whose context cannot hold the progress of
    their windows: fewer window steps, with warm-up kept at a quarter of them, down to
    ``MIN_FITTED_WINDOW_STEPS``. Settings from a file are the user's and stay as given.
    ``unset`` names the flag (and section) that would give them."""
    if settings.source != "default":
        return settings
    room = min(context_limit, DEFAULT_CONTEXTS[0].max_kv_length) - 1  # a prefill needs one
    window = settings.window_steps
    while sampling_progress(width, window // 4, window) > room:
        if window <= MIN_FITTED_WINDOW_STEPS:
            need = sampling_progress(width, MIN_FITTED_WINDOW_STEPS // 4,
                                     MIN_FITTED_WINDOW_STEPS) + 1
            raise ConfigError(unset, MISSING,
                              f"not given, and the built-in calibration needs a context of "
                              f"at least {need} tokens at width {width}, more than the "
                              f"model's limit of {context_limit}; give a file with fewer "
                              "warmup_steps or window_steps")
        window -= 1
    if window == settings.window_steps:
        return settings
    return replace(settings, warmup_steps=min(settings.warmup_steps, window // 4),
                   window_steps=window)
