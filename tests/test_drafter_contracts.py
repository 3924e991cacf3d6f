"""The contracts a drafter relies on, pinned through the runtime: it sees the whole prompt
(``x_0`` and a one-token prompt included) before the first round, every committed position
after each round, positions that never leave the context, and a checkpoint identity that
depends on values alone. A drafter that runs the target's own weights on a KV context of its
own therefore drafts exactly what the target decides: every verified draft is accepted."""

import asyncio
import copy
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from runtime_helpers import config, run_staggered
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from adaspec.config import SamplingParams
from adaspec.models import (
    ContextRows,
    DSparkBlock,
    MtpStep,
    PrefillOutput,
    ReferenceModels,
    TargetOutput,
    VerifyRows,
    checkpoint_identity,
    load_reference_models,
)
from adaspec.models.checkpoint import FILES, shipped_folder
from adaspec.models.target import ReferenceTarget
from adaspec.runtime.engine import Runtime
from adaspec.runtime.requests import RequestResult

PROMPTS = [b"A", b"ROMEO.\nBut soft, what light", b"Q", b"To be, or not to be", b"\n"]


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


class TargetCopy:
    """The target's own weights on a KV cache of their own: each call runs the target on one
    row per entry, (token, position, slot), writing before reading as ``verify`` does."""

    def __init__(self, target: ReferenceTarget) -> None:
        self.model = copy.deepcopy(target)
        self.identity = "copy-of-" + target.identity
        self.max_width = 7

    def allocate(self, num_kv_slots: int) -> None:
        self.model.allocate(num_kv_slots)

    def forward(self, token_ids: Tensor, positions: Tensor, kv_slots: Tensor) -> TargetOutput:
        index = torch.arange(token_ids.shape[0])
        inside = (kv_slots < self.model.num_kv_slots) & (positions < self.model.context_limit)
        return self.model.verify(VerifyRows(
            token_ids=token_ids, row_reqs=index, row_offsets=torch.zeros_like(index),
            row_valid=inside, req_kv_slots=torch.where(inside, kv_slots, self.model.num_kv_slots),
            req_starts=positions.clamp(max=self.model.context_limit - 1), rows_per_req=1))

    def publish(self, rows: ContextRows) -> None:
        self.forward(rows.token_ids, rows.positions, rows.kv_slots)  # x_p at p


class TargetAsMtp(TargetCopy):
    """An ``MtpDrafter``: the token of a step sits at p + 1, the next token is its argmax."""

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        assert int(positions.max()) <= self.model.context_limit - 2  # the token fits
        out = self.forward(token_ids, positions + 1, kv_slots)
        token = out.logits.argmax(-1)
        probs = out.logits.softmax(-1).gather(-1, token[:, None])[:, 0]
        return MtpStep(hidden=out.hidden, token_ids=token, probs=probs, logits=out.logits)


class TargetAsDSpark(TargetCopy):
    """A ``DSparkDrafter`` with a context of its own: the block is ``width`` target steps
    from the anchor at p + 1 (steps past the context run on scratch, never verified)."""

    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        token, tokens, logits = token_ids, [], []
        for k in range(width):
            out = self.forward(token, positions + 1 + k, kv_slots)
            token = out.logits.argmax(-1)
            tokens.append(token)
            logits.append(out.logits)
        stacked = torch.stack(logits, 1)
        chosen = torch.stack(tokens, 1)
        confidences = stacked.softmax(-1).gather(-1, chosen[..., None])[..., 0]
        return DSparkBlock(token_ids=chosen, confidences=confidences, logits=stacked)


def decode(models: Any, algorithm: str, prompts: list[bytes], max_tokens: int | list[int],
           width: int = 3, batch: int = 4) -> list[RequestResult]:
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=count) for count in counts]
    runtime = Runtime(config(algorithm, width, batch), models=models)
    return asyncio.run(run_staggered(runtime, prompts, params, batch))


@functools.cache
def target_alone(models: ReferenceModels) -> list[tuple[int, ...]]:
    return [r.token_ids for r in decode(models, "none", PROMPTS, 16, width=0)]


@pytest.mark.parametrize(("algorithm", "make"), [("MTP", TargetAsMtp),
                                                 ("DSpark", TargetAsDSpark)])
