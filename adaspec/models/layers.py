"""Transformer pieces shared by the reference target and drafters.

Attention is causal within a sliding window of ``window`` positions, with rotary position
embeddings. Because RoPE scores depend only on the distance between positions and no query
sees further back than the window, a position deep into a long context is computed exactly
like one a window in: the models are trained on short sequences yet keep their quality up to
the context limit.

Two attention entry points serve the runtime:
- ``sequence``: whole sequences at once (training, prefill), keys from the same sequences;
- ``grid``: a fixed-shape ``[num_reqs, rows_per_req]`` grid of query rows whose keys come
  from a KV cache (verification, decode, draft steps). Shapes depend only on the bucket, so
  the call has no host synchronisation and can be captured as a graph.
"""

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and x.device.type == "cpu" \
                and x.dtype == self.weight.dtype == torch.float32:
            # Serving in float32 on the cpu: one fused kernel instead of six, equal to the
            # form below bit for bit there (checked by the tests); elsewhere that is unproven.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Training keeps this form: the shipped weights were trained through its backward.
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


def rope_tables(max_positions: int, head_dim: int, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Cos and sin tables ``[max_positions, head_dim // 2]``."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [..., H, hd]`` by per-position tables ``cos, sin [..., hd // 2]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def window_mask(query_pos: Tensor, key_pos: Tensor, window: int) -> Tensor:
    """True where a query may attend a key: causal, at most ``window - 1`` back, key >= 0."""
    q = query_pos.unsqueeze(-1)
    k = key_pos.unsqueeze(-2)
    return (k <= q) & (k > q - window) & (k >= 0)


def sequence_mask(positions: Tensor, window: int, key_valid: Tensor | None = None) -> Tensor:
    """``[B, 1, T, T]`` boolean mask of attention over whole sequences at ``positions
    [B, T]``: the sliding causal window, keys outside ``key_valid [B, T]`` excluded."""
    mask = window_mask(positions, positions, window)
    if key_valid is not None:
        mask = mask & key_valid[:, None, :]
    # A query with no key left (a padded position) would softmax over nothing; let it see
    # itself so the result stays finite. Its output is never used.
    mask = mask | torch.eye(positions.shape[-1], dtype=torch.bool, device=positions.device)
    return mask[:, None]


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one attention computes with (0 or -inf):
    made once, it saves every layer the conversion. Every query must see some key."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


class Attention(nn.Module):
    """Multi-head self-attention with RoPE and a sliding causal window."""

    cos: Tensor
    sin: Tensor

    def __init__(self, dim: int, num_heads: int, window: int, max_positions: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window = window
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        cos, sin = rope_tables(max_positions, self.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rope_at(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Cos and sin ``[..., hd // 2]`` at ``positions``; every attention of one head size
        has the same tables, so a forward gathers them once for all its layers."""
        flat = positions.flatten()
        shape = (*positions.shape, self.cos.shape[-1])
        return (self.cos.index_select(0, flat).view(shape),
                self.sin.index_select(0, flat).view(shape))

    def project(self, x: Tensor, positions: Tensor | None,
                rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[..., H, hd]`` for inputs ``x [..., dim]`` at ``positions [...]``
        (``rope``: their tables from ``rope_at``, when the caller has them already; then
        ``positions`` may be None)."""
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        if rope is None:
            if positions is None:
                raise ValueError("project needs positions or their rope tables")
            rope = self.rope_at(positions)
        cos, sin = rope
        # q and k rotate together: one set of elementwise ops instead of two.
        qk = apply_rope(qkv[..., :2, :, :], cos.unsqueeze(-2), sin.unsqueeze(-2))
        return qk[..., 0, :, :], qk[..., 1, :, :], qkv[..., 2, :, :]

    def key_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Only k, v (for publishing context into a cache without attending)."""
        _, k, v = self.project(x, positions)
        return k, v

    def sequence(self, x: Tensor, positions: Tensor, key_valid: Tensor | None = None,
                 mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Attention over whole sequences ``x [B, T, dim]``; returns (out, k, v). ``mask``
        is ``sequence_mask(positions, window, key_valid)`` made once for every layer, or
        None to make it here."""
        q, k, v = self.project(x, positions)
        if mask is None:
            mask = sequence_mask(positions, self.window, key_valid)
        return self._attend(q, k, v, mask=mask), k, v

    def causal(self, x: Tensor) -> Tensor:
        """Attention over sequences ``x [B, T, dim]`` at positions 0 .. T-1 with T at most the
        window: the mask is plain causal and the rope tables are the first T rows, so neither
        is built (what ``sequence`` computes for those positions, with fewer kernels)."""
        length = x.shape[1]
        if length > self.window:
            raise ValueError(f"causal attention over {length} positions exceeds the window "
                             f"of {self.window}")
        q, k, v = self.project(x, None, (self.cos[:length], self.sin[:length]))
        return self._attend(q, k, v, is_causal=True)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                is_causal: bool = False) -> Tensor:
        """Attention of ``q, k, v [B, T, H, hd]`` and the output projection: ``[B, T, dim]``."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask,
                                             is_causal=is_causal)
        projected: Tensor = self.out(out.transpose(1, 2).flatten(2))
        return projected

    def grid(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """Attention of a query grid ``q [N, R, H, hd]`` over gathered keys and values
        ``[N, K, H, hd]`` under ``mask [N, 1, R, K]``; returns ``[N, R, H*hd]``."""
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2).reshape(*q.shape[:2], -1)


class MLP(nn.Module):
    """``down(gelu(up(x)))``; ``approximate="tanh"`` picks GELU's tanh form, one short kernel
    on the cpu where the exact (erf) form pays a fixed cost several times larger per call."""

    def __init__(self, dim: int, hidden: int, approximate: str = "none") -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(F.gelu(self.up(x), approximate=self.approximate))
        return out


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, window: int,
                 max_positions: int, approximate: str = "none") -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, num_heads, window, max_positions)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, mlp_hidden, approximate)

    def sequence(self, x: Tensor, positions: Tensor, key_valid: Tensor | None = None,
                 mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        attn, k, v = self.attn.sequence(self.attn_norm(x), positions, key_valid, mask)
        x = x + attn
        return x + self.mlp(self.mlp_norm(x)), k, v

    def causal(self, x: Tensor) -> Tensor:
        """``sequence`` at positions 0 .. T-1 (T within the window), via ``Attention.causal``."""
        x = x + self.attn.causal(self.attn_norm(x))
        out: Tensor = x + self.mlp(self.mlp_norm(x))
        return out


def init_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-2 style initialisation: small normal weights, residual outputs scaled by depth."""
    for name, param in module.named_parameters():
        if param.dim() < 2:
            continue
        std = 0.02
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            std /= math.sqrt(2 * num_layers)
        nn.init.normal_(param, mean=0.0, std=std)


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory the device has in all (a CPU's: the machine's RAM), or None where
    that cannot be told: no allocation on it can be larger."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError, RuntimeError):  # no sysconf name, no driver
        return None
    return None


def beyond_memory(needed: int, device: torch.device) -> str | None:
    """Why ``needed`` bytes cannot be allocated on ``device`` (more than it has in all), or
    None when they may be (the allocation itself decides)."""
    memory = device_memory(device)
    if memory is not None and needed > memory:
        return f"more than the {memory} bytes of {device.type} memory"
    return None
