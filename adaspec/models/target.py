"""The reference target: a small byte-level decoder-only transformer with a slotted KV cache."""

import math
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaspec.models.layers import (
    Attention,
    Block,
    RMSNorm,
    additive_mask,
    beyond_memory,
    init_weights,
    sequence_mask,
    window_mask,
)
from adaspec.models.protocols import PrefillOutput, TargetOutput, VerifyRows


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetConfig:
    vocab_size: int = 256
    """Bytes: any UTF-8 text encodes without a tokenizer file."""
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    mlp_hidden: int = 512
    window: int = 256
    """Each position attends to at most this many positions, itself included."""
    context_limit: int = 1024

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


PREFILL_PADDING = 1.15
"""A prefill group's padded positions may exceed its real ones by at most this factor..."""

PREFILL_SLACK = 32
"""...or by this many positions: a forward pass of its own costs more than a few padded
positions."""


def length_groups(lengths: list[int], padding: float, slack: int = PREFILL_SLACK
                  ) -> list[list[int]]:
    """Indices of ``lengths`` in groups, longest first, each as large as it can be while
    its longest times its size stays within ``padding`` times its total or ``slack``
    positions over it: the prompts one padded batch runs."""
    groups: list[list[int]] = []
    group: list[int] = []
    total = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        longest = lengths[group[0]] if group else lengths[index]
        padded, real = longest * (len(group) + 1), total + lengths[index]
        if group and padded > max(padding * real, real + slack):
            groups.append(group)
            group, total = [], 0
        group.append(index)
        total += lengths[index]
    if group:
        groups.append(group)
    return groups


