"""The runtime on a CUDA device (every test skips without one; benchmarks/device_check.sh runs
them): captured bindings in split and unified mode, output equal to the target alone, and no
host synchronisation while requests are served."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_marks import needs_cuda
from runtime_helpers import (
    TINY_CALIBRATION,
    CyclingDepth,
    config,
    lossless_prompts,
    max_tokens_of,
)

from adaspec.config import SamplingParams
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.runtime.devices.graphs import CapturedVerify
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.split import SplitBinding
from adaspec.runtime.unified import BoundRound

PROMPTS = lossless_prompts()[:10]
LAUNCHES = {
    "split-fixed": ("DSpark", 5, {}),
    "split-mtp": ("MTP", 3, {}),
    "split-mtp-every-depth": ("MTP", 3, {}),  # a policy cycling depths 1..3 (RuntimeOptions)
    "split-adaptive-verify": ("DSpark", 5, {"enable_adaptive_target_verify": True}),
    "unified-fixed": ("DSpark", 5, {"enable_unified_mtp_graph": True}),
    "unified-adaptive-verify": ("DSpark", 5, {"enable_unified_mtp_graph": True,
                                              "enable_adaptive_target_verify": True}),
}


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return load_reference_models("cuda")


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens_of(i))
            for i in range(len(PROMPTS))]


async def _serve(runtime: Runtime, sync_check: bool) -> list[tuple[int, ...]]:
    """Decode every prompt; with ``sync_check`` any host synchronisation with the device
    between start and the last result raises (``torch.cuda.set_sync_debug_mode``)."""
    await runtime.start()
    try:
        if sync_check:
            torch.cuda.set_sync_debug_mode("error")
        handles = [runtime.submit(list(p), q) for p, q in zip(PROMPTS, params(), strict=True)]
        return [(await handle.result()).token_ids for handle in handles]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        await runtime.stop()


def run(name: str, models: ReferenceModels, tmp_path: Path, sync_check: bool = False
        ) -> tuple[Runtime, list[tuple[int, ...]]]:
    algorithm, width, flags = LAUNCHES.get(name, ("none", 0, {}))
    launch: dict[str, Any] = {"device": "cuda", **flags}
    if flags.get("enable_adaptive_target_verify"):
        calibration = tmp_path / f"{name}.json"
        calibration.write_text(json.dumps(TINY_CALIBRATION))
        launch["adaptive_target_verify_calibration"] = str(calibration)
    # Several draft graphs of one bucket then share their pool, each replayed in turn.
    options = RuntimeOptions(depth_policy=CyclingDepth()) if name.endswith("every-depth") \
        else None
    runtime = Runtime(config(algorithm, width, 4, **launch), models=models, options=options)
    return runtime, asyncio.run(_serve(runtime, sync_check))


@pytest.fixture(scope="module")
def target_only(models: ReferenceModels, tmp_path_factory: pytest.TempPathFactory
                ) -> list[tuple[int, ...]]:
    return run("target-only", models, tmp_path_factory.mktemp("target"))[1]


@needs_cuda
@pytest.mark.parametrize("name", list(LAUNCHES))
def test_greedy_output_on_cuda_equals_the_target_alone_with_no_host_sync(
        name: str, models: ReferenceModels, target_only: list[tuple[int, ...]],
        tmp_path: Path) -> None:
    runtime, outputs = run(name, models, tmp_path, sync_check=True)
    assert outputs == target_only
    registries = runtime._pipeline.registries  # type: ignore[union-attr]  # what start prepared
    assert registries is not None
    for registry in registries:
        assert registry.sealed
        bindings = [registry.lookup(b, g).binding for _, _, b, g in registry.keys]
        if name.startswith("unified"):
            assert all(isinstance(b, BoundRound) and b.graph is not None for b in bindings)
            continue
        # Split: the drafter's forwards, packing and verify each replay a captured graph.
        assert all(isinstance(b, SplitBinding) for b in bindings)
        for binding in bindings:
            assert isinstance(binding.verify, CapturedVerify)
            assert binding.pack.call.graph is not None
            assert all(draft.call.graph is not None for draft in binding.drafts.values())
