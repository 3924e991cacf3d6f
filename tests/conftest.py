"""Shared helpers: launch lines for the configuration tests, loaded reference models."""

import shlex

import pytest

from adaspec.config import EffectiveConfig, load_config_from_argv
from adaspec.errors import ConfigError
from adaspec.models import ReferenceModels, load_reference_models


def launch(line: str) -> EffectiveConfig:
    """Load a launch line written as it would be typed."""
    return load_config_from_argv(shlex.split(line))


def rejection(line: str) -> ConfigError:
    """The ConfigError a launch line raises (fails the test if it is accepted)."""
    with pytest.raises(ConfigError) as info:
        launch(line)
    return info.value


def serving_models(num_slots: int) -> ReferenceModels:
    """The shipped reference models with KV caches for ``num_slots`` requests."""
    loaded = load_reference_models()
    loaded.target.allocate(num_slots)
    loaded.mtp.allocate(num_slots)
    return loaded
