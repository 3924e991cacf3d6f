"""The bench: real requests through the real runtime, adaptive speculation against every fixed
width and against no speculation, side by side in one process and one run.

Arms. ``plain`` (the target alone in a straight loop with no runtime, ``adaspec.bench.
plain``: the baseline every figure is read against), ``none`` (the target alone through the
runtime, without speculation), ``fixed:K`` for the launch's algorithm at each width K, and
the adaptive modes the launch allows: ``adaptive-verify`` (DSpark or MTP at width 5 or 7)
and ``adaptive-depth`` (MTP). Every runtime arm is its own ``Runtime`` started once, so
adaptive arms calibrate their costs once, at start, as a serving launch would; the plain
arm gets its own copy of the target.

Runs. At each concurrency C a closed loop of C clients sends the level's prompts (each client
sends its next prompt when the previous one finishes), ``max_tokens`` each, greedy unless the
plan gives temperatures (below). One pass runs every (level, arm) once; passes repeat, every
other one in reverse order and each rotated (``pass_order``), so a slow spell of the machine
does not land on the same arm every time.

Figures per arm and level: output tokens per second (the geometric mean of the passes; the
aggregate over all passes is reported too), TPOT (time per output token after the first: a
request's last-token time minus its first-token time, over its tokens minus one) mean, p50 and
p90, mean acceptance length AL (drafted tokens accepted plus the residual or bonus token, per
request and round), acceptance rate (accepted over verified drafts), per-position acceptance
(of the requests and rounds that verified position k, the share that accepted drafts 1..k),
mean padded target rows verified per round, and the speedups over the plain loop, over no
speculation and over the best fixed width of that level (geometric means of the per-pass
ratios, with their noise and a verdict). The greedy outputs of all arms must be identical
token for token: the bench compares them with the plain loop's and reports every difference.

Sampled requests. A plan may give positive temperatures, alone or mixed with 0 (``BenchPlan.
temperatures``): request i of a level sends prompt i // m at the (i mod m)-th of the m
temperatures, so greedy and sampled requests see the same prompts. Random-target acceptance and
speed are not those of greedy targets, so each arm's AL, acceptance rate, TPOT and tokens/s are
also given per kind of request (``by_kind``: greedy, sampled). Sampled outputs are not compared:
each arm draws its own random tokens (their rounds differ), so token equality cannot hold and
is not claimed; the exactness of random sampling is what the sampler tests check. An arm that
cannot run sampled requests (the plain loop is greedy only; a launch's own request check may
refuse positive temperatures) is refused or skipped with its reason before anything runs.
"""

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from adaspec.bench.plain import PlainRun, plain_loop
from adaspec.config import EffectiveConfig, SamplingParams, check_request, load_config
from adaspec.config.flags import coerce
from adaspec.config.launch import launch_field_types
from adaspec.errors import (
    AdaspecError,
    ConfigError,
    EventLogError,
    OutputWriteError,
    UnsupportedRequest,
)
from adaspec.models.protocols import ModelSet, TargetModel
from adaspec.runtime.calibration import Progress
from adaspec.runtime.devices.buckets import BucketGeometry
from adaspec.runtime.engine import Runtime, RuntimeOptions, builtin_models
from adaspec.runtime.pipeline import RuntimeStatistics
from adaspec.runtime.requests import RequestHandle, RequestResult

PLAIN = "plain"
"""The arm that runs the target alone in a straight loop, outside the runtime."""

GREEDY, SAMPLED = "greedy", "sampled"
"""The kinds of request: temperature 0 (the target's argmax) and above 0 (drawn)."""

PLAIN_IS_GREEDY = ("the plain loop decodes greedily only (adaspec.bench.plain); the none "
                   "arm is the target-alone baseline for sampled requests")

FULL_LEVELS = (1, 4, 16)
ADAPTIVE_FLAGS = ("enable_adaptive_target_verify", "enable_adaptive_draft_step",
                  "adaptive_target_verify_cost_table", "adaptive_target_verify_calibration",
                  "adaptive_target_verify_cost_table_output", "adaptive_draft_step_config")
