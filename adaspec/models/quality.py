"""Quality measurements of the reference models on held-out text.

Acceptance is measured the way the runtime meets it: prefill a context, take the target's
greedy next token as the anchor, draft a block after it, verify ``[anchor, d_1 .. d_w]`` in
one target pass over packed rows, and compare. At temperature 0 position k is accepted when
d_k is the target's argmax; at temperature 1 its acceptance probability is the target's
probability of d_k (exact point-mass rejection sampling with a greedy draft). Conditional
rates are along the draft path; prefix acceptance multiplies them (unconditional survival).
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from adaspec.models.drafters import ReferenceDSpark, ReferenceMtp
from adaspec.models.protocols import ContextRows, VerifyRows
from adaspec.models.target import ReferenceTarget


@dataclass(frozen=True, slots=True)
class DraftTrace:
    """Per-context acceptance of one drafter's block, ``[N, width]`` each."""

    greedy_accept: np.ndarray  # 1.0 where d_k equals the target argmax (conditional on path)
    sample_accept: np.ndarray  # target probability of d_k at temperature 1
    confidence_logits: np.ndarray | None  # DSpark raw confidence log-odds (uncalibrated)


def encode(text: bytes) -> Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def sample_contexts(text: bytes, count: int, width: int, context_limit: int,
                    rng: np.random.Generator, min_length: int = 32) -> list[Tensor]:
    """Random contexts whose length leaves room for the anchor and a full block."""
    return excerpts(text, count, min_length, context_limit - width - 1, rng)


def excerpts(text: bytes, count: int, shortest: int, longest: int,
             rng: np.random.Generator) -> list[Tensor]:
    """``count`` random excerpts of ``text``, ``shortest .. longest`` tokens long (the text
    must be longer than ``longest``)."""
    tokens = encode(text)
    found = []
    for _ in range(count):
        length = int(rng.integers(shortest, longest + 1))
        start = int(rng.integers(0, len(tokens) - length))
        found.append(tokens[start:start + length])
    return found


@dataclass(frozen=True, slots=True)
class DSparkRound:
    """One DSpark block and its verification, with what the confidence head reads."""

    states: Tensor  # [N, width, d] backbone states
    prev_token_ids: Tensor  # [N, width] token before each position (anchor, d_1 ..)
    draft_logits: Tensor  # [N, width, vocab]
    token_ids: Tensor  # [N, width] drafted tokens
    target_logits: Tensor  # [N, width, vocab] target logits at each draft position


@torch.no_grad()
def dspark_round(target: ReferenceTarget, dspark: ReferenceDSpark, hidden: Tensor,
                 anchor: Tensor, lengths: Tensor, kv_slots: Tensor, width: int) -> DSparkRound:
    block = dspark.draft(hidden, anchor, lengths - 1, kv_slots, width)
    prev = torch.cat([anchor[:, None], block.token_ids[:, :-1]], 1)
    return DSparkRound(states=dspark.states(hidden, anchor, width), prev_token_ids=prev,
                       draft_logits=block.logits, token_ids=block.token_ids,
                       target_logits=_verify_block(target, anchor, block.token_ids, lengths,
                                                   kv_slots))


@torch.no_grad()
def trace_drafts(target: ReferenceTarget, mtp: ReferenceMtp, dspark: ReferenceDSpark,
                 contexts: list[Tensor], width: int) -> dict[str, DraftTrace]:
    """Draft a block after each context with both drafters and verify it with the target."""
    device = target.embed.weight.device
    kv_slots = torch.arange(len(contexts), device=device)
    prompts = [c.to(device) for c in contexts]
    prefill = target.prefill(prompts, kv_slots)
    anchor = prefill.last.logits.argmax(-1)
    hidden = prefill.last.hidden
    lengths = prefill.lengths
    mtp.publish(ContextRows.of_prompts(prefill, prompts, kv_slots, anchor))
    mtp_drafts = _mtp_block(mtp, hidden, anchor, lengths - 1, kv_slots, width)
    rounds = {"mtp": (mtp_drafts, _verify_block(target, anchor, mtp_drafts, lengths, kv_slots))}
    block = dspark_round(target, dspark, hidden, anchor, lengths, kv_slots, width)
    rounds["dspark"] = (block.token_ids, block.target_logits)
    raw = dspark.confidence_logits(block.states, block.prev_token_ids, block.draft_logits)
    traces = {}
    for name, (drafts, logits) in rounds.items():
        greedy = (logits.argmax(-1) == drafts).float()
        probs = logits.softmax(-1).gather(-1, drafts[..., None])[..., 0]
        conf = raw.cpu().numpy() if name == "dspark" else None
        traces[name] = DraftTrace(greedy.cpu().numpy(), probs.cpu().numpy(), conf)
    return traces


BATCH = 16  # contexts per prefill


def trace_contexts(target: ReferenceTarget, mtp: ReferenceMtp, dspark: ReferenceDSpark,
                   contexts: list[Tensor], width: int) -> dict[str, DraftTrace]:
    """``trace_drafts`` over any number of contexts (the models need ``BATCH`` KV slots).

    Contexts go in batches of similar length: prefill padding costs quadratically."""
    ordered = sorted(contexts, key=len)
    parts = [trace_drafts(target, mtp, dspark, ordered[i:i + BATCH], width)
             for i in range(0, len(ordered), BATCH)]
    return {name: concat_traces([part[name] for part in parts]) for name in parts[0]}


