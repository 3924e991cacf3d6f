"""Plug a model of your own into adaspec: a byte-level log-linear language model as the target
and a bigram head as its MTP-style drafter, both written against the protocols in
``adaspec.models.protocols``, decoded by the runtime and checked against a plain greedy loop.

The target scores the next byte from the previous two, ``A[x_t-1, x_t] + S[x_t-2, x_t]``
(log bigram and skip-bigram frequencies of the packaged held-out text). Its "KV cache" holds
the byte at each position of each KV slot: ``verify`` writes every row's byte at its position
before reading the byte one position back, so a rejected suffix is simply overwritten later,
which is the consistency rule the runtime relies on. The drafter drafts from ``A`` alone.
docs/embedding.md states every contract these classes follow.

    python examples/own_model.py
"""

import asyncio
import sys
from types import SimpleNamespace

import torch
from torch import Tensor

from adaspec.bench.plain import plain_loop
from adaspec.config import SamplingParams, load_config
from adaspec.models import (
    ContextRows,
    MtpStep,
    PrefillOutput,
    TargetOutput,
    VerifyRows,
    checkpoint_identity,
)
from adaspec.models.report import heldout_excerpt
from adaspec.runtime.engine import Runtime

VOCAB = 256  # bytes
HIDDEN = 8  # this drafter ignores the target's hidden state; the runtime still carries one


def log_tables(text: bytes) -> tuple[Tensor, Tensor]:
    """Log frequencies of (previous, next) and (two back, next) byte pairs, add-one smoothed."""
    data = torch.tensor(list(text))
    pairs = torch.ones(VOCAB, VOCAB).index_put_((data[:-1], data[1:]), torch.ones(len(data) - 1),
                                                accumulate=True)
    skips = torch.ones(VOCAB, VOCAB).index_put_((data[:-2], data[2:]), torch.ones(len(data) - 2),
                                                accumulate=True)
    return pairs.log_softmax(-1), skips.log_softmax(-1)


class TrigramTarget:
    """A ``TargetModel``: prefill and verify over a per-KV-slot cache of past bytes."""

    def __init__(self, pairs: Tensor, skips: Tensor, context_limit: int = 1024) -> None:
        self.pairs, self.skips = pairs, skips
        # A stable hash of configuration and weights: cost tables saved for one model are
        # refused for another.
        self.identity = checkpoint_identity({"context_limit": context_limit},
                                            {"pairs": pairs, "skips": skips})
        self.vocab_size, self.hidden_size, self.context_limit = VOCAB, HIDDEN, context_limit
        self.dtype = torch.float32
        self.bytes = torch.zeros(1, context_limit, dtype=torch.int64)

    @property
    def num_kv_slots(self) -> int:
        return self.bytes.shape[0] - 1  # the last slot is scratch: padding rows write there

    def allocate(self, num_kv_slots: int) -> None:
        self.bytes = torch.zeros(num_kv_slots + 1, self.context_limit, dtype=torch.int64)

    def _logits(self, kv_slots: Tensor, positions: Tensor, token_ids: Tensor) -> Tensor:
        """Scores of the byte after ``token_ids`` at ``positions`` (the byte before them comes
        from the cache; position 0 has none and counts byte 0 there)."""
        before = self.bytes[kv_slots, (positions - 1).clamp(min=0)]
        before = torch.where(positions > 0, before, 0)
        return self.pairs[token_ids] + self.skips[before]

    def prefill(self, prompts: list[Tensor], kv_slots: Tensor) -> PrefillOutput:
        lengths = torch.tensor([len(p) for p in prompts])
        for slot, prompt in zip(kv_slots.tolist(), prompts, strict=True):
            self.bytes[slot, :len(prompt)] = prompt
        last = lengths - 1
        tokens = self.bytes[kv_slots, last]
        logits = self._logits(kv_slots, last, tokens)
        hidden = torch.zeros(len(prompts), int(lengths.max()), HIDDEN)
        return PrefillOutput(last=TargetOutput(logits=logits, hidden=hidden[:, 0]),
                             hidden=hidden, lengths=lengths)

    def verify(self, rows: VerifyRows) -> TargetOutput:
        kv_slots = torch.where(rows.row_valid, rows.req_kv_slots[rows.row_reqs], self.num_kv_slots)
        positions = torch.where(rows.row_valid, rows.positions, 0)
        self.bytes[kv_slots, positions] = rows.token_ids  # write first, then read back one
        logits = self._logits(kv_slots, positions, rows.token_ids)
        return TargetOutput(logits=logits, hidden=torch.zeros(len(positions), HIDDEN))


class BigramDrafter:
    """An ``MtpDrafter`` with no context of its own: each step drafts from the last byte."""

    def __init__(self, pairs: Tensor, target: TrigramTarget) -> None:
        self.pairs = pairs  # the target's table: the identity names the checkpoint it shares
        self.identity = checkpoint_identity({}, {"pairs": pairs}, parent=target.identity)

    def allocate(self, num_kv_slots: int) -> None:
        """Nothing per request to keep."""

    def publish(self, rows: ContextRows) -> None:
        """Nothing to keep: each step sees the byte it drafts from."""

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        logits = self.pairs[token_ids]
        chosen = logits.argmax(-1)
        probs = (logits.gather(-1, chosen[:, None])[:, 0] - logits.logsumexp(-1)).exp()
        return MtpStep(hidden=hidden, token_ids=chosen, probs=probs, logits=logits)


PROMPTS = [b"ROMEO.\nBut soft, what light", b"To be, or not to be", b"Of Man's first"]


async def decode(models: SimpleNamespace, max_tokens: int) -> tuple[list[tuple[int, ...]], float]:
    config = load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                          "max_seqs_per_batch": 2})
    runtime = Runtime(config, models=models)
    await runtime.start()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    handles = [runtime.submit(list(prompt), params) for prompt in PROMPTS]
    outputs = [(await handle.result()).token_ids for handle in handles]
    acceptance = runtime.statistics().mean_acceptance_length
    await runtime.stop()
    return outputs, acceptance


def main(max_tokens: int = 48) -> None:
    pairs, skips = log_tables("".join(heldout_excerpt().values()).encode())
    target = TrigramTarget(pairs, skips)
    models = SimpleNamespace(target=target, mtp=BigramDrafter(pairs, target), dspark=None)
    outputs, acceptance = asyncio.run(decode(models, max_tokens))
    reference = TrigramTarget(pairs, skips)
    reference.allocate(len(PROMPTS))
    alone = plain_loop(reference, [list(p) for p in PROMPTS], max_tokens, len(PROMPTS)).outputs
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        print(repr((prompt + bytes(output)).decode(errors="replace")))
    print(f"acceptance length {acceptance:.2f} (accepted drafts + 1)")
    print(f"greedy outputs identical to the target alone: {outputs == list(alone)}")
    if outputs != list(alone):
        raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:]:  # nothing to configure: say so rather than ignore what was given
        print(f"own_model.py: error: it takes no arguments; got {' '.join(sys.argv[1:])}",
              file=sys.stderr)
        raise SystemExit(2)
    main()
