"""Startup calibration holds at any acceptance rate, every draft accepted included.

Calibration prompts leave the context just the sampling progress: every round of the window
at the point's full width may commit w + 1 tokens. When every draft is accepted it does, so
the point's requests reach their context end right after the window and the rounds still in
flight retire without them. The window must stand once measured; those rounds used to break
the run it was measured on whenever they retired before calibration looked, and the launch
failed with "its requests ended before the point was measured". The launches run the
byte-level model of ``examples/own_model.py`` (fast enough for the full pipeline in a
second), drafted either by its own bigram head or by the target's own tables, which accept
every draft; a scripted pipeline pins the case without depending on how many rounds retire
before calibration looks."""

import asyncio
import importlib.util
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from runtime_helpers import TINY_CALIBRATION
from torch import Tensor

from adaspec.config import SamplingParams, load_config
from adaspec.config.calibration import CalibrationConfig, ContextInterval
from adaspec.models import DSparkBlock, MtpStep, TargetOutput, VerifyRows
from adaspec.models.report import heldout_excerpt
from adaspec.policies.base import BudgetContext, DepthContext, RoundFeedback
from adaspec.runtime.calibration import (
    CalibrationDriver,
    CalibrationError,
    ForcedBudget,
    ForcedDepth,
    PointMeasured,
    measure_window,
)
from adaspec.runtime.engine import Runtime, RuntimeOptions
from adaspec.runtime.events.bus import EventBus
from adaspec.runtime.events.types import BudgetDecided, DepthDecided, RoundRetired
from adaspec.runtime.ranks import ForcedPoint
from adaspec.runtime.requests import Request

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_model.py"
PROMPTS = [b"ROMEO.\nBut soft, what light", b"To be, or not to be", b"Q"]


def own_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_model_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE_MODULE = own_model()
TABLES = EXAMPLE_MODULE.log_tables("".join(heldout_excerpt().values()).encode())


class OwnTables:
    """The target's own tables on a byte cache of their own: each call writes the entry's
    byte at its position, then scores the next byte as the target does, so every draft is
    the target's own choice and is accepted."""

    max_width = 7

    def __init__(self, target: Any) -> None:
        self.model = EXAMPLE_MODULE.TrigramTarget(*TABLES, context_limit=target.context_limit)
        self.identity = "copy-of-" + target.identity

    def allocate(self, num_kv_slots: int) -> None:
        self.model.allocate(num_kv_slots)

    def forward(self, token_ids: Tensor, positions: Tensor, kv_slots: Tensor) -> TargetOutput:
        index = torch.arange(token_ids.shape[0])
        inside = (kv_slots < self.model.num_kv_slots) & (positions < self.model.context_limit)
        output: TargetOutput = self.model.verify(VerifyRows(
            token_ids=token_ids, row_reqs=index, row_offsets=torch.zeros_like(index),
            row_valid=inside, req_kv_slots=torch.where(inside, kv_slots, self.model.num_kv_slots),
            req_starts=positions.clamp(max=self.model.context_limit - 1), rows_per_req=1))
        return output

    def publish(self, rows: Any) -> None:
        self.forward(rows.token_ids, rows.positions, rows.kv_slots)  # x_p at p

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        logits = self.forward(token_ids, positions + 1, kv_slots).logits
        token = logits.argmax(-1)
        probs = logits.softmax(-1).gather(-1, token[:, None])[:, 0]
        return MtpStep(hidden=hidden, token_ids=token, probs=probs, logits=logits)

    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        token, tokens, logits = token_ids, [], []
        for k in range(width):
            scores = self.forward(token, positions + 1 + k, kv_slots).logits
            token = scores.argmax(-1)
            tokens.append(token)
            logits.append(scores)
        stacked, chosen = torch.stack(logits, 1), torch.stack(tokens, 1)
        confidences = stacked.softmax(-1).gather(-1, chosen[..., None])[..., 0]
        return DSparkBlock(token_ids=chosen, confidences=confidences, logits=stacked)


def launch(tmp_path: Path, algorithm: str, width: int, plan: str,
           window_steps: int) -> dict[str, object]:
    """Adaptive target verify (rows) or adaptive draft steps (depth) on the tiny grid."""
    flags: dict[str, object] = {"speculative_algorithm": algorithm,
                                "num_speculative_tokens": width, "max_seqs_per_batch": 2}
    settings = tmp_path / "calibration.json"
    calibration = TINY_CALIBRATION | {"window_steps": window_steps}
    if plan == "rows":
        settings.write_text(json.dumps(calibration))
        return flags | {"enable_adaptive_target_verify": True,
                        "adaptive_target_verify_calibration": str(settings)}
    settings.write_text(json.dumps({"version": 1, "calibration": calibration}))
    return flags | {"enable_adaptive_draft_step": True,
                    "adaptive_draft_step_config": str(settings)}


