"""Hugging Face causal language models through the protocols: a ``TargetModel`` and an
MTP-style sequential drafter (a second, smaller causal LM, or the target's own checkpoint).

Optional: ``pip install 'adaspec[hf]'``; nothing imports this module unless asked for.

Checkpoints load from a local directory only (``config.json`` and safetensors weights,
``local_files_only``): a missing file is an error, never a download. The model's own layers
run unchanged (embeddings, RoPE and its scaling, grouped-query projections, MLPs, norms);
only attention is adaspec's, registered with transformers' attention interface as
``adaspec_kv_slots``. It keeps a static KV cache per layer, ``[num_kv_slots + 1, kv_heads,
context_limit, head_dim]``, writes each row's keys and values at its (KV slot, position)
before attending, and lets a row at position p read positions <= p of its own KV slot (and no
further back than the sliding window, where the config has one). So packed rows of many
requests verify in one forward, and a rejected suffix is overwritten before anything reads it,
as the protocols require.

Tested families: Llama (grouped-query attention) and GPT-2. Mistral and Qwen2 load through the
same path; any other ``model_type`` is refused naming it.
"""

import contextvars
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from adaspec.errors import ConfigError, InvalidRequest
from adaspec.models.checkpoint import checkpoint_identity
from adaspec.models.protocols import (
    ContextRows,
    MtpStep,
    PrefillOutput,
    TargetOutput,
    VerifyRows,
)

ATTENTION = "adaspec_kv_slots"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "gpt2")
_UNSUPPORTED_FIELDS = {
    # config field -> why adaspec's attention cannot honour it
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
}


@dataclass(slots=True)
class SlotCache:
    """Every layer's keys and values, per KV slot and position."""

    keys: list[Tensor]  # [num_kv_slots + 1, kv_heads, context_limit, head_dim] per layer
    values: list[Tensor]
    window: int | None  # sliding window: a row reads at most this many positions back


@dataclass(frozen=True, slots=True)
class _Rows:
    cache: SlotCache
    kv_slots: Tensor  # [N] (or [1]: every row in one KV slot, as a prefill)
    positions: Tensor  # [N]


_ROWS: contextvars.ContextVar[_Rows] = contextvars.ContextVar("adaspec_hf_rows")


