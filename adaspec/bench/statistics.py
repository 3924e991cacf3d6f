"""The bench's figures: per (arm, level) entries of a run's records, the speedups with their
noise and verdicts, and the comparison of greedy outputs between arms."""

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scipy.special import stdtrit

from adaspec.bench.run import GREEDY, PLAIN, SAMPLED, Arm, BenchPlan, RunRecord


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (q in hundredths) by linear interpolation between order statistics."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(100 * q) - 1]


@dataclass(frozen=True, slots=True)
class Speedup:
    """An arm's speedup over a reference at one level: the geometric mean of its per-pass
    ratios, their range and their noise (two standard errors, ``noise``)."""

    mean: float | None  # None when no pass measured both
    low: float
    high: float
    noise: float


SPEEDUP_REFERENCES = (PLAIN, "none", "best_fixed")
"""What each arm's speedups are over, in report order."""


@dataclass(slots=True, kw_only=True)
class ArmEntry:
    """One arm at one concurrency level, as the report gives it (``as_dict``)."""

    arm: str
    concurrency: int
    tokens_per_second: float  # geometric mean over passes
    pass_tokens_per_second: list[float]
    tokens_per_cpu_second: float | None
    aggregate_tokens_per_second: float
    tpot_ms: dict[str, float | None]
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    position_acceptance: list[float | None]
    mean_rows_per_round: float | None
    tokens: int
    seconds: float
    rounds: int
    by_kind: dict[str, dict[str, Any]]
    # Set per level by ``_speedups``; None where the reference did not run.
    speedups: dict[str, Speedup | None] = field(default_factory=dict)
    best_fixed: str | None = None
    versus_best_fixed_bounds: list[float] | None = None
    versus_best_fixed: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "arm": self.arm, "concurrency": self.concurrency,
            "tokens_per_second": self.tokens_per_second,
            "pass_tokens_per_second": self.pass_tokens_per_second,
            "tokens_per_cpu_second": self.tokens_per_cpu_second,
            "aggregate_tokens_per_second": self.aggregate_tokens_per_second,
            "tpot_ms": self.tpot_ms, "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "position_acceptance": self.position_acceptance,
            "mean_rows_per_round": self.mean_rows_per_round, "tokens": self.tokens,
            "seconds": self.seconds, "rounds": self.rounds, "by_kind": self.by_kind}
        for key in SPEEDUP_REFERENCES:
            speedup = self.speedups.get(key)
            data[f"speedup_vs_{key}"] = None if speedup is None else speedup.mean
            if speedup is not None:
                data[f"speedup_vs_{key}_range"] = None if speedup.mean is None else \
                    [speedup.low, speedup.high]
                data[f"speedup_vs_{key}_noise"] = speedup.noise
        data.update(best_fixed=self.best_fixed,
                    versus_best_fixed_bounds=self.versus_best_fixed_bounds,
                    versus_best_fixed=self.versus_best_fixed)
        return data


