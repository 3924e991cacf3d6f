"""The runtime an engine embeds: ``await start()``, ``submit`` requests and stream their
tokens, ``statistics()``, ``await stop()``.

Start loads and places the models, allocates KV slots, prepares every graph binding on the
device stream, and opens the event bus, the event log and the state trace; the round loop
itself is ``adaspec.runtime.pipeline``.
"""

import asyncio
import datetime
import functools
import json
import logging
import math
import numbers
import os
import reprlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adaspec.availability import require_device
from adaspec.config.effective import EffectiveConfig
from adaspec.config.environment import (
    STDERR,
    TRACE_ENV,
    rank_file,
    trace_destination,
)
from adaspec.config.launch import (
    PER_RANK_SETTINGS,
    LaunchConfig,
    ascii_digits,
    launch_field_types,
)
from adaspec.config.limits import BUILTIN_DRAFTS, BUILTIN_TARGETS
from adaspec.config.paths import check_own_files, new_file
from adaspec.config.requests import (
    MAX_SEED,
    SamplingParams,
    check_request,
    check_room,
)
from adaspec.errors import MISSING, AdaspecError, ConfigError, DeviceLayerError, InvalidRequest
from adaspec.models.checkpoint import ReferenceModels, load_reference_models
from adaspec.models.limits import check_model_limits, check_num_kv_slots
from adaspec.models.parallel import split_blocks
from adaspec.models.protocols import ModelSet, TargetModel, has_member, missing_member
from adaspec.policies.base import BudgetPolicy, DepthPolicy
from adaspec.policies.bundles import (
    Compatibility,
    CostBundle,
    bundle_from_dict,
    launch_fields,
)
from adaspec.policies.registry import BUILT_IN_CLASSES, make_budget_policy, make_depth_policy
from adaspec.runtime.calibration import CalibrationRun, Progress, calibrate_on_stream
from adaspec.runtime.devices.buckets import BindingRegistry, BucketGeometry, preparation_order
from adaspec.runtime.devices.collectives import (
    Collectives,
    DistributedCollectives,
    LocalCollectives,
)
from adaspec.runtime.devices.graphs import binding_factory
from adaspec.runtime.devices.streams import (
    DeviceStream,
    cpu_threads,
    open_stream,
    share_cores,
)
from adaspec.runtime.drafting import Drafting, DSparkDrafting, MtpDrafting, NoDrafting
from adaspec.runtime.events.bus import EventBus, is_async_callable
from adaspec.runtime.events.clock import CheckedClock, Clock, MonotonicClock, clock_fault
from adaspec.runtime.events.types import RequestArrived
from adaspec.runtime.kv_slots import KvSlotSampling, KvSlotStates
from adaspec.runtime.pipeline import Pipeline, RuntimeStatistics
from adaspec.runtime.plans import CalibrationPlan, cost_source
from adaspec.runtime.ranks import FollowerRefused, RankLink
from adaspec.runtime.requests import Request, RequestHandle, check_prompt, prompt_ids
from adaspec.runtime.rounds import CheckedDrafter, DeviceContext, Lockstep, StageHook
from adaspec.runtime.split import SplitBindings
from adaspec.runtime.states import RoundHooks
from adaspec.runtime.trace import StateTrace
from adaspec.runtime.unified import round_binding_factory

LOG = logging.getLogger("adaspec")

ABANDONED = ("stop() was called while the runtime was starting; the start was abandoned: "
             "start it again")


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """Runtime settings that are not launch flags."""

    seed: int = 0
    """Seeds every random draw (per round and per prefill), so a run replays exactly."""
    event_log: str | None = None
    """Write the event log (JSON lines) here; the file must not exist. An ``os.PathLike``
    is kept as its str."""
    trace: str | None = None
    """Write the state trace (one JSON line per transition) here, in place of
    ``ADASPEC_TRACE`` (not read then); off when None and that variable is unset."""
    clock: Clock | None = None
    """Time source of events and the trace (a virtual clock in tests): seconds as a finite
    real number that never goes back. A reading that is none fails the start, or every
    request at the round loop's next pass, naming this option; a later start reads again."""
    stage_hook: StageHook | None = None
    """Called as each stage's device work starts (fault injection in tests)."""
    depth_policy: DepthPolicy | None = None
    """Replaces the configured draft-depth policy (counterfactual runs, tests); with graphs,
    every legal G is then prepared, so a shallower round verifies the rows it covers.
    Refused without speculation and with unified graphs, which run one depth."""
    budget_policy: BudgetPolicy | None = None
    """Replaces the configured budget policy; with graphs, every legal G is then prepared, as
    for adaptive target verify, so that each pick is verified as picked."""
    calibration_progress: Progress | None = None
    """Called after each calibration window (a progress bar); default: one structured log
    line per window on the ``adaspec.calibration`` logger."""
    command_flags: tuple[tuple[str, str], ...] = ()
    """The (name, value) flags of the command that runs the runtime, other than launch flags
    (``--prompt``, ``--max_tokens``, ...): with several ranks, each rank's must equal rank
    0's, as its launch flags must, since rank 0 alone reads them."""

    def __post_init__(self) -> None:
        seed: object = self.seed  # whatever the caller passed, until checked
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
                or not 0 <= int(seed) < MAX_SEED:
            raise ConfigError("RuntimeOptions.seed", repr(seed), "expected an integer in "
                              f"0..{MAX_SEED - 1}")
        object.__setattr__(self, "seed", int(seed))  # a numpy integer is the int it holds
        for name in ("event_log", "trace"):  # a path-like is kept as its str
            object.__setattr__(self, name, _option_path(name, getattr(self, name)))
        flags: object = self.command_flags
        if not isinstance(flags, Sequence) or isinstance(flags, str) or not all(
                isinstance(pair, Sequence) and len(pair) == 2
                and all(isinstance(part, str) for part in pair) for pair in flags):
            raise ConfigError("RuntimeOptions.command_flags", flags, "expected (name, value) "
                              "pairs of strings")
        object.__setattr__(self, "command_flags", tuple(tuple(pair) for pair in flags))
        _check_protocol("RuntimeOptions.clock", self.clock, Clock,
                        "a Clock (adaspec.runtime.events.clock: now() returns seconds) or None")
        for name, called in (("stage_hook", "(round, stage)"),
                             ("calibration_progress", "(measured point)")):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"RuntimeOptions.{name}", value,
                                  f"expected a callable, called with {called}, or None")
            if value is not None and is_async_callable(value):
                raise ConfigError(f"RuntimeOptions.{name}", value, "expected a plain function: "
                                  "an async def one would only make coroutines nobody awaits")
        for name, protocol in (("depth_policy", DepthPolicy),
                               ("budget_policy", BudgetPolicy)):
            _check_protocol(f"RuntimeOptions.{name}", getattr(self, name), protocol,
                            f"a {protocol.__name__} (adaspec.policies.base) or None")
            _check_recordable(f"RuntimeOptions.{name}", getattr(self, name))