def slot_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                   attention_mask: Tensor | None, scaling: float | None = None,
                   dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention call for the rows of the forward in progress: ``query [1, H,
    N, D]``, ``key`` and ``value [1, KVH, N, D]``; returns ``[1, N, H, D]``. The mask
    transformers built is not used: the KV slots and positions say what each row reads."""
    rows = _ROWS.get()
    layer: int = module.layer_idx  # type: ignore[assignment]
    keys, values = rows.cache.keys[layer], rows.cache.values[layer]
    count, heads, dim = query.shape[2], query.shape[1], query.shape[3]
    kv_heads, limit = keys.shape[1], keys.shape[2]
    slots = rows.kv_slots.expand(count) if rows.kv_slots.shape[0] == 1 else rows.kv_slots
    keys[slots, :, rows.positions] = key[0].transpose(0, 1).to(keys.dtype)
    values[slots, :, rows.positions] = value[0].transpose(0, 1).to(values.dtype)
    groups = heads // kv_heads
    q = query[0].transpose(0, 1).reshape(count, kv_heads, groups, dim)
    scale = dim ** -0.5 if scaling is None else scaling
    reach = torch.arange(limit, device=query.device)[None, :]
    visible = reach <= rows.positions[:, None]  # [N, L]
    if rows.cache.window is not None:
        visible &= reach > rows.positions[:, None] - rows.cache.window
    if rows.kv_slots.shape[0] == 1:  # one KV slot: read it once for every row
        held_k = keys.index_select(0, rows.kv_slots)[0]  # [KVH, L, D]
        held_v = values.index_select(0, rows.kv_slots)[0]
        scores = torch.einsum("nkgd,kld->nkgl", q, held_k) * scale
        weights = _softmax(scores, visible, q.dtype)
        out = torch.einsum("nkgl,kld->nkgd", weights, held_v)
    else:
        held_k = keys.index_select(0, slots)  # [N, KVH, L, D]
        held_v = values.index_select(0, slots)
        scores = torch.einsum("nkgd,nkld->nkgl", q, held_k) * scale
        weights = _softmax(scores, visible, q.dtype)
        out = torch.einsum("nkgl,nkld->nkgd", weights, held_v)
    return out.reshape(count, heads, dim)[None], None


def _softmax(scores: Tensor, visible: Tensor, dtype: torch.dtype) -> Tensor:
    masked = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return torch.softmax(masked.float(), dim=-1).to(dtype)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, slot_attention)
    # No mask: the KV slots and positions are the mask.
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)


def _require_transformers(flag: str, path: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(flag, path, "a Hugging Face checkpoint needs transformers: pip "
                          "install 'adaspec[hf]'") from None


@dataclass(frozen=True, slots=True)
class LoadedLM:
    model: Any  # a transformers PreTrainedModel with a causal LM head
    config: dict[str, Any]  # config.json as stored
    identity: str
    window: int | None


def read_config(path: str, flag: str) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory, checked for what adaspec can run."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(flag, path, "expected a directory holding a Hugging Face causal LM "
                          "(config.json and *.safetensors)")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(flag, path, "has no config.json; expected a Hugging Face causal "
                          "LM checkpoint directory") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(flag, path, f"config.json is unreadable: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(flag, path, "config.json is no JSON object")
    kind = config.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ConfigError(flag, path, f"model_type={kind!r}: expected one of "
                          f"{', '.join(SUPPORTED_TYPES)} (tested: llama, gpt2)")
    for field, what in _UNSUPPORTED_FIELDS.items():
        if config.get(field) is not None:
            raise ConfigError(flag, path, f"config field {field}={config[field]!r}: {what} "
                              "is not supported")
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise ConfigError(flag, path, "has no *.safetensors weights (other formats are not "
                          "loaded)")
    return config


def load_lm(path: str, *, flag: str, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> LoadedLM:
    """A causal LM from a local checkpoint directory, with adaspec's attention, in eval mode
    without gradients; refused in one line naming ``flag`` when it is not one."""
    _require_transformers(flag, path)
    config = read_config(path, flag)
    _register()
    from transformers import AutoModelForCausalLM

    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=ATTENTION,
            use_safetensors=True)
    except Exception as error:  # a damaged file: safetensors, torch and transformers errors
        raise ConfigError(flag, path, f"cannot be loaded: {_reason(error)}") from None
    model = model.to(device).eval().requires_grad_(False)
    window = None
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        window = int(config["sliding_window"])
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return LoadedLM(model=model, config=config, identity=checkpoint_identity(config, weights),
                    window=window)


class _CausalLM:
    """What the target and the drafter share: a loaded LM, its KV cache and one forward over
    (token, KV slot, position) rows."""

    def __init__(self, loaded: LoadedLM) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = self.model.config
        self.identity = loaded.identity
        self._base = self.model.base_model
        self._head = self.model.get_output_embeddings()
        self._cache: SlotCache | None = None
        self._num_kv_slots = 0

    @property
    def vocab_size(self) -> int:
        return int(self._head.weight.shape[0])

    @property
    def context_limit(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def num_kv_slots(self) -> int:
        return self._num_kv_slots

    @property
    def dtype(self) -> torch.dtype:
        return self._head.weight.dtype  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        return self._head.weight.device  # type: ignore[no-any-return]

    def allocate(self, num_kv_slots: int) -> None:
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (num_kv_slots + 1, kv_heads, self.context_limit, head_dim)
        layers = config.num_hidden_layers
        self._cache = SlotCache(
            keys=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(layers)],
            values=[torch.zeros(shape, dtype=self.dtype, device=self.device)
                    for _ in range(layers)],
            window=self.loaded.window)
        self._num_kv_slots = num_kv_slots

    def hidden(self, token_ids: Tensor, kv_slots: Tensor, positions: Tensor) -> Tensor:
        """``[N, hidden_size]`` final hidden states of the rows (a ``[1]`` ``kv_slots``: all
        in that KV slot)."""
        assert self._cache is not None, "allocate() runs before any forward"
        with _rows(_Rows(self._cache, kv_slots, positions)):
            out = self._base(input_ids=token_ids[None], position_ids=positions[None],
                             use_cache=False)
        return out.last_hidden_state[0]  # type: ignore[no-any-return]

    def logits(self, hidden: Tensor) -> Tensor:
        return self._head(hidden).float()  # type: ignore[no-any-return]


@contextmanager
def _rows(rows: _Rows) -> Iterator[None]:
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


class HfTarget(_CausalLM):
    """A Hugging Face causal LM as the runtime's target."""

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def prefill(self, prompts: list[Tensor], kv_slots: Tensor) -> PrefillOutput:
        longest = max(len(prompt) for prompt in prompts)
        hidden = torch.zeros(len(prompts), longest, self.hidden_size, dtype=self.dtype,
                             device=self.device)
        lasts = []
        for index, prompt in enumerate(prompts):  # one KV slot at a time: T x L scores
            prompt = prompt.to(self.device)
            positions = torch.arange(len(prompt), device=self.device)
            rows = self.hidden(prompt, kv_slots[index:index + 1], positions)
            hidden[index, :len(prompt)] = rows
            lasts.append(rows[-1])
        last = torch.stack(lasts)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=self.device)
        return PrefillOutput(last=TargetOutput(logits=self.logits(last), hidden=last),
                             hidden=hidden, lengths=lengths)

    def verify(self, rows: VerifyRows) -> TargetOutput:
        scratch = torch.full_like(rows.row_reqs, self._num_kv_slots)
        slots = torch.where(rows.row_valid, rows.req_kv_slots.index_select(0, rows.row_reqs),
                            scratch)
        hidden = self.hidden(rows.token_ids, slots, rows.positions)
        return TargetOutput(logits=self.logits(hidden), hidden=hidden)