# Whether the rounds after a window retire before calibration looks depends on how many
# retire in one go, so the window lengths vary: windows of 3..6 steps between them put the
# window's last round at every place in a cycle of up to four retirements.
@pytest.mark.parametrize(("algorithm", "width", "drafter", "plan", "window_steps"), [
    ("MTP", 5, "example", "rows", 5),  # examples/own_model.py as written, adaptive verify
    ("MTP", 5, "own tables", "rows", 5),
    ("MTP", 7, "own tables", "rows", 6),
    ("DSpark", 5, "own tables", "rows", 3),
    ("DSpark", 5, "own tables", "rows", 4),
    ("DSpark", 5, "own tables", "rows", 5),
    ("DSpark", 5, "own tables", "rows", 6),
    ("DSpark", 7, "own tables", "rows", 5),
    ("MTP", 5, "own tables", "depth", 5),
])
def test_calibration_measures_every_point_when_every_draft_is_accepted(
        tmp_path: Path, algorithm: str, width: int, drafter: str, plan: str,
        window_steps: int) -> None:
    target = EXAMPLE_MODULE.TrigramTarget(*TABLES)
    draft = (EXAMPLE_MODULE.BigramDrafter(TABLES[0], target) if drafter == "example"
             else OwnTables(target))
    models = SimpleNamespace(target=target, mtp=draft if algorithm == "MTP" else None,
                             dspark=draft if algorithm == "DSpark" else None)
    windows: list[PointMeasured] = []
    runtime = Runtime(load_config(launch(tmp_path, algorithm, width, plan,
                                                window_steps)), models=models,
                      options=RuntimeOptions(calibration_progress=windows.append))

    async def run() -> list[Any]:
        await runtime.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=40)
            handles = [runtime.submit(list(prompt), params) for prompt in PROMPTS]
            return [await handle.result() for handle in handles]
        finally:
            await runtime.stop()

    results = asyncio.run(run())
    assert runtime.costs is not None
    # Every point of the plan, once in each of both passes: none was skipped or lost.
    assert windows
    assert [w.done for w in windows] == list(range(1, windows[0].total + 1))
    passes = [[(w.num_reqs_bucket, w.num_rows, w.depth) for w in windows if w.window == k]
              for k in range(2)]
    assert len(set(passes[0])) == len(passes[0]) == len(windows) // 2
    assert sorted(passes[0]) == sorted(passes[1])
    assert {bucket for bucket, _, _ in passes[0]} == {1, 2}
    assert all(w.seconds > 0 for w in windows)
    if drafter == "own tables":  # the drafter is the target: every verified draft accepted
        for result in results:
            assert 0 < result.accepted == result.verified


class AllAccepted:
    """A calibration pipeline's events for a point of one request at full width whose every
    draft is accepted, all retired in one go before calibration runs again: ``rounds``
    rounds at the point's shape, then the round that was in flight when the request reached
    its context end, which retires without it."""

    def __init__(self, bus: EventBus, rounds: int, width: int = 5) -> None:
        self.bus, self.rounds, self.width = bus, rounds, width
        self.requests: list[Request] = []

    def add(self, request: Request) -> None:
        self.requests.append(request)
        asyncio.get_running_loop().call_soon(self.play)

    def cancel(self, request: Request) -> None:
        request.finish("cancelled")

    def force(self, point: ForcedPoint) -> None:
        """The rounds this stand-in plays are at the point's shape already."""

    def play(self) -> None:
        rows = self.width + 1
        for number in range(self.rounds + 1):
            live = int(number < self.rounds)
            self.bus.publish(DepthDecided(round=number, slot=number % 2, depth=self.width,
                                          context=DepthContext(
                                              round=number, num_reqs=live, num_reqs_bucket=1,
                                              width=self.width, retired_through=number - 2)))
            self.bus.publish(BudgetDecided(round=number, slot=number % 2, num_rows=rows,
                                           bound_rows=rows, context=BudgetContext(
                                               round=number, num_reqs=live, num_reqs_bucket=1,
                                               width=self.width, depth=self.width,
                                               legal_rows=(1, 2, 4, 6),
                                               retired_through=number - 2)))
            self.bus.publish(RoundRetired(time=0.001 * number, round=number, slot=number % 2,
                                          feedback=RoundFeedback(
                                              round=number, num_reqs=live, num_reqs_bucket=1,
                                              width=self.width, depth=self.width,
                                              num_rows=rows, verify_lengths=(self.width,) * live,
                                              num_accepted=(self.width,) * live)))
        for request in self.requests:
            request.finish("length")


def measure_all_accepted(rounds: int) -> float:
    settings = CalibrationConfig(draft_width=5, request_buckets=(1,), warmup_steps=2,
                                 window_steps=3)
    context = ContextInterval(prefill_tokens=8, min_kv_length=1, max_kv_length=64)

    async def measure() -> float:
        bus = EventBus()
        driver = CalibrationDriver(AllAccepted(bus, rounds), bus, 256, ForcedBudget(),
                                   ForcedDepth())
        return await measure_window(driver, settings, context, 1, 5, 6, 0)

    return asyncio.run(measure())


def test_a_window_stands_once_measured_whatever_retires_before_calibration_looks() -> None:
    # Warmup 2 and window 3 take 6 stable rounds; the context holds 7 at full acceptance.
    assert measure_all_accepted(7) == pytest.approx(0.001)
    assert measure_all_accepted(6) == pytest.approx(0.001)
    # One round short of the window: the point was not measured, and says so.
    with pytest.raises(CalibrationError, match="its requests ended before the point was "
                                               "measured"):
        measure_all_accepted(5)
