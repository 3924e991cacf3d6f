"""Shared helpers of the runtime tests: prompts, launches and a driver with staggered arrivals."""

import asyncio
import json
from importlib import resources
from typing import Any

import numpy as np

from adaspec.config import EffectiveConfig, SamplingParams, load_config
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.models.report import heldout_excerpt
from adaspec.policies.base import DepthContext
from adaspec.policies.fixed import FixedDepth
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.requests import RequestFailed, RequestResult


def shipped_prompts() -> list[bytes]:
    text = resources.files("adaspec.models.data").joinpath("prompts.jsonl").read_text()
    return [json.loads(line)["prompt"].encode() for line in text.splitlines() if line]


def excerpt_prompts(count: int) -> list[bytes]:
    """Held-out slices of varied lengths (8 to ~900 bytes), spread over the four domains."""
    excerpt = heldout_excerpt()
    domains = sorted(excerpt)
    prompts = []
    for index in range(count):
        text = excerpt[domains[index % 4]].encode()
        length = 8 + (index * 97) % 900
        start = (index * 613) % (len(text) - length)
        prompts.append(text[start:start + length])
    return prompts


def lossless_prompts() -> list[bytes]:
    """200 distinct prompts: the 64 shipped ones and 136 held-out slices."""
    prompts = shipped_prompts() + excerpt_prompts(136)
    assert len(set(prompts)) == 200
    return prompts


TINY_CALIBRATION = {"request_buckets": [1, 2], "warmup_steps": 2, "window_steps": 3,
                    "windows_per_point": 2}
"""A grid small enough for a test launch to calibrate at start in about a second."""


def config(algorithm: str, width: int, batch: int, **launch: Any) -> EffectiveConfig:
    return load_config({"speculative_algorithm": algorithm, "num_speculative_tokens": width,
                        "max_seqs_per_batch": batch, **launch})


def max_tokens_of(index: int) -> int:
    """Different budgets per request, so requests leave the batch at different rounds."""
    return 6 + (index * 7) % 27


async def run_staggered(runtime: Runtime, prompts: list[bytes],
                        params: list[SamplingParams], wave: int) -> list[RequestResult]:
    """Submit ``wave`` requests at a time, each wave once the first request of the previous
    wave has streamed a chunk, so requests join a batch that is already decoding."""
    await runtime.start()
    try:
        handles = []
        for start in range(0, len(prompts), wave):
            batch = [runtime.submit(list(p), q) for p, q in
                     zip(prompts[start:start + wave], params[start:start + wave], strict=True)]
            handles += batch
            iterator = batch[0].__aiter__()
            try:
                await iterator.__anext__()
            except StopAsyncIteration:
                pass
        return [await handle.result() for handle in handles]
    finally:
        await runtime.stop()


def decode(config_: EffectiveConfig, prompts: list[bytes], params: list[SamplingParams],
           models: ReferenceModels | None = None, wave: int = 5,
           options: RuntimeOptions | None = None) -> list[RequestResult]:
    runtime = Runtime(config_, models=models or load_reference_models(), options=options)
    return asyncio.run(run_staggered(runtime, prompts, params, wave))


class CyclingDepth(FixedDepth):
    """A test's depth policy: depths 1..w in turn, so every draft binding runs."""

    name = "cycling"

    def decide(self, context: DepthContext) -> int:
        # A numpy integer, as a policy computing with numpy returns: taken as the int it is.
        return np.int64(1 + context.round % context.width)  # type: ignore[return-value]


def first_failure(runtime: Runtime, max_tokens: int, started: Any = None) -> str:
    """The one-line reason the first greedy request of "ROMEO." fails for (``started``, when
    given, is called once the runtime has started); the runtime is stopped either way."""
    async def run() -> str:
        await runtime.start()
        if started is not None:
            started()
        try:
            handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                    max_tokens=max_tokens))
            try:
                await handle.result()
            except RequestFailed as failed:
                return str(failed)
            raise AssertionError("the request finished; expected it to fail")
        finally:
            await runtime.stop()

    return asyncio.run(run())