def _check_policies_for_launch(options: RuntimeOptions, launch: LaunchConfig) -> None:
    """An own policy the launch could not follow is refused before anything runs, not by
    every request failing at its first round: without speculation there is no depth to
    choose nor draft to verify, and a unified graph runs each round at its prepared depth."""
    algorithm = launch.speculative_algorithm
    for name in ("depth_policy", "budget_policy"):
        policy = getattr(options, name)
        if policy is not None and algorithm == "none":
            raise ConfigError(f"RuntimeOptions.{name}", policy.name, "expected None with "
                              "speculative_algorithm=none: that launch drafts nothing, so "
                              "there is no draft depth or verify width to decide")
    if options.depth_policy is not None and launch.enable_unified_mtp_graph:  # graphs on
        raise ConfigError("RuntimeOptions.depth_policy", options.depth_policy.name,
                          "expected None with enable_unified_mtp_graph=true: a unified graph "
                          "runs each round at the depth it was prepared for (the launch rules "
                          "refuse adaptive draft steps with it for the same reason)")


def _option_path(name: str, value: object) -> str | None:
    """A file-path option as a str: a str, an ``os.PathLike`` of a str, or None."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"RuntimeOptions.{name}", value,
                          "expected a file path (a str or os.PathLike) or None")
    if path == "":  # not "none": None says that
        raise ConfigError(f"RuntimeOptions.{name}", path, "expected a file path, or None for "
                          f"no {name.replace('_', ' ')}")
    if name == "event_log" and path == STDERR:
        raise ConfigError(f"RuntimeOptions.{name}", path, EVENT_LOG_NOT_A_STREAM)
    return path


def _check_protocol(setting: str, value: object, protocol: type, what: str) -> None:
    """Refuse ``value`` (None passes) unless it provides ``protocol``: a class instead of an
    instance, or the first member it lacks or cannot be called as, named."""
    if value is None:
        return
    if isinstance(value, type):
        raise ConfigError(setting, value, f"expected {what}; got a class: pass an instance")
    missing = missing_member(value, protocol)
    if missing is not None:
        raise ConfigError(setting, value, f"expected {what}; it has {missing}")


def _check_recordable(setting: str, policy: object) -> None:
    """An event log's header records a policy by its name and settings, and a replay rebuilds
    a built-in policy from its name: an own policy needs a name of its own (a str) and
    settings a JSON object can hold."""
    if policy is None:
        return
    name = policy.name  # type: ignore[attr-defined]  # checked by _check_protocol
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{setting}.name", name, "expected a non-empty str (the event log "
                          "records the policy by it)")
    built_in = BUILT_IN_CLASSES.get(name)
    if built_in is not None and type(policy) is not built_in:  # a subclass decides otherwise
        raise ConfigError(f"{setting}.name", name, "is a built-in policy's name; expected "
                          "another, so that a replay does not rebuild the built-in one in "
                          "this policy's place")
    try:
        settings = policy.settings()  # type: ignore[attr-defined]
    except Exception as error:  # the policy's bug, named before anything runs
        raise ConfigError(f"{setting}.settings()", MISSING, f"raised "
                          f"{type(error).__name__}: {error}; expected a dict of settings") \
            from None
    if type(settings) is not dict:
        raise ConfigError(f"{setting}.settings()", reprlib.repr(settings), "expected a dict "
                          "of str keys to JSON values")
    for key, value in settings.items():
        if not isinstance(key, str) or not _json_exact(value):
            raise ConfigError(f"{setting}.settings()[{key!r}]", reprlib.repr(value),
                              "expected a str key and a JSON value (finite numbers, str, bool, "
                              "None, lists and str-keyed dicts of them): the event log "
                              "records it as it is")


def _json_exact(value: object, depth: int = 0) -> bool:
    """Whether JSON holds ``value`` as it is (no tuple read back as a list, no int key as a
    str, no NaN)."""
    if depth > 32:
        return False
    if value is None or isinstance(value, bool | str):
        return True
    if isinstance(value, int | float):
        return type(value) in (int, float) and (type(value) is int or math.isfinite(value))
    if type(value) is list:
        return all(_json_exact(item, depth + 1) for item in value)
    if type(value) is dict:
        return all(isinstance(k, str) and _json_exact(v, depth + 1) for k, v in value.items())
    return False


def builtin_models(launch: LaunchConfig, device: torch.device) -> ReferenceModels:
    """The shipped reference family of a built-in ``--model``. The runtime loads nothing
    else itself: an engine's own models are passed in as ``Runtime(models=...)``."""
    family = BUILTIN_TARGETS.get(launch.model)
    if family is None:
        raise ConfigError("--model", launch.model,
                          f"expected one of {', '.join(BUILTIN_TARGETS)} when no models are "
                          "passed to Runtime(models=...); the runtime loads no checkpoint "
                          "path itself")
    if launch.draft_model is not None and not launch.draft_model.startswith("builtin:"):
        raise ConfigError("--draft_model", launch.draft_model,
                          f"expected {BUILTIN_DRAFTS.get(launch.speculative_algorithm, 'none')} "
                          "when no models are passed to Runtime(models=...); the runtime "
                          "loads no checkpoint path itself")
    return load_reference_models(device, name=family)


MODELS_IN_USE: dict[int, "weakref.ref[Runtime]"] = {}
"""The given model objects of every runtime started and not yet stopped, by id: a start
(re)allocates a model's KV caches, which would corrupt another running runtime's requests.
Weak: a runtime dropped unstopped holds nothing."""

MODEL_ROLES = ("target", "mtp", "dspark")

EVENT_LOG_NOT_A_STREAM = ("expected a file path: replay reads an event log back from its file, "
                          "so none is written to a stream ('-' sends the state trace to stderr)")


LOOPBACK_HOSTS = ("localhost", "127.", "[::1]")


