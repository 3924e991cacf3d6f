"""Tensor parallelism for the reference models, in the Megatron layout.

Every transformer block is split across the ranks of a TP group: the query, key and value
projections and the MLP's first layer are column-parallel (each rank keeps its own attention
heads and its own slice of the MLP's hidden units), the attention output and the MLP's second
layer are row-parallel (each rank multiplies its slice and an all-reduce sums the partial
results). Embedding, output head, norms and the DSpark confidence head stay whole on every
rank: they are small, and keeping them whole means every rank holds the same hidden states
and logits after each block. A rank's KV caches then hold its own heads only.

The all-reduce is a callable supplied by the runtime (``Collectives.tp_all_reduce``), so the
models never import the runtime; a sum in a different order than the whole model's makes
logits differ in the last bits, so a TP launch is compared with itself at the same TP size.
"""

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from adaspec.errors import ConfigError
from adaspec.models.layers import MLP, Attention, Block

AllReduce = Callable[[Tensor], None]
"""Sum a tensor in place over the ranks of this rank's TP group."""


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over this rank's slice of its input features, whose partial
    outputs are summed over the TP group: every rank ends with the whole layer's output."""

    def __init__(self, weight: Tensor, all_reduce: AllReduce) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        self.all_reduce(out)
        return out


def _column(weight: Tensor) -> nn.Linear:
    """A bias-free linear layer holding ``weight [out, in]`` (this rank's output columns)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return layer


def _check_divides(what: str, count: int, tp_size: int) -> None:
    if count % tp_size:
        raise ConfigError("--tp_size", tp_size,
                          f"expected a divisor of the model's {what} ({count}): each TP rank "
                          f"keeps an equal share")


def split_attention(attn: Attention, tp_rank: int, tp_size: int, all_reduce: AllReduce) -> None:
    """Keep heads ``tp_rank * H / tp_size`` .. of ``attn``; its output sums over the group."""
    heads = attn.num_heads // tp_size
    first = tp_rank * heads
    dim = attn.qkv.weight.shape[1]
    qkv = attn.qkv.weight.detach().view(3, attn.num_heads, attn.head_dim, dim)
    attn.qkv = _column(qkv[:, first:first + heads].reshape(3 * heads * attn.head_dim, dim))
    out = attn.out.weight.detach().view(dim, attn.num_heads, attn.head_dim)
    attn.out = RowParallelLinear(out[:, first:first + heads].reshape(dim, heads * attn.head_dim),
                                 all_reduce)
    attn.num_heads = heads


def split_mlp(mlp: MLP, tp_rank: int, tp_size: int, all_reduce: AllReduce) -> None:
    """Keep hidden units ``tp_rank * hidden / tp_size`` .. of ``mlp``."""
    hidden = mlp.up.weight.shape[0] // tp_size
    first = tp_rank * hidden
    mlp.up = _column(mlp.up.weight.detach()[first:first + hidden])
    mlp.down = RowParallelLinear(mlp.down.weight.detach()[:, first:first + hidden], all_reduce)


def split_blocks(model: nn.Module, tp_rank: int, tp_size: int, all_reduce: AllReduce) -> None:
    """Split every transformer block of ``model`` for TP rank ``tp_rank`` of ``tp_size``, in
    place. A model whose heads or MLP width ``tp_size`` does not divide is refused before
    any block changes."""
    if tp_size == 1:
        return
    if not 0 <= tp_rank < tp_size:
        raise ConfigError("tp_rank", tp_rank, f"expected 0 <= tp_rank < tp_size={tp_size}")
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for block in blocks:
        _check_divides("attention heads", block.attn.num_heads, tp_size)
        _check_divides("MLP hidden units", block.mlp.up.weight.shape[0], tp_size)
        for layer in (block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down):
            if layer.bias is not None:  # a split would have to divide or keep it: not built
                raise ConfigError("--tp_size", tp_size, "expected projections without a "
                                  "bias: this split keeps weights only")
    for block in blocks:
        split_attention(block.attn, tp_rank, tp_size, all_reduce)
        split_mlp(block.mlp, tp_rank, tp_size, all_reduce)