def concat_traces(traces: list[DraftTrace]) -> DraftTrace:
    confidences = [t.confidence_logits for t in traces if t.confidence_logits is not None]
    return DraftTrace(np.concatenate([t.greedy_accept for t in traces]),
                      np.concatenate([t.sample_accept for t in traces]),
                      np.concatenate(confidences) if confidences else None)


def _mtp_block(mtp: ReferenceMtp, hidden: Tensor, anchor: Tensor, positions: Tensor,
               kv_slots: Tensor, width: int) -> Tensor:
    tokens = []
    state, token = hidden, anchor
    for step in range(width):
        out = mtp.step(state, token, positions + step, kv_slots)
        state, token = out.hidden, out.token_ids
        tokens.append(token)
    return torch.stack(tokens, 1)


def _verify_block(target: ReferenceTarget, anchor: Tensor, drafts: Tensor, lengths: Tensor,
                  kv_slots: Tensor) -> Tensor:
    """Target logits ``[N, width, vocab]`` for each draft position."""
    num, width = drafts.shape
    rows = torch.cat([anchor[:, None], drafts], 1)  # [N, w+1]
    offsets = torch.arange(width + 1, device=rows.device)
    verify = VerifyRows(
        token_ids=rows.reshape(-1),
        row_reqs=torch.arange(num, device=rows.device).repeat_interleave(width + 1),
        row_offsets=offsets.repeat(num),
        row_valid=torch.ones(num * (width + 1), dtype=torch.bool, device=rows.device),
        req_kv_slots=kv_slots, req_starts=lengths, rows_per_req=width + 1)
    logits = target.verify(verify).logits.reshape(num, width + 1, -1)
    return logits[:, :width]


def prefix_rates(accept: np.ndarray) -> tuple[list[float], list[float]]:
    """(conditional, prefix) acceptance per position from per-path rates ``[N, w]``."""
    prefix = np.cumprod(accept, axis=1).mean(0)
    previous = np.concatenate([[1.0], prefix[:-1]])
    conditional = np.where(previous > 0, prefix / np.maximum(previous, 1e-12), 0.0)
    return [round(float(c), 4) for c in conditional], [round(float(p), 4) for p in prefix]


def acceptance_length(accept: np.ndarray) -> float:
    """Expected tokens per round: accepted drafts plus the residual or bonus token."""
    return float(1.0 + np.cumprod(accept, axis=1).sum(1).mean())


def acceptance_summary(accept: np.ndarray) -> dict[str, object]:
    """Conditional and prefix acceptance per position, and the acceptance length."""
    conditional, prefix = prefix_rates(accept)
    return {"conditional": conditional, "prefix": prefix,
            "acceptance_length": round(acceptance_length(accept), 4)}


def calibration_error(predicted: np.ndarray, observed: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error with equal-width bins."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.digitize(predicted, edges[1:-1]), 0, bins - 1)
    error = 0.0
    for b in range(bins):
        chosen = index == b
        if chosen.any():
            error += chosen.mean() * abs(predicted[chosen].mean() - observed[chosen].mean())
    return float(error)


def prefix_survival_ece(confidence: np.ndarray, accept: np.ndarray) -> float:
    """Mean over positions of the ECE of predicted vs observed prefix survival."""
    predicted, observed = np.cumprod(confidence, 1), np.cumprod(accept, 1)
    return float(np.mean([calibration_error(predicted[:, k], observed[:, k])
                          for k in range(accept.shape[1])]))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, count in zip(first, counts, strict=True):
        ranks[order[start:start + count]] = start + (count + 1) / 2
    positives = labels.astype(bool)
    num_pos, num_neg = positives.sum(), (~positives).sum()
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    return float((ranks[positives].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 1.0 / (1.0 + np.exp(-x))
    return out


def fit_temperatures(logits: np.ndarray, accept: np.ndarray,
                     grid: np.ndarray | None = None) -> np.ndarray:
    """Sequential temperature scaling: position by position, left to right, pick the
    temperature minimising the ECE of the cumulative product with the earlier positions'
    fitted temperatures held fixed."""
    grid = np.exp(np.linspace(np.log(0.1), np.log(10.0), 241)) if grid is None else grid
    survival = np.cumprod(accept, 1)
    temperatures = np.ones(logits.shape[1])
    running = np.ones(logits.shape[0])
    for k in range(logits.shape[1]):
        errors = [calibration_error(running * sigmoid(logits[:, k] / t), survival[:, k])
                  for t in grid]
        temperatures[k] = grid[int(np.argmin(errors))]
        running = running * sigmoid(logits[:, k] / temperatures[k])
    return temperatures


@torch.no_grad()
def heldout_loss(target: ReferenceTarget, text: bytes, chunk: int, max_chunks: int,
                 ) -> tuple[float, list[float]]:
    """Mean nats per byte over chunks of ``chunk`` bytes, and per quarter of the chunk
    (positions 0..chunk/4-1, ...), which shows whether quality holds at long positions."""
    tokens = encode(text)
    count = min(max_chunks, (len(tokens) - 1) // chunk)
    starts = torch.arange(count) * chunk
    inputs = torch.stack([tokens[s:s + chunk] for s in starts])
    labels = torch.stack([tokens[s + 1:s + chunk + 1] for s in starts])
    device = target.embed.weight.device
    losses = []
    for batch in range(0, count, 8):
        logits, _ = target(inputs[batch:batch + 8].to(device))
        losses.append(torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels[batch:batch + 8].to(device), reduction="none"))
    per_position = torch.cat(losses).mean(0)
    quarters = per_position.reshape(4, -1).mean(1)
    return float(per_position.mean()), [round(float(q), 4) for q in quarters]
