"""Plain-Python references for the device kernels: loops over lists, one request at a time.

They state each stage's rule as directly as possible, so the tensor kernels are tested
element by element against them, and ``benchmarks/kernels.py`` times them as the plain-loop
baseline. Nothing in the runtime calls them.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass


def allocate(confidences: Sequence[Sequence[float]], num_rows: int, caps: Sequence[int],
             req_valid: Sequence[bool]) -> list[int]:
    """Verify lengths: the top ``num_rows - live`` survivals, ties by (request, position)."""
    candidates: list[tuple[float, int, int]] = []
    for req, row in enumerate(confidences):
        survival = 1.0
        for pos, confidence in enumerate(row):
            clean = 0.0 if math.isnan(confidence) else min(max(confidence, 0.0), 1.0)
            survival *= clean
            if req_valid[req] and pos < caps[req]:
                candidates.append((-survival, req, pos))
    candidates.sort()  # by survival descending, then request, then position
    free = num_rows - sum(req_valid)
    admitted = {(req, pos) for _, req, pos in candidates[:max(free, 0)]}
    lengths = []
    for req in range(len(confidences)):
        length = 0
        while (req, length) in admitted:
            length += 1
        lengths.append(length)
    return lengths


@dataclass(frozen=True, slots=True)
class Packed:
    """The reference packing: per row (entry, offset, token, valid), per entry its first row."""

    row_reqs: list[int]
    row_offsets: list[int]
    token_ids: list[int]
    row_valid: list[bool]
    first_rows: list[int]


def pack(verify_lengths: Sequence[int], anchor_token_ids: Sequence[int],
         draft_token_ids: Sequence[Sequence[int]], req_valid: Sequence[bool],
         num_rows: int) -> Packed:
    reqs: list[int] = []
    offsets: list[int] = []
    tokens: list[int] = []
    first_rows: list[int] = []
    for req, length in enumerate(verify_lengths):
        first_rows.append(len(reqs))
        if not req_valid[req]:
            continue
        for offset in range(length + 1):
            reqs.append(req)
            offsets.append(offset)
            tokens.append(anchor_token_ids[req] if offset == 0
                          else draft_token_ids[req][offset - 1])
    used = len(reqs)
    padding = num_rows - used
    return Packed(row_reqs=reqs + [0] * padding, row_offsets=offsets + [0] * padding,
                  token_ids=tokens + [anchor_token_ids[0]] * padding,
                  row_valid=[True] * used + [False] * padding, first_rows=first_rows)


def filtered_distribution(logits: Sequence[float], temperature: float, top_k: int,
                          top_p: float, min_p: float) -> list[tuple[int, float]]:
    """Kept ``(token, unnormalised probability)`` pairs in descending order."""
    scale = temperature if temperature > 0 else 1.0
    order = sorted(range(len(logits)), key=lambda t: (-logits[t] / scale, t))
    scaled = [logits[t] / scale for t in order]
    k = min(top_k, len(logits)) if top_k > 0 else len(logits)
    kept = [i for i, value in enumerate(scaled) if value >= scaled[k - 1]]
    peak = scaled[0]
    weights = [math.exp(scaled[i] - peak) for i in kept]
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    floor = math.log(min_p) if min_p > 0 else -math.inf
    result: list[tuple[int, float]] = []
    ahead = 0.0
    for i, p in zip(kept, probs, strict=True):
        if (ahead < top_p or top_p >= 1.0) and scaled[i] - peak >= floor and p > 0:
            result.append((order[i], p))
        ahead += p
    return result


def sample(logits: Sequence[Sequence[float]], temperature: Sequence[float],
           top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float],
           uniforms: Sequence[float]) -> list[int]:
    """The target token of every row (parameters given per row)."""
    tokens = []
    for row, values in enumerate(logits):
        if temperature[row] == 0:
            tokens.append(max(range(len(values)), key=lambda t: (values[t], -t)))
            continue
        kept = filtered_distribution(values, temperature[row], top_k[row], top_p[row],
                                     min_p[row])
        target = uniforms[row] * math.fsum(p for _, p in kept)
        cumulative = 0.0
        chosen = kept[-1][0]
        for token, p in kept:
            cumulative += p
            if cumulative > target:
                chosen = token
                break
        tokens.append(chosen)
    return tokens


@dataclass(frozen=True, slots=True)
class Committed:
    num_accepted: list[int]
    token_ids: list[list[int]]
    finish: list[int]  # 0 running, 1 stop token, 2 token budget reached


def commit(target_token_ids: Sequence[int], packed: Packed, verify_lengths: Sequence[int],
           draft_token_ids: Sequence[Sequence[int]], stop_token_ids: Sequence[Sequence[int]],
           budget: Sequence[int], req_valid: Sequence[bool]) -> Committed:
    accepted_counts: list[int] = []
    committed: list[list[int]] = []
    finish: list[int] = []
    for req, length in enumerate(verify_lengths):
        if not req_valid[req]:
            accepted_counts.append(0)
            committed.append([])
            finish.append(0)
            continue
        first = packed.first_rows[req]
        accepted = 0
        while accepted < length and \
                target_token_ids[first + accepted] == draft_token_ids[req][accepted]:
            accepted += 1
        tokens: list[int] = []
        reason = 0
        for offset in range(accepted + 1):
            tokens.append(target_token_ids[first + offset])
            if tokens[-1] in stop_token_ids[req]:
                reason = 1
                break
            if len(tokens) == budget[req]:
                reason = 2
                break
        accepted_counts.append(accepted)
        committed.append(tokens)
        finish.append(reason)
    return Committed(num_accepted=accepted_counts, token_ids=committed, finish=finish)
