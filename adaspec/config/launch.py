"""The launch configuration: one frozen dataclass holding every launch flag.

Flag names follow the specification's launch examples so that an existing launch line ports
unchanged; ``device`` and ``tp_size`` are what a CPU or CUDA user needs beyond them. A
``LaunchConfig`` is checked completely when it is built: field types and ranges here, the
combination rules of the specification in ``adaspec.config.rules``. Settings left unset
(``None``) get their effective value in ``LaunchConfig.resolved``, derived once here.
"""

import functools
import ipaddress
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from adaspec.config.limits import (
    BUILTIN_DRAFTS,
    BUILTIN_TARGET,
    GRAPH_BACKEND_FOR_DEVICE,
    INT_RANGES,
    GraphBackend,
)
from adaspec.config.rules import check_launch_rules
from adaspec.errors import MISSING, ConfigError

Device = Literal["cpu", "cuda", "npu"]
Algorithm = Literal["none", "MTP", "DSpark"]

@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """Every launch flag, validated and resolved at construction."""

    model: str = BUILTIN_TARGET
    """Target model: a checkpoint path, or a shipped reference target: ``builtin:target``
    (rows nearly free on a CPU) or ``builtin:target-large`` (rows cost)."""

    draft_model: str | None = None
    """Draft model path; unset means the built-in draft of the chosen algorithm
    (``builtin:mtp`` or ``builtin:dspark``, trained for the built-in target chosen), and no
    draft without speculation. A checkpoint ``--model`` needs its own draft's path here."""

    backend: Literal["llm"] = "llm"
    """Serving backend; adaspec serves language models only."""

    model_impl: Literal["python"] = "python"
    """Model implementation; the runtime drives Python (torch) model implementations."""

    npu_kernel_backend: Literal["TORCH"] = "TORCH"
    """Kernel backend on an NPU; adaspec's device kernels are torch operators."""

    device: Device = "cpu"
    """Where the models and kernels run: cpu, cuda or npu (npu needs torch_npu and CANN)."""

    nnodes: int = 1
    """Number of ranks in the service (one process per rank)."""

    node_rank: int = 0
    """Rank of this process, 0 .. nnodes-1."""

    host: str = "127.0.0.1"
    """Address this rank listens on."""

    port: int = 8000
    """Port this rank listens on."""

    master_node_addr: str = "127.0.0.1:27000"
    """host:port of rank 0's rendezvous for torch.distributed."""

    collective_timeout_s: int = 300
    """Seconds any collective between ranks may take before the rank fails naming it (a
    dead or hung peer); rank 0 also sends an empty plan every quarter of it while idle."""

    speculative_algorithm: Algorithm = "none"
    """Draft algorithm: MTP (sequential draft steps), DSpark (one parallel block), or none."""

    num_speculative_tokens: int = 0
    """Draft width w: tokens drafted per round (the maximum depth for adaptive draft steps);
    0 exactly when there is no speculation. The built-in DSpark drafters draft at most 7."""

    enable_adaptive_draft_step: bool = False
    """Choose the number of sequential MTP draft steps per batch from lagged acceptance."""

    enable_adaptive_target_verify: bool = False
    """Choose how many drafted tokens the target verifies per round from lagged confidence."""

    enable_probabilistic_draft: bool = False
    """Sample draft tokens instead of taking the draft's argmax; adaspec drafts greedily."""

    enable_graph: bool = True
    """Run decode through prepared fixed-shape buckets (graphs on cuda and npu)."""

    python_graph_backend: GraphBackend | None = None
    """Graph backend; unset picks the one that fits the device (cpu: eager_buckets,
    cuda: cudagraph, npu: aclgraph)."""

    disable_graph_warmup: bool = False
    """Skip preparing every bucket before ready."""

    enable_unified_mtp_graph: bool = False
    """Run a whole round (draft, pack, verify, commit) as one captured device unit."""

    enable_schedule_overlap: bool = True
    """Overlap two rounds over two pipeline slots; false runs one round at a time."""

    enable_task_pipeline: bool = True
    """Enqueue a round's stages with no host wait between them (as one stream item that runs
    them back to back); false enqueues each stage on its own and waits for it."""

    enable_disagg_pd: bool = False
    """Prefill/decode disaggregation across services; adaspec runs both in one process."""

    dp_size: int = 1
    """Data-parallel shards; each owns its requests and shares one verification budget."""

    cp_size: int = 1
    """Context-parallel size."""

    tp_size: int | None = None
    """Tensor-parallel size; unset means nnodes / (dp_size * cp_size)."""

    max_seqs_per_batch: int = 16
    """Most sequences decoded at once, over all DP shards."""

    acl_graph_decode_batch_size_limit: int | None = None
    """Largest prepared decode request bucket; unset means max_seqs_per_batch."""

    adaptive_draft_step_config: str | None = None
    """JSON file with the adaptive draft-step policy and calibration settings."""

    adaptive_target_verify_calibration: str | None = None
    """JSON file overriding the startup cost calibration of adaptive target verify."""

    adaptive_target_verify_cost_table: str | None = None
    """Saved cost-table bundle to reuse instead of calibrating at startup."""

    adaptive_target_verify_cost_table_output: str | None = None
    """Where to save the cost table fitted at startup; the file must not exist yet."""

    resolved: "ResolvedLaunch" = field(init=False, repr=False, compare=False)
    """Effective values of the settings left unset (and of the others they depend on)."""

    def __post_init__(self) -> None:
        for name, hint in launch_field_types().items():
            check_field_type(name, getattr(self, name), hint)
        self._check_fixed_ranges()
        # Resolved values live apart from the given ones, so dataclasses.replace() on a
        # config re-derives them instead of carrying stale defaults as if they were given.
        object.__setattr__(self, "resolved", ResolvedLaunch.of(self))
        check_launch_rules(self)

    def _check_fixed_ranges(self) -> None:
        for name, (low, high) in INT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ConfigError(f"--{name}", value, f"expected an integer in {low}..{high}")
        for name in ("model", "host"):
            if not getattr(self, name).strip():
                raise ConfigError(f"--{name}", getattr(self, name), "expected a non-empty value")
        if not valid_host(self.host):
            raise ConfigError("--host", self.host, f"expected {HOST_EXPECTED}")
        parse_host_port("master_node_addr", self.master_node_addr)
        group = self.dp_size * self.cp_size
        # With CP its own rule refuses the launch, naming --cp_size rather than --nnodes.
        if self.cp_size == 1 and self.nnodes % group:
            raise ConfigError("--nnodes", self.nnodes,
                              f"expected a multiple of dp_size*cp_size={group} (one TP group "
                              f"per DP/CP shard)")

    @property
    def speculative(self) -> bool:
        """Whether a draft model proposes tokens at all."""
        return self.speculative_algorithm != "none"

    @property
    def world_size(self) -> int:
        return self.nnodes

    @property
    def dp_rank(self) -> int:
        """The DP shard of --node_rank: shard s owns ranks s*tp_size .. (s+1)*tp_size - 1."""
        return self.node_rank // self.resolved.tp_size

    @property
    def seqs_per_shard(self) -> int:
        """Most sequences one DP shard decodes at once."""
        return -(-self.max_seqs_per_batch // self.dp_size)

    @property
    def decode_batch_limit(self) -> int:
        """Most requests one shard's round holds: ``seqs_per_shard``, and with graphs never
        more than the largest prepared request bucket (the graph batch limit). Requests
        beyond it wait for a place."""
        buckets = self.prepared_request_buckets()
        return min(self.seqs_per_shard, buckets[-1]) if buckets else self.seqs_per_shard

    def prepared_request_buckets(self) -> tuple[int, ...]:
        """The physical draft request buckets (Bcap values) prepared per shard for decode.

        Powers of two up to the graph batch limit, plus the limit itself, so a batch of B
        requests pads to the first bucket >= B. Empty without graphs: eager shapes are unpadded.
        """
        if not self.enable_graph:
            return ()
        return _ladder(self.resolved.acl_graph_decode_batch_size_limit)

    def prepared_target_rows(self) -> tuple[int, ...]:
        """The padded target row counts (G values) prepared for verification.

        The power-of-two ladder up to full width at the largest bucket, plus full width
        ``Bcap * (w + 1)`` of every request bucket, so full-width verification never pads.
        With adaptive draft steps, also ``Bcap * (d + 1)`` for every depth d: a round at
        depth d verifies exactly its rows instead of padding to a deeper depth's (on the
        ladder alone depth 4 of Draft5 at Bcap 16 would verify 96 rows, as depth 5 does).
        """
        buckets = self.prepared_request_buckets()
        if not buckets:
            return ()
        rows_per_request = self.num_speculative_tokens + 1
        full = {b * rows_per_request for b in buckets}
        if self.enable_adaptive_draft_step:
            full |= {b * (d + 1) for b in buckets for d in range(1, rows_per_request)}
        return tuple(sorted(set(_ladder(buckets[-1] * rows_per_request)) | full))

    def prepared_bindings(self) -> dict[int, tuple[int, ...]]:
        """The G values startup prepares a binding for, per request bucket: every legal G
        when the budget policy may pick any (adaptive target verify or draft steps), else
        full width alone. Empty without graphs."""
        adaptive = self.enable_adaptive_target_verify or self.enable_adaptive_draft_step
        full = self.num_speculative_tokens + 1
        return {bucket: self.legal_target_rows(bucket) if adaptive else (bucket * full,)
                for bucket in self.prepared_request_buckets()}

    @property
    def captures_tiers_only(self) -> bool:
        """Unified adaptive verification captures a whole round per binding, so it prepares
        the tiers of each request count rather than every legal G of a bucket."""
        return self.enable_unified_mtp_graph and self.enable_adaptive_target_verify

    def legal_target_rows(self, bucket: int) -> tuple[int, ...]:
        """Prepared G values a batch in request bucket ``bucket`` may verify: every request
        keeps its anchor row (G >= Bcap) and no request verifies beyond the width; under
        unified adaptive verification, only the tiers of the counts the bucket holds."""
        return prepared_rows(self.prepared_target_rows(), self.prepared_request_buckets(),
                             bucket, self.num_speculative_tokens,
                             tiers_only=self.captures_tiers_only)


def tiers_among(legal_rows: Sequence[int], num_reqs: int, width: int) -> tuple[int, ...]:
    """The tiers for B among its bucket's legal rows: the first G covering B, 2B, 4B and
    B * (w + 1) rows (the largest legal G where none covers), ascending and distinct."""
    chosen = set()
    for need in (num_reqs, 2 * num_reqs, 4 * num_reqs, num_reqs * (width + 1)):
        chosen.add(next((g for g in legal_rows if g >= need), legal_rows[-1]))
    return tuple(sorted(chosen))


@functools.lru_cache(maxsize=4096)
def prepared_rows(target_rows: tuple[int, ...], request_buckets: tuple[int, ...], bucket: int,
                  width: int, *, tiers_only: bool) -> tuple[int, ...]:
    """The G values prepared for request bucket ``bucket`` of a padded geometry: the ladder's
    rows from Bcap to full width ``Bcap * (w + 1)``, or with ``tiers_only`` just the tiers of
    every request count that pads to this bucket (full width among them). Cached: replay
    asks it once per logged decision, and the tiers of a large bucket take a few hundred
    comparisons."""
    ladder = tuple(g for g in target_rows if bucket <= g <= bucket * (width + 1))
    if not tiers_only:
        return ladder
    smaller = max((b for b in request_buckets if b < bucket), default=0)
    return tuple(sorted({g for num_reqs in range(smaller + 1, bucket + 1)
                         for g in tiers_among(ladder, num_reqs, width)}))


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedLaunch:
    """The effective value of each launch setting whose default depends on others."""

    draft_model: str | None
    python_graph_backend: GraphBackend | None
    tp_size: int
    acl_graph_decode_batch_size_limit: int

    @classmethod
    def of(cls, cfg: LaunchConfig) -> "ResolvedLaunch":
        draft = cfg.draft_model
        if draft is None:
            draft = BUILTIN_DRAFTS.get(cfg.speculative_algorithm)
        backend = cfg.python_graph_backend
        if backend is None and cfg.enable_graph:
            backend = GRAPH_BACKEND_FOR_DEVICE[cfg.device]
        tp_size = cfg.tp_size or cfg.nnodes // (cfg.dp_size * cfg.cp_size)
        limit = cfg.acl_graph_decode_batch_size_limit or cfg.max_seqs_per_batch
        return cls(draft_model=draft, python_graph_backend=backend, tp_size=tp_size,
                   acl_graph_decode_batch_size_limit=limit)


def _ladder(limit: int) -> tuple[int, ...]:
    """Powers of two below ``limit``, then ``limit``."""
    values = [1]
    while values[-1] * 2 <= limit:
        values.append(values[-1] * 2)
    if values[-1] != limit:
        values.append(limit)
    return tuple(values)


@functools.cache
def launch_field_types() -> dict[str, object]:
    """Resolved annotations of the launch fields, in declaration order."""
    hints = typing.get_type_hints(LaunchConfig)
    return {f.name: hints[f.name] for f in fields(LaunchConfig) if f.init}


def describe_type(hint: object) -> str:
    """How a flag's expected value reads in an error message."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + "|".join(str(a) for a in args)
    if type(None) in args:
        return describe_type(next(a for a in args if a is not type(None)))
    if hint is bool:
        return "true|false"
    if hint is int:
        return "an integer"
    return "a string"


def metavar(hint: object) -> str:
    """How a flag's value is shown in ``--help``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if type(None) in args:
        return metavar(next(a for a in args if a is not type(None)))
    if hint is bool:
        return "{true,false}"
    return "INT" if hint is int else "TEXT"


def check_field_type(name: str, value: object, hint: object) -> None:
    """Reject a value of the wrong type for a launch field (Python API callers)."""
    if value is None and type(None) in typing.get_args(hint):
        return
    base = [a for a in typing.get_args(hint) if a is not type(None)]
    target = base[0] if typing.get_origin(hint) is not Literal and base else hint
    if typing.get_origin(target) is Literal:
        ok = value in typing.get_args(target) and isinstance(value, str)
    elif target is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, target)  # type: ignore[arg-type]
    if not ok:
        raise ConfigError(f"--{name}", value, f"expected {describe_type(hint)}")