def ranks_on_this_host(launch: LaunchConfig) -> int:
    """How many ranks of the launch run on this host: all of them when the rendezvous is on
    the loopback (no other host can reach it), else torchrun's LOCAL_WORLD_SIZE, else one
    (one rank per node, as the specification launches them)."""
    if launch.master_node_addr.startswith(LOOPBACK_HOSTS):
        return launch.world_size
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if ascii_digits(local) and int(local) >= 1 else 1


def _slot_states(target: TargetModel, num_kv_slots: int, keeps_hidden: bool,
                 device: torch.device) -> KvSlotStates:
    """Every KV slot's decoding state, with a row of the target's hidden state each when a
    drafter reads it. Only an absurd ``hidden_size`` (a model of the embedder's) makes those
    rows too large to allocate: then it is named, not the allocator."""
    hidden_size = target.hidden_size if keeps_hidden else 0
    try:
        return KvSlotStates.allocate(num_kv_slots, hidden_size, target.dtype, device)
    # torch's CPU allocator raises RuntimeError; a size past a 64-bit integer, TypeError.
    except (MemoryError, RuntimeError, TypeError, OverflowError):
        size = (num_kv_slots + 1) * hidden_size * target.dtype.itemsize
        raise ConfigError("Runtime(models=...).target.hidden_size", hidden_size, (
            f"the hidden states of its {num_kv_slots + 1} KV slot rows ({size} bytes) cannot "
            f"be allocated on {device}; expected the width of the target's hidden states, or "
            "fewer sequences per batch")) from None


def local_rank(launch: LaunchConfig) -> int:
    """This rank's place among the ranks on its host: torchrun's LOCAL_RANK, else
    --node_rank modulo the ranks on this host."""
    local = os.environ.get("LOCAL_RANK", "")
    if ascii_digits(local):
        return int(local)
    return launch.node_rank % ranks_on_this_host(launch)


def rank_device(launch: LaunchConfig) -> torch.device:
    """The device this rank runs on. Ranks sharing a host each take their own accelerator
    (the local rank's), made current so the backend's collectives and graphs use it; the
    cpu is shared."""
    if launch.device == "cpu" or launch.world_size == 1:
        return torch.device(launch.device)
    index = local_rank(launch)
    module = getattr(torch, launch.device)  # torch.cuda, or torch.npu once torch_npu loaded
    if index >= module.device_count():
        raise ConfigError("--node_rank", launch.node_rank,
                          f"expected a local rank below the {module.device_count()} "
                          f"{launch.device} devices of this host (one each); it is local "
                          f"rank {index}")
    device = torch.device(launch.device, index)
    module.set_device(device)
    return device


def check_given_layout(collectives: Collectives, launch: LaunchConfig) -> None:
    """An engine's collectives hold this launch's ranks: integer ranks and sizes, the
    launch's TP size and DP shards."""
    for name in ("tp_rank", "tp_size", "dp_rank", "dp_size"):
        value = getattr(collectives, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"Runtime(collectives).{name}", value,
                              "expected a non-negative int")
    for name, theirs, ours in (("tp_size", collectives.tp_size, launch.resolved.tp_size),
                               ("dp_size", collectives.dp_size, launch.dp_size)):
        if theirs != ours:
            raise ConfigError(f"Runtime(collectives).{name}", theirs,
                              f"expected {ours}, the launch's --{name} (--nnodes="
                              f"{launch.nnodes})")


def heartbeat_s(launch: LaunchConfig, collectives: Collectives) -> float:
    """How often an idle front sends an empty plan: a quarter of the shortest collective
    timeout in force (--collective_timeout_s, or a shorter one of the engine's collectives
    when they tell theirs as ``timeout``), so a waiting rank never times out on a quiet
    front."""
    seconds = float(launch.collective_timeout_s)
    theirs = getattr(collectives, "timeout", None)
    if isinstance(theirs, datetime.timedelta) and theirs.total_seconds() > 0:
        seconds = min(seconds, theirs.total_seconds())
    return seconds / 4


def rank_of(collectives: Collectives) -> int:
    """A rank's place in the world: DP shard s owns ranks s*tp_size .. (s+1)*tp_size - 1."""
    return collectives.dp_rank * collectives.tp_size + collectives.tp_rank


# Command flags (prompts, sampling) are compared as written, since only the command knows
# how to read them: 0 and 0.0 differ there, and the message says so.
SAME_LINE = ("every rank starts with the same command line, each flag written alike (its own "
             "--node_rank, --host and --port aside)")