def test_a_drafter_with_the_targets_own_weights_accepts_every_draft(
        models: ReferenceModels, algorithm: str, make: Callable[[ReferenceTarget], Any]
        ) -> None:
    drafter = make(models.target)
    own = SimpleNamespace(target=models.target, mtp=drafter if algorithm == "MTP" else None,
                          dspark=drafter if algorithm == "DSpark" else None)
    results = decode(own, algorithm, PROMPTS, 16)
    assert [r.token_ids for r in results] == target_alone(models)
    for prompt, result in zip(PROMPTS, results, strict=True):
        # One-token prompts included: the drafter saw x_0 before round 0.
        assert result.verified > 0, prompt
        assert result.accepted == result.verified, prompt


class Recorder:
    """Wraps a drafter and records what the runtime hands it, checking each call's ranges."""

    def __init__(self, drafter: Any, context_limit: int) -> None:
        self.drafter = drafter
        self.identity = drafter.identity
        self.limit = context_limit
        self.num_kv_slots = 0
        self.published: list[tuple[int, int, int, int]] = []  # (slot, p, x_p, x_{p+1})
        self.calls: list[tuple[int, int]] = []  # (slot, p) of each entry of each draft call

    @property
    def max_width(self) -> int:
        return int(self.drafter.max_width)

    def allocate(self, num_kv_slots: int) -> None:
        self.num_kv_slots = num_kv_slots
        if hasattr(self.drafter, "allocate"):
            self.drafter.allocate(num_kv_slots)

    def publish(self, rows: ContextRows) -> None:
        assert 0 <= int(rows.positions.min())
        assert int(rows.positions.max()) < self.limit
        for slot, p, token, after in zip(rows.kv_slots.tolist(), rows.positions.tolist(),
                                         rows.token_ids.tolist(),
                                         rows.next_token_ids.tolist(), strict=True):
            if slot != self.num_kv_slots:
                assert p <= self.limit - 2
                self.published.append((slot, p, token, after))
        if hasattr(self.drafter, "publish"):
            self.drafter.publish(rows)

    def _called(self, positions: Tensor, kv_slots: Tensor) -> None:
        assert 0 <= int(positions.min())
        assert int(positions.max()) <= self.limit - 2
        assert 0 <= int(kv_slots.min())
        assert int(kv_slots.max()) <= self.num_kv_slots
        self.calls += [(s, p) for s, p in zip(kv_slots.tolist(), positions.tolist(), strict=True)
                       if s != self.num_kv_slots]

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        self._called(positions, kv_slots)
        step: MtpStep = self.drafter.step(hidden, token_ids, positions, kv_slots)
        return step

    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        self._called(positions, kv_slots)
        block: DSparkBlock = self.drafter.draft(hidden, token_ids, positions, kv_slots, width)
        return block


@pytest.mark.parametrize("algorithm", ["MTP", "DSpark"])
def test_the_drafter_sees_every_committed_position_and_never_leaves_the_context(
        models: ReferenceModels, algorithm: str) -> None:
    limit = models.target.context_limit
    text = (b"Now is the winter of our discontent made glorious summer. " * 20)
    # One-token, short, up to the context edge (runs into it) and at the longest prompt.
    prompts = [b"A", text[:40], text[:limit - 30], text[:limit - 1]]
    drafted = models.mtp if algorithm == "MTP" else models.dspark
    recorder = Recorder(drafted, limit)
    own = SimpleNamespace(target=models.target, mtp=recorder if algorithm == "MTP" else None,
                          dspark=recorder if algorithm == "DSpark" else None)
    # Every request admitted at once: each keeps its own KV slot throughout. The last two
    # may decode up to the context's last position: 30 tokens, and the prefill's one.
    results = decode(own, algorithm, prompts, [60, 60, 30, 1], width=5, batch=len(prompts))
    assert results[2].finish_reason == "length"
    assert len(results[2].token_ids) == limit - len(prompts[2])  # up to position limit - 1
    by_slot: dict[int, dict[int, tuple[int, int]]] = {}
    for slot, p, token, after in recorder.published:
        seen = by_slot.setdefault(slot, {})
        assert seen.get(p, (token, after)) == (token, after)  # published again: unchanged
        seen[p] = (token, after)
    # Each request's slot holds every position but its newest token's, x_0 included, each
    # with its token and the committed token after it: together, the whole sequence.
    published = []
    for seen in by_slot.values():
        assert sorted(seen) == list(range(len(seen)))
        published.append([seen[p][0] for p in range(len(seen))] + [seen[len(seen) - 1][1]])
    expected = [list(prompt) + list(result.token_ids)
                for prompt, result in zip(prompts, results, strict=True)]
    assert sorted(published) == sorted(expected)
    assert max(p for _, p in recorder.calls) >= limit - 3  # the calls reached the edge