def summarise(plan: BenchPlan, records: Sequence[RunRecord]) -> dict[str, Any]:
    """The JSON report: one entry per (arm, level), the output comparison, the settings."""
    groups: dict[tuple[str, int], list[RunRecord]] = {}
    for record in records:
        groups.setdefault((record.arm, record.level), []).append(record)
    entries = [_entry(arm.name, level, groups[arm.name, level], plan.kinds)
               for level in plan.levels for arm in plan.arms]
    # One pass measures no noise: its figures stand, but no comparison is called a verdict.
    verdicts = plan.passes >= MIN_VERDICT_PASSES
    levels: list[dict[str, Any]] = []
    for level in plan.levels:
        at_level = [e for e in entries if e.concurrency == level]
        _speedups(at_level, groups, level, verdicts)
        levels.append({"concurrency": level, "best_fixed": at_level[0].best_fixed,
                       "fixed_within_noise": fixed_within_noise(at_level) if verdicts
                       else None})
    steady = steady_fixed([level["fixed_within_noise"] for level in levels]) if verdicts \
        else None
    mismatches = compare_outputs(records)
    reference = output_reference([arm.name for arm in plan.arms])
    return {
        "arms": [entry.as_dict() for entry in entries],
        "levels": levels,
        "verdicts": verdicts,
        "fixed_within_noise_at_every_level": steady,
        "best_fixed_changes_with_concurrency": None if not verdicts or not any(
            level["best_fixed"] for level in levels) else not steady,
        # None: the plan sent no greedy request, so there was nothing to compare.
        "greedy_outputs_identical": not mismatches if GREEDY in plan.kinds else None,
        "outputs_compared": _compared(records),
        "outputs_reference": reference,
        "output_mismatches": mismatches[:20],
        "output_checks": output_checks(plan, reference),
        "notes": sampling_notes(plan),
        "skipped_arms": [{"arm": name, "why": why} for name, why in plan.skipped],
        "settings": {"concurrency": list(plan.levels), "passes": plan.passes,
                     "max_tokens": plan.max_tokens, "seed": plan.seed,
                     "requests_per_pass": {str(k): v for k, v in plan.requests.items()},
                     "sampling": _sampling_settings(plan),
                     "modes": {arm.name: _mode(arm) for arm in plan.arms}},
        "definitions": {
            "acceptance_length": "accepted drafts + 1 per request and round (counts the "
                                 "residual or bonus token)",
            "tpot_ms": "(last token time - first token time) / (tokens - 1) per request "
                       "whose tokens came in two chunks or more",
            "tokens_per_cpu_second": "output tokens over the CPU time of this process (every "
                                     "thread: device worker, event loop, torch's own)",
            "position_acceptance": "of the request-rounds that verified position k, the "
                                   "share that accepted drafts 1..k",
            "mean_rows_per_round": "padded target rows G verified per round",
            "by_kind": "the arm's greedy (temperature 0) and sampled (above 0) requests apart, "
                       "from their own results: AL, acceptance rate and TPOT (no tokens/s: the "
                       "kinds share the batches and the run's time)"},
    }


def _sampling_settings(plan: BenchPlan) -> dict[str, Any]:
    return {"temperatures": list(plan.temperatures), "top_k": plan.top_k,
            "top_p": plan.top_p, "min_p": plan.min_p,
            "requests_per_pass_by_kind": {kind: plan.kind_requests(kind)
                                          for kind in plan.kinds},
            "assignment": "request i sends prompt i // m at the (i mod m)-th of the m "
                          "temperatures: each prompt once at each"}


def output_checks(plan: BenchPlan, reference: str) -> dict[str, str | None]:
    """Which output verdict applies to each kind of request the plan sent (None: the kind
    was not sent). Greedy outputs are compared token for token; sampled ones are not, since
    no two arms draw the same random tokens, and the bench claims nothing from them."""
    checks: dict[str, str | None] = {GREEDY: None, SAMPLED: None}
    if GREEDY in plan.kinds:
        checks[GREEDY] = (f"every arm's greedy outputs must equal {reference}'s token for "
                          "token")
    if SAMPLED in plan.kinds:
        checks[SAMPLED] = ("not compared token for token: each arm draws its own random "
                           "tokens, so equality cannot hold and no losslessness is claimed "
                           "from it (the sampler tests check that random sampling keeps the "
                           "target distribution); acceptance and speed are reported per kind")
    return checks


def sampling_notes(plan: BenchPlan) -> list[str]:
    """What a reader of a run with sampled requests must know to read its figures."""
    if SAMPLED not in plan.kinds:
        return []
    notes = [f"random draws come from each arm's runtime generator, seeded with {plan.seed} "
             "(the runtime refuses per-request seeds); the arms' rounds differ, so their "
             "draws and sampled outputs differ"]
    if any(arm.name.startswith("adaptive") for arm in plan.arms):
        notes.append("the adaptive arms' costs are calibrated on greedy requests: random "
                     "sampling adds sampler work that calibration does not measure")
    return notes


def _mode(arm: Arm) -> str:
    """The arm's execution mode as the effective configuration words it."""
    if arm.name == PLAIN:
        return "the target alone in a straight loop, no runtime"
    execution = arm.config.as_dict()["execution"]
    assert isinstance(execution, dict)
    return str(execution["mode"])