"""Launch flags that belong to the adaptive arms only (the fixed arms run without them)."""

ADAPTIVE_ARM_OF = {flag: "adaptive-depth" if "draft_step" in flag else "adaptive-verify"
                   for flag in ADAPTIVE_FLAGS}
"""The adaptive arm each adaptive flag configures."""

DRAFT_ONLY_FLAGS = ("draft_model", "enable_unified_mtp_graph")
"""Launch flags that need a draft model: the ``none`` arm runs without them."""

QUICK_CALIBRATION = {"warmup_steps": 2, "window_steps": 8, "windows_per_point": 2}
"""The quick run's startup calibration: few short windows per grid point (a rough table
measured in seconds; the full run calibrates with the defaults)."""


@dataclass(frozen=True, slots=True)
class Arm:
    name: str  # plain | none | fixed:K | adaptive-verify | adaptive-depth, each maybe @dp1
    config: EffectiveConfig  # plain: the target-only launch (its model and device)
    threads: int | None = None  # torch threads its runs take (None: as they are)

    @property
    def on_ranks(self) -> bool:
        """Whether every rank of a multi-rank launch runs the arm (the plain loop and the
        DP=1 twins run on the front alone)."""
        return self.name != PLAIN and self.config.launch.world_size > 1


DP1 = "@dp1"
"""The suffix of an arm's DP=1 twin: the same arm on the front alone."""


def dp1_twins(settings: Mapping[str, object], arms: Sequence[Arm], *,
              widths: Sequence[int] | None, quick: bool, levels: Sequence[int],
              scratch: Path, temperatures: Sequence[float], cores: int) -> tuple[Arm, ...]:
    """With DP shards of one rank each, every arm again on the front alone (DP=1), with all
    ``cores`` of the host as its torch threads: the DP shards use them all too, so the two
    are compared on the same cores."""
    one = {**settings, "nnodes": 1, "node_rank": 0, "dp_size": 1}
    names = [arm.name for arm in arms if arm.name != PLAIN]
    twins, _ = plan_arms(one, widths=widths, names=names, quick=quick, levels=levels,
                         scratch=scratch, temperatures=temperatures)
    return tuple(Arm(name=arm.name + DP1, config=arm.config, threads=cores) for arm in twins)


