"""The reference drafters: an MTP head and a DSpark-style block drafter.

Both share the target's token embedding and output head (as DeepSeek-V3's multi-token
prediction module does) and condition on the target's final hidden state at the row that
produced the newest token. Their own weights stay small.
"""

from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaspec.models.layers import MLP, Block, RMSNorm, init_weights
from adaspec.models.protocols import ContextRows, DSparkBlock, MtpStep, VerifyRows
from adaspec.models.target import GridIndex, KVCache, ReferenceTarget, grid_attention


@dataclass(frozen=True, slots=True, kw_only=True)
class MtpConfig:
    num_heads: int = 4
    mlp_hidden: int = 512

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DSparkConfig:
    max_width: int = 7
    num_layers: int = 1
    num_heads: int = 4
    mlp_hidden: int = 768
    markov_rank: int = 96
    """Rank of the Markov head through which the previous draft token steers a position."""
    confidence_hidden: int = 64

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SharedHead:
    """The target's embedding and output head, held without registering the target as a
    submodule (its weights belong to the target's checkpoint, not the drafter's)."""

    def __init__(self, target: ReferenceTarget) -> None:
        self.target = target

    def embed(self, token_ids: Tensor) -> Tensor:
        embedded: Tensor = self.target.embed(token_ids)
        return embedded

    def logits(self, hidden: Tensor) -> Tensor:
        return self.target.logits(hidden)