def _entry(arm: str, level: int, runs: Sequence[RunRecord], kinds: Sequence[str]
           ) -> ArmEntry:
    seconds = sum(r.seconds for r in runs)
    tokens = sum(r.tokens for r in runs)
    tpot = [t for r in runs for t in r.tpot_s]
    request_rounds = sum(r.request_rounds for r in runs)
    accepted, verified = sum(r.accepted for r in runs), sum(r.verified for r in runs)
    reached = [sum(c) for c in itertools.zip_longest(*(r.reached for r in runs), fillvalue=0)]
    through = [sum(c) for c in itertools.zip_longest(*(r.through for r in runs), fillvalue=0)]
    rounds = sum(r.rounds for r in runs)
    rates = [r.tokens / r.seconds for r in runs if r.seconds and r.tokens]
    cpu_rates = [r.tokens / r.cpu_seconds for r in runs if r.cpu_seconds and r.tokens]
    return ArmEntry(
        arm=arm, concurrency=level,
        # The geometric mean: the ratio of two arms' figures is then exactly the geometric
        # mean of their per-pass ratios, so every column of a level's table agrees.
        tokens_per_second=round(statistics.geometric_mean(rates), 2) if rates else 0.0,
        pass_tokens_per_second=[round(rate, 2) for rate in rates],
        # Tokens per CPU second of this process: other processes stretch wall time far more
        # than they stretch the CPU time of the threads doing the work.
        tokens_per_cpu_second=round(statistics.geometric_mean(cpu_rates), 2)
        if cpu_rates else None,
        aggregate_tokens_per_second=round(tokens / seconds, 2) if seconds else 0.0,
        tpot_ms=_tpot_ms(tpot),
        mean_acceptance_length=_al(accepted, request_rounds),
        acceptance_rate=round(accepted / verified, 4) if verified else None,
        position_acceptance=[round(t / n, 4) if n else None
                             for t, n in zip(through, reached, strict=True)],
        mean_rows_per_round=round(sum(r.rows for r in runs) / rounds, 2) if rounds else None,
        tokens=tokens, seconds=round(seconds, 3), rounds=rounds,
        by_kind={kind: _kind_entry(runs, kind) for kind in kinds})


def _kind_entry(runs: Sequence[RunRecord], kind: str) -> dict[str, Any]:
    """One kind of request's figures over an arm's runs at one level."""
    counts = [(r, r.kinds[kind]) for r in runs if kind in r.kinds]
    accepted = sum(c.accepted for _, c in counts)
    verified = sum(c.verified for _, c in counts)
    return {"requests": sum(c.requests for _, c in counts),
            "tokens": sum(c.tokens for _, c in counts),
            "tpot_ms": _tpot_ms([t for _, c in counts for t in c.tpot_s]),
            "mean_acceptance_length": _al(accepted, sum(c.rounds for _, c in counts)),
            "acceptance_rate": round(accepted / verified, 4) if verified else None}


def _tpot_ms(tpot: Sequence[float]) -> dict[str, float | None]:
    return {"mean": _ms(statistics.fmean(tpot)) if tpot else None,
            "p50": _ms(percentile(tpot, 0.5)) if tpot else None,
            "p90": _ms(percentile(tpot, 0.9)) if tpot else None}


