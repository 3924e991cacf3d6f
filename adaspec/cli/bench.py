"""``adaspec bench``: adaptive against fixed-width speculation on real requests.

    adaspec bench [LAUNCH FLAGS] [--quick] [--concurrency 1,4,16] [--widths 1,...,w]
                  [--arms NAME,...] [--passes N] [--requests N] [--max_tokens N] [--seed S]
                  [--temperature T[,T...]] [--top_k K] [--top_p P] [--min_p M]
                  [--event_log_dir DIR] [--plot FILE.png] [--json]

Launch flags are those of ``adaspec config`` (default: DSpark, width 5, on the built-in
reference models); the fixed arms drop the adaptive flags, the adaptive arms keep them. An
adaptive flag asks for its arm: one whose arm cannot run, or that ``--arms`` leaves out, is
refused. See ``adaspec.bench.run`` for what is measured and how.
"""

import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from adaspec.bench.run import (
    ADAPTIVE_ARM_OF,
    PLAIN,
    SAMPLED,
    Arm,
    BenchPlan,
    RunProgress,
    RunRecord,
    asks_for,
    dp1_twins,
    event_log_name,
    plan_arms,
    run_bench,
    serve_arms,
    shipped_prompts,
)
from adaspec.bench.statistics import summarise
from adaspec.cli import interrupts
from adaspec.cli.calibrate import ProgressStream, progress_reporter
from adaspec.cli.flags import (
    CommandFlags,
    Flag,
    check_runnable_here,
    launch_settings,
    output_named_by_flag,
    sampling_flag,
)
from adaspec.config import SamplingParams
from adaspec.config.builtin import builtin_checkpoints, uses_builtin_models
from adaspec.config.environment import STDERR, TRACE_ENV, rank_file, trace_destination
from adaspec.config.flags import coerce
from adaspec.config.paths import existing_directory, new_file, path_status
from adaspec.config.requests import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE
from adaspec.errors import AdaspecError, ConfigError, InvalidRequest
from adaspec.models.launch import checkpoint_models, command_tokenizer
from adaspec.models.tokenizer import Tokenizer
from adaspec.runtime.devices.streams import available_cores, cpu_threads
from adaspec.runtime.engine import rank_device, ranks_on_this_host

ABOUT = (
    "Runs the target alone in a plain loop (no runtime), no speculation, every fixed width and "
    "the adaptive modes the launch allows on the shipped prompt set at several concurrency "
    "levels, greedy unless --temperature says otherwise, in one process (rank 0 of a "
    "multi-rank launch, the other ranks serving its arms), and compares "
    "tokens/s, TPOT, acceptance and verified rows. Greedy outputs must be identical in every "
    "arm; random-target acceptance and speed differ from greedy ones, so sampled requests get "
    "their own figures and no token-equality verdict. Launch flags are those of `adaspec "
    "config --help` (default: --speculative_algorithm=DSpark --num_speculative_tokens=5); the "
    "adaptive ones (cost table, calibration and draft-step files) go to the adaptive arms "
    "only, and each asks for its arm (refused where that arm cannot run or --arms leaves it "
    "out); --arms picks the arms.\n\n"
    "Two regimes ship: --model=builtin:target (default) has verified rows nearly free on a "
    "CPU, as an accelerator at low load; with --model=builtin:target-large --concurrency=1,64 "
    "verified rows cost at 64 requests, as at high load.\n\n"
    "With DP shards of one rank each (--nnodes=D --dp_size=D) every arm also runs on rank 0 "
    "alone with all the host's cores (ARM@dp1), so DP=D and DP=1 are compared side by side "
    "on the same cores.")

