"""Full-step cost models of a round, fitted to calibration samples: SPS and additive.

A sample is the wall time of one complete decode interval (draft, verification, sampling,
commit and retirement together) at a padded shape: Bcap physical request entries and G
target graph rows. These are full-step costs; nothing is added on top of them.

- **SPS**: steps per second over G alone, ``cost_ms = 1000 / SPS(G)``.
- **Additive**: ``seconds = bias + alpha(Bcap) + theta(G)`` by least squares over the probe
  grid, with one gauge fixed (alpha of the smallest bucket and theta of the smallest G are
  zero, the bias absorbs them), so the fit is unique when the grid is connected.
- **Log-additive** (the additive model of a depth profile): the same least squares on log
  seconds, ``seconds = exp(bias + alpha(Bcap) + theta(d))``, so a depth multiplies its
  bucket's cost instead of adding one time to every bucket: a depth's extra draft forwards
  and verified rows cost in proportion to the batch (docs/costs.md shows the measurement).

Prices are step functions of the padded shape. A shape without a measurement is priced at
the next larger measured shape, never extrapolated down to free, and fitted terms are made
monotone (a larger G or Bcap never costs less), because padding is real work.

Steps within the noise. The G terms decide how many rows a round verifies, so a price step
that is only noise would make a policy trim rows for a saving that does not exist. The terms
are first made monotone by pooling adjacent violators (a noisy high term is averaged with its
neighbours instead of lifting every larger G); then, walking G upwards, a term stays at the
current level until it rises above it by more than two standard errors of the difference.
For the additive model those come from the least squares itself, with a point's noise the
larger of the fit's residual (the model's misfit included) and its median window's scatter;
for SPS from the windows behind each G. Real steps larger than that are kept, and a run of
small steps is kept as soon as together they exceed it. Without any noise measured (one
window per point and an exact fit) every monotone step is kept. The passes over the grid must
also agree: each pass fitted alone (the k-th window of a point is pass k's; calibration
measures every point once per pass) shows a rise, and their mean must exceed zero by a
one-sided Student t bound on their own scatter, because the pooled window noise assumes
windows scatter alike and independently while a slow spell of a shared machine can span
neighbouring windows (docs/costs.md tells the step that taught this). Depth profiles are not
levelled: depths are whole draft forwards apart, and the depth policy has its own switch
gain.
"""

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal, Protocol, TypeVar

import numpy as np
from scipy.special import stdtrit

from adaspec.config.calibration import (
    MAX_BATCH_ROWS,
    json_type,
    key_prefix,
    require_float,
    require_increasing,
)
from adaspec.errors import AdaspecError, ConfigError


@dataclass(frozen=True, slots=True)
class CostSample:
    """One measured decode interval."""

    num_reqs_bucket: int  # Bcap
    num_rows: int  # G
    seconds: float  # wall time of the complete interval


class UnpricedShape(AdaspecError):
    """A shape above everything the table measured: nothing larger can price it."""

    def __init__(self, what: str, value: int, largest: int) -> None:
        super().__init__(what, value, largest)
        self.what, self.value, self.largest = what, value, largest

    def __str__(self) -> str:
        return (f"cost table: {self.what}={self.value} lies above the largest measured "
                f"{self.what}={self.largest}; calibrate that shape")


TableKind = Literal["sps", "additive", "log-additive"]


class CostTable(Protocol):
    @property
    def kind(self) -> TableKind: ...

    def cost_ms(self, num_reqs_bucket: int, num_rows: int) -> float:
        """Predicted full-step milliseconds of a round at (Bcap, G)."""
        ...

    def as_dict(self) -> dict[str, object]: ...


def _next_measured(values: tuple[int, ...], value: int, what: str) -> int:
    """Index of the smallest measured value >= ``value``."""
    index = bisect.bisect_left(values, value)
    if index == len(values):
        raise UnpricedShape(what, value, values[-1])
    return index


