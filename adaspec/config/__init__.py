"""Frozen launch, policy, calibration and request configuration, loaded and checked once.

This package imports nothing of adaspec's but ``adaspec.errors``, so every other layer may
depend on it.
"""

from adaspec.config.calibration import (
    CalibrationConfig,
    ContextInterval,
    DraftStepConfig,
    DraftStepPolicyConfig,
)
from adaspec.config.effective import EffectiveConfig, load_config, load_config_from_argv
from adaspec.config.launch import LaunchConfig
from adaspec.config.requests import SamplingParams, check_request
from adaspec.config.rules import RULES, Rule

__all__ = [
    "RULES",
    "CalibrationConfig",
    "ContextInterval",
    "DraftStepConfig",
    "DraftStepPolicyConfig",
    "EffectiveConfig",
    "LaunchConfig",
    "Rule",
    "SamplingParams",
    "check_request",
    "load_config",
    "load_config_from_argv",
]