BENCH = CommandFlags(
    command="bench",
    usage="[LAUNCH FLAGS] [--quick] [--concurrency LIST] [--json] ...",
    about=ABOUT,
    launch=True,
    flags={
        "quick": Flag(help="a short run (one pass, one wave of requests, 24 tokens each, a "
                           "quick calibration): under a minute"),
        "concurrency": Flag(metavar="LIST",
                            help="comma-separated concurrency levels (default 1,4,16)"),
        "widths": Flag(metavar="LIST", help="fixed widths to run (default every width 1..w)"),
        "arms": Flag(metavar="LIST", help="run only these arms (plain, none, fixed:K, "
                                          "adaptive-verify, adaptive-depth)"),
        "passes": Flag(metavar="N", help="passes over every arm and level (default 6; "
                                         "--quick: 1)"),
        "requests": Flag(metavar="N", help="requests per pass at every level (default "
                                           "max(8, 2C); --quick: max(4, C))"),
        "max_tokens": Flag(metavar="N", help="tokens generated per request (default 128; "
                                             "--quick: 24)"),
        "seed": Flag(metavar="S", help="seed of every random draw (default 0)"),
        "temperature": Flag(metavar="T[,T...]", help=(
            "sampling temperature of the requests: 0 greedy (default), above 0 samples the "
            "target; a mix such as 0,0.8 sends each prompt once at each temperature. AL, "
            "acceptance and speed are then also reported per kind (greedy, sampled); sampled "
            "outputs are not compared between arms, and the plain loop (greedy only) is "
            "skipped")),
        "top_k": Flag(metavar="K", help="target top-k of sampled requests (default 0: off; "
                                        "needs a positive --temperature)"),
        "top_p": Flag(metavar="P", help="target top-p of sampled requests, in (0, 1] (default "
                                        "1: off; needs a positive --temperature)"),
        "min_p": Flag(metavar="M", help="target min-p of sampled requests, in [0, 1] (default "
                                        "0: off; needs a positive --temperature)"),
        "event_log_dir": Flag(metavar="DIR", help="write each arm's event log there "
                                                  "(ARM.jsonl, new files)"),
        "plot": Flag(metavar="FILE", help="save a plot (PNG) of tokens/s and per-position "
                                          "acceptance, written after the report is printed "
                                          "(needs matplotlib: pip install 'adaspec[plot]')"),
        "json": Flag(help="print one JSON object instead of the table"),
        "url": Flag(metavar="URL", help="bench a running OpenAI-compatible server instead "
                    "(adaspec serve or another; http://HOST:PORT): tokens/s and TTFT, TPOT "
                    "and end-to-end latency percentiles per concurrency level; only "
                    "--concurrency, --requests, --max_tokens, --temperature, the filters, "
                    "--quick, --json and --served_model_name apply (no runtime starts, so no "
                    "ADASPEC_* variable is read)"),
        "served_model_name": Flag(metavar="NAME", help="with --url: the model requests name "
                                  "(default: the one the server lists)"),
    })


@dataclass(slots=True)
class BenchArgs:
    switches: set[str] = field(default_factory=set)
    values: dict[str, str] = field(default_factory=dict)
    launch_argv: list[str] = field(default_factory=list)


def split_argv(argv: Sequence[str]) -> BenchArgs:
    """The bench flags of ``argv`` (``BENCH`` refuses a flag given twice); everything else is
    a launch flag."""
    parsed = BENCH.parse(argv)
    args = BenchArgs(launch_argv=list(parsed.launch_argv))
    for name, value in parsed.given:
        if BENCH.flags[name].metavar:
            args.values[name] = value
        else:
            args.switches.add(name)
    return args


def _int(name: str, raw: str, low: int, high: int) -> int:
    expected = f"expected an integer in {low}..{high}"
    try:
        value = coerce(name, raw, int)
    except ConfigError:
        raise ConfigError(f"--{name}", raw, expected) from None
    if not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"--{name}", raw, expected)
    return value


def _ints(name: str, raw: str, low: int, high: int) -> tuple[int, ...]:
    parts = raw.split(",")
    values = tuple(_int(name, part, low, high) if part.strip() else
                   _int(name, raw, low, high) for part in parts)
    if len(set(values)) != len(values):
        raise ConfigError(f"--{name}", raw, "expected distinct values")
    return values


TEMPERATURES_EXPECTED = (f"expected 0 (greedy) or a number in {MIN_TEMPERATURE:g}.."
                         f"{MAX_TEMPERATURE:g} (sampled), or a comma-separated mix of distinct "
                         "ones such as 0,0.8")


def read_temperatures(raw: str) -> tuple[float, ...]:
    """``--temperature``: one temperature, or a mix given as a comma-separated list. Every
    refusal shows the whole value given, so a bad member of a mix is seen in its place."""
    try:
        values = tuple(float(sampling_flag("temperature", part)) for part in raw.split(","))
    except ConfigError:
        raise ConfigError("--temperature", raw, TEMPERATURES_EXPECTED) from None
    if len(set(values)) != len(values):
        raise ConfigError("--temperature", raw, "expected distinct values "
                          "(each prompt is sent once at each temperature)")
    return values


FILTER_DEFAULTS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
"""The target filters, off by default."""


