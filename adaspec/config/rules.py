"""The combination rules of the launch configuration, written as data.

Each ``Rule`` reads "when these settings hold, this one must hold too" and carries the part
of the specification it comes from, so the whole list can be audited against it line by line.
Rules are checked in order and the first violation is raised, so specific rules (with the
specification's reason) come before general ones. A few rules compare numbers across flags;
they are small functions in ``CROSS_CHECKS`` after the table.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adaspec.config.limits import (
    BUILTIN_DRAFTS,
    BUILTIN_TARGETS,
    GRAPH_BACKEND_FOR_DEVICE,
    MAX_SPECULATIVE_TOKENS,
)
from adaspec.errors import MISSING, ConfigError, show_value

if TYPE_CHECKING:  # the launch config runs these rules when it is built
    from adaspec.config.launch import LaunchConfig

_SET = object()  # marker: "any value other than None"

NO_DRAFT_HINT = "choose --speculative_algorithm=MTP, or DSpark with the built-in models"


@dataclass(frozen=True, slots=True)
class Cond:
    """One setting constrained to a set of values (or to being set / unset)."""

    name: str
    allowed: tuple[object, ...]

    def holds(self, cfg: "LaunchConfig") -> bool:
        value = getattr(cfg, self.name)
        if self.allowed == (_SET,):
            return value is not None
        return any(value == a and type(value) is type(a) for a in self.allowed)

    def describe(self) -> str:
        if self.allowed == (_SET,):
            return f"--{self.name}"
        if self.allowed == (None,):
            return f"no --{self.name}"
        # None in a longer list means "or left unset", which needs no mention.
        shown = [show_value(a) for a in self.allowed if a is not None]
        return f"--{self.name}=" + " or ".join(shown)


def eq(name: str, *allowed: object) -> Cond:
    return Cond(name, allowed)


def given(name: str) -> Cond:
    return Cond(name, (_SET,))


@dataclass(frozen=True, slots=True)
class Rule:
    """When every ``when`` condition holds, ``need`` must hold too."""

    when: tuple[Cond, ...]
    need: Cond
    source: str
    """The specification's statement this rule implements (section: paraphrase)."""
    hint: str = ""

    def describe(self) -> str:
        """The rule as one line: condition, requirement, and where it comes from."""
        when = " and ".join(c.describe() for c in self.when) or "always"
        return f"{when} -> {self.need.describe()}   [{self.source}]"

    def violated(self, cfg: "LaunchConfig") -> bool:
        return all(c.holds(cfg) for c in self.when) and not self.need.holds(cfg)

    def error(self, cfg: "LaunchConfig") -> ConfigError:
        value = getattr(cfg, self.need.name)
        reason = " and ".join(c.describe() for c in self.when)
        need = self.need.describe()
        verb = "needs" if len(self.when) == 1 else "need"
        expected = f"{reason} {verb} {need}" if reason else f"expected {need}"
        if self.hint:
            expected += f" ({self.hint})"
        return ConfigError(f"--{self.need.name}", value, expected, rule=self.source)


ADS = eq("enable_adaptive_draft_step", True)
ATV = eq("enable_adaptive_target_verify", True)
UNIFIED = eq("enable_unified_mtp_graph", True)
MTP = eq("speculative_algorithm", "MTP")
DSPARK = eq("speculative_algorithm", "DSpark")
NONE = eq("speculative_algorithm", "none")
ATV_TABLE = given("adaptive_target_verify_cost_table")