def parse_host_port(name: str, text: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 hosts in brackets) and check the port and the host."""
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip() or not ascii_digits(port, 5) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--{name}", text, "expected host:port with a port in 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not valid_host(bare) or (bare is host and ":" in host):
        raise ConfigError(f"--{name}", text, f"expected host:port whose host is "
                          f"{HOST_EXPECTED} (an IPv6 address in brackets)")
    return host, int(port)


HOST_EXPECTED = ("a hostname (letters, digits, '-', '_' and '.'-separated labels of at most "
                 "63 characters) or an IP address, without spaces or control characters")
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def valid_host(text: str) -> bool:
    """Whether ``text`` is an IP address literal or a hostname (RFC 1123 labels, '_' also
    taken; a final '.' allowed), at most 253 characters."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


PER_RANK_SETTINGS = ("node_rank", "host", "port")
"""Launch settings each rank of one launch gives its own value; all others are the same."""


MAX_INT_DIGITS = 4300
"""Integers given as text with more significant digits read as ``BEYOND_INTEGERS``: int()
reads no more by default, and takes long to read them where that limit is lifted."""
BEYOND_INTEGERS = 10 ** MAX_INT_DIGITS
"""Past every integer setting's range, as a longer integer is."""
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")


def integer_text(text: str) -> int | None:
    """``text`` read as every integer a user types is read: ASCII digits after an optional
    sign, with surrounding space and leading zeros ignored; None for other text (int()
    alone also takes other scripts' digits and underscores). More than ``MAX_INT_DIGITS``
    significant digits read as +-``BEYOND_INTEGERS``, refused by any range."""
    stripped = text.strip()
    if not _INTEGER_TEXT.fullmatch(stripped):
        return None
    sign = -1 if stripped.startswith("-") else 1
    digits = stripped.lstrip("+-").lstrip("0") or "0"
    return sign * (BEYOND_INTEGERS if len(digits) > most_int_digits() else int(digits))


