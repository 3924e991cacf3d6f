"""Seeded synthetic workloads with known acceptance regimes, for policy tests and
``adaspec simulate``.

Every request-round draws its own per-position acceptance probabilities around the regime's
level (a logit-normal spread, so some requests are easy and some hard); the drafter reports
those probabilities with a little noise as its confidences, and the accepted count is the
leading run of Bernoulli draws with them. Regimes:

- ``high`` / ``low``: a stationary level (0.85 / 0.35 per position);
- ``step``: high, then low from the middle on;
- ``drift``: the level slides from high to low over the run;
- ``alternating``: high and low phases of ``phase`` rounds each.
"""

import random
from collections.abc import Callable

from adaspec.config.calibration import ContextInterval
from adaspec.errors import ConfigError
from adaspec.policies.bundles import Compatibility, CostBundle, CostProfile, fitted_bundle
from adaspec.policies.costs import AdditiveTable
from adaspec.policies.depth import logit, sigmoid
from adaspec.policies.simulate import Workload, WorkloadRequest, WorkloadRound

HIGH, LOW = 0.85, 0.35
SPREAD = 0.8  # logit standard deviation between request-rounds
CONFIDENCE_NOISE = 0.05


def _levels(kind: str, rounds: int, phase: int) -> Callable[[int], float]:
    regimes: dict[str, Callable[[int], float]] = {
        "high": lambda n: HIGH,
        "low": lambda n: LOW,
        "step": lambda n: HIGH if n < rounds // 2 else LOW,
        "drift": lambda n: HIGH + (LOW - HIGH) * n / max(1, rounds - 1),
        "alternating": lambda n: HIGH if (n // phase) % 2 == 0 else LOW,
    }
    if kind not in regimes:
        raise ConfigError("workload", kind, f"expected one of {', '.join(regimes)}")
    return regimes[kind]


def synthetic(kind: str, *, rounds: int = 2000, batch: int = 8, width: int = 5,
              seed: int = 0, phase: int = 100, dp_size: int = 1) -> Workload:
    """A workload of ``rounds`` rounds of ``batch`` requests per DP shard (ids change every
    64 rounds, as requests finish and new ones arrive). With several shards in the
    alternating regime, shard s runs ``s`` phases later: one shard's easy phase is the
    other's hard one, so every round mixes easy and hard shards."""
    level = _levels(kind, rounds, phase)
    lag = phase if kind == "alternating" else 0
    rng = random.Random(seed)
    out = []
    for number in range(rounds):
        requests: list[WorkloadRequest] = []
        for shard in range(dp_size):
            requests.extend(_request(rng, logit(level(number + shard * lag)), width, shard,
                                     (number // 64) * batch + slot) for slot in range(batch))
        out.append(WorkloadRound(requests=tuple(requests)))
    return Workload(width=width, rounds=tuple(out), name=f"{kind} (seed {seed})",
                    dp_size=dp_size)


def _request(rng: random.Random, center: float, width: int, shard: int, rid: int
             ) -> WorkloadRequest:
    probabilities = [sigmoid(center + rng.gauss(0, SPREAD)) for _ in range(width)]
    confidences = tuple(min(1.0, max(0.0, p + rng.gauss(0, CONFIDENCE_NOISE)))
                        for p in probabilities)
    accepted = 0
    while accepted < width and rng.random() < probabilities[accepted]:
        accepted += 1
    return WorkloadRequest(id=rid, confidences=confidences, accepted=accepted, shard=shard)


SHAPE_TIERS = (8, 16, 32, 48)  # Draft5 at B = 8


def shaped_table(theta: tuple[float, ...], bias: float = 0.01, dp_size: int = 1) -> CostBundle:
    """A cost bundle of MTP Draft5 at B = 8 (tiers 8, 16, 32, 48) priced ``bias + theta(G)``
    seconds, for policy tests that need a table of a known shape. MTP, because both kinds of
    policy run on it: depth policies choose MTP draft steps, budget policies any drafts."""
    table = AdditiveTable(bias=bias, buckets=(8,), alpha=(0.0,), rows=SHAPE_TIERS, theta=theta,
                          residual_rms=0.0, residual_max_relative=0.0)
    compatibility = Compatibility(
        algorithm="MTP", draft_width=5, dp_size=dp_size, tp_size=1, unified=False, device="cpu",
        target="synthetic", draft="synthetic", request_buckets=(8,), target_rows=(SHAPE_TIERS,))
    context = ContextInterval(prefill_tokens=1, min_kv_length=1, max_kv_length=4096)
    return fitted_bundle(compatibility, {}, [CostProfile(context, table)], "synthetic table")


def shaped_tables(dp_size: int = 1) -> dict[str, CostBundle]:
    """Three shapes a policy must handle: rows that cost about nothing (verify everything),
    a staircase (16 rows cost what 8 cost, 48 what 32), and a saturated device (every row
    is dear, so trimming pays)."""
    return {"nearly free": shaped_table((0.0, 1e-7, 2e-7, 3e-7), dp_size=dp_size),
            "staircase": shaped_table((0.0, 0.0, 0.006, 0.006), dp_size=dp_size),
            "saturated": shaped_table((0.0, 0.004, 0.012, 0.020), bias=0.005,
                                      dp_size=dp_size)}
