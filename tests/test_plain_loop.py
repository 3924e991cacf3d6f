"""The plain loop, the baseline of every speed figure: the target alone, greedy, with the
same end rules as the runtime; and the cpu stream's thread and autograd settings that keep
the runtime from fighting its own event loop for the cores."""

import asyncio
import os
import threading

import pytest
import torch

from adaspec.bench.plain import plain_loop
from adaspec.bench.run import shipped_prompts
from adaspec.config import SamplingParams, load_config
from adaspec.errors import ConfigError, InvalidRequest
from adaspec.models import ReferenceModels, load_reference_models
from adaspec.runtime.devices.streams import (
    CPU_STREAM_ENV,
    CPU_THREADS_ENV,
    WorkerStream,
    cpu_threads,
)
from adaspec.runtime.engine import Runtime


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    loaded = load_reference_models()
    loaded.target.allocate(4)
    return loaded


def recomputed_greedy(target: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """The greedy continuation by re-running the whole sequence every token (no KV cache): a
    reference independent of the serving path."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            logits, _ = target(torch.tensor([tokens]))
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_the_plain_loop_decodes_what_the_target_alone_decodes(models: ReferenceModels) -> None:
    prompts = [list(p) for p in shipped_prompts()[:3]]
    run = plain_loop(models.target, prompts, 12, concurrency=2)
    assert run.outputs == tuple(tuple(recomputed_greedy(models.target, p, 12)) for p in prompts)
    # Two at a time: every step after the prefills verifies one row per running request.
    assert run.steps >= 11
    assert len(run.tpot_s) == 3
    assert all(t > 0 for t in run.tpot_s)


@pytest.mark.parametrize("stream", ["loop", "worker"])
def test_the_plain_loop_matches_the_runtime_token_for_token(
        models: ReferenceModels, stream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_STREAM_ENV, stream)
    prompts = [list(p) for p in shipped_prompts()[:4]]
    run = plain_loop(models.target, prompts, 20, concurrency=3)

    async def served() -> list[tuple[int, ...]]:
        runtime = Runtime(load_config({"speculative_algorithm": "DSpark",
                                       "num_speculative_tokens": 5}))
        await runtime.start()
        try:
            handles = [runtime.submit(p, SamplingParams(temperature=0, max_tokens=20))
                       for p in prompts]
            return [(await h.result()).token_ids for h in handles]
        finally:
            await runtime.stop()

    assert list(run.outputs) == asyncio.run(served())


def test_a_request_ends_at_the_context_limit_like_in_the_runtime(models: ReferenceModels) -> None:
    limit = models.target.context_limit
    prompt = list(shipped_prompts()[0]) * limit
    near = prompt[:limit - 4]  # room for the prefill's token and three more
    full = prompt[:limit - 1]  # the prefill's token lands on the last position
    assert [len(out) for out in plain_loop(models.target, [near], 4, 1).outputs] == [4]
    assert [len(out) for out in plain_loop(models.target, [near, full], 1, 2).outputs] == [1, 1]
    # More than the context holds after the prompt is refused, as the runtime refuses it.
    with pytest.raises(InvalidRequest, match="max_tokens=5: expected at most 4: the context "
                                             "limit 1024 less the prompt's 1020 tokens"):
        plain_loop(models.target, [near], 5, 1)


def test_max_tokens_one_emits_the_prefill_token_only(models: ReferenceModels) -> None:
    run = plain_loop(models.target, [list(shipped_prompts()[1])], 1, concurrency=1)
    assert len(run.outputs[0]) == 1
    assert run.steps == 0
    assert run.tpot_s == ()


@pytest.mark.parametrize(("prompt", "message"), [
    ([], r"prompts\[0\]=0 tokens: expected 1..1023 tokens"),
    ([65] * 1024, r"prompts\[0\]=1024 tokens: expected 1..1023 tokens"),
    ([65, 256], r"prompts\[0\]\[1\]=256: expected a token id in 0..255"),
    ([-1], r"prompts\[0\]\[0\]=-1: expected a token id in 0..255")])
def test_prompts_the_runtime_would_refuse_are_refused(models: ReferenceModels, prompt: list[int],
                                                      message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        plain_loop(models.target, [prompt], 4, 1)


@pytest.mark.parametrize(("concurrency", "max_tokens", "message"), [
    (5, 4, "concurrency=5: expected 1..4"), (0, 4, "concurrency=0: expected 1..4"),
    (1, 0, "max_tokens=0: expected at least 1")])
def test_impossible_plain_runs_are_refused(models: ReferenceModels, concurrency: int,
                                           max_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plain_loop(models.target, [[65]], max_tokens, concurrency)


def test_a_bad_stream_is_refused_even_when_the_thread_count_is_set() -> None:
    with pytest.raises(ConfigError, match=f"^{CPU_STREAM_ENV}=bogus: expected loop"):
        cpu_threads({CPU_STREAM_ENV: "bogus", CPU_THREADS_ENV: "1"})


def test_cpu_threads_keep_torchs_own_on_the_loop_and_leave_a_core_beside_a_worker() -> None:
    assert cpu_threads({CPU_THREADS_ENV: "3"}) == 3
    assert cpu_threads({CPU_THREADS_ENV: " 2 "}) == 2
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads({}) == torch.get_num_threads()  # the loop stream keeps torch's own
    assert cpu_threads({CPU_STREAM_ENV: "worker"}) == max(1, cores - 1)
    assert cpu_threads({}, stream="worker") == max(1, cores - 1)


@pytest.mark.parametrize("raw", ["0", "two", "-1", "2147483648", "\u00b2", "", "1.5",
                                 "9" * 5000, "\uff12"])
def test_a_thread_count_outside_1_to_1024_is_refused_in_one_line(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"^{CPU_THREADS_ENV}=.*: expected an integer in "
                                          "1..1024") as caught:
        cpu_threads({CPU_THREADS_ENV: raw})
    assert "\n" not in str(caught.value)


def test_a_worker_of_zero_threads_is_refused_before_it_starts() -> None:
    async def open_it() -> None:
        WorkerStream(asyncio.get_running_loop(), threads=0)

    with pytest.raises(ConfigError, match="^threads=0: expected an integer in 1..1024"):
        asyncio.run(open_it())


def test_the_worker_thread_count_does_not_leak_into_other_threads() -> None:
    caller = torch.get_num_threads()
    seen: list[int] = []

    async def run() -> int:
        stream = WorkerStream(asyncio.get_running_loop(), threads=1)
        try:
            later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            later.start()
            later.join()
            return await stream.enqueue(torch.get_num_threads)
        finally:
            stream.close()

    assert asyncio.run(run()) == 1
    assert seen == [caller]  # a thread started later keeps the process's own default
    assert torch.get_num_threads() == caller


def test_cpu_stream_work_runs_with_its_threads_and_without_autograd() -> None:
    caller_threads = torch.get_num_threads()

    async def inside() -> tuple[int, bool, bool]:
        stream = WorkerStream(asyncio.get_running_loop(), threads=1)
        try:
            weight = torch.ones(3, requires_grad=True)
            return await stream.enqueue(lambda: (torch.get_num_threads(),
                                                 torch.is_grad_enabled(),
                                                 (weight * 2).requires_grad))
        finally:
            stream.close()

    threads, grad_enabled, tracked = asyncio.run(inside())
    assert (threads, grad_enabled, tracked) == (1, False, False)
    assert torch.get_num_threads() == caller_threads  # the caller's own setting is untouched


@pytest.mark.parametrize(("variable", "value", "expected"), [
    (CPU_THREADS_ENV, "-1", "an integer"), (CPU_STREAM_ENV, "gpu", "loop")])
def test_a_bad_stream_setting_fails_the_start_in_one_line(
        variable: str, value: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)

    async def start() -> None:
        await Runtime(load_config({"speculative_algorithm": "none"})).start()

    with pytest.raises(ConfigError, match=f"^{variable}={value}: expected {expected}"):
        asyncio.run(start())
