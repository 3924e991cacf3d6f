"""What the built-in reference models can run, known without loading them.

A launch can be valid in general (widths up to 16) and still ask the shipped models for more
than they were trained to do; such a launch is refused here, before anything loads, instead of
failing every request at its first round. Kept free of torch so ``adaspec config`` stays fast.
"""

from adaspec.config.launch import BUILTIN_TARGETS, LaunchConfig
from adaspec.errors import ConfigError

BUILTIN_DSPARK_MAX_WIDTH: dict[str, int] = {"small": 7, "large": 7}
"""The widest block the DSpark drafter of each built-in family drafts (its ``max_width``: one
learned query per position); a test pins these to the shipped weights."""


def uses_builtin_models(launch: LaunchConfig) -> bool:
    """Whether the launch runs a built-in target with its built-in drafts."""
    draft = launch.draft_model
    return launch.model in BUILTIN_TARGETS and (draft is None or draft.startswith("builtin:"))


def check_builtin_limits(launch: LaunchConfig) -> None:
    """Refuse a launch of the built-in models that they cannot draft; a launch of other
    models is left to ``adaspec.models.limits.check_model_limits`` on the models themselves."""
    if not uses_builtin_models(launch) or launch.speculative_algorithm != "DSpark":
        return
    limit = BUILTIN_DSPARK_MAX_WIDTH[BUILTIN_TARGETS[launch.model]]
    if launch.num_speculative_tokens > limit:
        raise ConfigError("--num_speculative_tokens", launch.num_speculative_tokens,
                          f"expected 1..{limit}: the built-in DSpark drafter of "
                          f"--model={launch.model} drafts at most {limit} tokens per block")
