"""What the built-in reference models can run, known without loading them.

A launch can be valid in general (widths up to 16) and still ask the shipped models for more
than they were trained to do; such a launch is refused here, before anything loads, instead of
failing every request at its first round. Kept free of torch so ``adaspec config`` stays fast.
"""

import json
from pathlib import Path
from typing import Any

from adaspec.config.launch import LaunchConfig
from adaspec.config.limits import BUILTIN_TARGETS
from adaspec.errors import ConfigError

BUILTIN_DSPARK_MAX_WIDTH: dict[str, int] = {"small": 7, "large": 7}
"""The widest block the DSpark drafter of each built-in family drafts (its ``max_width``: one
learned query per position); a test pins these to the shipped weights."""


BUILTIN_FOLDERS: dict[str, str] = {"small": ".", "large": "large"}
"""The folder of each built-in family's checkpoints and model card under the weights package
(``adaspec/models/families.py`` names the same; a test pins them together)."""

WEIGHTS = Path(__file__).resolve().parents[1] / "models" / "weights"
"""Found by path: importing the weights package would import torch."""


def builtin_checkpoints(launch: LaunchConfig) -> tuple[dict[str, str], int] | None:
    """The checkpoint identities of a launch of the built-in models (``target``, and
    ``draft``: the drafter its algorithm uses, "none" without one) and the target's context
    limit, read from the shipped model card without loading anything; None for other
    models."""
    if not uses_builtin_models(launch):
        return None
    models = _card(launch)["models"]
    drafter = {"MTP": "mtp", "DSpark": "dspark"}.get(launch.speculative_algorithm)
    identities = {"target": models["target"]["identity"],
                  "draft": models[drafter]["identity"] if drafter else "none"}
    return identities, int(models["target"]["config"]["context_limit"])


def uses_builtin_models(launch: LaunchConfig) -> bool:
    """Whether the launch runs a built-in target with its built-in drafts."""
    draft = launch.draft_model
    return launch.model in BUILTIN_TARGETS and (draft is None or draft.startswith("builtin:"))


def check_builtin_limits(launch: LaunchConfig) -> None:
    """Refuse a launch of the built-in models that they cannot draft; a launch of other
    models is left to ``adaspec.models.limits.check_model_limits`` on the models themselves."""
    if not uses_builtin_models(launch):
        return
    _check_tp_split(launch)
    if launch.speculative_algorithm != "DSpark":
        return
    limit = BUILTIN_DSPARK_MAX_WIDTH[BUILTIN_TARGETS[launch.model]]
    if launch.num_speculative_tokens > limit:
        raise ConfigError("--num_speculative_tokens", launch.num_speculative_tokens,
                          f"expected 1..{limit}: the built-in DSpark drafter of "
                          f"--model={launch.model} drafts at most {limit} tokens per block")


def _check_tp_split(launch: LaunchConfig) -> None:
    """Each TP rank keeps an equal share of every built-in model's heads and MLP units, as
    the split at start requires (read from the model card: nothing loads)."""
    tp_size = launch.resolved.tp_size
    if tp_size == 1:
        return
    models = _card(launch)["models"]
    for model in models.values():
        for what, key in (("attention heads", "num_heads"), ("MLP hidden units", "mlp_hidden")):
            count = model["config"].get(key)
            if isinstance(count, int) and count % tp_size:
                raise ConfigError("--tp_size", tp_size, f"expected a divisor of the model's "
                                  f"{what} ({count}): each TP rank keeps an equal share")


def builtin_target_limit(identity: str) -> tuple[str, int] | None:
    """The built-in target (its ``--model`` name) whose checkpoint identity is ``identity``,
    with its context limit from the model card; None for any other target, whose limit only
    its own checkpoint knows."""
    for model, family in BUILTIN_TARGETS.items():
        target = _family_card(family)["models"]["target"]
        if target["identity"] == identity:
            return model, int(target["config"]["context_limit"])
    return None


def _card(launch: LaunchConfig) -> dict[str, Any]:
    return _family_card(BUILTIN_TARGETS[launch.model])


def _family_card(family: str) -> dict[str, Any]:
    folder = BUILTIN_FOLDERS[family]
    card: dict[str, Any] = json.loads((WEIGHTS / folder / "model_card.json").read_text(
        encoding="utf-8"))
    return card


def check_checkpoint_launch(launch: LaunchConfig) -> None:
    """What a launch of checkpoint directories cannot run, refused before anything loads."""
    if uses_builtin_models(launch):
        return
    if launch.model in BUILTIN_TARGETS:
        raise ConfigError("--draft_model", launch.draft_model, "a drafter checkpoint drafts "
                          "for a target checkpoint; expected --model=DIR with it, or a "
                          "builtin: drafter")
    if launch.speculative_algorithm == "DSpark":
        raise ConfigError("--speculative_algorithm", "DSpark", "a Hugging Face checkpoint "
                          "drafts MTP-style (a second causal LM, or the target itself); "
                          "expected MTP or none")
    if launch.resolved.tp_size > 1:
        raise ConfigError("--tp_size", launch.resolved.tp_size, "a Hugging Face checkpoint "
                          "runs whole on each rank; expected 1 (DP shards may be several)")


def check_checkpoint_folders(launch: LaunchConfig) -> None:
    """A checkpoint flag names a directory holding ``config.json``, as loading requires (its
    contents are checked when it loads)."""
    for flag, path in (("--model", launch.model), ("--draft_model", launch.draft_model)):
        if path is None or path in BUILTIN_TARGETS or path.startswith("builtin:"):
            continue
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(flag, path, "expected a directory holding a Hugging Face causal "
                              "LM (config.json and *.safetensors)")
        if not (folder / "config.json").is_file():
            raise ConfigError(flag, path, "has no config.json; expected a Hugging Face "
                              "causal LM checkpoint directory")
