"""Whether a launch asks its models for more than they can do, checked before any device work.

``Runtime.start`` calls ``check_model_limits(launch, models)`` with the models it was given
(``None`` for the built-in ones, checked without loading them): a DSpark launch wider than its
drafter's ``max_width`` would otherwise fail every request at its first round.
"""

from typing import Protocol

from adaspec.config.builtin import check_builtin_limits
from adaspec.config.launch import LaunchConfig
from adaspec.errors import ConfigError
from adaspec.models.protocols import DSparkDrafter


class HasDSpark(Protocol):
    """The part of a model set (``ReferenceModels`` or an engine's own) checked here."""

    @property
    def dspark(self) -> DSparkDrafter: ...


def check_model_limits(launch: LaunchConfig, models: HasDSpark | None) -> None:
    """Refuse, naming ``--num_speculative_tokens``, a DSpark width the drafter cannot draft;
    ``models=None`` means the built-in models of ``launch.model``."""
    if models is None:
        check_builtin_limits(launch)
        return
    if launch.speculative_algorithm != "DSpark":
        return
    limit = models.dspark.max_width
    if launch.num_speculative_tokens > limit:
        raise ConfigError("--num_speculative_tokens", launch.num_speculative_tokens,
                          f"expected 1..{limit}: the DSpark drafter passed to the runtime "
                          f"(identity {models.dspark.identity}) drafts at most {limit} tokens "
                          "per block")