def read_filter(name: str, values: Mapping[str, str], temperatures: Sequence[float]
                ) -> float:
    """A target filter flag's value (its default when not given), held to its request
    field's rule. Given with no positive temperature, it would filter nothing (greedy
    requests take the argmax), so it is refused rather than accepted silently."""
    if name not in values:
        return FILTER_DEFAULTS[name]
    raw = values[name]
    value = sampling_flag(name, raw)
    if not any(temperatures):
        raise ConfigError(f"--{name}", raw, "filters sampled requests only; expected a "
                          "positive --temperature with it")
    return value


@dataclass(frozen=True, slots=True)
class Choices:
    quick: bool
    levels: tuple[int, ...]
    widths: tuple[int, ...] | None
    arms: tuple[str, ...] | None
    passes: int
    requests: int | None
    max_tokens: int
    seed: int
    event_log_dir: str | None
    plot: str | None
    as_json: bool
    temperatures: tuple[float, ...] = (0.0,)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def read_choices(args: BenchArgs) -> Choices:
    values, quick = args.values, "quick" in args.switches
    get = values.get
    temperatures = read_temperatures(get("temperature", "0"))
    return Choices(
        quick=quick,
        levels=tuple(sorted(_ints("concurrency", get("concurrency", "1,4,16"), 1, 1024))),
        widths=_ints("widths", values["widths"], 1, 64) if "widths" in values else None,
        arms=tuple(a.strip() for a in values["arms"].split(",")) if "arms" in values else None,
        passes=_int("passes", get("passes", "1" if quick else "6"), 1, 100),
        requests=_int("requests", values["requests"], 1, 100000) if "requests" in values
        else None,
        max_tokens=_int("max_tokens", get("max_tokens", "24" if quick else "128"), 1, 100000),
        seed=_int("seed", get("seed", "0"), 0, MAX_SEED - 1),
        event_log_dir=get("event_log_dir"), plot=get("plot"), as_json="json" in args.switches,
        temperatures=temperatures, top_k=int(read_filter("top_k", values, temperatures)),
        top_p=read_filter("top_p", values, temperatures),
        min_p=read_filter("min_p", values, temperatures))


def requests_per_level(choices: Choices) -> dict[int, int]:
    if choices.requests is not None:
        for level in choices.levels:
            if choices.requests < level:
                raise ConfigError("--requests", choices.requests, f"expected at least the "
                                  f"largest concurrency {max(choices.levels)}, so every "
                                  "client sends a request")
        return dict.fromkeys(choices.levels, choices.requests)
    if choices.quick:
        return {level: max(4, level) for level in choices.levels}  # one wave: figures only
    # Two waves of C requests (eight at least, so a pass at concurrency 1 lasts a few
    # seconds, not one stall of the shared host): short passes, so the many passes
    # interleave the arms finely.
    return {level: max(8, 2 * level) for level in choices.levels}


def check_outputs(choices: Choices, arms: Sequence[Arm],
                  cost_table_output: str | None = None) -> None:
    """Output places are checked before anything runs: nothing is overwritten, and no two
    outputs (the event logs, the plot, the adaptive-verify arm's cost table) are one file."""
    raw = os.environ.get(TRACE_ENV)
    if trace_destination(raw) not in (None, STDERR):
        # Every arm and pass starts a runtime, each of which would write this new file.
        raise ConfigError(TRACE_ENV, raw, "names a file, which one runtime writes; bench "
                          "starts one for every arm and pass: expected it unset, 0, or 1 (the "
                          "trace on standard error)")
    outputs: dict[str, str] = {}  # real path -> the flag that names it
    if cost_table_output is not None:
        outputs[os.path.realpath(cost_table_output)] = \
            f"--adaptive_target_verify_cost_table_output={cost_table_output}"
    if choices.event_log_dir is not None:
        folder = choices.event_log_dir
        existing_directory("--event_log_dir", folder)
        logged = [arm for arm in arms if arm.name.split("@")[0] != PLAIN]
        if not logged:
            raise ConfigError("--event_log_dir", folder, f"expected an arm that writes an "
                              f"event log; {', '.join(arm.name for arm in arms)} runs outside "
                              "the runtime")
        for arm in logged:
            launch = arm.config.launch  # with several ranks, each writes a file of its own
            path = rank_file(os.path.join(folder, event_log_name(arm.name)), launch.world_size,
                             launch.node_rank)
            if path_status("--event_log_dir", path, follow=False):
                raise ConfigError("--event_log_dir", folder, f"{os.path.basename(path)} exists "
                                  "already; expected a folder without this bench's logs")
            new_file("--event_log_dir", path)
            _own_file(outputs, path, f"--event_log_dir={folder}")
    if choices.plot is not None:
        _own_file(outputs, choices.plot, f"--plot={choices.plot}")
        if Path(choices.plot).suffix.lower() != ".png":
            raise ConfigError("--plot", choices.plot, "expected a .png file name")
        new_file("--plot", choices.plot)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot", choices.plot, "needs matplotlib: pip install "
                              "'adaspec[plot]'") from None