def _running_max(values: Sequence[float]) -> tuple[float, ...]:
    out: list[float] = []
    for value in values:
        out.append(value if not out else max(out[-1], value))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SpsTable:
    """Steps per second over G; monotone: a larger G never runs more steps per second."""

    rows: tuple[int, ...]  # measured G, ascending
    steps_per_second: tuple[float, ...]
    kind: Literal["sps"] = "sps"

    def cost_ms(self, num_reqs_bucket: int, num_rows: int) -> float:
        index = _next_measured(self.rows, num_rows, "G")
        return 1000.0 / self.steps_per_second[index]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class AdditiveTable:
    """``bias + alpha(Bcap) + theta(G)`` seconds, terms monotone in their argument."""

    bias: float
    buckets: tuple[int, ...]  # measured Bcap, ascending
    alpha: tuple[float, ...]  # seconds; alpha[0] = 0 before monotone repair
    rows: tuple[int, ...]  # measured G, ascending
    theta: tuple[float, ...]  # seconds; theta[0] = 0 before monotone repair
    residual_rms: float  # seconds, over the fitted samples
    residual_max_relative: float  # largest |residual| / measured
    kind: Literal["additive"] = "additive"

    def seconds(self, num_reqs_bucket: int, num_rows: int) -> float:
        b = _next_measured(self.buckets, num_reqs_bucket, "Bcap")
        g = _next_measured(self.rows, num_rows, "G")
        return self.bias + self.alpha[b] + self.theta[g]

    def cost_ms(self, num_reqs_bucket: int, num_rows: int) -> float:
        return 1000.0 * self.seconds(num_reqs_bucket, num_rows)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LogAdditiveTable:
    """``exp(bias + alpha(Bcap) + theta(d))`` seconds, terms monotone in their argument: the
    additive model of a depth profile, fitted on log seconds (a depth scales its bucket's
    cost). Residuals are in log seconds, so about relative."""

    bias: float  # log seconds
    buckets: tuple[int, ...]
    alpha: tuple[float, ...]
    rows: tuple[int, ...]  # the profile's second axis: depths, ascending
    theta: tuple[float, ...]
    residual_rms: float  # log seconds
    residual_max_relative: float  # largest |measured / fitted - 1|
    kind: Literal["log-additive"] = "log-additive"

    def seconds(self, num_reqs_bucket: int, depth: int) -> float:
        b = _next_measured(self.buckets, num_reqs_bucket, "Bcap")
        d = _next_measured(self.rows, depth, "d")
        return math.exp(self.bias + self.alpha[b] + self.theta[d])

    def cost_ms(self, num_reqs_bucket: int, num_rows: int) -> float:
        return 1000.0 * self.seconds(num_reqs_bucket, num_rows)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class FitError(AdaspecError):
    """The samples cannot determine the model (too few points, a disconnected grid)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"cost fit: {self.reason}"


def fit_sps(samples: Sequence[CostSample], *, level: bool = True) -> SpsTable:
    """Median interval time per G, pooled over buckets, as steps per second."""
    if not samples:
        raise FitError("no samples")
    rows = tuple(sorted({s.num_rows for s in samples}))
    medians = [float(np.median([s.seconds for s in samples if s.num_rows == g])) for g in rows]
    windows = _windows_per_g(samples, rows)
    spread = window_noise(samples) * math.sqrt(MEDIAN_VARIANCE) if level else 0.0
    passes = [[float(np.median([s.seconds for s in windows_ if s.num_rows == g]))
               for g in rows] for windows_ in (by_pass(samples) if level else [])
              if {s.num_rows for s in windows_} == set(rows)]
    seconds = significant_steps(medians, windows, lambda i, j: spread * math.sqrt(
        1 / max(windows[i], 1) + 1 / max(windows[j], 1)), passes)
    return SpsTable(rows=rows, steps_per_second=tuple(1.0 / t for t in seconds))


SIGNIFICANT_SE = 2.0
"""A price step is kept when it exceeds this many standard errors of the difference."""

MEDIAN_VARIANCE = 1.35
"""A point's price is the median of its windows, whose variance is about 1.35 times a
mean's for a handful of windows."""


def window_noise(samples: Sequence[CostSample]) -> float:
    """The pooled standard deviation (seconds) of windows around their point's mean; 0.0 when
    no point has two windows."""
    by_point: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        by_point.setdefault((s.num_reqs_bucket, s.num_rows), []).append(s.seconds)
    squares = sum(float(np.sum((np.array(t) - np.mean(t)) ** 2)) for t in by_point.values())
    freedom = sum(len(t) - 1 for t in by_point.values())
    return math.sqrt(squares / freedom) if freedom else 0.0