def _al(accepted: int, rounds: int) -> float | None:
    """Mean acceptance length: accepted drafts plus the residual or bonus token per round."""
    return round((accepted + rounds) / rounds, 4) if rounds else None


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _speedups(entries: list[ArmEntry], groups: Mapping[tuple[str, int], list[RunRecord]],
              level: int, verdicts: bool = True) -> None:
    """Speedups over no speculation and over the level's best fixed width (the fixed arm with
    the highest tokens/s): the geometric mean of the per-pass ratios (the arms of a pass run
    close together in time, so each pass pairs them), their range, and their noise (two
    standard errors of it, see ``noise``). Then each arm's verdict against the best
    fixed width, from its ratios to every fixed width (``best_fixed_bounds``)."""
    by_arm = {e.arm: e for e in entries}
    fixed = [e.arm for e in entries if e.arm.startswith("fixed:")]
    best = max(fixed, key=lambda arm: by_arm[arm].tokens_per_second) if fixed else None
    references = [arm for arm in (PLAIN, "none", *fixed) if arm in by_arm]
    for entry in entries:
        # Its per-pass ratios to every reference, once: the speedups and the bounds share them.
        paired = {arm: paired_ratios(groups[entry.arm, level], groups[arm, level])
                  for arm in references}
        for key, reference in zip(SPEEDUP_REFERENCES, (PLAIN, "none", best), strict=True):
            ratios = paired.get(reference) if reference is not None else None
            entry.speedups[key] = None if ratios is None else _speedup(ratios)
        entry.best_fixed = best
        bounds = best_fixed_bounds({arm: paired[arm] for arm in fixed if arm != entry.arm}) \
            if fixed else None
        if bounds is not None and entry.arm in fixed:  # the best includes the arm itself
            bounds = (min(bounds[0], 1.0), min(bounds[1], 1.0))
        if not verdicts:
            bounds = None
        entry.versus_best_fixed_bounds = None if bounds is None else \
            [round(bound, 4) for bound in bounds]
        entry.versus_best_fixed = verdict(bounds)


def _speedup(ratios: Sequence[float]) -> Speedup:
    if not ratios:
        return Speedup(mean=None, low=0.0, high=0.0, noise=round(noise(ratios), 4))
    return Speedup(mean=round(statistics.geometric_mean(ratios), 4),
                   low=round(min(ratios), 4), high=round(max(ratios), 4),
                   noise=round(noise(ratios), 4))


def noise(ratios: Sequence[float]) -> float:
    """Two standard errors of the geometric mean of per-pass ratios, in ratio units (the
    log-scale error times the mean, to first order); 0.0 with fewer than two passes."""
    if len(ratios) < 2:
        return 0.0
    return 2 * statistics.geometric_mean(ratios) * log_standard_error(ratios)


def log_standard_error(ratios: Sequence[float]) -> float:
    """The standard error of the mean log ratio, from the passes' sample standard deviation;
    0.0 with fewer than two passes.

    Not a median with its absolute deviation: over six passes that deviation collapses
    whenever four of them agree, and two passes far from the rest then count for nothing
    (docs/bench-statistics.md shows a verdict that went wrong so). A pass caught by a stall
    widens this one, so the verdicts lean to ``within noise`` rather than resting on it."""
    if len(ratios) < 2:
        return 0.0
    return statistics.stdev(math.log(r) for r in ratios) / math.sqrt(len(ratios))


MIN_VERDICT_PASSES = 2
"""Fewer passes measure no noise, so the report gives figures and no verdict."""

ONE_SIDED_ERROR = 0.025
"""The chance, shared by all of an arm's comparisons, that noise alone puts its verdict on
one side (``below`` or ``beats``) of a best fixed width it equals."""


def best_fixed_bounds(ratios: Mapping[str, Sequence[float]]) -> tuple[float, float]:
    """Simultaneous bounds on an arm's ratio to the best fixed width, from its per-pass
    ratios to every (other) fixed width.

    Which fixed width is best is itself measured with noise: the one that came out on top
    was lifted by it, so a ratio to that one alone reads low, and arms tied with it would
    often look ``below``. Every fixed width is compared instead (multiple comparisons with
    the best): the true ratio to the best lies under each width's ratio times its margin, so
    under their smallest, and over the smallest lower margin. A margin is ``margin``
    standard errors of the mean log ratio (a paired t interval per width). No other fixed
    width: (1, 1)."""
    if not ratios:
        return 1.0, 1.0
    centres = {arm: statistics.fmean(math.log(x) for x in r) if r else 0.0
               for arm, r in ratios.items()}
    spans = {arm: margin(len(r), len(ratios)) * log_standard_error(r)
             for arm, r in ratios.items()}
    return (math.exp(min(centres[arm] - spans[arm] for arm in ratios)),
            math.exp(min(centres[arm] + spans[arm] for arm in ratios)))


