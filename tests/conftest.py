"""Shared helpers for the configuration tests."""

import shlex

import pytest

from adaspec.config import EffectiveConfig, load_config_from_argv
from adaspec.errors import ConfigError


def launch(line: str) -> EffectiveConfig:
    """Load a launch line written as it would be typed."""
    return load_config_from_argv(shlex.split(line))


def rejection(line: str) -> ConfigError:
    """The ConfigError a launch line raises (fails the test if it is accepted)."""
    with pytest.raises(ConfigError) as info:
        launch(line)
    return info.value
