"""Target sampling for the verify rows: one target token per row, greedy or drawn.

A row at offset j of a request yields the target's distribution for the token after it. For
a greedy request the row's target token is the argmax of the raw logits (first index on
ties, as in target-only decoding). For a random request it is one draw from the filtered
target distribution: logits divided by the temperature, then top-k, then top-p, then min-p,
each with its usual meaning. Drafts are deterministic (point masses), so comparing each draw
with the next drafted token is exact rejection sampling: a draw equal to the draft accepts
it (probability p(draft)), and a different draw is distributed as the target conditioned on
not being the draft, which is the residual distribution. ``commit`` applies that rule. There
is deliberately no input for draft probabilities: a probabilistic draft needs another rule.

Draws use inverse-CDF sampling over the kept tokens in descending order from one uniform per
row, passed in by the caller, so that a round replays exactly from its uniforms. The kept set
is always a prefix of that order (each filter keeps a prefix, and zero-probability tokens sit
at its end), so clamping the index to the last kept token can never pick a removed one.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from adaspec.config.requests import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-entry sampling parameters of a batch; padding entries decode greedily."""

    temperature: Tensor  # [Bcap] float64; 0 decodes greedily
    top_k: Tensor  # [Bcap] int64; 0 keeps every token
    top_p: Tensor  # [Bcap] float64; 1 keeps every token
    min_p: Tensor  # [Bcap] float64; 0 keeps every token
    all_greedy: bool  # host-known: no entry samples, so the random path can be skipped

    def to(self, device: torch.device) -> "SamplingTensors":
        """The same parameters on ``device``, copied without the host waiting."""
        return SamplingTensors(
            temperature=self.temperature.to(device, non_blocking=True),
            top_k=self.top_k.to(device, non_blocking=True),
            top_p=self.top_p.to(device, non_blocking=True),
            min_p=self.min_p.to(device, non_blocking=True), all_greedy=self.all_greedy)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], num_reqs: int,
                    device: torch.device | str = "cpu") -> "SamplingTensors":
        """Host factory: one entry per request, padded with greedy entries to ``num_reqs``."""
        padding = num_reqs - len(params)
        if padding < 0:
            raise ValueError(f"{len(params)} requests do not fit a bucket of {num_reqs}")

        def column(values: list[float] | list[int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperatures = [float(p.temperature or 0.0) for p in params] + [0.0] * padding
        return cls(
            temperature=column(temperatures, torch.float64),
            top_k=column([p.top_k for p in params] + [0] * padding, torch.int64),
            top_p=column([p.top_p for p in params] + [1.0] * padding, torch.float64),
            min_p=column([p.min_p for p in params] + [0.0] * padding, torch.float64),
            all_greedy=not any(temperatures),
        )


def sampling_dtype(device: torch.device) -> torch.dtype:
    """Float64 on the CPU, where vocabularies here are small and the kernels are compared with
    plain-Python float references; float32 on accelerators, where a float64 copy of
    ``[G, vocab]`` logits for a 150k vocabulary would cost gigabytes and NPUs lack fast
    float64. Either way the kept set stays a prefix, so a removed token is never drawn."""
    return torch.float64 if device.type == "cpu" else torch.float32


def sorted_filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                          min_p: Tensor) -> tuple[Tensor, Tensor]:
    """Unnormalised kept probabilities in descending order ``[N, V]`` and the token order.

    Per-row parameters ``[N]``; a row with temperature 0 is treated as temperature 1 here
    (its target token is the argmax and never uses these probabilities).
    """
    vocab = logits.shape[-1]
    dtype = sampling_dtype(logits.device)
    scale = torch.where(temperature > 0, temperature, 1.0).to(dtype)
    top_p, min_p = top_p.to(dtype), min_p.to(dtype)
    scaled = logits.to(dtype) / scale[:, None]
    # A stable sort orders equal logits by token id, so filter boundaries among ties do
    # not depend on the sort implementation.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    keep = sorted_logits >= kth  # ties with the k-th logit stay, as in the usual top-k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -torch.inf), dim=-1)
    # Mass strictly ahead of each token: the inclusive sum shifted by one, not "sum - p",
    # which rounds differently at the boundary.
    cumulative = torch.cumsum(probs, dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    # The smallest prefix whose mass reaches top_p; top_p = 1 is off outright, so rounding
    # of a cumulative sum near 1 cannot drop tail tokens.
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    # min-p relative to the most likely token, compared as a logit difference: exact for the
    # ratio, and independent of how the softmax rounded.
    keep &= sorted_logits - sorted_logits[:, :1] >= torch.log(min_p)[:, None]
    keep &= probs > 0
    return torch.where(keep, probs, 0.0), order


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 min_p: Tensor) -> Tensor:
    """[N, V] the filtered target distribution of each row, in token order (for tests and
    offline evaluation; the sampler itself stays in sorted order)."""
    kept, order = sorted_filtered_probs(logits, temperature, top_k, top_p, min_p)
    probs = torch.zeros_like(kept).scatter_(1, order, kept)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_sorted(kept: Tensor, order: Tensor, uniforms: Tensor) -> Tensor:
    """[N] one token per row by inverse CDF over the kept tokens, from ``uniforms [N]`` in
    [0, 1)."""
    cdf = torch.cumsum(kept, dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)
    # Rounding can put the target on the total mass; stay on the last kept token.
    last_kept = (kept > 0).sum(dim=-1, keepdim=True) - 1
    index = torch.minimum(index, last_kept.clamp(min=0))
    return order.gather(1, index).squeeze(1)


def sample_rows(logits: Tensor, row_reqs: Tensor, params: SamplingTensors,
                uniforms: Tensor) -> Tensor:
    """[G] int64 the target token of every verify row.

    ``logits [G, vocab]`` from the target forward; ``row_reqs [G]`` the packed-row owners
    through which per-entry parameters are mapped; ``uniforms [G]`` in [0, 1), one per row
    (padding rows draw too, harmlessly, so the shape never depends on the round).
    """
    greedy = torch.argmax(logits, dim=-1)
    if params.all_greedy:
        return greedy
    temperature = params.temperature.index_select(0, row_reqs)
    kept, order = sorted_filtered_probs(logits, temperature, params.top_k.index_select(0, row_reqs),
                                        params.top_p.index_select(0, row_reqs),
                                        params.min_p.index_select(0, row_reqs))
    drawn = draw_sorted(kept, order, uniforms)
    return torch.where(temperature > 0, drawn, greedy)
