"""The models and tokenizer of a launch: the built-in reference models (byte-level), or the
Hugging Face checkpoint directories ``--model`` and ``--draft_model`` name.

``Runtime`` itself loads only the built-in models; the commands load a checkpoint directory
here and pass it as ``Runtime(models=...)``, as an engine would.
"""

import torch

from adaspec.config.builtin import (
    builtin_checkpoints,
    check_checkpoint_launch,
    uses_builtin_models,
)
from adaspec.config.launch import LaunchConfig
from adaspec.errors import ConfigError
from adaspec.models.protocols import ModelSet
from adaspec.models.tokenizer import ByteTokenizer, Tokenizer


def _quiet_transformers() -> None:
    """A command's stderr carries one line per error: no progress bars or warnings of
    transformers (an engine that loads checkpoints itself keeps its own settings)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # refused in one line where a checkpoint is loaded
        return
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]


def command_tokenizer(launch: LaunchConfig) -> tuple[Tokenizer, int]:
    """The tokenizer of the launch's target and its context limit (read from its files, with
    no weights loaded): prompts are checked against both before any model loads. The
    tokenizer's ``eos_token_ids`` are the checkpoint's end-of-sequence tokens (none for the
    built-in models)."""
    builtin = builtin_checkpoints(launch)
    if uses_builtin_models(launch):
        assert builtin is not None
        return ByteTokenizer(), builtin[1]
    check_checkpoint_launch(launch)
    from adaspec.models.hf import check_draft_tokenizer, checkpoint_tokenizer, read_config

    _quiet_transformers()  # read_config validates the config with transformers
    config = read_config(launch.model, "--model")
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if not isinstance(limit, int) or limit < 2:
        raise ConfigError("--model", launch.model, f"config.json gives no context length "
                          f"(max_position_embeddings={limit!r})")
    tokenizer = checkpoint_tokenizer(launch.model, config)
    draft = launch.draft_model
    if launch.speculative and draft is not None and draft != launch.model:
        # Its config first: a damaged one would otherwise be blamed on its tokenizer, which
        # transformers loads through it.
        read_config(draft, "--draft_model")
        check_draft_tokenizer(draft, tokenizer.tokenizer)
    return tokenizer, limit


def checkpoint_models(launch: LaunchConfig, device: torch.device) -> ModelSet | None:
    """The checkpoints of ``--model`` and ``--draft_model`` on ``device`` (this rank's);
    None for the built-in models, which the runtime loads itself."""
    if uses_builtin_models(launch):
        return None
    check_checkpoint_launch(launch)
    from adaspec.models.hf import load_hf_models

    _quiet_transformers()
    return load_hf_models(launch.model, launch.draft_model, device=device,
                          drafter=launch.speculative_algorithm == "MTP")