RULES: tuple[Rule, ...] = (
    # --- the two adaptive controls --------------------------------------------------------
    Rule((ADS,), eq("enable_adaptive_target_verify", False),
         "Adaptive Speculation: at most one of the two adaptive controls may be on",
         "choose one adaptive control"),
    # --- adaptive draft steps (MTP) -------------------------------------------------------
    Rule((ADS,), eq("speculative_algorithm", "MTP"),
         "Adaptive draft steps: MTP drafts sequentially, so only MTP can shorten its depth"),
    Rule((ADS,), eq("enable_unified_mtp_graph", False),
         "Adaptive draft steps: no support for whole-round (unified) graphs"),
    Rule((ADS,), eq("enable_disagg_pd", False),
         "Adaptive draft steps: no support for prefill/decode disaggregation"),
    Rule((ADS,), eq("enable_graph", True),
         "Adaptive draft steps: run on ordinary graphs"),
    Rule((ADS,), eq("disable_graph_warmup", False),
         "Adaptive draft steps: those graphs are prewarmed"),
    Rule((ADS,), eq("enable_schedule_overlap", True),
         "Adaptive draft steps: need the asynchronous (overlapped) scheduler"),
    Rule((ADS,), eq("enable_task_pipeline", True),
         "Adaptive draft steps: need the task pipeline"),
    Rule((ADS,), eq("dp_size", 1), "Adaptive draft steps: one DP shard only"),
    Rule((ADS,), eq("cp_size", 1), "Adaptive draft steps: no context parallelism"),
    Rule((given("adaptive_draft_step_config"),), eq("enable_adaptive_draft_step", True),
         "Optional draft-step configuration: the file tunes adaptive draft steps; it does "
         "not switch them on"),
    # --- adaptive target verify (MTP proxy and DSpark) ------------------------------------
    Rule((ATV,), eq("speculative_algorithm", "MTP", "DSpark"),
         "Adaptive Speculation: only DSpark (confidence head) and MTP (probability proxy) "
         "implement budgeted verification"),
    Rule((ATV,), eq("enable_probabilistic_draft", False),
         "Adaptive target verification: drafts stay greedy (point mass) under pruning"),
    Rule((ATV,), eq("num_speculative_tokens", 5, 7),
         "Adaptive target verification: widths 5 and 7 only"),
    Rule((ATV,), eq("enable_graph", True),
         "Adaptive target verification: runs on ordinary graphs"),
    Rule((ATV,), eq("disable_graph_warmup", False),
         "Adaptive target verification (DSpark): needs warmed graphs"),
    Rule((ATV,), eq("enable_schedule_overlap", True),
         "Adaptive target verification: needs the overlapped scheduler"),
    Rule((ATV,), eq("enable_task_pipeline", True),
         "Adaptive target verification: needs the task pipeline"),
    Rule((ATV,), eq("cp_size", 1), "Adaptive target verification: no context parallelism"),
    Rule((ATV, MTP), eq("dp_size", 1),
         "Adaptive target verification with MTP logits: one DP shard only",
         "data parallelism is supported for DSpark only"),
    Rule((ATV, MTP), eq("enable_unified_mtp_graph", False),
         "Adaptive target verification with MTP logits: ordinary graphs, not unified ones"),
    Rule((given("adaptive_target_verify_calibration"),), eq("enable_adaptive_target_verify", True),
         "Custom configuration: the calibration file configures adaptive target verify"),
    Rule((ATV_TABLE,), eq("enable_adaptive_target_verify", True),
         "Reuse a saved cost table: the table prices adaptive target verify"),
    Rule((given("adaptive_target_verify_cost_table_output"),),
         eq("enable_adaptive_target_verify", True),
         "Launch example: the output file saves the table fitted for adaptive target verify"),
    Rule((ATV_TABLE,), eq("adaptive_target_verify_calibration", None),
         "Reuse a saved cost table: the table replaces the calibration flag",
         "a saved table skips calibration"),
    Rule((ATV_TABLE,), eq("adaptive_target_verify_cost_table_output", None),
         "Reuse a saved cost table: the table replaces the output flag",
         "a saved table is not fitted again, so there is nothing to save"),
    # --- unified graphs ---------------------------------------------------------------------
    Rule((UNIFIED, DSPARK), eq("dp_size", 1),
         "Adaptive target verification (DSpark): unified graphs take one shard, fixed width "
         "or adaptive; split graphs are never substituted",
         "use --enable_unified_mtp_graph=false for DP"),
    Rule((UNIFIED,), eq("speculative_algorithm", "MTP", "DSpark"),
         "Unified graphs capture a speculative round; without a draft there is none"),
    Rule((UNIFIED,), eq("enable_graph", True),
         "Unified graphs capture each complete round, so graphs must be on"),
    Rule((UNIFIED,), eq("disable_graph_warmup", False),
         "Unified startup captures its tiers during warmup"),
    Rule((UNIFIED,), eq("enable_task_pipeline", True),
         "A unified graph runs the whole round as one device unit, so there are no stages to "
         "run one by one; never silently ignored",
         "drop --enable_task_pipeline=false or set --enable_unified_mtp_graph=false"),
    # --- graphs and device ---------------------------------------------------------------------
    *(Rule((eq("device", device), eq("enable_graph", True)),
           eq("python_graph_backend", backend, None),
           f"Graph backend must fit the device: {backend} on {device}",
           ", ".join(f"{b} runs on --device={d}" for d, b in GRAPH_BACKEND_FOR_DEVICE.items()))
      for device, backend in GRAPH_BACKEND_FOR_DEVICE.items()),
    Rule((eq("enable_graph", False),), eq("python_graph_backend", None),
         "A graph backend is meaningless with graphs off; never silently ignored",
         "drop --python_graph_backend or set --enable_graph=true"),
    Rule((eq("enable_graph", False),), eq("acl_graph_decode_batch_size_limit", None),
         "A graph batch limit is meaningless with graphs off; never silently ignored",
         "drop --acl_graph_decode_batch_size_limit or set --enable_graph=true"),
    Rule((eq("enable_graph", False),), eq("disable_graph_warmup", False),
         "Graph warmup can only be disabled when there are graphs to warm",
         "drop --disable_graph_warmup or set --enable_graph=true"),
    # --- no speculation ------------------------------------------------------------------------
    Rule((NONE,), eq("num_speculative_tokens", 0),
         "Without a draft algorithm nothing is drafted",
         NO_DRAFT_HINT),
    Rule((NONE,), eq("draft_model", None),
         "Without a draft algorithm there is no draft model",
         NO_DRAFT_HINT),
    # --- what adaspec does not implement in any mode ---------------------------------------
    Rule((), eq("enable_probabilistic_draft", False),
         "adaspec's rejection sampler takes deterministic (point-mass) drafts only, as the "
         "specification's DSpark path does"),
    Rule((), eq("enable_disagg_pd", False),
         "adaspec runs prefill and decode in one process; PD disaggregation is not implemented"),
    Rule((), eq("cp_size", 1),
         "adaspec splits a model across ranks by TP only; context parallelism is not "
         "implemented", "context parallelism is not implemented; use --tp_size to split the "
         "model across ranks"),
)