def _own_file(outputs: dict[str, str], path: str, named: str) -> None:
    """Record ``path`` as the output ``named`` names, refused when another output names it."""
    real = os.path.realpath(path)
    if real in outputs:
        flag, _, value = named.partition("=")
        raise ConfigError(flag, value, f"expected a file of its own; {outputs[real]} names "
                          f"{path} too")
    outputs[real] = named


def check_arms(settings: Mapping[str, str], arms: Sequence[Arm],
               skipped: Sequence[tuple[str, str]]) -> None:
    """Every arm must run on the built-in models and this device; an adaptive arm that a
    flag of the launch asks for or configures is refused with its reason, never skipped."""
    # Widest first, so a width beyond the drafter is refused at the launch's own width.
    for arm in sorted(arms, key=lambda arm: -arm.config.launch.num_speculative_tokens):
        check_runnable_here(arm.config.launch)
    reasons = dict(skipped)
    for flag, arm_name in ADAPTIVE_ARM_OF.items():
        if flag in settings and asks_for(flag, settings[flag]) and arm_name in reasons:
            raise ConfigError(f"--{flag}", settings[flag], f"asks for the {arm_name} arm, "
                              f"which this launch cannot run ({reasons[arm_name]})")


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''}".strip()
            + f", {os.cpu_count()} cores, torch {torch.__version__}, "
            + f"python {platform.python_version()}")


@dataclass(frozen=True, slots=True)
class CpuTicks:
    """Linux's /proc/stat CPU ticks so far: stolen by the hypervisor, busy (neither idle nor
    waiting for I/O, steal included), and all."""

    stolen: int
    busy: int
    total: int