class HfDrafter(_CausalLM):
    """A causal LM drafting one token per sequential step (an MTP-style drafter) from its own
    KV context of the committed tokens; it shares the target's tokenizer. Its confidence is
    the drafted token's probability, ``exp(selected_logit - logsumexp(logits))``; the
    target's hidden state passes through it unread."""

    def publish(self, rows: ContextRows) -> None:
        self.hidden(rows.token_ids, rows.kv_slots, rows.positions)

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        logits = self.logits(self.hidden(token_ids, kv_slots, positions + 1))
        best = logits.max(dim=-1)
        probs = torch.exp(best.values - torch.logsumexp(logits, dim=-1))
        return MtpStep(hidden=hidden, token_ids=best.indices, probs=probs, logits=logits)


@dataclass(frozen=True, slots=True)
class HfModels:
    """A ``ModelSet`` of Hugging Face checkpoints: a target and an MTP-style drafter."""

    target: HfTarget
    mtp: HfDrafter | None
    dspark: None = None


def load_hf_models(model: str, draft_model: str | None = None, *,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   drafter: bool = True) -> HfModels:
    """The target of ``--model`` and the drafter of ``--draft_model`` (the target's own
    checkpoint, loaded a second time with a KV cache of its own, when None); no drafter
    without ``drafter`` (a launch that does not speculate)."""
    target = HfTarget(load_lm(model, flag="--model", device=device, dtype=dtype))
    if not drafter:
        return HfModels(target=target, mtp=None)
    mtp = HfDrafter(load_lm(draft_model or model, flag="--draft_model"
                            if draft_model else "--model", device=device, dtype=dtype))
    if mtp.vocab_size != target.vocab_size:
        raise ConfigError("--draft_model", draft_model, f"a vocabulary of {mtp.vocab_size} "
                          f"tokens; expected the target's {target.vocab_size} (one tokenizer)")
    if mtp.context_limit < target.context_limit:
        raise ConfigError("--draft_model", draft_model, f"a context of {mtp.context_limit} "
                          f"positions; expected at least the target's {target.context_limit}")
    return HfModels(target=target, mtp=mtp)


def hf_tokenizer(path: str, flag: str = "--model") -> Any:
    """The checkpoint's tokenizer (local files only)."""
    _require_transformers(flag, path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # missing or damaged tokenizer files
        raise ConfigError(flag, path, f"has no loadable tokenizer: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    """A library's error message on one line, at most 300 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class HfDetokenizer:
    """Text of growing token ids by decoding them all and sending what is new; a trailing
    U+FFFD (a character whose tokens have not all come) is held back until they do."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = 0

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        text = self._tokenizer.decode(self._ids)
        end = len(text.rstrip("\ufffd"))
        piece, self._sent = text[self._sent:end], max(self._sent, end)
        return piece  # type: ignore[no-any-return]

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        piece, self._sent = text[self._sent:], len(text)
        return piece  # type: ignore[no-any-return]


class HfTokenizer:
    """A checkpoint's tokenizer as adaspec's ``Tokenizer`` (``adaspec.models.tokenizer``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        """The text's token ids; text the vocabulary cannot hold (it would read as the
        unknown token) is refused, never substituted."""
        ids = list(self.tokenizer.encode(text))
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        if unknown is not None and unknown in ids and \
                str(self.tokenizer.unk_token) not in text:
            raise InvalidRequest("prompt", text, "holds characters the checkpoint's tokenizer "
                                 f"cannot encode (they would read as {self.tokenizer.unk_token})")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    def detokenizer(self) -> HfDetokenizer:
        return HfDetokenizer(self.tokenizer)