def _check_parallel_shape(cfg: "LaunchConfig") -> ConfigError | None:
    """tp_size * dp_size * cp_size equals nnodes, and node_rank < nnodes."""
    if cfg.cp_size != 1:  # refused by its own rule, which names it (no CP is implemented)
        return None
    group = cfg.dp_size * cfg.cp_size
    tp_size = cfg.resolved.tp_size
    if tp_size * group != cfg.nnodes:
        return ConfigError("--tp_size", tp_size,
                           f"expected tp_size*dp_size*cp_size == nnodes={cfg.nnodes}, "
                           f"that is tp_size={cfg.nnodes // group}")
    if cfg.node_rank >= cfg.nnodes:
        return ConfigError("--node_rank", cfg.node_rank,
                           f"expected a rank in 0..{cfg.nnodes - 1} (--nnodes={cfg.nnodes})")
    return None


def _check_batch_limits(cfg: "LaunchConfig") -> ConfigError | None:
    """max_seqs_per_batch >= dp_size, and the graph batch limit <= max_seqs_per_batch."""
    if cfg.max_seqs_per_batch < cfg.dp_size:
        return ConfigError("--max_seqs_per_batch", cfg.max_seqs_per_batch,
                           f"expected at least --dp_size={cfg.dp_size} (one sequence per "
                           f"DP shard)")
    limit = cfg.resolved.acl_graph_decode_batch_size_limit
    if limit > cfg.max_seqs_per_batch:
        return ConfigError("--acl_graph_decode_batch_size_limit", limit,
                           f"expected at most --max_seqs_per_batch={cfg.max_seqs_per_batch} "
                           f"(a larger bucket can never be filled)")
    return None


def _check_width(cfg: "LaunchConfig") -> ConfigError | None:
    """A draft algorithm drafts at least one token per round."""
    if cfg.speculative and cfg.num_speculative_tokens < 1:
        return ConfigError("--num_speculative_tokens", cfg.num_speculative_tokens,
                           f"--speculative_algorithm={cfg.speculative_algorithm} needs a "
                           f"width in 1..{MAX_SPECULATIVE_TOKENS}")
    return None


def _check_own_target_draft(cfg: "LaunchConfig") -> ConfigError | None:
    """A checkpoint target drafts with a named draft of its own, never a built-in one."""
    if cfg.model in BUILTIN_TARGETS or not cfg.speculative:
        return None
    # The built-in drafts share a built-in target's embedding and output head: paired with
    # another target they would be a silent substitution, so the pairing is never implied.
    why = (f"with --model={show_value(cfg.model)} (the built-in drafts draft for "
           f"{' and '.join(BUILTIN_TARGETS)} only)")
    if cfg.draft_model is None:
        return ConfigError("--draft_model", MISSING, f"required {why}; give your draft's path")
    if cfg.draft_model.startswith("builtin:"):
        return ConfigError("--draft_model", cfg.draft_model,
                           f"expected your draft's path {why}")
    return None


def _check_builtin_models(cfg: "LaunchConfig") -> ConfigError | None:
    """builtin: names exist and the built-in draft matches the algorithm."""
    if cfg.model.startswith("builtin:") and cfg.model not in BUILTIN_TARGETS:
        return ConfigError("--model", cfg.model,
                           f"expected a path or one of {', '.join(BUILTIN_TARGETS)}")
    draft = cfg.draft_model
    # Without a draft algorithm any --draft_model is refused by the rules, built-in or not:
    # the one message says what is wrong (no draft at all), not which draft would do.
    if draft is not None and draft.startswith("builtin:") and cfg.speculative:
        own = BUILTIN_DRAFTS.get(cfg.speculative_algorithm)
        if draft != own:
            expected = f"expected a path or {own}" if own else "expected a path"
            known = ", ".join(sorted(BUILTIN_DRAFTS.values()))
            return ConfigError("--draft_model", draft,
                               f"{expected} for --speculative_algorithm="
                               f"{cfg.speculative_algorithm} (built-in drafts: {known})")
    return None


CROSS_CHECKS: "tuple[Callable[[LaunchConfig], ConfigError | None], ...]" = (
    _check_parallel_shape,
    _check_batch_limits,
    _check_width,
    _check_own_target_draft,
    _check_builtin_models,
)


def check_launch_rules(cfg: "LaunchConfig") -> None:
    """Raise the first violated rule, numeric cross-checks first (they name ranges)."""
    for check in CROSS_CHECKS:
        error = check(cfg)
        if error is not None:
            raise error
    for rule in RULES:
        if rule.violated(cfg):
            raise rule.error(cfg)
