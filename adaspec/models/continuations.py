"""The target's own greedy continuations: the text a drafter reads while the runtime decodes.

A greedy decode feeds the drafters the target's own output after the first few tokens, text
that is more repetitive and more predictable than the corpus and that distillation on corpus
windows never shows them. The training script distils on both and measures acceptance on
both (``train``); this module makes the continuations and cuts training windows and
evaluation contexts from them.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from adaspec.models.protocols import VerifyRows
from adaspec.models.target import ReferenceTarget

DECODE_BATCH = 64  # prompts continued together


@dataclass(frozen=True, slots=True)
class Continuations:
    """Prompts, each followed by the target's greedy tokens."""

    sequences: list[Tensor]  # prompt + continuation, int64
    prompt_lengths: list[int]

    def windows(self, batch: int, length: int, generator: torch.Generator) -> Iterator[Tensor]:
        """Endless random windows ``[batch, length]``, each inside one random sequence (it may
        start in the prompt: a window holds the prompt's end as the decode's context does)."""
        shortest = min(len(s) for s in self.sequences)
        if shortest < length:
            raise ValueError(f"a continued sequence of {shortest} tokens is shorter than a "
                             f"training window of {length}: continue the prompts further")
        while True:
            picks = torch.randint(0, len(self.sequences), (batch,), generator=generator)
            rows = []
            for pick in picks.tolist():
                sequence = self.sequences[pick]
                start = int(torch.randint(0, len(sequence) - length + 1, (1,),
                                          generator=generator))
                rows.append(sequence[start:start + length])
            yield torch.stack(rows)

    def contexts(self, count: int, width: int, rng: np.random.Generator) -> list[Tensor]:
        """Random contexts ending inside a continuation, with the anchor and a block of
        ``width`` after them still inside the sequence."""
        shortest = min(n - p for n, p in zip(map(len, self.sequences), self.prompt_lengths,
                                             strict=True))
        if shortest < width + 2:
            raise ValueError(f"a continuation of {shortest} tokens leaves no context with an "
                             f"anchor and a block of {width} after it: continue further")
        out = []
        for _ in range(count):
            pick = int(rng.integers(0, len(self.sequences)))
            sequence, prompt = self.sequences[pick], self.prompt_lengths[pick]
            end = int(rng.integers(prompt + 1, len(sequence) - width))
            out.append(sequence[:end])
        return out


@torch.no_grad()
def greedy_continuations(target: ReferenceTarget, prompts: list[Tensor], tokens: int,
                         ) -> Continuations:
    """Each prompt followed by ``tokens`` greedy target tokens (they must fit the context).
    Leaves the target allocated with ``min(DECODE_BATCH, len(prompts))`` KV slots."""
    if not prompts or tokens < 1:
        raise ValueError(f"{len(prompts)} prompts, {tokens} tokens each: expected at least "
                         "one prompt and one token")
    longest = max(len(p) for p in prompts) + tokens
    if longest > target.context_limit:
        raise ValueError(f"a prompt of {longest - tokens} tokens and {tokens} more exceed the "
                         f"target's context of {target.context_limit}")
    target.allocate(min(DECODE_BATCH, len(prompts)))
    sequences: list[Tensor] = []
    for start in range(0, len(prompts), DECODE_BATCH):
        chunk = prompts[start:start + DECODE_BATCH]
        generated = _decode(target, chunk, tokens)
        sequences += [torch.cat([p, g]) for p, g in zip(chunk, generated, strict=True)]
    return Continuations(sequences=sequences, prompt_lengths=[len(p) for p in prompts])


def _decode(target: ReferenceTarget, prompts: list[Tensor], tokens: int) -> Tensor:
    """``[N, tokens]`` greedy tokens after each prompt, one verify row per request a step."""
    device = target.embed.weight.device
    kv_slots = torch.arange(len(prompts), device=device)
    prefill = target.prefill([p.to(device) for p in prompts], kv_slots)
    token = prefill.last.logits.argmax(-1)
    positions = prefill.lengths.clone()
    out = [token]
    zeros = torch.zeros_like(kv_slots)
    valid = torch.ones(len(prompts), dtype=torch.bool, device=device)
    for _ in range(tokens - 1):
        rows = VerifyRows(token_ids=token, row_reqs=kv_slots, row_offsets=zeros, row_valid=valid,
                          req_kv_slots=kv_slots, req_starts=positions, rows_per_req=1)
        token = target.verify(rows).logits.argmax(-1)
        positions = positions + 1
        out.append(token)
    return torch.stack(out, 1).cpu()