def command_values(flags: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """A command's flags by name, every value of a repeated one in order."""
    values: dict[str, list[str]] = {}
    for name, value in flags:
        values.setdefault(name, []).append(value)
    return values


def _given(values: list[str] | None) -> object:
    if values is None:
        return "(not given)"
    if values == [""]:  # a switch (--json)
        return "(given)"
    return values[0] if len(values) == 1 else values


def _line_difference(line: dict[str, Any], first: dict[str, Any]
                     ) -> tuple[str, object, object] | None:
    """The first setting in which a rank's line differs from rank 0's: (flag, its value,
    rank 0's value); None when they are the same."""
    for name, value in line["launch"].items():
        if first["launch"].get(name) != value:
            return f"--{name}", value, first["launch"].get(name)
    mine, theirs = line["command"], first["command"]
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return f"--{name}", _given(mine.get(name)), _given(theirs.get(name))
    if line["seed"] != first["seed"]:
        return "RuntimeOptions.seed", line["seed"], first["seed"]
    return None


class RuntimeStopped(RuntimeError):
    """The runtime is not running (not started, stopping, or stopped after a fault)."""


class WrongLoop(RuntimeError):
    """A call that must run on the runtime's event loop came from elsewhere (another thread
    or another loop): nothing would wake the loop for it."""

    def __init__(self, call: str) -> None:
        super().__init__(f"{call} was called outside the event loop the runtime runs on (from "
                         "another thread or loop); call it on that loop, for example through "
                         "loop.call_soon_threadsafe or asyncio.run_coroutine_threadsafe")


class Runtime:
    """Adaptive speculative decoding for one rank."""

    def __init__(self, config: EffectiveConfig, *, models: ModelSet | None = None,
                 options: RuntimeOptions | None = None,
                 collectives: Collectives | None = None) -> None:
        if not isinstance(config, EffectiveConfig):
            raise ConfigError("Runtime(config)", config,
                              "expected an EffectiveConfig; build one with "
                              "adaspec.config.load_config(flags)")
        if options is not None and not isinstance(options, RuntimeOptions):
            raise ConfigError("Runtime(options)", options,
                              "expected a RuntimeOptions or None; build one with "
                              "RuntimeOptions(seed=..., event_log=..., ...)")
        _check_protocol("Runtime(collectives)", collectives, Collectives,
                        "a Collectives (adaspec.runtime.devices.collectives) or None")
        self.config = config
        self.launch = config.launch
        self.options = options or RuntimeOptions()
        _check_policies_for_launch(self.options, self.launch)
        given = self.options.clock
        self.clock: Clock = MonotonicClock() if given is None else CheckedClock(given)
        self.bus = EventBus()
        self.hooks = RoundHooks()
        self._models = models
        self._given = collectives  # an engine's own, used as they are, never closed here
        # In use: the engine's, the ones start() opened (kept once closed: their counts stay
        # readable), or one rank's.
        self._collectives: Collectives = collectives or LocalCollectives()
        self._opened: DistributedCollectives | None = None  # open, and opened by start()
        self._link: RankLink | None = None
        self._issued = 0  # request ids given so far: 0 .. _issued - 1
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None  # the shutdown, once stop is called
        self._stream: DeviceStream | None = None
        self._pipeline: Pipeline | None = None
        self._closers: list[Any] = []
        self._detach: list[Callable[[], None]] = []  # undoes what _open_observers attached
        self._starting = False
        self._starting_on: asyncio.AbstractEventLoop | None = None  # the loop start() runs on
        self._start_ended: asyncio.Event | None = None  # set once the start has ended
        self.costs: CostBundle | None = None
        """The immutable cost table installed at start (adaptive target verify only)."""
        self.saved_cost_table: str | None = None
        """Where the start saved the table it calibrated, once that file is complete (the
        front only, with an output file)."""

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load and place the models, prepare every graph binding, start the round loop. A
        runtime starts again only once it has stopped: a second start while it runs or while
        a stop() is still shutting it down is refused (it would reset the KV caches that
        requests in flight are using)."""
        if self._starting or self._task is not None or (
                self._stopping is not None and not self._stopping.done()):
            raise RuntimeStopped("the runtime is starting, running or still shutting down: "
                                 "await stop() before starting it again")
        self._starting = True
        self._starting_on = asyncio.get_running_loop()
        ended = self._start_ended = asyncio.Event()
        self._stopping = None  # a stop() from now on abandons this start
        try:
            await self._start()
        except Exception as error:
            if self._stop_called() and not isinstance(error, RuntimeStopped):
                # The stop closed the stream under a step of the start (a binding, a
                # calibration window): that step's failure is the stop's doing.
                raise RuntimeStopped(ABANDONED) from error
            raise
        finally:
            if self._task is None:  # the start failed: it holds no models and no ranks
                self._release_models()
                self._close_ranks()
            self._starting = False
            ended.set()

    def _abandoned(self) -> None:
        """Raise ``RuntimeStopped`` when a stop() came during the start: the start goes no
        further, so no request can be queued to a runtime whose stream is closed."""
        if self._stop_called():
            raise RuntimeStopped(ABANDONED)

    def _stop_called(self) -> bool:
        return self._stopping is not None

    async def _start(self) -> None:
        launch = self.launch
        if isinstance(self.clock, CheckedClock):
            self.clock.fault = None  # a start reads the clock afresh
        self.clock.now()  # an embedder's clock that reads no seconds fails here, not a request
        fault = clock_fault(self.clock)
        if fault is not None:
            raise fault
        if launch.device == "cpu":
            cpu_threads()  # a bad ADASPEC_CPU_STREAM or _THREADS is refused before any loading
        require_device(launch.device)  # torch cannot even name "npu" without torch_npu
        self._check_observer_paths()
        # The built-in models are checked unloaded; given ones run as checked, read once.
        checked = check_model_limits(launch, self._models)
        self._hold_models()
        device = rank_device(launch)
        builtin = None if checked is not None else builtin_models(launch, device)
        models = checked or builtin
        assert models is not None
        geometry = BucketGeometry.of(launch)
        # Everything refusable about the costs is refused before any device work.
        plan, saved = cost_source(self.config, self.compatibility(models, geometry),
                                  geometry, models.target.context_limit)
        await self._open_ranks(builtin)
        self._stream = open_stream(launch.device, asyncio.get_running_loop())
        try:
            await self._start_on_stream(models, device, geometry, plan, saved)
        except BaseException:
            # A start that fails leaves nothing running: no worker thread, no open file.
            if self._stream is not None:  # a stop() during the start may have closed it
                self._stream.close()
                self._stream = None
            self._close_ranks()
            self._close_observers()
            raise

    def _hold_models(self) -> None:
        """Refuse models another running runtime holds; else hold them until stop."""
        if self._models is None:
            return
        given = [(role, getattr(self._models, role, None)) for role in MODEL_ROLES]
        for role, model in given:
            held = MODELS_IN_USE.get(id(model)) if model is not None else None
            holder = None if held is None else held()
            if holder is not None and holder is not self and holder._serving():
                raise ConfigError(f"Runtime(models=...).{role}", type(model).__name__,
                                  "expected a model no other running runtime holds: a start "
                                  "reallocates its KV caches under that runtime's requests; "
                                  "stop it first or give this runtime models of its own")
        for _, model in given:
            if model is not None:
                MODELS_IN_USE[id(model)] = weakref.ref(self)

    def _serving(self) -> bool:
        """Whether this runtime is starting or its loop still runs (a loop that ended with
        its event loop, unstopped, holds nothing any more)."""
        task = self._task
        if task is not None:
            return not task.done() and not task.get_loop().is_closed()
        return self._starting

    def _release_models(self) -> None:
        for key in [key for key, held in MODELS_IN_USE.items() if held() in (self, None)]:
            del MODELS_IN_USE[key]

    async def _open_ranks(self, builtin: ReferenceModels | None) -> None:
        """Several ranks: rendezvous at --master_node_addr (unless the engine passed its own
        collectives), split the built-in models across the TP group, and link this rank to
        the front. One rank needs none of it."""
        launch = self.launch
        given = self._given
        if given is not None:
            check_given_layout(given, launch)
        self._collectives, self._link = given or LocalCollectives(), None
        if launch.world_size == 1:
            return
        if given is None:
            timeout = datetime.timedelta(seconds=launch.collective_timeout_s)
            ended = self._start_ended
            assert ended is not None, "ranks are opened by start()"
            # In a worker thread: the rendezvous waits for every rank, and the loop (an
            # engine's, maybe) keeps running meanwhile.
            self._collectives = self._opened = await asyncio.to_thread(
                DistributedCollectives,
                rank=launch.node_rank, world_size=launch.world_size,
                tp_size=launch.resolved.tp_size, dp_size=launch.dp_size,
                init_method=f"tcp://{launch.master_node_addr}", device=launch.device,
                # A rank that has not arrived within the timeout is as good as dead: the
                # others say so in one line instead of waiting on in silence.
                timeout=timeout, rendezvous_timeout=timeout,
                # A stop(), or a start cancelled under way (Ctrl-C), ends the wait for the
                # ranks at once: the thread would otherwise hold the process until timeout.
                stopped=lambda: self._stop_called() or ended.is_set())
        comm = self._collectives
        if launch.device == "cpu":
            share_cores(ranks_on_this_host(launch))
        if builtin is not None:  # an engine's own models come split already
            for model in (builtin.target, builtin.mtp, builtin.dspark):
                split_blocks(model, comm.tp_rank, comm.tp_size, comm.tp_all_reduce)
        self._link = RankLink(comm, rank_of(comm), heartbeat_s(launch, comm))
        await self._check_same_launch(comm)

    @property
    def collectives(self) -> Collectives:
        """The collectives this runtime decodes with (``LocalCollectives`` on one rank)."""
        return self._collectives

    @property
    def rank(self) -> int:
        """This process's rank: in the engine's collectives when it passed its own, else
        --node_rank."""
        if self._given is None:
            return self.launch.node_rank
        return rank_of(self._given)

    async def _check_same_launch(self, comm: Collectives) -> None:
        """Every rank starts with rank 0's launch line (its own --node_rank, --host and
        --port aside): ranks that differ would issue different collectives, which the backend
        may answer by aborting the process. A rank that differs says which flag, and exits;
        the others then fail at their next collective."""
        settings = self.config.launch
        mine = {name: getattr(settings, name) for name in launch_field_types()
                if name not in PER_RANK_SETTINGS}
        command = command_values(self.options.command_flags)
        line = {"launch": mine, "command": command, "seed": self.options.seed}
        # Every rank sees every line: the rank that differs says which flag, and so do the
        # others (rank 0 names that rank), instead of meeting its exit in a collective.
        lines = [json.loads(data) for data in await asyncio.to_thread(
            comm.gather_from_every_rank, json.dumps(line).encode(), "check_launch")]
        first = lines[0]
        for rank, other in enumerate(lines):
            difference = _line_difference(other, first)
            if difference is None:
                continue
            name, value, expected = difference
            if rank == self.rank:
                raise ConfigError(name, value, f"expected {expected}, rank 0's: {SAME_LINE}")
            raise ConfigError(name, value, f"on rank {rank}; expected {expected}, rank 0's: "
                              f"{SAME_LINE}")

    @property
    def is_front(self) -> bool:
        """Whether this rank takes requests: rank 0, or the only rank."""
        return self.rank == 0

    def commit_digest(self) -> str:
        """With several ranks: a digest of every request this rank ended, in order, with its
        reason and tokens. Ranks that committed the same tokens have the same digest."""
        pipeline = self._pipeline
        if pipeline is None or pipeline.link is None:
            raise RuntimeStopped("a commit digest is kept only by a runtime started on "
                                 "several ranks")
        return pipeline.commits.hexdigest()

    def _rank_file(self, path: str) -> str:
        """With several ranks on one launch line, each writes its own file: ``run.jsonl``
        becomes ``run.rank1.jsonl`` on rank 1."""
        return rank_file(path, self.launch.world_size, self.rank)

    async def serve(self) -> None:
        """A rank other than the front: decode the front's requests until the front stops,
        then stop. Raises what ended the loop when it faulted (a dead peer, a timeout)."""
        if self.is_front:
            raise RuntimeStopped("serve() is for the ranks behind the front; rank 0 takes "
                                 "requests with submit()")
        if self._task is None:
            raise RuntimeStopped("the runtime is not running: await start() first")
        try:
            await asyncio.shield(self._task)
        finally:
            await self.stop()
        if self.fault is not None:
            raise self.fault

    @property
    def fault(self) -> BaseException | None:
        """What ended the last start's round loop other than ``stop()`` (a dead peer, a failed
        round the loop cannot go on from, an interrupt), kept after ``stop()``; None while
        that loop runs or when ``stop()`` ended it."""
        return None if self._pipeline is None else self._pipeline.fault

    async def ended(self) -> None:
        """Return once the round loop has ended: after ``stop()``, or on a fault (a dead
        peer, a failed round the loop cannot go on from), which is raised here."""
        task = self._task
        if task is None:
            raise RuntimeStopped("the runtime is not running: await start() first")
        await asyncio.wait({task})  # a caller cancelled here leaves the loop running
        if self.fault is not None:
            raise self.fault

    async def _start_on_stream(self, models: ModelSet, device: torch.device,
                               geometry: BucketGeometry, plan: CalibrationPlan | None,
                               saved: CostBundle | None) -> None:
        launch = self.launch
        assert self._stream is not None
        try:
            ctx = self._device_context(models, device)
        except (MemoryError, torch.OutOfMemoryError) as error:
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ConfigError("--max_seqs_per_batch", launch.max_seqs_per_batch, (
                f"the KV caches of its {2 * launch.max_seqs_per_batch} KV slots (two per "
                f"sequence, one waiting for the rounds in flight) do not fit: {reason}; "
                "expected fewer sequences per batch")) from None
        registries = await self._prepare_bindings(models, ctx, geometry)
        self._abandoned()  # a stop during the last binding: no calibration on a closed stream
        if saved is not None:
            self.costs = await self._shared(saved)
        elif plan is not None:
            self.costs = await self._shared(await self._calibrate(ctx, geometry, registries,
                                                                   plan, models))
        self._abandoned()
        LOG.info(json.dumps(self.effective_log(geometry, registries)))
        # Built once, on the costs just installed: the log's header records these very ones.
        depth_policy, budget_policy = self._depth_policy(), self._budget_policy()
        self._open_observers(models, depth_policy, budget_policy)
        self._pipeline = Pipeline(
            launch=launch, ctx=ctx, stream=self._stream, geometry=geometry,
            registries=registries, depth_policy=depth_policy,
            budget_policy=budget_policy, bus=self.bus, clock=self.clock,
            hooks=self.hooks, seed=self.options.seed, link=self._link)
        self._task = asyncio.get_running_loop().create_task(self._pipeline.run())

    def _device_context(self, models: ModelSet, device: torch.device) -> DeviceContext:
        launch = self.launch
        # A finished request's KV slot is reused only after the rounds in flight retire.
        num_kv_slots = 2 * launch.max_seqs_per_batch
        target = models.target
        before = _num_kv_slots(target)
        target.allocate(num_kv_slots)
        check_num_kv_slots("Runtime(models=...).target", target, num_kv_slots, before)
        drafting: Drafting = NoDrafting()
        # check_model_limits refused a set without the drafter the algorithm uses.
        # A drafter's own context is allocated with the same KV slots by its Drafting.
        drafter: CheckedDrafter | None = None
        if launch.speculative_algorithm == "MTP" and models.mtp is not None:
            drafter = CheckedDrafter("mtp", models.mtp, target.vocab_size)
            before = _num_kv_slots(models.mtp)
            drafting = MtpDrafting(drafter, launch.num_speculative_tokens,
                                   target.context_limit, num_kv_slots)
        elif launch.speculative_algorithm == "DSpark" and models.dspark is not None:
            drafter = CheckedDrafter("dspark", models.dspark, target.vocab_size)
            before = _num_kv_slots(models.dspark)
            drafting = DSparkDrafting(drafter, launch.num_speculative_tokens,
                                      target.context_limit, num_kv_slots)
        if drafter is not None and getattr(drafting, "context", None) is not None and \
                has_member(drafter.model, "num_kv_slots"):
            # A drafter that keeps a context was allocated with the target's KV slots: one that
            # tells its count must tell the same (the protocol does not require it to).
            check_num_kv_slots(drafter.setting, drafter.model, num_kv_slots, before)
        states = _slot_states(target, num_kv_slots, drafting.keeps_hidden, device)
        comm = self._collectives
        return DeviceContext(target=target, drafting=drafting, collectives=comm,
                             lockstep=Lockstep(comm.tp_size * comm.dp_size),
                             states=states, sampling=KvSlotSampling.allocate(num_kv_slots, device),
                             device=device, vocab_size=target.vocab_size,
                             hidden_size=target.hidden_size, seed=self.options.seed,
                             stage_hook=self.options.stage_hook)

    async def _prepare_bindings(self, models: ModelSet, ctx: DeviceContext,
                                geometry: BucketGeometry) -> list[BindingRegistry] | None:
        """One registry per pipeline slot, prepared on the device stream before ready: per
        (Bcap, G) the draft, pack and verify of split mode, the whole round in unified mode."""
        launch = self.launch
        if not launch.enable_graph:
            return None
        assert self._stream is not None
        # An own policy may make any legal G the round's, as the adaptive controls may (a
        # budget policy by its pick, a depth policy by the rows a shallower round covers):
        # every one is prepared, else such a round would fall back to full width unsaid.
        own = self.options.budget_policy is not None or self.options.depth_policy is not None
        pairs = geometry.planned_bindings(adaptive=adaptive_budget(launch) or own)
        width = launch.num_speculative_tokens
        # Fails at once for a device without graph capture, before anything is prepared.
        binding_factory(models.target, width, launch.device)
        varying_depth = launch.enable_adaptive_draft_step or self.options.depth_policy is not None
        registries = []
        for slot in range(2 if launch.enable_schedule_overlap else 1):
            self._abandoned()
            assert self._stream is not None  # a stop closes it only with _stopping set
            make = round_binding_factory(ctx, width) if launch.enable_unified_mtp_graph \
                else SplitBindings(ctx, width, launch.device, slot, varying_depth)
            registry = BindingRegistry(geometry, make, slot=slot)
            try:
                # One binding per work item, the stop checked between them: a signal during
                # the start waits for the binding in hand, not for every bucket's.
                for pair in preparation_order(pairs):
                    self._abandoned()
                    await self._stream.enqueue(functools.partial(registry.prepare, (pair,)))
            except (AdaspecError, RuntimeStopped):
                raise
            except Exception as error:  # the model's own failure, named in one line
                what = getattr(make, "preparing", "a round")  # split: the part it was on
                raise DeviceLayerError(f"preparing the graph bindings at start: {what} "
                                       f"raised {type(error).__name__}: {error}") from error
            registry.seal()
            registries.append(registry)
        return registries

    # --- costs -----------------------------------------------------------------------------
    def compatibility(self, models: ModelSet, geometry: BucketGeometry
                      ) -> Compatibility:
        """What a saved table must share with this launch."""
        return Compatibility(
            **launch_fields(self.launch),  # type: ignore[arg-type]
            target=models.target.identity, draft=self._draft_identity(models),
            request_buckets=geometry.request_buckets,
            target_rows=tuple(geometry.legal_rows(b) for b in geometry.request_buckets))

    def _draft_identity(self, models: ModelSet) -> str:
        """The identity of the drafter this launch drafts with ("none" without one)."""
        draft = models.mtp if self.launch.speculative_algorithm == "MTP" else models.dspark
        if self.launch.speculative_algorithm not in ("MTP", "DSpark"):
            return "none"  # a model set may hold a drafter that this launch does not use
        return "none" if draft is None else draft.identity

    async def _calibrate(self, ctx: DeviceContext, geometry: BucketGeometry,
                         registries: list[BindingRegistry] | None, plan: CalibrationPlan,
                         models: ModelSet) -> CostBundle | None:
        """Calibrate on this runtime's context, stream and bindings; save the bundle when
        asked. Only the front fits one (None elsewhere: the other ranks ran its windows in
        lockstep) and saves it."""
        assert self._stream is not None
        bundle = await calibrate_on_stream(
            CalibrationRun(launch=self.launch, ctx=ctx, stream=self._stream, geometry=geometry,
                           registries=registries, seed=self.options.seed, link=self._link),
            plan, self.compatibility(models, geometry), self.options.calibration_progress)
        output = self.launch.adaptive_target_verify_cost_table_output
        if output is not None and bundle is not None:
            bundle.save(output)
            self.saved_cost_table = output
        return bundle

    async def _shared(self, bundle: CostBundle | None) -> CostBundle:
        """Rank 0's table on every rank: decisions must agree, so all install the same
        immutable table (a rank that loaded a saved one of its own takes rank 0's)."""
        mine = b"" if bundle is None else bundle.to_json().encode()
        data = await asyncio.to_thread(self._collectives.share_from_first_rank, mine,
                                       "share_cost_table")
        if bundle is not None and data == mine:
            return bundle
        source = "rank 0's table" if bundle is None else f"{bundle.source} (rank 0's table)"
        return bundle_from_dict(json.loads(data), source=source)

    def effective_log(self, geometry: BucketGeometry,
                      registries: list[BindingRegistry] | None) -> dict[str, object]:
        """The startup log line: every effective setting, the costs' source and coverage,
        and the captured geometry, read from the bindings startup prepared."""
        costs: dict[str, object] = {"source": "none: no adaptive target verify"}
        if self.costs is not None:
            costs = {"source": self.costs.source, "settings": dict(self.costs.settings),
                     "coverage": [p.context.as_dict() for p in self.costs.profiles],
                     "unchecked_compatibility": list(self.costs.unchecked)}
        return {"event": "effective_config", "config": self.config.as_dict(), "costs": costs,
                "captured_geometry": {
                    "request_buckets": list(geometry.request_buckets),
                    "target_rows": {} if not registries else {
                        str(b): list(rows) for b, rows in registries[0].prepared_rows().items()}}}

    def _open_observers(self, models: ModelSet, depth_policy: DepthPolicy,
                        budget_policy: BudgetPolicy) -> None:
        """Event log and state trace, each only when asked for."""
        if self.options.event_log is not None:
            from adaspec.runtime.events.log import EventLogWriter, LogHeader

            header = LogHeader.of_run(
                config=self.config.as_dict(),
                cost_table=None if self.costs is None else self.costs.as_dict(),
                models={"target": models.target.identity,
                        "draft": self._draft_identity(models)},
                context_limit=models.target.context_limit, seed=self.options.seed,
                depth_policy=depth_policy, budget_policy=budget_policy,
                lag=2 if self.launch.enable_schedule_overlap else 1)
            writer = EventLogWriter(self._rank_file(self.options.event_log), header)
            self.bus.subscribe(writer.write, first=True)
            self._closers.append(writer)
            self._detach.append(functools.partial(self.bus.unsubscribe, writer.write))
        trace_path, setting = self._trace_path()
        if trace_path:
            trace = StateTrace.to_file(trace_path, self.clock, setting)
            hook = trace.hook  # one bound method: hooks are removed by identity
            self.hooks.on_transition(hook)
            self.bus.subscribe(trace.observe)
            self._closers.append(trace)
            self._detach += [functools.partial(self.hooks.remove, hook),
                             functools.partial(self.bus.unsubscribe, trace.observe)]

    def _trace_path(self) -> tuple[str | None, str]:
        """Where the state trace goes (None: off), and the setting that said so."""
        if self.options.trace:
            return self._rank_file(self.options.trace), "trace"
        path = trace_destination(os.environ.get(TRACE_ENV))
        return (None if path is None else self._rank_file(path)), TRACE_ENV

    def _check_observer_paths(self) -> None:
        """Refuse an event log or trace path that could not be created, or two outputs that
        are one file (the cost-table output included), before the models load and calibrate
        rather than after."""
        log = None if self.options.event_log is None else self._rank_file(self.options.event_log)
        if log is not None:
            new_file("event_log", log)
        trace_path, setting = self._trace_path()
        if trace_path == STDERR:
            trace_path = None
        if trace_path is not None:
            new_file(setting, trace_path)
        check_own_files([("adaptive_target_verify_cost_table_output",
                          self.launch.adaptive_target_verify_cost_table_output),
                         ("event_log", log), (setting, trace_path)])

    def _close_observers(self) -> None:
        """Detach this run's event log and trace, then close every one of them (the first
        error of a close is raised once all were tried): a later start opens its own."""
        for detach in self._detach:
            detach()
        self._detach.clear()
        closers, self._closers = self._closers, []
        failed: BaseException | None = None
        for closer in closers:
            try:
                closer.close()
            except Exception as error:  # the others still get closed
                failed = failed or error
        if failed is not None:
            raise failed

    def _depth_policy(self) -> DepthPolicy:
        if self.options.depth_policy is not None:
            return self.options.depth_policy
        if self.launch.enable_adaptive_draft_step:
            assert self.config.draft_step is not None
            return make_depth_policy("adaptive-depth", self.config.draft_step.policy.as_dict(),
                                     self.costs)
        return make_depth_policy("fixed", {})

    def _budget_policy(self) -> BudgetPolicy:
        if self.options.budget_policy is not None:
            return self.options.budget_policy
        if self.launch.enable_adaptive_target_verify:
            return make_budget_policy("adaptive-verify", {}, self.costs)
        return make_budget_policy("full", {})

    async def stop(self) -> None:
        """Finish every submitted request, retire every round, release the stream and files.

        The shutdown runs as a task of its own: a caller that cancels ``stop`` (or whose
        ``wait_for`` times out) stops waiting, not the shutdown, so every request still ends;
        a second ``stop`` waits for the first one's shutdown to finish. Called from another
        loop than the runtime's, it raises ``WrongLoop`` and changes nothing."""
        self._on_loop("stop()")
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._shut_down())
        await asyncio.shield(self._stopping)

    async def _shut_down(self) -> None:
        if self._pipeline is not None:
            self._pipeline.stop()
        try:
            await self._end_loop()
        finally:  # an interrupt while waiting for the loop still releases what it holds
            await self._release()

    async def _end_loop(self) -> None:
        task = self._task
        if task is None:
            return
        if _ended_by_interrupt(task):
            # The interrupt reached the loop's caller when it happened, after every request
            # had ended: stopping has only to release what remains.
            self._task = None
            return
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():  # this shutdown was cancelled, not the loop
                raise
            # The loop was cancelled under us, maybe before its first step: no request
            # may be left waiting for it.
            if self._pipeline is not None:
                self._pipeline.fail_all("runtime stopped: its loop was interrupted "
                                        "(CancelledError)")
        self._task = None

    async def _release(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        try:
            self._close_observers()
        finally:
            if self._starting and self._start_ended is not None:
                # The closed stream abandons the start (its calibration's requests fail):
                # wait for it to unwind, so nothing of it runs once stop() returns.
                await self._start_ended.wait()
            # Only then: a start's plan agreement may still be using the process groups.
            self._close_ranks()
            self._release_models()

    def _close_ranks(self) -> None:
        """Leave the process groups start() joined (an engine's own collectives stay)."""
        opened, self._opened = self._opened, None
        if self._link is not None:
            self._link.close()
        if opened is not None:
            opened.close()

    # --- requests ------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams) -> RequestHandle:
        """Queue a request. Refused before execution, with a one-line error naming the field,
        when the launch cannot decode it exactly or the prompt does not fit. ``prompt`` holds
        token ids in order: a list or tuple of ints, bytes, or a 1-d integer array."""
        ids = self.check(prompt, params)
        self._on_loop("submit()")
        pipeline = self._running()
        request = Request(id=self._issued, prompt=ids, params=params)
        self._issued += 1
        # Queued before its arrival is told, so a subscriber can cancel it by id, and an
        # interrupt a subscriber raises leaves a request that ends as the log says it arrived.
        pipeline.add(request)
        if pipeline.link is None:  # with several ranks, once the plan gives it a shard
            self.bus.publish(RequestArrived.of(request, self.clock.now()))
        return RequestHandle(request, self._cancel, self._on_loop)

    def check(self, prompt: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        """Refuse what ``submit`` would refuse, queuing nothing, and return the prompt's token
        ids: a caller with several prompts checks them all before it submits any."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params", params,
                                 "expected a SamplingParams; build one with SamplingParams(...) "
                                 "or SamplingParams.from_request(fields)")
        pipeline = self._running()
        self._front_only("submit")
        check_request(params, self.launch)  # a filter on a greedy request included
        ids = prompt_ids(prompt)
        check_prompt(pipeline.ctx.target, ids)
        check_room(pipeline.ctx.context_limit, len(ids), params.max_tokens)
        vocab = pipeline.ctx.target.vocab_size
        unknown = next((token for token in params.stop if token >= vocab), None)
        if unknown is not None:  # it could never be sampled: the request would never stop
            raise InvalidRequest("stop", unknown, f"expected token ids in 0..{vocab - 1}")
        return ids

    def _front_only(self, call: str) -> None:
        """Requests reach the ranks through the front: a rank behind it refuses them before
        anything is recorded."""
        if self._link is not None and not self._link.front:
            raise FollowerRefused(f"{call}: rank {self.rank} decodes the requests of rank 0, "
                                  f"the front; {call} there")

    def _on_loop(self, call: str) -> None:
        """Refuse ``call`` unless it runs on the loop the runtime lives on while it starts,
        runs or shuts down."""
        home = self._home_loop()
        if home is None:
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # a thread without a loop
            running = None
        if running is not home:
            raise WrongLoop(call)

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the runtime lives on; None once its tasks have ended (a loop that
        asyncio.run closed leaves them cancelled: a new loop may then stop the runtime)."""
        for task in (self._task, self._stopping):
            if task is not None and not task.done():
                return task.get_loop()
        return self._starting_on if self._starting else None

    def _running(self) -> Pipeline:
        pipeline = self._pipeline
        if pipeline is None or self._task is None or pipeline.stop_asked:
            raise RuntimeStopped("the runtime is not running: await start() first, and do "
                                 "not submit after stop()")
        fault = pipeline.fault
        if isinstance(fault, asyncio.CancelledError) or self._task.cancelled():
            # No fault of the runtime: its loop was cancelled under it, as asyncio.run does
            # to the tasks left when it closes its event loop.
            raise RuntimeStopped("the runtime's round loop was cancelled without stop() (an "
                                 "event loop closed under it?): await stop(), then start() "
                                 "on the loop that is to run it")
        if fault is not None:
            raise RuntimeStopped(f"the runtime stopped after an internal error: "
                                 f"{type(fault).__name__}: {fault}")
        return pipeline

    def cancel(self, request_id: int) -> None:
        """End a request between rounds (see ``RequestHandle.cancel``); a request that has
        ended is left alone (its cancel may race its end). ``request_id`` is an int
        (``RequestHandle.request_id``) that ``submit`` gave: any other is a ValueError."""
        given: object = request_id  # whatever the caller passed, until checked
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise TypeError(f"cancel(request_id={reprlib.repr(given)}): expected an int "
                            f"request id (RequestHandle.request_id); got "
                            f"{type(given).__name__}")
        self._on_loop("cancel()")
        self._front_only("cancel")
        if not 0 <= int(given) < self._issued:
            raise ValueError(f"cancel(request_id={int(given)}): no request has that id; "
                             f"expected one submit gave (0..{self._issued - 1})"
                             if self._issued else f"cancel(request_id={int(given)}): no "
                             "request has that id; nothing was submitted yet")
        if self._pipeline is not None:
            request = self._pipeline.find(int(given))  # a numpy integer as the int it equals
            if request is not None:
                self._cancel(request)

    def _cancel(self, request: Request) -> None:
        self._on_loop("cancel()")
        if request.running and self._pipeline is not None:
            self._pipeline.cancel(request)

    def statistics(self) -> RuntimeStatistics:
        """A frozen snapshot of the runtime's counters and its policies' statistics."""
        if self._pipeline is None:
            raise RuntimeStopped("the runtime has not started")
        return self._pipeline.statistics()

    @property
    def vocab_size(self) -> int:
        return self._running().ctx.target.vocab_size

    @property
    def context_limit(self) -> int:
        return self._running().ctx.target.context_limit

    @property
    def geometry(self) -> BucketGeometry:
        return self._running().geometry

    async def wait_idle(self) -> None:
        """Return once every submitted request has ended and every round has retired (a
        round submitted before its requests were seen to finish retires after them)."""
        self._on_loop("wait_idle()")
        await self._running().idle.wait()  # cleared by every submit, set only by the loop
        self._running()  # a fault that ended the loop is raised here

    def subscribe(self, handler: Any) -> None:
        """Receive every event (a plain callable, run in subscription order)."""
        self.bus.subscribe(handler)

    def unsubscribe(self, handler: Any) -> None:
        """Stop delivering events to ``handler``; ``ValueError`` if it was not subscribed
        (one the bus dropped after it raised is already unsubscribed)."""
        self.bus.unsubscribe(handler)


def _num_kv_slots(model: object) -> object:
    """A model's ``num_kv_slots`` before ``allocate`` (None where it has none yet, or raises):
    a refusal after it says when ``allocate`` left the count unchanged."""
    try:
        return model.num_kv_slots  # type: ignore[attr-defined]
    except Exception:
        return None


def adaptive_budget(launch: LaunchConfig) -> bool:
    """Whether the budget policy may pick any legal G (adaptive target verify or depth)."""
    return bool(launch.enable_adaptive_target_verify or launch.enable_adaptive_draft_step)


def _ended_by_interrupt(task: asyncio.Task[None]) -> bool:
    """Whether the loop's task ended with ``KeyboardInterrupt`` or ``SystemExit`` (which
    asyncio raises to the loop's caller as well as storing it)."""
    return task.done() and not task.cancelled() and \
        isinstance(task.exception(), KeyboardInterrupt | SystemExit)