class Fuse(nn.Module):
    """DeepSeek-V3's MTP input: project [norm(hidden); norm(embed(token))] to one vector."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(dim)
        self.embed_norm = RMSNorm(dim)
        self.proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        fused: Tensor = self.proj(
            torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], -1))
        return fused


class ReferenceMtp(nn.Module):
    """One transformer block drafting a token per sequential step.

    Step inputs are the state of the previous step (the target's hidden state for the first)
    and the token after it; the block attends over its own KV cache, which ``publish`` fills
    with teacher-forced context for committed positions. Position p of that cache holds
    ``(h_p, x_{p+1})`` (DeepSeek-V3's MTP input), so the token at p itself is not used: the
    target's state ``h_p`` already carries it.
    """

    def __init__(self, config: MtpConfig, target: ReferenceTarget) -> None:
        super().__init__()
        tc = target.config
        self.config = config
        self.head = SharedHead(target)
        self.fuse = Fuse(tc.hidden_size)
        self.block = Block(tc.hidden_size, config.num_heads, config.mlp_hidden, tc.window,
                           tc.context_limit)
        init_weights(self, 1)
        self.cache: KVCache | None = None
        self.identity = ""

    def allocate(self, num_kv_slots: int) -> None:
        tc = self.head.target.config
        param = self.fuse.proj.weight
        attn = self.block.attn  # a TP rank's block holds its own heads only
        self.cache = KVCache(1, num_kv_slots, tc.context_limit, attn.num_heads, attn.head_dim,
                             param.device, param.dtype)

    def forward(self, hidden: Tensor, next_token_ids: Tensor) -> Tensor:
        """Training: output states ``[B, T, d]`` for whole sequences of (state, next token)."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[:2])
        x = self.fuse(hidden, self.head.embed(next_token_ids))
        x, _, _ = self.block.sequence(x, positions)
        return x

    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("call allocate(num_kv_slots) before drafting")
        return self.cache

    @torch.no_grad()
    def publish(self, rows: ContextRows) -> None:
        cache = self._require_cache()
        x = self.fuse(rows.hidden, self.head.embed(rows.next_token_ids))
        k, v = self.block.attn.key_values(self.block.attn_norm(x), rows.positions)
        cache.write(0, rows.kv_slots, rows.positions, k, v)

    @torch.no_grad()
    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        cache = self._require_cache()
        x = self.fuse(hidden, self.head.embed(token_ids))
        index = torch.arange(x.shape[0], device=x.device)
        rows = VerifyRows(token_ids=token_ids, row_reqs=index,
                          row_offsets=torch.zeros_like(index),
                          row_valid=kv_slots < cache.num_kv_slots, req_kv_slots=kv_slots,
                          req_starts=positions, rows_per_req=1)
        grid = GridIndex.of(rows, cache, self.block.attn.window, self.block.attn)
        x = x + grid_attention(self.block, cache, 0, x, rows, grid)
        x = x + self.block.mlp(self.block.mlp_norm(x))
        logits = self.head.logits(x)
        token = logits.argmax(-1)
        probs = torch.exp(logits.gather(-1, token[:, None])[:, 0] - logits.logsumexp(-1))
        return MtpStep(hidden=x, token_ids=token, probs=probs, logits=logits)


class ReferenceDSpark(nn.Module):
    """A block drafter: one parallel pass, a low-rank Markov head, a confidence head.

    The backbone reads a context vector (target hidden state fused with the newest token)
    followed by one learned query per draft position, causally, so a block of width w uses
    the first w queries and the drafter serves any width up to ``max_width``. Position k's
    logits (the shared output head applied to its state) get a low-rank Markov term that
    mixes the state with the previous draft token, so the block stays coherent without
    sequential forwards: per position that is one embedding row, one activation and one
    rank-r output projection, every other piece running once for the whole block.
    The confidence head estimates position k's conditional acceptance from the backbone
    state, the previous token and the draft distribution's own sharpness; ``temperatures``
    (fitted after training, one per position) calibrate it.
    """

    temperatures: Tensor

    def __init__(self, config: DSparkConfig, target: ReferenceTarget) -> None:
        super().__init__()
        dim = target.config.hidden_size
        self.config = config
        self.head = SharedHead(target)
        self.fuse = Fuse(dim)
        self.queries = nn.Parameter(torch.zeros(config.max_width, dim))
        self.blocks = cast(list[Block], nn.ModuleList(
            Block(dim, config.num_heads, config.mlp_hidden, config.max_width + 1,
                  config.max_width + 1, approximate="tanh")
            for _ in range(config.num_layers)))
        self.markov_in = nn.Embedding(target.config.vocab_size, config.markov_rank)
        self.markov_state = nn.Linear(dim, config.markov_rank, bias=False)
        self.markov_out = nn.Linear(config.markov_rank, target.config.vocab_size, bias=False)
        self.confidence_norm = RMSNorm(dim)
        self.confidence = MLP(dim + config.markov_rank + 2, config.confidence_hidden,
                              approximate="tanh")
        self.confidence_out = nn.Linear(dim + config.markov_rank + 2, 1)
        self.register_buffer("temperatures", torch.ones(config.max_width))
        init_weights(self, config.num_layers)
        nn.init.normal_(self.queries, std=0.02)
        self.identity = ""

    @property
    def max_width(self) -> int:
        return self.config.max_width

    def states(self, hidden: Tensor, token_ids: Tensor, width: int) -> Tensor:
        """Backbone states ``[..., width, d]`` for each draft position."""
        context = self.fuse(hidden, self.head.embed(token_ids))
        x = torch.cat([context.unsqueeze(-2), context.unsqueeze(-2) + self.queries[:width]], -2)
        flat = x.reshape(-1, width + 1, x.shape[-1])
        for block in self.blocks:
            flat = block.causal(flat)  # positions 0 .. width, all inside the block's window
        return flat[:, 1:].reshape(*x.shape[:-2], width, x.shape[-1])

    def position_logits(self, states: Tensor, prev_token_ids: Tensor) -> Tensor:
        """Draft logits of each position given the token before it."""
        return self.markov_logits(self.head.logits(states), self.markov_state(states),
                                  prev_token_ids)

    def markov_logits(self, base: Tensor, projected: Tensor, prev_token_ids: Tensor) -> Tensor:
        """Logits ``base`` (the head on the states) corrected by the Markov term of the
        states' projection ``projected`` and the previous token."""
        markov = F.gelu(projected + self.markov_in(prev_token_ids), approximate="tanh")
        corrected: Tensor = base + self.markov_out(markov)
        return corrected

    def confidence_logits(self, states: Tensor, prev_token_ids: Tensor, logits: Tensor) -> Tensor:
        """Uncalibrated log-odds of each position's conditional acceptance."""
        log_probs = logits.detach().float().log_softmax(-1)
        top = log_probs.max(-1).values
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        features = torch.cat([self.confidence_norm(states), self.markov_in(prev_token_ids),
                              top.unsqueeze(-1), entropy.unsqueeze(-1)], -1)
        raw: Tensor = self.confidence_out(features + self.confidence(features))
        return raw[..., 0]

    @torch.no_grad()
    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        """The block after ``token_ids`` from ``hidden`` alone: this drafter keeps no context,
        so ``positions`` and ``kv_slots`` are not used."""
        if not 1 <= width <= self.config.max_width:
            raise ValueError(f"width={width}: expected 1..{self.config.max_width}")
        states = self.states(hidden, token_ids, width)
        # What does not wait for the previous token runs once for the whole block.
        base, projected = self.head.logits(states), self.markov_state(states)
        prev, tokens, prevs, logits = token_ids, [], [], []
        # The Markov head makes each position depend on the previous draft token; this loop
        # is w rank-r corrections, not backbone forwards or output heads.
        for k in range(width):
            step = self.markov_logits(base[:, k], projected[:, k], prev)
            prevs.append(prev)
            prev = step.argmax(-1)
            tokens.append(prev)
            logits.append(step)
        all_logits = torch.stack(logits, 1)
        raw = self.confidence_logits(states, torch.stack(prevs, 1), all_logits)
        confidences = torch.sigmoid(raw / self.temperatures[:width])
        return DSparkBlock(token_ids=torch.stack(tokens, 1), confidences=confidences,
                           logits=all_logits)


def soft_cross_entropy(logits: Tensor, target_logits: Tensor) -> Tensor:
    """Cross-entropy of the draft against the target's full distribution (distillation)."""
    return -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def analytic_acceptance(draft_probs: Tensor, target_probs: Tensor) -> Tensor:
    """``sum_v min(p_draft, p_target)``: the probability that exact rejection sampling
    accepts a token drawn from ``p_draft`` against ``p_target``."""
    return torch.minimum(draft_probs, target_probs).sum(-1)


def greedy_acceptance_label(draft_token_ids: Tensor, target_logits: Tensor) -> Tensor:
    """The analytic acceptance of the runtime's own blocks at temperature 0.

    adaspec drafts are deterministic, so p_draft is a point mass on the drafted token, and a
    greedy target's distribution is a point mass on its argmax; ``sum_v min`` of the two is
    1 when they agree and 0 otherwise. (The soft draft distribution would describe sampled
    drafts, which the runtime never makes; measured here it also calibrated worse.)
    """
    vocab = target_logits.shape[-1]
    draft = F.one_hot(draft_token_ids, vocab).float()
    target = F.one_hot(target_logits.argmax(-1), vocab).float()
    return analytic_acceptance(draft, target)


def confidence_loss(raw: Tensor, label: Tensor) -> Tensor:
    """Cross-entropy of conditional acceptance: position k counts only where positions
    1..k-1 were accepted, because that is the event the confidence is conditioned on."""
    reached = torch.cat([torch.ones_like(label[..., :1]), label[..., :-1].cumprod(-1)], -1)
    loss = F.binary_cross_entropy_with_logits(raw, label, reduction="none")
    return (loss * reached).sum() / reached.sum().clamp(min=1)