def test_prompt_rows_cover_every_position_and_end_with_the_first_token() -> None:
    prompts = [torch.tensor([10, 11, 12]), torch.tensor([20]), torch.tensor([30, 31])]
    hidden = torch.arange(3 * 3 * 2, dtype=torch.float32).view(3, 3, 2)
    prefill = PrefillOutput(last=TargetOutput(logits=torch.zeros(3, 4), hidden=hidden[:, 0]),
                            hidden=hidden, lengths=torch.tensor([3, 1, 2]))
    rows = ContextRows.of_prompts(prefill, prompts, torch.tensor([5, 2, 7]),
                                  torch.tensor([13, 21, 32]))
    assert rows.token_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert rows.next_token_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert rows.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert rows.kv_slots.tolist() == [5, 5, 5, 2, 7, 7]
    expected = torch.stack([hidden[0, 0], hidden[0, 1], hidden[0, 2], hidden[1, 0],
                            hidden[2, 0], hidden[2, 1]])
    assert torch.equal(rows.hidden, expected)


# --- identity --------------------------------------------------------------------------------

WEIGHTS = {"b": torch.arange(12, dtype=torch.float32).view(3, 4) / 7,
           "a": torch.tensor([1, 2, 3], dtype=torch.int64), "scalar": torch.tensor(0.5)}
CONFIG = {"hidden_size": 4, "window": 16, "name": "tiny", "eps": 1e-6}
IDENTITY_SCRIPT = """
import torch
from adaspec.models import checkpoint_identity
weights = {"b": torch.arange(12, dtype=torch.float32).view(3, 4) / 7,
           "a": torch.tensor([1, 2, 3], dtype=torch.int64), "scalar": torch.tensor(0.5)}
print(checkpoint_identity({"window": 16, "hidden_size": 4, "eps": 1e-6, "name": "tiny"},
                          weights))
"""


def test_identity_is_stable_across_processes_order_and_layout() -> None:
    identity = checkpoint_identity(CONFIG, WEIGHTS)
    assert len(identity) == 32
    assert set(identity) <= set("0123456789abcdef")
    other = subprocess.run([sys.executable, "-c", IDENTITY_SCRIPT], capture_output=True,
                           text=True, check=True)
    assert other.stdout.strip() == identity
    reordered = {name: WEIGHTS[name] for name in reversed(list(WEIGHTS))}
    transposed = {**WEIGHTS, "b": WEIGHTS["b"].t().contiguous().t()}  # not contiguous
    assert not transposed["b"].is_contiguous()
    assert checkpoint_identity(dict(reversed(CONFIG.items())), reordered) == identity
    assert checkpoint_identity(CONFIG, transposed) == identity
    trained = {k: v.clone().requires_grad_() if v.is_floating_point() else v
               for k, v in WEIGHTS.items()}
    assert checkpoint_identity(CONFIG, trained) == identity
    if torch.cuda.is_available():
        on_gpu = {name: tensor.cuda() for name, tensor in WEIGHTS.items()}
        assert checkpoint_identity(CONFIG, on_gpu) == identity


def test_identity_changes_with_any_value_name_dtype_config_or_parent() -> None:
    identity = checkpoint_identity(CONFIG, WEIGHTS)
    changed = {**WEIGHTS, "b": WEIGHTS["b"].clone()}
    changed["b"][2, 3] += 1e-6
    variants = [
        checkpoint_identity(CONFIG, changed),
        checkpoint_identity(CONFIG, {**WEIGHTS, "a": torch.tensor([1, 2, 4])}),
        checkpoint_identity(CONFIG, {"c" if k == "b" else k: v for k, v in WEIGHTS.items()}),
        checkpoint_identity(CONFIG, {**WEIGHTS, "b": WEIGHTS["b"].double()}),
        checkpoint_identity(CONFIG, {**WEIGHTS, "b": WEIGHTS["b"].reshape(4, 3)}),
        checkpoint_identity({**CONFIG, "window": 32}, WEIGHTS),
        checkpoint_identity(CONFIG, WEIGHTS, parent="a target"),
    ]
    assert identity not in variants
    assert len(set(variants)) == len(variants)


def test_the_reference_models_identities_are_checkpoint_identities_of_their_files(
        models: ReferenceModels) -> None:
    folder = shipped_folder()
    parents = {"target": "", "mtp": models.target.identity, "dspark": models.target.identity}
    for name, file in FILES.items():
        with safe_open(str(folder / file), framework="pt") as handle:
            stored_config = json.loads((handle.metadata() or {})["config"])
        stored = load_file(str(folder / file))
        expected = checkpoint_identity(stored_config, stored, parent=parents[name])
        assert getattr(models, name).identity == expected
