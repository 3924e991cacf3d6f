"""The effective configuration: the launch plus every file it names, loaded and checked once.

``load_config`` is the one entry point an engine (or the CLI) calls before anything runs. Its
result knows where each setting came from, so startup can log it and ``adaspec config`` can
print it.
"""

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from adaspec.config.calibration import CalibrationConfig, DraftStepConfig
from adaspec.config.files import (
    check_cost_table_paths,
    load_draft_step_config,
    load_target_verify_calibration,
)
from adaspec.config.flags import launch_config_from_settings, parse_argv
from adaspec.config.launch import LaunchConfig, launch_field_types
from adaspec.config.limits import GRAPH_BACKEND_MEANING

CONFIDENCE_SOURCE = {
    "DSpark": "DSpark confidence head",
    "MTP": "MTP selected-token probability exp(selected_logit - logsumexp(draft_logits))",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EffectiveConfig:
    """Everything a launch decided, with each launch setting's source."""

    launch: LaunchConfig
    sources: Mapping[str, str] = field(default_factory=dict)
    """Per launch field: default, derived (resolved from other settings), or the label of
    whoever gave it (flag on the command line)."""
    draft_step: DraftStepConfig | None = None
    """Adaptive draft-step settings; None unless adaptive draft steps are on."""
    target_verify_calibration: CalibrationConfig | None = None
    """Startup calibration of adaptive target verify; None when it is off or a saved table
    is reused."""

    def as_dict(self) -> dict[str, object]:
        """Every effective setting, JSON-ready, sections with their sources."""
        launch = self.launch
        settings = {name: effective_value(launch, name) for name in launch_field_types()}
        return {
            "launch": {"settings": settings, "sources": dict(self.sources)},
            "execution": _execution(launch),
            "adaptive_draft_step": self._draft_step_dict(),
            "adaptive_target_verify": self._target_verify_dict(),
            "requests": _requests(launch),
        }

    def _draft_step_dict(self) -> dict[str, object]:
        if self.draft_step is None:
            return {"enabled": False}
        policy, calibration = self.draft_step.policy, self.draft_step.calibration
        return {
            "enabled": True,
            "policy": {"source": policy.source, **policy.as_dict()},
            "calibration": {"source": calibration.source, **calibration.as_dict()},
        }

    def _target_verify_dict(self) -> dict[str, object]:
        launch = self.launch
        if not launch.enable_adaptive_target_verify:
            return {"enabled": False}
        calibration: dict[str, object]
        if self.target_verify_calibration is None:
            calibration = {"source": "skipped: costs come from the saved table "
                                     f"{launch.adaptive_target_verify_cost_table}"}
        else:
            cal = self.target_verify_calibration
            calibration = {"source": cal.source, **cal.as_dict()}
        return {
            "enabled": True,
            "confidence": CONFIDENCE_SOURCE[launch.speculative_algorithm],
            "calibration": calibration,
            "cost_table": launch.adaptive_target_verify_cost_table,
            "cost_table_output": launch.adaptive_target_verify_cost_table_output,
        }


EXECUTION_SHAPE = ("world_size", "tp_size", "seqs_per_shard", "prepared_request_buckets",
                   "prepared_target_rows", "prepared_bindings")
"""The execution section's numbers, which the launch settings alone make (a reader of an
event log's header compares them); its other entries are descriptions in words."""


def execution_shape(launch: LaunchConfig) -> dict[str, object]:
    execution = _execution(launch)
    return {name: execution[name] for name in EXECUTION_SHAPE}


def _execution(launch: LaunchConfig) -> dict[str, object]:
    backend = launch.resolved.python_graph_backend
    if launch.enable_adaptive_draft_step:
        mode = f"MTP adaptive draft depth 1..{launch.num_speculative_tokens}"
    elif launch.enable_adaptive_target_verify:
        mode = f"{launch.speculative_algorithm} adaptive target verify, width " \
               f"{launch.num_speculative_tokens}"
    elif launch.speculative:
        mode = f"{launch.speculative_algorithm} fixed width {launch.num_speculative_tokens}"
    else:
        mode = "no speculation"
    return {
        "mode": mode,
        "graph": GRAPH_BACKEND_MEANING[backend] if backend else "off: eager, unpadded shapes",
        "round": "unified: one device unit per round" if launch.enable_unified_mtp_graph
                 else "split: the stages back to back, one stream item per round"
                 if launch.enable_task_pipeline
                 else "split: one stream item per stage, each awaited",
        "pipeline": "two pipeline slots, decisions lagged to round n-2"
                    if launch.enable_schedule_overlap
                    else "one pipeline slot, one round at a time",
        "world_size": launch.world_size,
        "tp_size": launch.resolved.tp_size,
        "seqs_per_shard": launch.seqs_per_shard,
        "prepared_request_buckets": list(launch.prepared_request_buckets()),
        "prepared_target_rows": list(launch.prepared_target_rows()),
        "prepared_bindings": {str(bucket): list(rows)
                              for bucket, rows in launch.prepared_bindings().items()},
    }


def _requests(launch: LaunchConfig) -> dict[str, str]:
    temperature = ("required on every request" if launch.enable_adaptive_target_verify
                   else "optional; unset means 0 (greedy)")
    positive = ("rejected: unified graphs decode greedily" if launch.enable_unified_mtp_graph
                else "accepted: random target sampling, exact")
    return {"temperature": temperature, "positive_temperature": positive}


def effective_value(launch: LaunchConfig, name: str) -> object:
    """A launch setting's effective value: as given, or as resolved when left unset."""
    value = getattr(launch, name)
    if value is None and hasattr(launch.resolved, name):
        return getattr(launch.resolved, name)
    return value


def _sources(launch: LaunchConfig, given: Mapping[str, object], label: str) -> dict[str, str]:
    sources = {}
    for name in launch_field_types():
        if name in given:
            sources[name] = label
        elif effective_value(launch, name) != getattr(launch, name):
            sources[name] = "derived"
        else:
            sources[name] = "default"
    return sources


def load_config(settings: Mapping[str, object], *, label: str = "flag") -> EffectiveConfig:
    """Check a launch completely (flags, rules, files, paths) before anything runs."""
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        raise TypeError(f"load_config(settings={reprlib.repr(settings)}): expected a mapping "
                        "of launch setting names (str) to values, such as "
                        "{'speculative_algorithm': 'MTP'}")
    launch = launch_config_from_settings(settings)
    check_cost_table_paths(launch)
    draft_step = load_draft_step_config(launch) if launch.enable_adaptive_draft_step else None
    return EffectiveConfig(
        launch=launch,
        sources=_sources(launch, settings, label),
        draft_step=draft_step,
        target_verify_calibration=load_target_verify_calibration(launch),
    )


def load_config_from_argv(argv: Sequence[str]) -> EffectiveConfig:
    """``load_config`` for launch tokens such as ``["--dp_size=2", "--device", "cuda"]``."""
    if isinstance(argv, str) or not isinstance(argv, Sequence) or \
            not all(isinstance(token, str) for token in argv):
        raise TypeError(f"load_config_from_argv(argv={reprlib.repr(argv)}): expected a list "
                        "of str tokens, such as ['--dp_size=2', '--device', 'cuda']")
    return load_config(parse_argv(argv))