def most_int_digits() -> int:
    """``MAX_INT_DIGITS``, or fewer where the interpreter reads fewer (set by
    ``PYTHONINTMAXSTRDIGITS``): a longer integer could be neither read nor shown."""
    return min(MAX_INT_DIGITS, sys.get_int_max_str_digits() or MAX_INT_DIGITS)


def ascii_digits(text: str, most: int = 8) -> bool:
    """Whether ``text`` is at most ``most`` ASCII digits: what int() reads as a count
    (``isdigit`` alone also takes superscripts, which int() refuses)."""
    return text.isascii() and text.isdigit() and len(text) <= most


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` (and any ``env://`` launcher) sets for each process it starts."""


def torchrun_settings(settings: Mapping[str, str], environ: Mapping[str, str]
                      ) -> dict[str, str]:
    """``settings`` with torchrun's rank, world size and rendezvous as the launch's
    --node_rank, --nnodes and --master_node_addr, when every variable of ``TORCHRUN_ENV``
    is set. A flag given as well must say the same, or it is refused naming both."""
    present = [name for name in TORCHRUN_ENV if name in environ]
    if not present:
        return dict(settings)
    if len(present) < len(TORCHRUN_ENV):  # a launcher half set up: say so, never guess
        missing = next(name for name in TORCHRUN_ENV if name not in environ)
        raise ConfigError(missing, MISSING, f"expected it beside {', '.join(present)} (torchrun "
                          "sets all four), or none of them for a launch by flags")
    _check_torchrun_numbers(environ)
    host = environ["MASTER_ADDR"]
    if ":" in host and not host.startswith("["):  # an IPv6 literal
        host = f"[{host}]"
    from_env = {"node_rank": ("RANK", environ["RANK"]),
                "nnodes": ("WORLD_SIZE", environ["WORLD_SIZE"]),
                "master_node_addr": ("MASTER_ADDR:MASTER_PORT",
                                     f"{host}:{_normal(environ['MASTER_PORT'])}")}
    merged = dict(settings)
    for name, (variable, value) in from_env.items():
        given = settings.get(name)
        if given is not None and _normal(given) != _normal(value):
            raise ConfigError(f"--{name}", given, f"expected {value}, what torchrun set in "
                              f"{variable}, or leave the flag out under torchrun")
        merged[name] = value
    return merged


def _check_torchrun_numbers(environ: Mapping[str, str]) -> None:
    """torchrun's numbers, named by their variables: read as flags they would be blamed on
    flags the user never gave."""
    size = _torchrun_integer("WORLD_SIZE", environ["WORLD_SIZE"], *INT_RANGES["nnodes"])
    _torchrun_integer("MASTER_PORT", environ["MASTER_PORT"], 1, 65535)
    _torchrun_integer("RANK", environ["RANK"], 0, size - 1)
    host = environ["MASTER_ADDR"]
    if not host or not host.isprintable() or any(c.isspace() for c in host):
        raise ConfigError("MASTER_ADDR", host, "expected the host name or address of rank 0 "
                          "(torchrun sets it; a launch by flags sets none of its variables)")
    # Where a host's ranks take their accelerators (LOCAL_RANK of LOCAL_WORLD_SIZE): never
    # read past, as a wrong one would put two ranks on one device.
    local_size = size
    if "LOCAL_WORLD_SIZE" in environ:
        local_size = _torchrun_integer("LOCAL_WORLD_SIZE", environ["LOCAL_WORLD_SIZE"], 1, size)
    if "LOCAL_RANK" in environ:
        _torchrun_integer("LOCAL_RANK", environ["LOCAL_RANK"], 0, local_size - 1)


def _torchrun_integer(variable: str, text: str, low: int, high: int) -> int:
    stripped = text.strip()
    if not (ascii_digits(stripped) and low <= int(stripped) <= high):
        raise ConfigError(variable, text, f"expected an integer in {low}..{high} (torchrun "
                          "sets it; a launch by flags sets none of its variables)")
    return int(stripped)


def _normal(text: str) -> str:
    """A rank or size as the number it spells (``02`` is 2); anything else as given."""
    stripped = text.strip()
    return str(int(stripped)) if ascii_digits(stripped) else stripped