def cpu_times() -> CpuTicks | None:
    """The machine's CPU ticks so far; None where there is no /proc/stat. On a shared virtual
    machine the hypervisor's steal is noise no ordering of arms removes, and so is the CPU
    other processes take, so the report says how much of each there was."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user .. steal; guest is inside user
    total = sum(ticks)
    return CpuTicks(stolen=ticks[7], busy=total - ticks[3] - ticks[4], total=total)


def steal_share(before: CpuTicks | None, after: CpuTicks | None) -> float | None:
    """The stolen share of the CPU ticks between two ``cpu_times`` readings."""
    if before is None or after is None or after.total <= before.total:
        return None
    return round((after.stolen - before.stolen) / (after.total - before.total), 4)


def others_share(before: CpuTicks | None, after: CpuTicks | None, own_cpu_seconds: float
                 ) -> float | None:
    """The share of the machine's CPU time that went to other processes between two
    readings: busy ticks less the host's steal (reported on its own) and less this process's
    own CPU time."""
    if before is None or after is None or after.total <= before.total:
        return None
    own = own_cpu_seconds * os.sysconf("SC_CLK_TCK")
    busy = (after.busy - after.stolen) - (before.busy - before.stolen)
    return round(max(0.0, busy - own) / (after.total - before.total), 4)


BUSY_SHARE = 0.1
"""Above this share of the machine's CPU going elsewhere, the report warns that the machine
was busy: its wall-clock figures then carry that noise."""


def busy_warning(share: float | None, load: tuple[float, float] | None) -> str | None:
    """One line when the machine was busy during the run, else None. ``load`` is the
    one-minute load average at the start and at the end."""
    cores = os.cpu_count() or 1
    reasons = []
    if share is not None and share > BUSY_SHARE:
        reasons.append(f"{100 * share:.0f} % of the CPU time went to other processes")
    if load is not None and load[0] > cores:
        reasons.append(f"the load average was {load[0]:.1f} on {cores} cores at the start")
    if not reasons:
        return None
    return ("warning: the machine was busy (" + "; ".join(reasons) + "): the figures carry "
            "that noise (torch's intra-op threads wait on each other for a free core, the "
            "plain loop's and the cpu stream's alike); rerun on a quiet machine before "
            "reading a ratio")


def torch_threads(arms: Sequence[Arm]) -> dict[str, int]:
    """The torch threads of the plain loop (this thread's own setting) and of the cpu stream,
    for the arms that run them."""
    stream = cpu_threads()  # checked even when no arm opens a stream: never silently ignored
    threads = {}
    plain = next((arm for arm in arms if arm.name == PLAIN), None)
    if plain is not None:
        threads["plain"] = plain.threads or torch.get_num_threads()
    if any(arm.name != PLAIN and arm.config.launch.device == "cpu" for arm in arms):
        threads["cpu_stream"] = stream
    return threads


def run_progress(stream: TextIO | None) -> RunProgress:
    """A bar on a terminal, one JSON line per run otherwise."""
    progress = ProgressStream(stream)
    if progress.isatty():
        def bar(record: RunRecord, done: int, total: int) -> None:
            filled = 30 * done // total
            end = "\n" if done == total else ""
            progress.write(f"\rbench [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} "
                           f"runs  {record.arm} C={record.level}          {end}")
        return bar

    def line(record: RunRecord, done: int, total: int) -> None:
        progress.write(json.dumps({"bench_run": done, "of": total, "arm": record.arm,
                                   "concurrency": record.level, "pass": record.passed,
                                   "tokens_per_second": round(record.tokens / record.seconds,
                                                              2) if record.seconds else None})
                       + "\n")
    return line


def bench_prompts(tokenizer: Tokenizer, context_limit: int, max_tokens: int, *,
                  checkpoint: bool, model: str) -> tuple[Sequence[int], ...]:
    """The shipped prompts as the target's tokens. A checkpoint's context may be shorter than
    the prompts were written for: each then keeps its last tokens, leaving room for
    ``max_tokens`` (said on stderr; the built-in models' prompts are never cut)."""
    try:
        prompts = tuple(tokenizer.encode(p.decode("utf-8")) for p in shipped_prompts())
    except InvalidRequest:
        raise ConfigError("--model", model, "its tokenizer cannot encode the shipped prompts "
                          "(their text would read as its unknown token)") from None
    if not checkpoint:
        return prompts
    room = context_limit - 1 - max_tokens
    if room < 1:
        raise ConfigError("--max_tokens", max_tokens, f"expected at most {context_limit - 2}: "
                          f"the checkpoint's context limit {context_limit} less a prompt")
    if any(len(p) > room for p in prompts):
        interrupts.say(f"adaspec bench: prompts cut to their last {room} tokens to fit the "
                       f"context limit {context_limit} of --model with --max_tokens={max_tokens}")
    return tuple(p[-room:] for p in prompts)


def check_room(plan: BenchPlan, arms: Sequence[Arm]) -> None:
    """Every prompt a run sends has room for --max_tokens in the built-in target's context:
    refused before anything loads, not when the first request is submitted."""
    limits = {found[1] for arm in arms
              if (found := builtin_checkpoints(arm.config.launch)) is not None}
    if not limits:
        return
    limit = min(limits)
    longest = max(len(prompt) for level in plan.levels for prompt in plan.level_prompts(level))
    if plan.max_tokens > limit - longest:
        raise ConfigError("--max_tokens", plan.max_tokens, f"expected at most "
                          f"{limit - longest}: the context limit {limit} less the {longest} "
                          "tokens of the longest shipped prompt this run sends")


def _run_url(argv: Sequence[str], args: BenchArgs, choices: Choices) -> int:
    from adaspec.bench.url import refuse_runtime_flags, run_url

    if "url" not in args.values:
        raise ConfigError("--served_model_name", args.values["served_model_name"],
                          "names a server's model; expected --url with it")
    refuse_runtime_flags(BENCH.parse(argv).given, args.launch_argv, os.environ)
    params = SamplingParams(temperature=0.0, top_k=choices.top_k, top_p=choices.top_p,
                            min_p=choices.min_p, max_tokens=choices.max_tokens)
    return run_url(args.values["url"], args.values.get("served_model_name"),
                   requests_per_level(choices), choices.temperatures, params, choices.as_json)


def run(argv: Sequence[str]) -> int:
    if BENCH.parse(argv).help:
        print(BENCH.help())
        return 0
    args = split_argv(argv)
    choices = read_choices(args)
    if "url" in args.values or "served_model_name" in args.values:
        return _run_url(argv, args, choices)
    settings = launch_settings(args.launch_argv, "bench")
    with tempfile.TemporaryDirectory(prefix="adaspec-bench-") as scratch:
        arms, skipped = plan_arms(settings, widths=choices.widths, names=choices.arms,
                                  quick=choices.quick, levels=choices.levels,
                                  scratch=Path(scratch), temperatures=choices.temperatures)
        check_arms(settings, arms, skipped)
        launch = arms[0].config.launch
        # The launch of a speculating arm names the drafter a checkpoint's arms load.
        drafting = next((arm.config.launch for arm in arms
                         if arm.config.launch.speculative_algorithm != "none"), launch)
        tokenizer, context_limit = command_tokenizer(drafting)
        prompts = bench_prompts(tokenizer, context_limit, choices.max_tokens,
                                checkpoint=not uses_builtin_models(drafting),
                                model=drafting.model)
        models = None if uses_builtin_models(drafting) else functools.partial(
            checkpoint_models, drafting, rank_device(drafting))
        front = launch.node_rank == 0
        if front and launch.world_size > 1:
            # Starting the ranks shares the host's cores among them; the arms on the front
            # alone keep them all.
            arms = tuple(dataclasses.replace(arm, threads=available_cores())
                         if arm.name == PLAIN else arm for arm in arms)
        if front and launch.dp_size > 1 and launch.resolved.tp_size == 1:
            arms += dp1_twins(settings, arms, widths=choices.widths, quick=choices.quick,
                              levels=choices.levels, scratch=Path(scratch),
                              temperatures=choices.temperatures, cores=available_cores())
        check_outputs(choices, arms,
                      next((arm.config.launch.adaptive_target_verify_cost_table_output
                            for arm in arms if arm.name == "adaptive-verify"), None))
        threads = torch_threads(arms)  # a bad ADASPEC_CPU_THREADS is refused before any run
        plan = BenchPlan(arms=arms, levels=choices.levels, prompts=prompts,
                         requests=requests_per_level(choices), max_tokens=choices.max_tokens,
                         passes=choices.passes, seed=choices.seed,
                         event_log_dir=choices.event_log_dir, skipped=skipped,
                         temperatures=choices.temperatures, top_k=choices.top_k,
                         top_p=choices.top_p, min_p=choices.min_p,
                         command_flags=BENCH.parse(argv).given)
        check_room(plan, arms)
        if not front:  # the same launch line on every rank: this one serves the front's runs
            interrupts.run(serve_arms(plan))
            return 0
        started, ticks, own = time.perf_counter(), cpu_times(), time.process_time()
        load_start = _load()
        failures: list[AdaspecError] = []
        records = interrupts.run(run_bench(plan, models, run_progress=run_progress(sys.stderr),
                                        calibration_progress=progress_reporter(sys.stderr),
                                        output_failures=failures))
    report = summarise(plan, records)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["machine"] = machine()
    ticks_after, load_end = cpu_times(), _load()
    report["cpu_steal_share"] = steal_share(ticks, ticks_after)
    report["cpu_share_of_other_processes"] = others_share(ticks, ticks_after,
                                                          time.process_time() - own)
    report["ranks_on_this_host"] = ranks_on_this_host(launch)
    report["load_average"] = None if load_start is None or load_end is None else {
        "start": load_start, "end": load_end}
    # The plain loop runs on this thread with torch's own setting; the runtime arms' cpu
    # stream keeps it too (loop stream) or its own (ADASPEC_CPU_THREADS, the worker stream).
    report["torch_threads"] = threads
    report["busy_warning"] = busy_warning(  # the other ranks' work is not another's
        None if report["ranks_on_this_host"] > 1 else report["cpu_share_of_other_processes"],
        None if load_start is None or load_end is None else (load_start, load_end))
    if choices.as_json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report, sys.stdout)
    sys.stdout.flush()
    if choices.plot is not None:  # after the report: a failed write loses the plot only
        write_plot(report, choices.plot)
    if failures:  # an event log that could not be written, said after the report
        raise output_named_by_flag(failures[0], "--event_log_dir")
    # No greedy request (None): no token-equality verdict applies, so none failed.
    return 1 if report["greedy_outputs_identical"] is False else 0


def write_plot(report: dict[str, Any], path: str) -> None:
    """Render the plot, then write it to ``path`` as a new file (``path`` was checked new
    before the run; a file that appeared since is never overwritten). A write that fails (a
    full disk, a quota, an I/O error) is one line naming --plot, and the partial file is
    removed."""
    from adaspec.bench.plot import render_png  # deferred: optional matplotlib

    png = render_png(report)
    try:
        out = open(path, "xb")  # noqa: SIM115 - closed below
    except OSError as error:
        reason = "it exists now" if isinstance(error, FileExistsError) else \
            error.strerror or type(error).__name__
        raise ConfigError("--plot", path, f"could not be written ({reason}); the report "
                          "above is complete") from None
    try:
        with out:
            out.write(png)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise ConfigError("--plot", path, f"could not be written "
                          f"({error.strerror or type(error).__name__}); the report above "
                          "is complete") from None


def _load() -> float | None:
    """The one-minute load average, where the system has one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # no load average on this system
        return None


def _fmt(value: Any, spec: str) -> str:
    """``value`` as ``spec`` has it, or ``-`` at the same width (the columns stay aligned)."""
    if value is None:
        width = re.match(r"\d*", spec)
        return "-".rjust(int(width.group()) if width and width.group() else 1)
    return format(value, spec)


def spread_of(entry: dict[str, Any]) -> float:
    """The noise of an arm's ratio to the best fixed width (0.0 when none was measured)."""
    return float(entry.get("speedup_vs_best_fixed_noise") or 0.0)


def _versus_best_fixed(entry: dict[str, Any]) -> str:
    """The last column: the ratio to the best fixed width, its noise and pass range; a dash
    alone where there is no ratio (no fixed arm ran, or no pass measured both), since a
    noise or range of nothing means nothing."""
    ratio = entry["speedup_vs_best_fixed"]
    if ratio is None:
        return "-"
    low, high = entry["speedup_vs_best_fixed_range"]
    return f"{ratio:7.3f} +-{spread_of(entry):.3f} ({low:.3f}..{high:.3f})"


def _best_fixed_words(level: dict[str, Any]) -> str:
    """The level's best fixed width, in words where no fixed arm ran (never a raw None)."""
    return level["best_fixed"] or "none (no fixed arm ran)"


def _tied(level: dict[str, Any]) -> str:
    others = [arm for arm in level["fixed_within_noise"] or () if arm != level["best_fixed"]]
    return f"; within noise of it: {', '.join(others)}" if others else ""


def _steady_line(report: dict[str, Any]) -> str:
    steady = report["fixed_within_noise_at_every_level"]
    if report["best_fixed_changes_with_concurrency"]:
        return ("the best fixed width changes with concurrency: no fixed width is within noise "
                "of the best at every level")
    return (f"within noise of the best fixed width at every concurrency: {', '.join(steady)} "
            "(the best fixed width does not change with concurrency beyond noise)")


def _others(report: dict[str, Any]) -> str:
    share = report.get("cpu_share_of_other_processes")
    ranks = report.get("ranks_on_this_host", 1)
    among = f" (the launch's {ranks - 1} other rank(s) on this host among them)" \
        if ranks > 1 else ""
    return "" if share is None else f", by other processes{among}: {100 * share:.1f} %"


def print_table(report: dict[str, Any], out: TextIO) -> None:
    write: Callable[[str], Any] = lambda text: out.write(text + "\n")  # noqa: E731
    _print_heading(report, write)
    requests = report["settings"]["requests_per_pass"]
    for summary in report["levels"]:
        level = summary["concurrency"]
        entries = [e for e in report["arms"] if e["concurrency"] == level]
        write("")
        write(f"concurrency {level} ({requests[str(level)]} requests per "
              f"pass; best fixed width: {_best_fixed_words(summary)}{_tied(summary)})")
        write(f"{'arm':16} {'tok/s':>8} {'tok/cpu-s':>9} {'TPOT ms':>8} {'p50':>7} {'p90':>7} "
              f"{'AL':>5} {'accept':>6} {'rows':>6} {'vs plain':>8} {'vs none':>8}  "
              "vs best fixed, 2 SE (pass range)")
        for e in entries:
            tpot = e["tpot_ms"]
            write(f"{e['arm']:16} {e['tokens_per_second']:8.1f} "
                  f"{_fmt(e.get('tokens_per_cpu_second'), '9.1f')} {_fmt(tpot['mean'], '8.2f')} "
                  f"{_fmt(tpot['p50'], '7.2f')} {_fmt(tpot['p90'], '7.2f')} "
                  f"{_fmt(e['mean_acceptance_length'], '5.2f')} "
                  f"{_fmt(e['acceptance_rate'], '6.2f')} "
                  f"{_fmt(e['mean_rows_per_round'], '6.1f')} "
                  f"{_fmt(e.get('speedup_vs_plain'), '8.3f')} "
                  f"{_fmt(e['speedup_vs_none'], '8.3f')} "
                  f"{_versus_best_fixed(e)}")
        fixed = sum(e["arm"].startswith("fixed:") for e in entries)
        for e in entries:
            if e["arm"].startswith("adaptive") and e["versus_best_fixed"] is not None:
                low, high = e["versus_best_fixed_bounds"]
                write(f"{e['arm']} against the best fixed width: {e['versus_best_fixed']} "
                      f"(its ratio to it lies in {low:.3f}..{high:.3f}, from its ratios to "
                      f"all {fixed} fixed widths)")
        write("per-position acceptance (share of request-rounds verifying position k that "
              "accepted drafts 1..k):")
        for e in entries:
            if e["position_acceptance"]:
                write(f"  {e['arm']:16} " + " ".join(_fmt(a, '.2f')
                                                      for a in e["position_acceptance"]))
        if SAMPLED in report["settings"]["sampling"]["requests_per_pass_by_kind"]:
            _print_kinds(entries, write)
    _print_footer(report, write)


def _print_kinds(entries: Sequence[dict[str, Any]], write: Callable[[str], Any]) -> None:
    """Each arm's greedy and sampled requests apart: random-target acceptance and speed are
    not greedy ones (the figures above mix the kinds). No tok/s: the kinds share the batches
    and the run's time, so a kind has no throughput of its own; TPOT is each kind's own."""
    write("by kind of request (TPOT, AL and accept from the kind's own requests; tok/s is "
          "the run's, above):")
    write(f"  {'arm':16} {'kind':8} {'reqs':>5} {'TPOT ms':>8} {'p90':>7} "
          f"{'AL':>5} {'accept':>6}")
    for e in entries:
        for kind, k in e["by_kind"].items():
            tpot = k["tpot_ms"]
            write(f"  {e['arm']:16} {kind:8} {k['requests']:5d} "
                  f"{_fmt(tpot['mean'], '8.2f')} {_fmt(tpot['p90'], '7.2f')} "
                  f"{_fmt(k['mean_acceptance_length'], '5.2f')} "
                  f"{_fmt(k['acceptance_rate'], '6.2f')}")


def sampling_words(settings: Mapping[str, Any]) -> str:
    """How the run's requests sample, for the heading."""
    sampling = settings["sampling"]
    temperatures = sampling["temperatures"]
    shown = " and ".join(f"{t:g}" for t in temperatures)
    if temperatures == [0.0]:
        return "greedy"
    filters = [f"{name.replace('_', '-')} {sampling[name]:g}"
               for name, off in (("top_k", 0), ("top_p", 1), ("min_p", 0))
               if sampling[name] != off]
    words = (f"each prompt at temperatures {shown}" if len(temperatures) > 1
             else f"sampled at temperature {shown}")
    return words + (f" ({', '.join(filters)})" if filters else "")


def _print_heading(report: dict[str, Any], write: Callable[[str], Any]) -> None:
    settings = report["settings"]
    steal = report.get("cpu_steal_share")
    threads = report.get("torch_threads") or {}
    names = {"plain": "plain loop", "cpu_stream": "cpu stream"}
    write(f"adaspec bench: {report['machine']}; {settings['passes']} pass(es), "
          f"{settings['max_tokens']} tokens per request, {sampling_words(settings)}; "
          f"{report['seconds']} s"
          + ("; torch threads: " + ", ".join(f"{names[k]} {v}" for k, v in threads.items())
             if threads else "")
          + ("" if steal is None else f"; CPU time stolen by the host: {100 * steal:.1f} %")
          + _others(report))
    if report.get("busy_warning"):
        write(report["busy_warning"])


def _print_footer(report: dict[str, Any], write: Callable[[str], Any]) -> None:
    write("")
    if not report["verdicts"]:
        write("one pass: figures only, no verdict (a verdict needs the noise of several "
              "passes; drop --quick, or give --passes 2 or more)")
    elif report["best_fixed_changes_with_concurrency"] is not None:
        write(_steady_line(report))
    write("AL counts the residual or bonus token (accepted + 1); rows = padded target rows "
          "verified per round.")
    for skipped in report["skipped_arms"]:
        write(f"skipped {skipped['arm']}: {skipped['why']}")
    reference = report.get("outputs_reference", "")
    against = "the target alone" if reference in ("plain", "none") else f"arm {reference}'s"
    identical = report["greedy_outputs_identical"]
    if identical:
        write(f"greedy outputs: identical in every arm ({report['outputs_compared']} outputs "
              f"compared with {against})")
    elif identical is False:
        first = report["output_mismatches"][0]
        write(f"greedy outputs DIFFER: {len(report['output_mismatches'])}+ mismatches, first "
              f"{first['arm']} at concurrency {first['concurrency']}, request "
              f"{first['prompt']}, token {first['first_difference']}")
    sampled = (report.get("output_checks") or {}).get(SAMPLED)
    if sampled:
        write(f"sampled outputs: {sampled}")
    for note in report.get("notes") or ():
        write(f"note: {note}")