def margin(passes: int, comparisons: int) -> float:
    """Standard errors a bound keeps from the mean log of ``passes`` ratios, so that noise
    takes none of ``comparisons`` bounds past the truth more often than ``ONE_SIDED_ERROR``
    in all (Bonferroni). Student's t with passes - 1 degrees of freedom, not the normal: the
    standard error itself comes from those few passes (six by default: 4.03 standard errors
    for five comparisons, where the normal would say 2.58). 0 for a single pass."""
    if passes < 2:
        return 0.0
    return float(stdtrit(passes - 1, 1 - ONE_SIDED_ERROR / comparisons))


def verdict(bounds: tuple[float, float] | None) -> str | None:
    """``beats`` (every fixed width, beyond noise), ``below`` (some fixed width, beyond
    noise) or ``within noise`` of the best fixed width, from ``best_fixed_bounds``; None
    without a fixed width or without bounds (a run of one pass gets none)."""
    if bounds is None:
        return None
    low, high = bounds
    if low > 1:
        return "beats"
    if high < 1:
        return "below"
    return "within noise"


def fixed_within_noise(entries: Sequence[ArmEntry]) -> list[str]:
    """The fixed widths of a level that this run cannot tell from its best fixed width: those
    not ``below`` it (the best itself included). Where several are, which one came out on
    top is the machine's noise, not the width."""
    return [e.arm for e in entries
            if e.arm.startswith("fixed:") and e.versus_best_fixed != "below"]


def steady_fixed(within: Sequence[Sequence[str]]) -> list[str]:
    """The fixed widths within noise of the best at every level: one of them serves every
    concurrency as well as the measurement can tell. Empty where the best fixed width changes
    with concurrency by more than the noise (the levels' sets share no width)."""
    if not within:
        return []
    common = set(within[0]).intersection(*within[1:])
    return [arm for arm in within[0] if arm in common]


def paired_ratios(runs: Sequence[RunRecord], reference: Sequence[RunRecord]) -> list[float]:
    """Per-pass ratios of tokens/s; a pass either side measured nothing in is left out (a
    ratio of zero would have no logarithm)."""
    by_pass = {r.passed: r for r in reference if r.seconds and r.tokens}
    return [(r.tokens / r.seconds) / (by_pass[r.passed].tokens / by_pass[r.passed].seconds)
            for r in runs if r.passed in by_pass and r.seconds and r.tokens]


def output_reference(arms: Sequence[str]) -> str:
    """The arm whose greedy outputs every other arm's are compared with: the target alone (the
    plain loop, else ``none``), else the first of ``arms``."""
    return next((arm for arm in (PLAIN, "none") if arm in arms), arms[0] if arms else "")


def compare_outputs(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Every (level, pass, request) whose greedy output differs from the reference arm's
    (``output_reference`` over the arms in the order they first ran). Sampled requests are
    left out: each arm draws its own tokens for them (``output_checks``)."""
    runs: dict[tuple[int, int], dict[str, RunRecord]] = {}
    for record in records:
        runs.setdefault((record.level, record.passed), {})[record.arm] = record
    reference_arm = output_reference(list(dict.fromkeys(r.arm for r in records)))
    mismatches = []
    for (level, number), arms in sorted(runs.items()):
        reference = arms.get(reference_arm) or next(iter(arms.values()))
        for name, record in arms.items():
            for index, (mine, theirs) in enumerate(zip(record.outputs, reference.outputs,
                                                       strict=True)):
                if mine != theirs and _greedy(reference, index):
                    mismatches.append({"arm": name, "reference": reference.arm,
                                       "concurrency": level, "pass": number, "prompt": index,
                                       "first_difference": _first_difference(mine, theirs)})
    return mismatches


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def _greedy(record: RunRecord, index: int) -> bool:
    """Whether the record's request ``index`` was greedy (a record without temperatures is
    all greedy)."""
    return index >= len(record.temperatures) or record.temperatures[index] == 0


def _compared(records: Sequence[RunRecord]) -> int:
    """The greedy outputs compared with the reference arm's."""
    reference = output_reference(list(dict.fromkeys(r.arm for r in records)))
    return sum(_greedy(r, index) for r in records if r.arm != reference
               for index in range(len(r.outputs)))