@dataclass(frozen=True, slots=True)
class BenchPlan:
    arms: tuple[Arm, ...]
    levels: tuple[int, ...]  # concurrency levels
    prompts: tuple[Sequence[int], ...]  # the pool each level draws from, in order (token ids)
    requests: Mapping[int, int]  # requests per pass at each level
    max_tokens: int
    passes: int
    seed: int = 0
    event_log_dir: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()  # (arm, why the launch does not allow it)
    temperatures: tuple[float, ...] = (0.0,)  # the mix; each prompt is sent at each one
    top_k: int = 0  # the target filters of every request (greedy requests ignore them)
    top_p: float = 1.0
    min_p: float = 0.0
    command_flags: tuple[tuple[str, str], ...] = ()
    """The bench command's own flags: with several ranks, every rank's must be rank 0's."""

    def level_requests(self, level: int) -> list[tuple[Sequence[int], float]]:
        """The level's requests in order, as (prompt, temperature). With m temperatures,
        request i sends prompt i // m at the (i mod m)-th one: each prompt goes out once at
        each temperature, so the kinds are measured on the same prompts (an alternation over
        the interleaved pool would give each kind its own domains)."""
        m = len(self.temperatures)
        return [(self.prompts[(i // m) % len(self.prompts)], self.temperatures[i % m])
                for i in range(self.requests[level])]

    def level_prompts(self, level: int) -> list[Sequence[int]]:
        return [prompt for prompt, _ in self.level_requests(level)]

    def params(self, temperature: float) -> SamplingParams:
        """The sampling parameters of a request at ``temperature``: a greedy request takes
        no filter (it would filter nothing, and requests refuse it)."""
        if not temperature:
            return SamplingParams(temperature=temperature, max_tokens=self.max_tokens)
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, max_tokens=self.max_tokens)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of request the plan sends, greedy first."""
        return tuple(kind for kind in (GREEDY, SAMPLED)
                     if any(kind_of(t) == kind for t in self.temperatures))

    def kind_requests(self, kind: str) -> dict[str, int]:
        """Requests of ``kind`` per pass at each level (keyed by the level as text, as JSON)."""
        return {str(level): sum(kind_of(t) == kind for _, t in self.level_requests(level))
                for level in self.levels}

    @property
    def total_runs(self) -> int:
        return len(self.arms) * len(self.levels) * self.passes


def kind_of(temperature: float) -> str:
    return GREEDY if temperature == 0 else SAMPLED


def shipped_prompts() -> tuple[bytes, ...]:
    """The packaged prompt set (four domains interleaved, so acceptance differs between
    neighbouring requests)."""
    text = resources.files("adaspec.models.data").joinpath("prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line]
    by_domain: dict[str, list[bytes]] = {}
    for row in rows:
        by_domain.setdefault(row["domain"], []).append(row["prompt"].encode())
    columns = [by_domain[d] for d in sorted(by_domain)]
    return tuple(p for group in itertools.zip_longest(*columns) for p in group if p)


# ---- the arms ------------------------------------------------------------------------------

def plan_arms(settings: Mapping[str, object], *, widths: Sequence[int] | None,
              names: Sequence[str] | None, quick: bool, levels: Sequence[int],
              scratch: Path, temperatures: Sequence[float] = (0.0,)
              ) -> tuple[tuple[Arm, ...], tuple[tuple[str, str], ...]]:
    """The arms of a launch: every one checked (``load_config``) before anything runs.

    ``settings`` are the launch flags given; without an algorithm the bench runs DSpark at
    width 5. ``names`` picks arms explicitly (refused when the launch does not allow one);
    otherwise adaptive arms the launch does not allow are skipped with the reason. Every
    arm must also run requests at each of ``temperatures`` (``sampling_refusal``): one that
    cannot is refused when named, and otherwise skipped with the reason when it is the plain
    loop or an adaptive arm, refused when it is ``none`` or a fixed width (the baselines)."""
    base = dict(settings)
    algorithm = str(_typed(base.pop("speculative_algorithm", "DSpark"), "speculative_algorithm"))
    width = int(_typed(base.pop("num_speculative_tokens", 5), "num_speculative_tokens"))
    if algorithm.lower() == "none":
        raise ConfigError("--speculative_algorithm", algorithm, "expected MTP or DSpark: the "
                          "bench always runs the target alone as its baseline")
    adaptive = {k: base.pop(k) for k in ADAPTIVE_FLAGS if k in base}
    turned_off = _turned_off_arms(adaptive, names)
    if names is not None:
        _refuse_unused_adaptive_flags(adaptive, names)
    base.setdefault("max_seqs_per_batch", max(16, max(levels)))
    _check_capacity(base, levels)
    fixed_widths = tuple(widths) if widths else tuple(range(1, width + 1))
    for k in fixed_widths:
        if not 1 <= k <= width:
            raise ConfigError("--widths", k, f"expected widths in 1..{width} (the launch's "
                              "--num_speculative_tokens)")
    if widths and names is not None and not any(n.startswith("fixed:") for n in names):
        raise ConfigError("--widths", ",".join(map(str, widths)), "expected no --widths: "
                          f"--arms={','.join(names)} runs no fixed:K arm")

    def target_only() -> EffectiveConfig:
        return load_config({**{k: v for k, v in base.items() if k not in DRAFT_ONLY_FLAGS},
                            "speculative_algorithm": "none"})

    candidates: dict[str, Callable[[], EffectiveConfig]] = {
        PLAIN: target_only, "none": target_only,
        **{f"fixed:{k}": _fixed(base, algorithm, k) for k in fixed_widths},
        **_adaptive(base, adaptive, algorithm, width, quick, levels, scratch)}
    for arm in turned_off:
        del candidates[arm]
    return _choose(candidates, names, tuple(temperatures))


def _turned_off_arms(adaptive: Mapping[str, object], names: Sequence[str] | None
                     ) -> tuple[str, ...]:
    """The adaptive arms an enable flag set false leaves out; refused where ``--arms`` names
    the arm, or another flag configures it."""
    off = []
    for flag, value in adaptive.items():
        if not flag.startswith("enable_") or asks_for(flag, value):
            continue
        arm = ADAPTIVE_ARM_OF[flag]
        if names is not None and arm in names:
            raise ConfigError(f"--{flag}", value, f"turns off the {arm} arm, which "
                              f"--arms={','.join(names)} runs; expected true, or {arm} left "
                              "out of --arms")
        configuring = next((other for other in adaptive
                            if other != flag and ADAPTIVE_ARM_OF[other] == arm), None)
        if configuring is not None:
            raise ConfigError(f"--{configuring}", adaptive[configuring], f"configures the "
                              f"{arm} arm, which --{flag}={value} turns off; expected one or "
                              "the other")
        off.append(arm)
    return tuple(off)


def asks_for(flag: str, value: object) -> bool:
    """Whether an adaptive flag given asks for its arm (an enable flag set false does not)."""
    if flag.startswith("enable_"):
        return _typed(value, flag) is True
    return True


def _refuse_unused_adaptive_flags(adaptive: Mapping[str, object], names: Sequence[str]) -> None:
    """An adaptive flag configures its arm only: one whose arm ``--arms`` leaves out would be
    ignored, so it is refused (its file is never read)."""
    for flag, value in adaptive.items():
        arm = ADAPTIVE_ARM_OF[flag]
        if arm not in names and asks_for(flag, value):
            raise ConfigError(f"--{flag}", value, f"configures the {arm} arm, which "
                              f"--arms={','.join(names)} does not run; expected {arm} in "
                              f"--arms, or no --{flag}")


def _fixed(base: Mapping[str, object], algorithm: str, k: int
           ) -> Callable[[], EffectiveConfig]:
    return lambda: load_config({**base, "speculative_algorithm": algorithm,
                                "num_speculative_tokens": k})


def _adaptive(base: Mapping[str, object], adaptive: Mapping[str, object], algorithm: str,
              width: int, quick: bool, levels: Sequence[int], scratch: Path
              ) -> dict[str, Callable[[], EffectiveConfig]]:
    common = {**base, "speculative_algorithm": algorithm, "num_speculative_tokens": width}
    verify = {k: v for k, v in adaptive.items() if k.startswith("adaptive_target_verify")}
    depth = {k: v for k, v in adaptive.items() if k == "adaptive_draft_step_config"}
    quick_calibration = {**QUICK_CALIBRATION, **_level_buckets(common, levels)}
    own_costs = {"adaptive_target_verify_calibration", "adaptive_target_verify_cost_table"}
    if quick and not own_costs & set(verify):
        verify["adaptive_target_verify_calibration"] = _write(
            scratch / "verify-calibration.json", quick_calibration)
    if quick and not depth:
        depth["adaptive_draft_step_config"] = _write(
            scratch / "draft-steps.json", {"version": 1, "calibration": quick_calibration})
    return {
        "adaptive-verify": lambda: load_config(
            {**common, "enable_adaptive_target_verify": True, **verify}),
        "adaptive-depth": lambda: load_config(
            {**common, "enable_adaptive_draft_step": True, **depth})}


def _level_buckets(settings: Mapping[str, object], levels: Sequence[int]
                   ) -> dict[str, list[int]]:
    """The request buckets the levels' full batches pad to (a quick calibration measures
    only those; smaller tail batches keep the prewarmed full width)."""
    try:
        launch = load_config(settings).launch
    except ConfigError:
        return {}  # the adaptive arm's own check reports why the launch does not allow it
    if not launch.prepared_request_buckets():
        return {}
    geometry = BucketGeometry.of(launch)
    return {"request_buckets": sorted({geometry.request_bucket(min(level,
                                                                   launch.decode_batch_limit))
                                       for level in levels})}


def _write(path: Path, data: Mapping[str, object]) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def _choose(candidates: Mapping[str, Callable[[], EffectiveConfig]],
            names: Sequence[str] | None, temperatures: tuple[float, ...]
            ) -> tuple[tuple[Arm, ...], tuple[tuple[str, str], ...]]:
    if names is not None:
        return _named(candidates, names, temperatures), ()
    chosen, skipped = [], []
    for name, build in candidates.items():
        try:
            arm = Arm(name, build())
        except ConfigError as error:
            if not name.startswith("adaptive"):
                raise
            skipped.append((name, str(error)))
            continue
        why = sampling_refusal(arm, temperatures)
        if why is None:
            chosen.append(arm)
        elif name == PLAIN or name.startswith("adaptive"):
            skipped.append((name, why))
        else:  # a baseline every figure is read against: the run would mean nothing without
            raise _cannot_sample(name, temperatures, why, "a baseline of this launch")
    return tuple(chosen), tuple(skipped)


def _named(candidates: Mapping[str, Callable[[], EffectiveConfig]], names: Sequence[str],
           temperatures: tuple[float, ...]) -> tuple[Arm, ...]:
    """The arms ``--arms`` names: each one asked for, so refused with its reason, never
    dropped."""
    if len(set(names)) != len(names):
        raise ConfigError("--arms", ",".join(names), "expected each arm once")
    for name in names:
        if name not in candidates:
            raise ConfigError("--arms", name, f"expected some of {', '.join(candidates)}")
    arms = tuple(Arm(name, _arm_config(name, candidates[name])) for name in names)
    for arm in arms:
        why = sampling_refusal(arm, temperatures)
        if why is not None:
            raise _cannot_sample(arm.name, temperatures, why, "named in --arms")
    return arms


def _arm_config(name: str, config: Callable[[], EffectiveConfig]) -> EffectiveConfig:
    """The launch of the arm ``--arms`` names; one the bench's launch does not allow is
    refused naming the arm (the flags it would set were not the user's)."""
    try:
        return config()
    except ConfigError as error:
        raise ConfigError("--arms", name, f"this launch cannot run it: {error}") from None


def sampling_refusal(arm: Arm, temperatures: Sequence[float]) -> str | None:
    """Why ``arm`` cannot run requests at ``temperatures``, or None. Runtime arms ask the
    runtime's own request check (``check_request``), so what the launch refuses at submit is
    found before anything runs, not as a failed request in the middle of a pass."""
    if arm.name == PLAIN:
        return None if all(t == 0 for t in temperatures) else PLAIN_IS_GREEDY
    for temperature in temperatures:
        try:
            check_request(SamplingParams(temperature=temperature), arm.config.launch)
        except UnsupportedRequest as error:
            return str(error)
    return None


def _cannot_sample(arm: str, temperatures: Sequence[float], why: str, asked: str
                   ) -> ConfigError:
    return ConfigError("--temperature", ",".join(f"{t:g}" for t in temperatures),
                       f"the {arm} arm, {asked}, cannot run it: {why}")


def _typed(raw: object, name: str) -> Any:
    """A launch flag's value as its field's type (a clear error for bad text)."""
    return coerce(name, raw, launch_field_types()[name])


def _check_capacity(base: Mapping[str, object], levels: Sequence[int]) -> None:
    capacity = int(_typed(base["max_seqs_per_batch"], "max_seqs_per_batch"))
    if max(levels) > capacity:
        raise ConfigError("--concurrency", max(levels), f"expected at most "
                          f"--max_seqs_per_batch={capacity}: requests beyond it would queue "
                          "instead of running concurrently")
    limit = base.get("acl_graph_decode_batch_size_limit")
    if limit is not None and max(levels) > int(_typed(limit,
                                                      "acl_graph_decode_batch_size_limit")):
        raise ConfigError("--concurrency", max(levels), f"expected at most "
                          f"--acl_graph_decode_batch_size_limit={limit}: a round holds no "
                          "more, so requests beyond it would queue")


# ---- measuring -----------------------------------------------------------------------------

@dataclass(slots=True)
class KindCounts:
    """The requests of one kind (greedy or sampled) in one run, from their own results: a
    mixed batch shares its rounds between the kinds, so the runtime's counters cannot split
    them."""

    requests: int = 0
    tokens: int = 0
    rounds: int = 0  # decode rounds the requests took part in
    verified: int = 0
    accepted: int = 0
    tpot_s: list[float] = field(default_factory=list)

    def add(self, result: RequestResult, tpot: float | None) -> None:
        self.requests += 1
        self.tokens += len(result.token_ids)
        self.rounds += result.rounds
        self.verified += result.verified
        self.accepted += result.accepted
        if tpot is not None:
            self.tpot_s.append(tpot)


@dataclass(slots=True)
class RunRecord:
    """One arm at one concurrency in one pass."""

    arm: str
    level: int
    passed: int  # the pass number
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of this process (all its threads) during the run
    tokens: int = 0
    tpot_s: list[float] = field(default_factory=list)
    outputs: list[tuple[int, ...]] = field(default_factory=list)  # in prompt order
    temperatures: list[float] = field(default_factory=list)  # per output; none: all greedy
    kinds: dict[str, KindCounts] = field(default_factory=dict)
    rounds: int = 0
    rows: int = 0
    request_rounds: int = 0
    verified: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # per position: verified it
    through: list[int] = field(default_factory=list)  # per position: accepted 1..k

    def count_plain(self, run: PlainRun) -> None:
        """A plain-loop run: one row per request per step, no draft."""
        self.seconds, self.outputs = run.seconds, list(run.outputs)
        self.tokens = sum(len(t) for t in run.outputs)
        self.tpot_s = list(run.tpot_s)
        self.rounds = run.steps
        # Every step after the prefills verifies one row per running request and emits one
        # token for it.
        self.rows = self.request_rounds = self.tokens - len(run.outputs)
        # The plain loop decodes greedily only (``sampling_refusal``): one kind.
        self.temperatures = [0.0] * len(run.outputs)
        self.kinds = {GREEDY: KindCounts(requests=len(run.outputs), tokens=self.tokens,
                                         rounds=self.request_rounds, tpot_s=list(run.tpot_s))}

    def count(self, before: RuntimeStatistics, after: RuntimeStatistics) -> None:
        """The run's rounds from the runtime's own counters (no event is built for them)."""
        self.rounds = after.rounds_retired - before.rounds_retired
        self.rows = after.rows_verified - before.rows_verified
        self.request_rounds = after.request_rounds - before.request_rounds
        self.verified = after.drafted_verified - before.drafted_verified
        self.accepted = after.drafted_accepted - before.drafted_accepted
        outcomes = {key: n - before.outcomes.get(key, 0) for key, n in after.outcomes.items()}
        width = max((length for length, _ in outcomes), default=0)
        self.reached = [sum(n for (length, _), n in outcomes.items() if length > k)
                        for k in range(width)]
        self.through = [sum(n for (length, accepted), n in outcomes.items()
                            if length > k and accepted > k) for k in range(width)]


async def timed_request(runtime: Runtime, prompt: Sequence[int], params: SamplingParams
                        ) -> tuple[RequestResult, float | None]:
    """The request's result and its TPOT (``timed``)."""
    return await timed(runtime.submit(list(prompt), params))


async def timed(handle: RequestHandle) -> tuple[RequestResult, float | None]:
    """The result of the request ``handle`` follows, and its TPOT as its client saw it: the
    time from its first chunk of tokens to its last, per token after the first. None with
    fewer than two tokens, or all of them in one chunk (a client that read them late saw no
    time between them, not a TPOT of 0)."""
    first = last = None
    chunks = 0
    async for _ in handle:
        last = time.perf_counter()
        first = first if first is not None else last
        chunks += 1
    result = await handle.result()
    count = len(result.token_ids)
    tpot = (last - first) / (count - 1) if chunks > 1 and first is not None \
        and last is not None else None
    return result, tpot


async def run_level(runtime: Runtime,
                    requests: Sequence[tuple[Sequence[int], SamplingParams]],
                    concurrency: int, record: RunRecord) -> None:
    """C closed-loop clients over the (prompt, parameters) requests; fills ``record``'s
    timing, outputs and per-kind counts."""
    queue = list(enumerate(requests))
    outputs: list[tuple[int, ...]] = [()] * len(requests)
    record.temperatures = [float(params.temperature or 0.0) for _, params in requests]

    async def client() -> None:
        while queue:
            index, (prompt, params) = queue.pop(0)
            result, tpot = await timed_request(runtime, prompt, params)
            outputs[index] = result.token_ids
            kind = kind_of(record.temperatures[index])
            record.kinds.setdefault(kind, KindCounts()).add(result, tpot)
            if tpot is not None:
                record.tpot_s.append(tpot)

    started = time.perf_counter()
    async with asyncio.TaskGroup() as clients:  # one failing client cancels the others
        for _ in range(concurrency):
            clients.create_task(client())
    record.seconds = time.perf_counter() - started
    record.outputs = outputs
    record.tokens = sum(len(t) for t in outputs)


RunProgress = Callable[[RunRecord, int, int], None]
"""Called after each run with the record, runs done and runs in all."""


async def run_bench(plan: BenchPlan, models: Callable[[], ModelSet | None] | None = None,
                    run_progress: RunProgress | None = None,
                    calibration_progress: Progress | None = None,
                    output_failures: list[AdaspecError] | None = None) -> list[RunRecord]:
    """Start every arm, run every pass, stop every arm; the records in run order.

    ``models`` makes one set of models per arm (each runtime owns its KV caches, so arms
    never share one set); default: the built-in reference models. An arm that cannot run
    the plan's temperatures is refused before any arm starts (``sampling_refusal``). An
    event log that could not be written whole is reported when its arm stops: into
    ``output_failures`` when given (the records are returned all the same), else raised."""
    check_sampling(plan)
    async with contextlib.AsyncExitStack() as stack:
        runtimes: dict[str, Runtime | PlainArm] = {}
        # Arms on every rank start first, in plan order as on the other ranks (serve_arms):
        # a long start on the front alone would keep the others waiting in a rendezvous.
        for arm in sorted(plan.arms, key=lambda arm: not arm.on_ranks):
            made = models() if models is not None else None
            if arm.name == PLAIN:
                runtimes[arm.name] = PlainArm.start(arm, made, max(plan.levels))
                continue
            runtime = Runtime(arm.config, models=made,
                              options=_options(plan, arm, calibration_progress))
            await runtime.start()
            # Every started arm stops, whatever fails.
            stack.push_async_callback(_stop, runtime, output_failures)
            runtimes[arm.name] = runtime
        return await _passes(plan, runtimes, run_progress)


def check_sampling(plan: BenchPlan) -> None:
    """Every arm can run the plan's temperatures (``sampling_refusal``), or none starts."""
    for arm in plan.arms:
        why = sampling_refusal(arm, plan.temperatures)
        if why is not None:
            raise _cannot_sample(arm.name, plan.temperatures, why, "in the plan")


async def _stop(runtime: Runtime, output_failures: list[AdaspecError] | None) -> None:
    """Stop an arm; an output it could not write is kept in ``output_failures`` if given."""
    try:
        await runtime.stop()
    except (EventLogError, OutputWriteError) as error:
        if output_failures is None:
            raise
        output_failures.append(error)


@dataclass(frozen=True, slots=True)
class PlainArm:
    """The plain loop's own target, with a KV slot per client of the largest level."""

    target: TargetModel

    @classmethod
    def start(cls, arm: Arm, models: ModelSet | None, concurrency: int) -> "PlainArm":
        device = torch.device(arm.config.launch.device)
        target = (models or builtin_models(arm.config.launch, device)).target
        target.allocate(concurrency)
        return cls(target)

    def run(self, plan: "BenchPlan", level: int, record: RunRecord) -> None:
        """One level, on the calling thread with torch's own thread settings: the plain loop
        is what a user's script gets without the runtime."""
        prompts = [list(prompt) for prompt in plan.level_prompts(level)]
        record.count_plain(plain_loop(self.target, prompts, plan.max_tokens, level))


def event_log_name(arm: str) -> str:
    """The file an arm's event log gets in ``--event_log_dir``."""
    return f"{arm.replace(':', '-')}.jsonl"


def _options(plan: BenchPlan, arm: Arm, progress: Progress | None) -> RuntimeOptions:
    log = None
    if plan.event_log_dir is not None:
        log = str(Path(plan.event_log_dir) / event_log_name(arm.name))
    return RuntimeOptions(seed=plan.seed, event_log=log, calibration_progress=progress,
                          command_flags=plan.command_flags)


def pass_order(names: Sequence[str], number: int) -> list[str]:
    """The arms' order in pass ``number``: every other pass runs them in reverse, and each
    pass rotates its order by ``number``, so over the passes each arm runs early and late
    and both before and after its neighbours (a drift of the machine within a pass does not
    favour one arm)."""
    base = list(names[::-1] if number % 2 else names)
    shift = number % len(base)
    return base[shift:] + base[:shift]


async def _passes(plan: BenchPlan, runtimes: Mapping[str, "Runtime | PlainArm"],
                  progress: RunProgress | None) -> list[RunRecord]:
    records: list[RunRecord] = []
    names = [arm.name for arm in plan.arms]
    arms = {arm.name: arm for arm in plan.arms}
    for number in range(plan.passes):
        order = pass_order(names, number)
        for level in plan.levels:
            for name in order:
                record = RunRecord(arm=name, level=level, passed=number)
                runtime = runtimes[name]
                cpu = time.process_time()
                with _threads(arms[name].threads):
                    if isinstance(runtime, PlainArm):
                        runtime.run(plan, level, record)
                    else:
                        await _run_runtime(runtime, plan, level, record)
                # Other ranks' CPU is not this process's: an arm on every rank has no figure.
                record.cpu_seconds = 0.0 if arms[name].on_ranks else time.process_time() - cpu
                records.append(record)
                if progress is not None:
                    progress(record, len(records), plan.total_runs)
    return records


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Torch's intra-op threads set to ``count`` while a run lasts (unchanged: None)."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


async def serve_arms(plan: BenchPlan) -> None:
    """A rank behind the front: start the arms that run on every rank, in the front's order,
    and decode the front's requests for all of them until the front stops them. What the
    front refuses before it starts is refused here too: no rank waits for a front that left."""
    check_sampling(plan)
    async with contextlib.AsyncExitStack() as stack:
        runtimes = []
        for arm in plan.arms:
            if not arm.on_ranks:
                continue
            runtime = Runtime(arm.config, options=_options(plan, arm, None))
            await runtime.start()
            stack.push_async_callback(runtime.stop)
            runtimes.append(runtime)
        async with asyncio.TaskGroup() as serving:
            for runtime in runtimes:
                serving.create_task(runtime.serve())


async def _run_runtime(runtime: Runtime, plan: BenchPlan, level: int,
                       record: RunRecord) -> None:
    before = runtime.statistics()
    requests = [(prompt, plan.params(t)) for prompt, t in plan.level_requests(level)]
    await run_level(runtime, requests, level, record)
    # Retirement of the last rounds may trail the last token by a round.
    await runtime.wait_idle()
    record.count(before, runtime.statistics())