def _windows_per_g(samples: Sequence[CostSample], rows: tuple[int, ...]) -> list[int]:
    return [sum(s.num_rows == g for s in samples) for g in rows]


def monotone(values: Sequence[float], weights: Sequence[int]) -> list[float]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators): a dip is
    averaged with the rise before it instead of being lifted to it, so one noisy high
    estimate does not raise every larger G."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights, strict=True):
        blocks.append([value, float(max(weight, 1)), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight_, count = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight_
            last[0] = (last[0] * last[1] + mean * weight_) / total
            last[1], last[2] = total, last[2] + count
    return [mean for mean, _, count in blocks for _ in range(int(count))]


def significant_steps(values: Sequence[float], windows: Sequence[int],
                      contrast: Callable[[int, int], float],
                      passes: Sequence[Sequence[float]] = ()) -> tuple[float, ...]:
    """Monotone terms over ascending G that rise only by steps above the noise (see the
    module docstring). ``contrast(i, j)`` is the standard error of term i minus term j; where
    it is 0.0 every step of the monotone fit is kept. ``passes``: the terms fitted to each
    pass alone; their rises must agree (``passes_agree``)."""
    smooth = monotone(values, windows)
    out: list[float] = []
    start = 0  # the G whose term began the current level
    for index, value in enumerate(smooth):
        if (index and value > smooth[start] + SIGNIFICANT_SE * contrast(index, start)
                and passes_agree([terms[index] - terms[start] for terms in passes])):
            start = index
        out.append(smooth[start])
    return tuple(out)


PASS_ERROR = 0.025
"""One-sided error of the passes' test: a flat pair of G passes it this rarely."""


def passes_agree(rises: Sequence[float]) -> bool:
    """Whether the rises of a step seen by each pass alone are above zero by more than
    their own scatter (Student t, one-sided ``PASS_ERROR``); true with fewer than two."""
    if len(rises) < 2:
        return True
    spread = float(np.std(rises, ddof=1))
    mean = float(np.mean(rises))
    if spread == 0.0:
        return mean > 0.0
    return mean > float(stdtrit(len(rises) - 1, 1 - PASS_ERROR)) * spread / math.sqrt(
        len(rises))


def by_pass(samples: Sequence[CostSample]) -> list[list[CostSample]]:
    """The windows of each pass over the grid: the k-th window of a point is pass k's."""
    seen: dict[tuple[int, int], int] = {}
    passes: list[list[CostSample]] = []
    for s in samples:
        number = seen.get((s.num_reqs_bucket, s.num_rows), 0)
        seen[(s.num_reqs_bucket, s.num_rows)] = number + 1
        if number == len(passes):
            passes.append([])
        passes[number].append(s)
    return passes


def point_medians(samples: Sequence[CostSample]) -> list[CostSample]:
    """One sample per (Bcap, G): the median of its windows. A window that an unrelated stall
    (the OS, another process) inflated then moves nothing, where a mean would follow it."""
    by_point: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        by_point.setdefault((s.num_reqs_bucket, s.num_rows), []).append(s.seconds)
    return [CostSample(b, g, float(np.median(times))) for (b, g), times in
            sorted(by_point.items())]


def fit_additive(samples: Sequence[CostSample], *, level: bool = True) -> AdditiveTable:
    """Least squares of ``bias + alpha(Bcap) + theta(G)`` over the points' medians; the grid
    must be connected. ``level``: level the G terms' steps within the noise."""
    if not samples:
        raise FitError("no samples")
    raw, samples = samples, point_medians(samples)
    buckets = tuple(sorted({s.num_reqs_bucket for s in samples}))
    rows = tuple(sorted({s.num_rows for s in samples}))
    components = grid_components([(s.num_reqs_bucket, s.num_rows) for s in samples])
    if components > 1:
        raise FitError(f"the sampled (Bcap, G) points form {components} groups with no G in "
                       "common; an additive fit needs them connected through shared G")
    design, measured = _design(samples, buckets, rows)
    solution, *_ = np.linalg.lstsq(design, measured, rcond=None)
    fitted = design @ solution
    residuals = measured - fitted
    alpha = (0.0, *solution[1:len(buckets)].tolist())
    theta = (0.0, *solution[len(buckets):].tolist())
    contrast = _theta_contrast(design, residuals, raw, len(buckets)) if level else _exact
    passes = _pass_thetas(raw, samples, buckets, rows) if level else []
    alpha = _running_max(alpha)
    theta = significant_steps(theta, _windows_per_g(raw, rows), contrast, passes)
    # Repairing and levelling the terms moves their level; the bias puts the table back on
    # the measured points on average, so no shape is priced far from what was measured (a
    # levelled first G term had priced the smallest shape at or below zero).
    terms = [alpha[buckets.index(p.num_reqs_bucket)] + theta[rows.index(p.num_rows)]
             for p in samples]
    bias = float(np.mean(measured - np.array(terms)))
    # Raising small buckets' terms to keep them monotone can still leave the smallest shape
    # priced below anything measured (at or below zero on a very noisy grid): no shape is
    # cheaper than the cheapest point measured.
    bias = max(bias, float(np.min(measured)) - alpha[0] - theta[0])
    # The diagnostics are the table's as it prices, after the repair and the levelling.
    priced = measured - (bias + np.array(terms))
    return AdditiveTable(
        bias=bias, buckets=buckets, alpha=alpha, rows=rows, theta=theta,
        residual_rms=float(np.sqrt(np.mean(priced ** 2))),
        residual_max_relative=float(np.max(np.abs(priced) / np.abs(measured))))


def _pass_thetas(raw: Sequence[CostSample], points: Sequence[CostSample],
                 buckets: tuple[int, ...], rows: tuple[int, ...]) -> list[list[float]]:
    """The G terms fitted to each pass alone, for the passes that measured every point."""
    grid = {(s.num_reqs_bucket, s.num_rows) for s in points}
    out = []
    for windows in by_pass(raw):
        if {(s.num_reqs_bucket, s.num_rows) for s in windows} != grid:
            continue
        design, measured = _design(windows, buckets, rows)
        solution, *_ = np.linalg.lstsq(design, measured, rcond=None)
        out.append([0.0, *solution[len(buckets):].tolist()])
    return out


def fit_log_additive(samples: Sequence[CostSample]) -> LogAdditiveTable:
    """The additive least squares on the log of the points' medians (a depth profile's
    model); the terms are made monotone, every step kept (depths are not levelled)."""
    if not samples:
        raise FitError("no samples")
    medians = point_medians(samples)
    if any(s.seconds <= 0 for s in medians):
        raise FitError("a measured interval is not positive; log seconds are undefined")
    logged = fit_additive([CostSample(s.num_reqs_bucket, s.num_rows, math.log(s.seconds))
                           for s in medians], level=False)
    table = LogAdditiveTable(bias=logged.bias, buckets=logged.buckets, alpha=logged.alpha,
                             rows=logged.rows, theta=logged.theta, residual_rms=0.0,
                             residual_max_relative=0.0)
    ratios = np.array([s.seconds / table.seconds(s.num_reqs_bucket, s.num_rows)
                       for s in medians])
    return replace(table, residual_rms=float(np.sqrt(np.mean(np.log(ratios) ** 2))),
                   residual_max_relative=float(np.max(np.abs(ratios - 1))))


def _exact(i: int, j: int) -> float:
    """No noise: every monotone step of the G terms is kept."""
    return 0.0


def _theta_contrast(design: np.ndarray, residuals: np.ndarray, raw: Sequence[CostSample],
                    num_buckets: int) -> Callable[[int, int], float]:
    """Standard error of theta(G_i) - theta(G_j) from the least squares. A point's noise is
    the larger of what the fit leaves over (the additive model's misfit included) and what
    its median window carries, so a G measured in one bucket only, whose term also absorbs
    that bucket's misfit, needs a larger step to count."""
    freedom = design.shape[0] - np.linalg.matrix_rank(design)
    left_over = math.sqrt(float(residuals @ residuals) / freedom) if freedom > 0 else 0.0
    per_point = len(raw) / design.shape[0]
    windows = window_noise(raw) * math.sqrt(MEDIAN_VARIANCE / per_point)
    sigma = max(left_over, windows)
    covariance = np.linalg.pinv(design.T @ design)

    def contrast(i: int, j: int) -> float:
        weights = np.zeros(design.shape[1])
        for index, sign in ((i, 1.0), (j, -1.0)):
            if index:  # theta of the smallest G is the gauge: zero, no column
                weights[num_buckets - 1 + index] += sign
        return sigma * math.sqrt(max(float(weights @ covariance @ weights), 0.0))
    return contrast


def _design(samples: Sequence[CostSample], buckets: tuple[int, ...], rows: tuple[int, ...]
            ) -> tuple[np.ndarray, np.ndarray]:
    """Columns: bias, one per bucket but the first, one per G but the first (the gauge)."""
    b_index = {b: i for i, b in enumerate(buckets)}
    g_index = {g: i for i, g in enumerate(rows)}
    design = np.zeros((len(samples), len(buckets) + len(rows) - 1))
    design[:, 0] = 1.0
    for row, sample in enumerate(samples):
        b, g = b_index[sample.num_reqs_bucket], g_index[sample.num_rows]
        if b:
            design[row, b] = 1.0
        if g:
            design[row, len(buckets) - 1 + g] = 1.0
    return design, np.array([s.seconds for s in samples])


def grid_components(points: Sequence[tuple[int, int]]) -> int:
    """Connected groups of the bipartite graph Bcap -- G drawn by the (Bcap, G) points."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def root(node: tuple[str, int]) -> tuple[str, int]:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for bucket, rows in points:
        parent[root(("b", bucket))] = root(("g", rows))
    return len({root(node) for node in list(parent)})


def fit(kind: Literal["sps", "additive"], samples: Sequence[CostSample], *,
        over: Literal["rows", "depth"] = "rows") -> CostTable:
    """The table of a profile over G (``rows``: steps within the noise levelled) or over the
    depth (``depth``: every step kept, as depths are whole draft forwards apart and the depth
    policy has its own switch gain; the additive model fitted on log seconds)."""
    if kind == "sps":
        return fit_sps(samples, level=over == "rows")
    if over == "depth":
        return fit_log_additive(samples)
    return fit_additive(samples)


def relative_errors(table: CostTable, samples: Sequence[CostSample]) -> list[float]:
    """|predicted - measured| / measured for each sample (held-out evaluation)."""
    return [abs(table.cost_ms(s.num_reqs_bucket, s.num_rows) / 1000.0 - s.seconds) / s.seconds
            for s in samples]


def table_from_dict(data: Mapping[str, object]) -> CostTable:
    """A table from ``as_dict`` output (a saved bundle), every field checked: a table that
    could price a shape at zero, a negative or a non-monotone cost is refused."""
    kind = data.get("kind")
    additive = {"kind", "bias", "buckets", "alpha", "rows", "theta", "residual_rms",
                "residual_max_relative"}
    expected = {"sps": {"kind", "rows", "steps_per_second"}, "additive": additive,
                "log-additive": additive}
    if "kind" not in data:  # named as the bundle's readers name a missing key, not as null
        raise ConfigError("kind", "missing", "expected this key: sps, additive or log-additive")
    if not isinstance(kind, str) or kind not in expected:  # a list or object is no kind
        raise ConfigError("kind", kind, "expected sps, additive or log-additive")
    keys = set(data)
    if keys != expected[str(kind)]:
        wrong = sorted(keys ^ expected[str(kind)])[0]
        raise ConfigError(wrong, data.get(wrong, "missing"),
                          f"expected exactly the keys {sorted(expected[str(kind)])}")
    if kind == "sps":
        rows = require_increasing("rows", _tuple(data["rows"]), MAX_BATCH_ROWS)
        sps = _terms("steps_per_second", data["steps_per_second"], len(rows), positive=True)
        if any(b > a for a, b in zip(sps, sps[1:], strict=False)):
            raise ConfigError("steps_per_second", list(sps),
                              "expected values that never rise with G (a larger G is never "
                              "faster)")
        return check_prices(SpsTable(rows=rows, steps_per_second=sps))
    buckets = require_increasing("buckets", _tuple(data["buckets"]), MAX_BATCH_ROWS)
    rows = require_increasing("rows", _tuple(data["rows"]), MAX_BATCH_ROWS)
    bias = require_float("bias", data["bias"], -math.inf, math.inf)
    alpha = _terms("alpha", data["alpha"], len(buckets), monotone=True)
    theta = _terms("theta", data["theta"], len(rows), monotone=True)
    rms = require_float("residual_rms", data["residual_rms"], 0.0, math.inf)
    worst = require_float("residual_max_relative", data["residual_max_relative"], 0.0,
                          math.inf)
    if kind == "log-additive":  # exp() of any sum is a positive price
        return check_prices(LogAdditiveTable(bias, buckets, alpha, rows, theta, rms, worst))
    if bias + alpha[0] + theta[0] <= 0:
        raise ConfigError("bias", bias, "expected bias + alpha[0] + theta[0] > 0 (the "
                          "smallest shape would cost nothing)")
    return check_prices(AdditiveTable(bias, buckets, alpha, rows, theta, rms, worst))


MIN_PRICE_SECONDS = 1e-6
"""No full decode step (draft, target forward, sampling, commit) takes under a microsecond.
Below it the policy's rate (tokens / price) can overflow to infinity at every tier, where the
first tier, the smallest, wins."""
MAX_PRICE_SECONDS = 3600.0
"""Nor an hour: no calibration window measured that. Above it, or at infinity, every tier's
rate is about zero and again the smallest wins, so adaptive verify stops verifying drafts."""


Loaded = TypeVar("Loaded", SpsTable, AdditiveTable, LogAdditiveTable)


def check_prices(table: Loaded) -> Loaded:
    """``table`` when every shape it prices costs MIN..MAX_PRICE_SECONDS, as ``adaspec
    simulate`` demands of each price it uses. Terms are monotone and float addition rounds
    monotonically, so the smallest and the largest measured shape bound every price."""
    for corner in (0, -1):
        seconds = _corner_seconds(table, corner)
        if not MIN_PRICE_SECONDS <= seconds <= MAX_PRICE_SECONDS:  # NaN and inf fail too
            key, value = _blamed(_corner_terms(table, corner), seconds < MIN_PRICE_SECONDS)
            raise ConfigError(key, value, f"expected every price in {MIN_PRICE_SECONDS}.."
                              f"{MAX_PRICE_SECONDS:g} s; {_corner_name(table, corner)} "
                              f"costs {seconds} s")
    return table


def _corner_seconds(table: Loaded, corner: int) -> float:
    if isinstance(table, SpsTable):
        return 1.0 / table.steps_per_second[corner]
    try:
        return table.seconds(table.buckets[corner], table.rows[corner])
    except OverflowError:  # exp() of a log-additive sum beyond any float
        return math.inf


def _blamed(terms: list[tuple[str, float]], too_low: bool) -> tuple[str, float]:
    """The term that pushes a price out most: the largest when it is too high; when too low,
    the most negative one, or else the first (the bias, which no other term lowers)."""
    if not too_low:
        return max(terms, key=lambda term: term[1])
    negative = [term for term in terms if term[1] < 0]
    return min(negative, key=lambda term: term[1]) if negative else terms[0]


def _corner_terms(table: Loaded, corner: int) -> list[tuple[str, float]]:
    """The keys and values that make up a corner's price, so an error names one of them."""
    g = corner % len(table.rows)
    if isinstance(table, SpsTable):
        return [(f"steps_per_second[{g}]", table.steps_per_second[g])]
    b = corner % len(table.buckets)
    return [("bias", table.bias), (f"alpha[{b}]", table.alpha[b]),
            (f"theta[{g}]", table.theta[g])]


def _corner_name(table: Loaded, corner: int) -> str:
    if isinstance(table, SpsTable):
        return f"G={table.rows[corner]}"
    axis = "d" if isinstance(table, LogAdditiveTable) else "G"
    return f"Bcap={table.buckets[corner]} {axis}={table.rows[corner]}"


def _tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list | tuple) else value


def _terms(name: str, value: object, length: int, *, positive: bool = False,
           monotone: bool = False) -> tuple[float, ...]:
    if not isinstance(value, list | tuple):
        raise ConfigError(name, value, f"expected a list of {length} numbers, got "
                          f"{json_type(value)}")
    if len(value) != length:
        raise ConfigError(name, f"{len(value)} values",
                          f"expected {length} numbers, one per measured shape")
    low = math.ulp(0.0) if positive else -math.inf
    terms = []
    for index, term in enumerate(value):
        with key_prefix(f"{name}"):
            terms.append(require_float(f"[{index}]", term, low, math.inf))
    if monotone and any(b < a for a, b in zip(terms, terms[1:], strict=False)):
        raise ConfigError(name, terms, "expected values that never fall (a larger shape "
                          "never costs less)")
    return tuple(terms)
