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


def serving_models(num_kv_slots: int) -> ReferenceModels:
    """The shipped reference models with KV caches for ``num_kv_slots`` requests."""
    loaded = load_reference_models()
    loaded.target.allocate(num_kv_slots)
    loaded.mtp.allocate(num_kv_slots)
    return loaded


@pytest.fixture(scope="session")
def dspark5_batch4_costs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cost bundle calibrated on the reference models for DSpark, width 5, batch 4, for
    tests of adaptive target verify that are not about calibration."""
    import asyncio
    import json

    from runtime_helpers import TINY_CALIBRATION

    from adaspec.config import load_config
    from adaspec.runtime.engine import Runtime, RuntimeOptions

    folder = tmp_path_factory.mktemp("costs")
    calibration, output = folder / "tiny.json", folder / "dspark5-batch4.json"
    calibration.write_text(json.dumps(TINY_CALIBRATION))
    runtime = Runtime(load_config({
        "speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
        "max_seqs_per_batch": 4, "enable_adaptive_target_verify": True,
        "adaptive_target_verify_calibration": str(calibration),
        "adaptive_target_verify_cost_table_output": str(output)}),
        models=load_reference_models(),
        options=RuntimeOptions(calibration_progress=lambda _: None))

    async def run() -> None:
        await runtime.start()
        await runtime.stop()

    asyncio.run(run())
    return str(output)


@pytest.fixture(scope="session")
def target_only_tp2() -> list[list[int]]:
    """Target-only greedy output of the rank tests' prompts at TP=2 (two local ranks): what
    every greedy launch whose shards are TP=2 groups must give."""
    from rank_launch import DECODE, front_tokens, run_ranks

    return front_tokens(run_ranks(2, [*DECODE, "--temperature=0"]), 2)
