"""The reference drafters: an MTP head and a DSpark-style block drafter.

Both share the target's token embedding and output head (as DeepSeek-V3's multi-token
prediction module does) and condition on the target's final hidden state at the row that
produced the newest token. Their own weights stay small, and so does their work: a drafter is
worth running only when it costs a small share of a target step, and at small batches on a CPU
that cost is mostly the count of tensor operations, so both are built from few of them (one
norm over the fused input, tanh-approximated GELU, a dedicated one-row attention for MTP steps,
an MLP backbone and a logit-space Markov head for DSpark).
"""

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaspec.models.layers import GELU_TANH, MLP, Block, RMSNorm, init_weights
from adaspec.models.protocols import DSparkBlock, MtpStep
from adaspec.models.target import KVCache, ReferenceTarget


@dataclass(frozen=True, slots=True, kw_only=True)
class MtpConfig:
    num_heads: int = 4
    mlp_hidden: int = 384
    window: int = 32
    """Positions the MTP block attends to, itself included: its own recent context (the
    target's hidden state it starts from already carries the long one)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class DSparkConfig:
    max_width: int = 7
    backbone_hidden: int = 1024
    """Hidden units of the MLP that maps the fused context to every position's state."""
    markov_rank: int = 64
    """Rank of the Markov head: a bigram table ``markov_in @ markov_out`` of logits through
    which the previous draft token steers a position."""
    confidence_hidden: int = 64
    confidence_features: int = 16
    """Width of the state projection and of the token embedding the confidence head reads."""

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
    """DeepSeek-V3's MTP input, [hidden; embed(token)] projected to one vector, with one norm
    over the concatenation (its weight scales the two halves apart) instead of one each."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(2 * dim)
        self.proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        fused: Tensor = self.proj(self.norm(torch.cat([hidden, embedded], -1)))
        return fused


class ReferenceMtp(nn.Module):
    """One transformer block drafting a token per sequential step.

    Step inputs are the state of the previous step (the target's hidden state for the first)
    and the token after it; the block attends over its own KV cache, which ``publish`` fills
    with teacher-forced context for committed positions, within a short window. A serving
    step has one query per request, so it attends without the target's row grid: the keys
    of positions ``p - window + 1 .. p`` of its own slot, those below 0 masked.
    """

    def __init__(self, config: MtpConfig, target: ReferenceTarget) -> None:
        super().__init__()
        tc = target.config
        self.config = config
        self.head = SharedHead(target)
        self.fuse = Fuse(tc.hidden_size)
        self.block = Block(tc.hidden_size, config.num_heads, config.mlp_hidden, config.window,
                           tc.context_limit, approximate=GELU_TANH)
        init_weights(self, 1)
        self.cache: KVCache | None = None
        self.identity = ""
        self.register_buffer("_offsets", torch.arange(config.window - 1, -1, -1),
                             persistent=False)

    _offsets: Tensor  # [window] window - 1 .. 0: how far back each gathered key sits

    def allocate(self, num_slots: int) -> None:
        tc = self.head.target.config
        param = self.fuse.proj.weight
        self.cache = KVCache(1, num_slots, tc.context_limit, self.config.num_heads,
                             tc.hidden_size // self.config.num_heads, param.device,
                             param.dtype)

    def forward(self, hidden: Tensor, next_token_ids: Tensor) -> Tensor:
        """Training: output states ``[B, T, d]`` for whole sequences of (state, next token)."""
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[:2])
        x = self.fuse(hidden, self.head.embed(next_token_ids))
        x, _, _ = self.block.sequence(x, positions)
        return x

    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("call allocate(num_slots) before drafting")
        return self.cache

    @torch.no_grad()
    def publish(self, hidden: Tensor, next_token_ids: Tensor, positions: Tensor,
                slots: Tensor) -> None:
        cache = self._require_cache()
        x = self.fuse(hidden, self.head.embed(next_token_ids))
        k, v = self.block.attn.key_values(self.block.attn_norm(x), positions)
        cache.write(0, slots, positions, k, v)

    @torch.no_grad()
    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             slots: Tensor) -> MtpStep:
        cache = self._require_cache()
        block, attn = self.block, self.block.attn
        x = self.fuse(hidden, self.head.embed(token_ids))
        q, k, v = attn.project(block.attn_norm(x), positions)
        cache.write(0, slots, positions, k, v)
        key_pos = positions[:, None] - self._offsets  # [N, window], the query's own last
        keys, values = cache.window(0, slots, key_pos)
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=(key_pos >= 0)[:, None, None])  # [N, H, 1, hd]
        x = x + attn.out(out.flatten(1))
        x = x + block.mlp(block.mlp_norm(x))
        logits = self.head.logits(x)
        token = logits.argmax(-1)
        # exp(selected_logit - logsumexp(logits)), as one fused softmax.
        probs = logits.softmax(-1).gather(-1, token[:, None])[:, 0]
        return MtpStep(hidden=x, token_ids=token, probs=probs, logits=logits)


class ReferenceDSpark(nn.Module):
    """A block drafter: one parallel pass, a low-rank Markov head, a confidence head.

    Every position's state is a function of one context vector (the target's hidden state
    fused with the newest token), so the backbone is one MLP from that vector to the states
    of all ``max_width`` positions at once, plus a learned vector per position; a block of
    width w uses the first w. Position k's logits are the shared output head's over its
    state plus a rank-r bigram term of the previous draft token (``markov_in`` times
    ``markov_out``, a ``[vocab, vocab]`` table of logits), so the block stays coherent with w
    sequential steps of a row lookup and an argmax. The confidence head estimates position
    k's conditional acceptance from a projection of the state, an embedding of the previous
    token and the draft distribution's own sharpness; ``temperatures`` (fitted after
    training, one per position) calibrate it.
    """

    temperatures: Tensor

    def __init__(self, config: DSparkConfig, target: ReferenceTarget) -> None:
        super().__init__()
        dim = target.config.hidden_size
        vocab = target.config.vocab_size
        self.config = config
        self.head = SharedHead(target)
        self.fuse = Fuse(dim)
        self.backbone = MLP(dim, config.backbone_hidden, out=config.max_width * dim,
                            approximate=GELU_TANH)
        self.queries = nn.Parameter(torch.zeros(config.max_width, dim))
        self.markov_in = nn.Embedding(vocab, config.markov_rank)
        self.markov_out = nn.Linear(config.markov_rank, vocab, bias=False)
        features = config.confidence_features
        self.confidence_state = nn.Linear(dim, features, bias=False)
        self.confidence_token = nn.Embedding(vocab, features)
        self.confidence = MLP(2 * features + 2, config.confidence_hidden, out=1,
                              approximate=GELU_TANH)
        self.register_buffer("temperatures", torch.ones(config.max_width))
        init_weights(self, 1)
        nn.init.normal_(self.queries, std=0.02)
        self.identity = ""
        self._bigram: tuple[tuple[int, int, torch.device], Tensor] | None = None

    @property
    def max_width(self) -> int:
        return self.config.max_width

    def states(self, hidden: Tensor, token_ids: Tensor, width: int) -> Tensor:
        """Backbone states ``[..., width, d]`` for each draft position."""
        context = self.fuse(hidden, self.head.embed(token_ids))
        dim = context.shape[-1]
        mlp = self.backbone
        # Only the first ``width`` positions' rows of the output weight are read: at one
        # request the backbone is bound by reading that weight, not by arithmetic.
        inner = F.gelu(mlp.up(context), approximate=mlp.approximate)
        spread = F.linear(inner, mlp.down.weight[:width * dim])
        states: Tensor = context.unsqueeze(-2) + spread.view(*spread.shape[:-1], width, dim) \
            + self.queries[:width]
        return states

    def bigram(self) -> Tensor:
        """[vocab, vocab] the Markov head's logits for each previous token. Serving reads it
        every round, so it is kept until either factor changes (their version counters
        and device say so)."""
        key = (self.markov_in.weight._version, self.markov_out.weight._version,
               self.markov_in.weight.device)
        if self._bigram is None or self._bigram[0] != key:
            with torch.no_grad():
                table: Tensor = self.markov_out(self.markov_in.weight)
            self._bigram = (key, table)
        return self._bigram[1]

    def position_logits(self, states: Tensor, prev_token_ids: Tensor) -> Tensor:
        """Draft logits of each position given the token before it (all positions at once,
        teacher-forced: training and evaluation)."""
        bigram: Tensor = self.markov_out(self.markov_in(prev_token_ids))
        return self.head.logits(states) + bigram

    def confidence_logits(self, states: Tensor, prev_token_ids: Tensor, logits: Tensor) -> Tensor:
        """Uncalibrated log-odds of each position's conditional acceptance."""
        log_probs = logits.detach().float().log_softmax(-1)
        top = log_probs.max(-1, keepdim=True).values
        entropy = -(log_probs.exp() * log_probs).sum(-1, keepdim=True)
        features = torch.cat([self.confidence_state(states),
                              self.confidence_token(prev_token_ids), top, entropy], -1)
        raw: Tensor = self.confidence(features)
        return raw[..., 0]

    @torch.no_grad()
    def draft(self, hidden: Tensor, token_ids: Tensor, width: int) -> DSparkBlock:
        if not 1 <= width <= self.config.max_width:
            raise ValueError(f"width={width}: expected 1..{self.config.max_width}")
        states = self.states(hidden, token_ids, width)
        base = self.head.logits(states)  # [N, w, V]
        table = self.bigram()  # [V, V]
        prev, tokens, logits = token_ids, [], []
        for k in range(width):  # each position depends on the previous draft token
            step = base[:, k] + table.index_select(0, prev)
            prev = step.argmax(-1)
            tokens.append(prev)
            logits.append(step)
        token_ids_block = torch.stack(tokens, 1)
        all_logits = torch.stack(logits, 1)
        prevs = torch.cat([token_ids[:, None], token_ids_block[:, :-1]], 1)
        raw = self.confidence_logits(states, prevs, all_logits)
        confidences = torch.sigmoid(raw / self.temperatures[:width])
        return DSparkBlock(token_ids=token_ids_block, confidences=confidences,
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