class KVCache:
    """Keys and values per layer, ``[num_kv_slots + 1, context_limit, heads, head_dim]``.

    Slot ``num_kv_slots`` is scratch: padding rows write there so no row needs a branch.
    """

    def __init__(self, num_layers: int, num_kv_slots: int, context_limit: int, num_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        """``MemoryError`` naming the bytes for a cache the device cannot hold: refused before
        allocating when it exceeds the device's memory, and when the allocation fails."""
        shape = (num_kv_slots + 1, context_limit, num_heads, head_dim)
        needed = 2 * num_layers * math.prod(shape) * dtype.itemsize  # keys and values
        what = f"a KV cache of {needed} bytes for {num_kv_slots + 1} KV slots"
        beyond = beyond_memory(needed, device)
        if beyond is not None:
            raise MemoryError(f"{what}, {beyond}")
        try:
            self.keys = [torch.zeros(shape, device=device, dtype=dtype)
                         for _ in range(num_layers)]
            self.values = [torch.zeros(shape, device=device, dtype=dtype)
                           for _ in range(num_layers)]
        except RuntimeError as error:  # torch.OutOfMemoryError and the CPU allocator's
            reason = " ".join(str(error).split())[:200]
            raise MemoryError(f"{what}, which {device.type} memory cannot hold: {reason}") \
                from None
        self.num_kv_slots = num_kv_slots
        self.context_limit = context_limit

    def rows_of(self, kv_slots: Tensor, positions: Tensor) -> Tensor:
        """Flat row index of ``(kv_slot, position)`` pairs into a layer viewed as
        ``[(num_kv_slots + 1) * context_limit, heads, head_dim]``. Flat rows let writes and
        gathers use ``index_copy_`` and ``index_select``, several times faster on the CPU
        than indexing with two index tensors, which works element by element. Positions
        must lie in ``0 .. context_limit - 1``: outside, a flat row lands in a neighbouring
        KV slot (callers clamp or mask them)."""
        return (kv_slots * self.context_limit + positions).flatten()

    def write(self, layer: int, kv_slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        self.write_rows(layer, self.rows_of(kv_slots, positions), k, v)

    def write_rows(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k, v [..., heads, head_dim]`` at flat ``rows`` (from ``rows_of``)."""
        for store, new in ((self.keys[layer], k), (self.values[layer], v)):
            store.view(-1, *store.shape[2:]).index_copy_(0, rows, new.reshape(-1,
                                                                              *store.shape[2:]))

    def window(self, layer: int, kv_slots: Tensor, key_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at ``key_pos [N, K]`` of ``kv_slots [N]`` (clamped into the cache;
        out-of-range positions are masked by the caller)."""
        rows = self.rows_of(kv_slots[:, None], key_pos.clamp(0, self.context_limit - 1))
        return self.gather_rows(layer, rows, key_pos.shape)

    def gather_rows(self, layer: int, rows: Tensor, shape: tuple[int, ...] | torch.Size
                    ) -> tuple[Tensor, Tensor]:
        """Keys and values at flat ``rows``, shaped ``[*shape, heads, head_dim]``."""
        keys, values = self.keys[layer], self.values[layer]
        full = (*shape, *keys.shape[2:])
        return (keys.view(-1, *keys.shape[2:]).index_select(0, rows).view(full),
                values.view(-1, *values.shape[2:]).index_select(0, rows).view(full))


@dataclass(frozen=True, slots=True)
class GridIndex:
    """The row layout of one batch, shared by every layer and computed once per forward.

    Rows are scattered into a ``[Bcap, R + 1]`` grid (column R collects padding rows); each
    request's grid row attends to one gathered window of its own cache.
    """

    positions: Tensor  # [G] position of each row
    rope: tuple[Tensor, Tensor]  # [G, hd // 2] cos and sin at each row's position
    write_rows: Tensor  # [G] flat cache row each row writes (padding rows: scratch KV slot)
    grid_cells: Tensor  # [G] flat grid cell entry * (R + 1) + column of each row (padding:
    #                     column R)
    key_rows: Tensor  # [Bcap * (window + R)] flat cache rows gathered per request
    key_shape: tuple[int, int]  # (Bcap, window + R)
    mask: Tensor  # [Bcap, 1, R + 1, window + R] which grid query may see which key

    @classmethod
    def of(cls, rows: VerifyRows, cache: KVCache, window: int, attn: Attention) -> "GridIndex":
        device = rows.token_ids.device
        width = rows.rows_per_req + 1
        positions = rows.positions
        write_kv_slots = torch.where(rows.row_valid,
                                     rows.req_kv_slots.index_select(0, rows.row_reqs),
                                     cache.num_kv_slots)
        columns = torch.where(rows.row_valid, rows.row_offsets, rows.rows_per_req)
        query_pos = rows.req_starts[:, None] + torch.arange(width, device=device)
        key_pos = (rows.req_starts[:, None] - window + 1
                   + torch.arange(window + width - 1, device=device))
        # The key window covers every query position, so each grid row sees at least itself
        # and the softmax stays finite even in padding rows.
        return cls(positions=positions, rope=attn.rope_at(positions),
                   # Padding rows write at position 0 of the scratch KV slot: a flat row
                   # index must never step outside its KV slot, whatever a padding row holds.
                   write_rows=cache.rows_of(write_kv_slots,
                                            torch.where(rows.row_valid, positions, 0)),
                   grid_cells=rows.row_reqs * width + columns,
                   key_rows=cache.rows_of(rows.req_kv_slots[:, None],
                                          key_pos.clamp(0, cache.context_limit - 1)),
                   key_shape=(key_pos.shape[0], key_pos.shape[1]),
                   mask=window_mask(query_pos, key_pos, window)[:, None])


def grid_attention(block: Block, cache: KVCache, layer: int, x_rows: Tensor, rows: VerifyRows,
                   index: GridIndex) -> Tensor:
    """One attention sublayer for packed rows: write their KV, attend on the request grid,
    gather back. Only the cheap attention runs on the grid; projections and MLPs run on the
    G packed rows, so target work scales with G."""
    attn = block.attn
    q, k, v = attn.project(block.attn_norm(x_rows), index.positions, index.rope)
    cache.write_rows(layer, index.write_rows, k, v)
    num_reqs, width = rows.req_kv_slots.shape[0], rows.rows_per_req + 1
    grid_q = q.new_zeros(num_reqs * width, *q.shape[1:])
    grid_q.index_copy_(0, index.grid_cells, q)
    keys, values = cache.gather_rows(layer, index.key_rows, index.key_shape)
    out = attn.grid(grid_q.view(num_reqs, width, *q.shape[1:]), keys, values, index.mask)
    projected: Tensor = attn.out(out.flatten(0, 1).index_select(0, index.grid_cells))
    return projected


class ReferenceTarget(nn.Module):
    """Byte-level causal LM; ``forward`` trains on sequences, ``prefill``/``verify`` serve."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        # A ModuleList at run time; typed as a list of blocks for the checker.
        self.blocks = cast(list[Block], nn.ModuleList(
            Block(config.hidden_size, config.num_heads, config.mlp_hidden, config.window,
                  config.context_limit)
            for _ in range(config.num_layers)))
        self.norm = RMSNorm(config.hidden_size)
        init_weights(self, config.num_layers)
        self.cache: KVCache | None = None
        self.identity = ""

    # --- protocol attributes -----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def context_limit(self) -> int:
        return self.config.context_limit

    @property
    def num_kv_slots(self) -> int:
        return 0 if self.cache is None else self.cache.num_kv_slots

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def logits(self, hidden: Tensor) -> Tensor:
        """Output head, tied to the input embedding."""
        return F.linear(self.norm(hidden), self.embed.weight)

    def allocate(self, num_kv_slots: int) -> None:
        """(Re)allocate the KV cache for ``num_kv_slots`` concurrent requests."""
        param = self.embed.weight
        attn = self.blocks[0].attn  # a TP rank's blocks hold its own heads only
        self.cache = KVCache(self.config.num_layers, num_kv_slots, self.config.context_limit,
                             attn.num_heads, attn.head_dim, param.device, param.dtype)

    # --- training ----------------------------------------------------------------------
    def forward(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Logits and final hidden states ``[B, T, ...]`` for whole sequences."""
        positions = torch.arange(token_ids.shape[1], device=token_ids.device).expand_as(token_ids)
        x = self.embed(token_ids)
        for block in self.blocks:
            x, _, _ = block.sequence(x, positions)
        return self.logits(x), x

    # --- serving -----------------------------------------------------------------------
    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("call allocate(num_kv_slots) before serving")
        return self.cache

    @torch.no_grad()
    def prefill(self, prompts: list[Tensor], kv_slots: Tensor) -> PrefillOutput:
        """Prompts of unlike lengths run in groups of like ones (``length_groups``): a padded
        position costs as much as a real one. The output is in the prompts' order."""
        cache = self._require_cache()
        groups = length_groups([len(p) for p in prompts], PREFILL_PADDING)
        if len(groups) <= 1:
            return self._prefill_group(cache, prompts, kv_slots)
        order = [i for group in groups for i in group]
        back = sorted(range(len(order)), key=order.__getitem__)
        # One host-to-device copy for both permutations: each copy may wait for the device.
        both = torch.tensor(order + back, device=self.embed.weight.device)
        sorted_kv_slots = kv_slots.index_select(0, both[:len(order)])
        parts, start = [], 0
        for group in groups:
            parts.append(self._prefill_group(cache, [prompts[i] for i in group],
                                             sorted_kv_slots[start:start + len(group)]))
            start += len(group)
        longest = len(prompts[order[0]])
        hidden = torch.cat([F.pad(p.hidden, (0, 0, 0, longest - p.hidden.shape[1]))
                            for p in parts])
        back_index = both[len(order):]
        last = TargetOutput(logits=torch.cat([p.last.logits for p in parts])[back_index],
                            hidden=torch.cat([p.last.hidden for p in parts])[back_index])
        return PrefillOutput(last=last, hidden=hidden[back_index],
                             lengths=torch.cat([p.lengths for p in parts])[back_index])

    def _prefill_group(self, cache: KVCache, prompts: list[Tensor], kv_slots: Tensor
                       ) -> PrefillOutput:
        device = self.embed.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        tokens = nn.utils.rnn.pad_sequence(prompts, batch_first=True).to(device)
        steps = torch.arange(tokens.shape[1], device=device)
        valid = steps[None, :] < lengths[:, None]
        positions = steps.expand_as(tokens)
        # One mask for every layer, already in the form attention adds.
        mask = additive_mask(sequence_mask(positions, self.config.window, valid), self.dtype)
        # Padding positions go to the scratch KV slot, so a shorter prompt's tail stays clean.
        write_kv_slots = torch.where(valid, kv_slots[:, None], cache.num_kv_slots)
        x = self.embed(tokens)
        for layer, block in enumerate(self.blocks):
            x, k, v = block.sequence(x, positions, mask=mask)
            cache.write(layer, write_kv_slots, positions, k, v)
        last_hidden = x[torch.arange(len(prompts), device=device), lengths - 1]
        last = TargetOutput(logits=self.logits(last_hidden), hidden=last_hidden)
        return PrefillOutput(last=last, hidden=x, lengths=lengths)

    @torch.no_grad()
    def verify(self, rows: VerifyRows) -> TargetOutput:
        cache = self._require_cache()
        x = self.embed(rows.token_ids)
        index = GridIndex.of(rows, cache, self.config.window, self.blocks[0].attn)
        for layer, block in enumerate(self.blocks):
            x = x + grid_attention(block, cache, layer, x, rows, index)
            x = x + block.mlp(block.mlp_norm(x))
        return TargetOutput(logits=self.logits(x), hidden=x)
