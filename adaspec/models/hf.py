"""Hugging Face causal language models through the protocols: a ``TargetModel`` and an
MTP-style sequential drafter (a second, smaller causal LM, or the target's own checkpoint).

Optional: ``pip install 'adaspec[hf]'``; nothing imports this module unless asked for.

Checkpoints load from a local directory only (``config.json`` and safetensors weights,
``local_files_only``): a missing file is an error, never a download. A checkpoint is refused in
one line naming its flag, rather than run, when a file in it is not a regular file (a FIFO
would hang the load), when its config does not validate, when its weights lack a tensor the
config needs (transformers would fill it with random values), hold one the config has no place
for or one of another shape, store a floating weight as integers (transformers would cast it),
when a weight is NaN or infinite, when a *.safetensors file is one transformers would not read
(a shard without its index), and when its tokenizer holds more tokens than the model's
vocabulary. A KV cache larger than the device's memory is refused the same way, when it is
allocated. The model's own layers run unchanged (embeddings, RoPE and its scaling,
grouped-query projections, MLPs, norms); only attention is adaspec's, registered with
transformers' attention interface as ``adaspec_kv_slots``. It keeps a static KV cache per
layer, ``[num_kv_slots + 1, kv_heads, context_limit, head_dim]``, writes each row's keys and
values at its (KV slot, position) before attending, and lets a row at position p read positions
<= p of its own KV slot (and no further back than the sliding window transformers gives its
layer, if any). So packed rows of many requests verify in one forward, and a rejected suffix is
overwritten before anything reads it, as the protocols require.

Tested families: Llama (grouped-query attention) and GPT-2. Mistral and Qwen2 load through the
same path (tested for greedy output with sliding windows); any other ``model_type`` is refused
naming it.
"""

import contextlib
import contextvars
import functools
import itertools
import json
import math
import os
import re
import stat
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor

from adaspec.config.files import json_fault
from adaspec.config.paths import NotRegularFile, open_regular
from adaspec.config.requests import MAX_STOP_TOKENS, is_neutral
from adaspec.errors import ConfigError, InvalidRequest, show_value
from adaspec.models.checkpoint import checkpoint_identity
from adaspec.models.layers import beyond_memory
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
    # transformers' generate trims its cache to the chunk while the attention masks nothing:
    # no single rule a verify of several rows could follow.
    "attention_chunk_size": "chunked attention",
}
_WINDOWED_TYPES = ("mistral", "qwen2")
"""The model types whose attention applies ``sliding_window``; a Llama or GPT-2 layer attends
every earlier position whatever the config says."""


@dataclass(slots=True)
class SlotCache:
    """Every layer's keys and values, per KV slot and position."""

    keys: list[Tensor]  # [num_kv_slots + 1, kv_heads, context_limit, head_dim] per layer
    values: list[Tensor]


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
    transformers built is not used: the KV slots and positions say what each row reads, and
    ``sliding_window``, which transformers passes per layer as its own masks apply it (a
    Mistral layer: the config's window; a Qwen2 layer: the window where ``layer_types`` says
    ``sliding_attention``, else none; a Llama or GPT-2 layer: none), how far back."""
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
    window = kwargs.get("sliding_window")
    if window is not None:  # transformers' sliding_window_overlay: kv > q - window
        visible &= reach > rows.positions[:, None] - int(window)
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
    flag: str  # the launch flag that named the checkpoint, for errors found after the load
    path: str


_MAX_JSON_BYTES = 16 * 2**20
"""A config.json or generation_config.json is a few KB; a longer one is no config (and a
special file that passes for a regular one may read without end)."""


def _read_json(path: str, flag: str, name: str) -> Any:
    """The JSON value of the checkpoint's file ``name``, read only when it is a regular file
    (a FIFO would block the read forever); ``FileNotFoundError`` when it is missing, any other
    problem refused in one line naming ``flag``."""
    try:
        with open_regular(os.path.join(path, name)) as file:
            data = file.read(_MAX_JSON_BYTES + 1)
    except NotRegularFile as error:
        raise ConfigError(flag, path, f"{name} is {error.strerror}") from None
    except FileNotFoundError:  # the caller says whether the file may be missing
        raise
    except OSError as error:
        raise ConfigError(flag, path, f"{name} is unreadable: {_reason(error)}") from None
    if len(data) > _MAX_JSON_BYTES:
        raise ConfigError(flag, path, f"{name} is over {_MAX_JSON_BYTES // 2**20} MiB; "
                          "expected a config of a few KB")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
    except _NonFinite as error:
        raise ConfigError(flag, path, f"{name} holds {error}; expected finite numbers "
                          "(strict JSON)") from None
    except _DuplicateKey as error:
        raise ConfigError(flag, path, f"{name} gives the key {error} twice; expected each key "
                          "once (transformers would keep the last silently)") from None
    except UnicodeDecodeError as error:
        raise ConfigError(flag, path, f"{name} is unreadable: {_reason(error)}") from None
    except ValueError as error:  # json's words, less its advice to a programmer
        reason = _reason(ValueError(json_fault(error)))
        raise ConfigError(flag, path, f"{name} is unreadable: {reason}") from None


class _NonFinite(Exception):
    """NaN or Infinity in a checkpoint's JSON: no config value means that."""


def _no_constant(name: str) -> Any:
    raise _NonFinite(name)


class _DuplicateKey(Exception):
    """A key given twice in one object of a checkpoint's JSON."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(json.dumps(key))
        result[key] = value
    return result


def _refuse_special_files(folder: Path, flag: str, path: str) -> None:
    """Every entry of the checkpoint directory is a regular file or a directory (links
    followed): transformers opens the files it wants by name, so a FIFO among them (a
    tokenizer's file, a weights shard) would hang it; anything else is refused first."""
    for name in sorted(os.listdir(folder)):
        try:
            mode = os.stat(folder / name).st_mode
        except OSError:  # a dangling link: transformers names it if it needs the file
            continue
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            continue
        try:  # open_regular names the kind as every other reader of the project does
            with open_regular(str(folder / name)):
                pass
        except NotRegularFile as error:
            raise ConfigError(flag, path, f"{name} is {error.strerror}") from None
        except OSError:  # it cannot be opened (a socket): transformers fails on it, not waits
            continue


def read_config(path: str, flag: str) -> dict[str, Any]:
    """``config.json`` of a checkpoint directory, checked for what adaspec can run and then
    validated by transformers' own config class (field types, heads dividing the hidden size),
    before anything reads another file of the directory,
    so a bad config is blamed on config.json and not on whatever loads after it."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(flag, path, "expected a directory holding a Hugging Face causal LM "
                          "(config.json and *.safetensors)")
    try:
        config = _read_json(path, flag, "config.json")
    except FileNotFoundError:
        raise ConfigError(flag, path, "has no config.json; expected a Hugging Face causal "
                          "LM checkpoint directory") from None
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
    _check_window(config, flag, path)
    _check_rope(config, flag, path)
    _check_dtype(config, flag, path)
    _check_heads(config, flag, path)
    _check_padding(config, flag, path)
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise ConfigError(flag, path, "has no *.safetensors weights (other formats are not "
                          "loaded)")
    _refuse_special_files(folder, flag, path)
    _validate_config(path, flag)
    _refuse_unread_weight_files(folder, flag, path)
    return config


_FORWARD_DEPENDENT_ROPE = ("longrope",)
"""RoPE types whose frequencies follow the longest position of each forward: a verify of
several rows would encode a row otherwise than the token-by-token decode transformers runs,
so greedy output would not be the checkpoint's."""


def _check_rope(config: dict[str, Any], flag: str, path: str) -> None:
    for field in ("rope_parameters", "rope_scaling"):
        if not isinstance(config.get(field), dict | None):  # transformers names its types
            raise ConfigError(flag, path, f"config.json {field}={config[field]!r}: expected "
                              "an object (rope_type and its settings), or null")
        for rope in _rope_settings(config.get(field)):
            kind = rope.get("rope_type", rope.get("type"))
            if kind in _FORWARD_DEPENDENT_ROPE:
                raise ConfigError(flag, path, f"config.json {field} rope_type={kind}: its "
                                  "frequencies follow the longest position of each forward, "
                                  "so verifying several tokens at once would not decode as "
                                  "transformers does; expected another rope type")


def _rope_settings(value: object) -> list[dict[str, Any]]:
    """The RoPE settings of a config field: one dict, or one per layer type."""
    if not isinstance(value, dict):
        return []
    if "rope_type" in value or "type" in value:
        return [value]
    return [inner for inner in value.values() if isinstance(inner, dict)]


def _check_dtype(config: dict[str, Any], flag: str, path: str) -> None:
    """transformers refuses to build a model in a dtype that is not floating, and names no
    field for a name torch lacks."""
    for field in ("dtype", "torch_dtype"):
        name = config.get(field)
        if not isinstance(name, str) or name == "auto":
            continue
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(flag, path, f"config.json {field}={name}: expected a floating "
                              "dtype (float32, bfloat16, float16, ...)")


_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head")
"""Head counts of the supported configs; transformers divides by them unchecked."""


def _check_heads(config: dict[str, Any], flag: str, path: str) -> None:
    for field in _HEAD_FIELDS:
        heads = config.get(field)
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int)
                                  or heads < 1):
            raise ConfigError(flag, path, f"config.json {field}={heads!r}: expected a positive "
                              "integer")


_PADDED_EMBEDDINGS = ("llama", "mistral", "qwen2")
"""Model types whose token embedding takes ``pad_token_id`` as its padding index."""


def _check_padding(config: dict[str, Any], flag: str, path: str) -> None:
    """torch refuses a padding index outside the embedding without naming the field."""
    pad, vocab = config.get("pad_token_id"), config.get("vocab_size")
    if (config.get("model_type") not in _PADDED_EMBEDDINGS or not isinstance(pad, int)
            or isinstance(pad, bool) or not isinstance(vocab, int) or isinstance(vocab, bool)):
        return
    if not -vocab <= pad < vocab:
        raise ConfigError(flag, path, f"config.json pad_token_id {pad} is outside the "
                          f"vocabulary of {vocab} tokens; expected an id in 0..{vocab - 1}, "
                          "or null")


def _check_window(config: dict[str, Any], flag: str, path: str) -> None:
    """A sliding window in use must be a positive number of positions (a window of 0 would
    hide every key, and the model would emit token 0 for ever; transformers cannot run it)
    on a model type whose attention applies it."""
    window = config.get("sliding_window")
    if config.get("model_type") == "qwen2":
        _check_qwen2_layer_types(config, flag, path)
    # Only Qwen2 switches its window with use_sliding_window (off when absent), and then only
    # on its sliding_attention layers; Mistral applies the window whatever that field says.
    if window is None or (config.get("model_type") == "qwen2"
                          and not _qwen2_slides(config, path)):
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(flag, path, f"config.json sliding_window={window!r}: expected a "
                          "positive integer, or null for no window")
    kind = config.get("model_type")
    if kind not in _WINDOWED_TYPES:
        # transformers' generate keeps only the window's keys in its cache while the layer's
        # attention masks none, so its decode and its forward disagree: neither is the model.
        raise ConfigError(flag, path, f"config.json sliding_window={window}: a {kind} layer's "
                          "attention applies no window (transformers' generate only trims "
                          "its cache to it); expected null, or a model_type whose attention "
                          f"applies it ({', '.join(_WINDOWED_TYPES)})")


def _check_qwen2_layer_types(config: dict[str, Any], flag: str, path: str) -> None:
    """Layers a Qwen2 config names ``sliding_attention`` need a window: transformers drops
    ``sliding_window`` when ``use_sliding_window`` is off, and its masks then fail at the
    first forward, so the checkpoint is refused here, by its fields, before it loads."""
    types = config.get("layer_types")
    if not isinstance(types, list) or "sliding_attention" not in types:
        return
    use, window = config.get("use_sliding_window", False), config.get("sliding_window")
    if use and window is not None:  # truthy, as transformers reads it
        return
    raise ConfigError(flag, path, "config.json layer_types names sliding_attention layers "
                      f"while use_sliding_window={json.dumps(use)} and sliding_window="
                      f"{json.dumps(window)} give them no window; expected "
                      "use_sliding_window=true with a sliding_window, or no "
                      "sliding_attention layer")


def _qwen2_slides(config: dict[str, Any], path: str) -> bool:
    """Whether some layer of a Qwen2 config reads through its window: the per-layer types
    transformers derives (from use_sliding_window and max_window_layers unless given)."""
    if not config.get("use_sliding_window", False):
        return False
    try:
        from transformers import AutoConfig

        types = AutoConfig.from_pretrained(path, local_files_only=True).layer_types or ()
    except Exception:  # transformers cannot read it: its own check names the fault later
        return False
    return "sliding_attention" in types


INDEX = "model.safetensors.index.json"


def _weight_files(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))


def _shard_files(folder: Path) -> list[str]:
    """The files named as shards of the model (``model-*.safetensors``); others, such as a
    ``consolidated.safetensors`` beside them, are files transformers never reads."""
    return [name for name in _weight_files(folder) if name.startswith("model-")]


def _refuse_unread_weight_files(folder: Path, flag: str, path: str) -> None:
    """transformers reads model.safetensors alone, or the shards model.safetensors.index.json
    names: a shard of the model left without its index, or not in it, would be dropped
    without a word, so it is refused."""
    shards = _shard_files(folder)
    try:
        index = _read_json(path, flag, INDEX)
    except FileNotFoundError:
        if shards:
            raise ConfigError(flag, path, f"holds the shards {_first(shards)} but no {INDEX}; "
                              "expected model.safetensors alone, or shards an index "
                              "names") from None
        return
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ConfigError(flag, path, f"{INDEX} has no weight_map object; expected the "
                          "index of the *.safetensors shards")
    for weight, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ConfigError(flag, path, f"{INDEX} weight_map[{json.dumps(weight)}]="
                              f"{show_value(shard)}; expected the file name of the shard that "
                              "holds the weight")
    named = set(weight_map.values())
    unnamed = [name for name in shards if name not in named]
    if unnamed:
        raise ConfigError(flag, path, f"{INDEX} does not name {_first(unnamed)}; expected "
                          "every model-*.safetensors shard to be one it names (no other is "
                          "read)")


def _validate_config(path: str, flag: str) -> None:
    _require_transformers(flag, path)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # transformers' validation errors have no common base
        raise ConfigError(flag, path, f"config.json cannot be loaded: {_reason(error)}") \
            from None


def load_lm(path: str, *, flag: str, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> LoadedLM:
    """A causal LM from a local checkpoint directory, with adaspec's attention, in eval mode
    without gradients; refused in one line naming ``flag`` when it is not one."""
    _require_transformers(flag, path)
    config = read_config(path, flag)
    _register()
    model = _from_pretrained(path, flag, dtype)
    model = model.to(device).eval().requires_grad_(False)
    _refuse_non_finite(model, flag, path)
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return LoadedLM(model=model, config=config, identity=checkpoint_identity(config, weights),
                    flag=flag, path=path)


def _from_pretrained(path: str, flag: str, dtype: torch.dtype) -> Any:
    """The model with every weight the config needs taken from the checkpoint: transformers
    fills a missing or reshaped weight with random values and drops an unexpected one, which
    would decode garbage, so its loading report must be empty. Weights transformers ties (a
    GPT-2 head to its embeddings) or ignores by design are not in the report."""
    from transformers import AutoModelForCausalLM

    try:  # ignore_mismatched_sizes: a reshaped weight is reported with its shapes, not raised
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, attn_implementation=ATTENTION,
            use_safetensors=True, output_loading_info=True, ignore_mismatched_sizes=True)
    except KeyError as error:  # transformers looks a config value up: name where it stands
        raise ConfigError(flag, path, f"cannot be loaded: "
                          f"{_unknown_config_value(path, error)}") from None
    except Exception as error:  # a damaged file: safetensors, torch and transformers errors
        raise ConfigError(flag, path, f"cannot be loaded: {_reason(error)}") from None
    model, info = loaded  # output_loading_info: the model and transformers' loading report
    _refuse_loading_report(info, flag, path)
    _refuse_integer_weights(model, flag, path)
    return model


def _refuse_integer_weights(model: Any, flag: str, path: str) -> None:
    """Every weight stored for a floating parameter or buffer is stored floating (F32, BF16,
    F8_E4M3, ...): transformers casts integers to the load dtype without a word, so a
    damaged (or quantized) tensor would run as weights it is not. Stored names are the
    model's, or lack its base model's prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``)."""
    from safetensors import safe_open

    floating = {name for name, tensor in model.state_dict().items()
                if tensor.is_floating_point()}
    prefix = f"{model.base_model_prefix}."
    for file in _weight_files(Path(path)):
        with safe_open(os.path.join(path, file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                dtype = str(handle.get_slice(name).get_dtype())
                if dtype.startswith(("F", "BF")) or not {name, prefix + name} & floating:
                    continue
                raise ConfigError(flag, path, f"weight {name} is stored as {dtype} in {file}; "
                                  "expected a floating dtype (F32, F16, BF16, ...) for a "
                                  "floating parameter")


def _refuse_loading_report(info: dict[str, Any], flag: str, path: str) -> None:
    """Refuse what transformers' loading report lists, naming the first few weights."""
    weights = _weights_name(path)
    ending = "s" if weights.endswith(".safetensors") else ""  # one file lacks, files lack
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(flag, path, f"{weights} lack{ending} {_weights(len(missing))} the "
                          f"config needs: {_first(missing)}")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:  # a config of fewer layers than the weights, say: a different model
        raise ConfigError(flag, path, f"{weights} hold{ending} {_weights(len(unexpected))} "
                          f"the config has no place for: {_first(unexpected)}")
    reshaped = sorted(f"{name} {list(given)} (config: {list(wanted)})"
                      for name, given, wanted in info.get("mismatched_keys") or ())
    if reshaped:
        raise ConfigError(flag, path, f"{weights} hold{ending} {_weights(len(reshaped))} of "
                          f"another shape than the config gives: {_first(reshaped)}")
    if info.get("error_msgs"):
        raise ConfigError(flag, path, f"cannot be loaded: {_reason(info['error_msgs'][0])}")


def _weights_name(path: str) -> str:
    """The weights as a message names them: the file when there is one, else all of them."""
    files = [name for name in os.listdir(path) if name.endswith(".safetensors")]
    return files[0] if len(files) == 1 else "the *.safetensors files"


def _weights(count: int) -> str:
    return f"{count} weight" if count == 1 else f"{count} weights"


def _first(names: Sequence[str], shown: int = 3) -> str:
    """The first few names of a report, so the message stays one short line."""
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _refuse_non_finite(model: Any, flag: str, path: str) -> None:
    """Every floating parameter and buffer is finite: a NaN or infinite weight makes every
    logit NaN, and decoding reads them as token 0 without an error. Checked after the move to
    the dtype they run in, so a value that dtype cannot hold (inf in float16) is caught too."""
    tensors: Iterable[tuple[str, Tensor]] = itertools.chain(model.named_parameters(),
                                                            model.named_buffers())
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            what = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
            raise ConfigError(flag, path, f"weight {name} holds {what} values; expected "
                              "finite weights")


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
        """The KV cache of ``num_kv_slots + 1`` KV slots of ``context_limit`` positions each.
        One the device cannot hold (a config's max_position_embeddings of 10**12, say) is
        refused in one line naming the checkpoint's flag and the bytes it needs: before
        allocating when they exceed the device's memory, and when the allocation fails."""
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (num_kv_slots + 1, kv_heads, self.context_limit, head_dim)
        layers = config.num_hidden_layers
        needed = 2 * layers * math.prod(shape) * self.dtype.itemsize  # keys and values
        beyond = beyond_memory(needed, self.device)
        if beyond is not None:
            self._refuse_kv_cache(num_kv_slots, needed, beyond)
        # A reallocation does not hold the old cache meanwhile (nor keep it, if it fails).
        self._cache, self._num_kv_slots = None, 0
        try:
            self._cache = SlotCache(
                keys=[torch.zeros(shape, dtype=self.dtype, device=self.device)
                      for _ in range(layers)],
                values=[torch.zeros(shape, dtype=self.dtype, device=self.device)
                        for _ in range(layers)])
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            self._refuse_kv_cache(num_kv_slots, needed, f"which {self.device.type} memory "
                                  f"cannot hold: {_reason(error)}")
        self._num_kv_slots = num_kv_slots

    def _refuse_kv_cache(self, num_kv_slots: int, needed: int, why: str) -> NoReturn:
        # GPT-2's config.json names the context length n_positions
        field = "n_positions" if self.config.model_type == "gpt2" else "max_position_embeddings"
        raise ConfigError(self.loaded.flag, self.loaded.path, f"config.json {field}="
                          f"{self.context_limit} needs a KV cache of {needed} bytes for "
                          f"{num_kv_slots + 1} KV slots, {why}; expected a context length "
                          "(or a --max_seqs_per_batch) whose KV cache fits the device")

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

    with contextlib.suppress(FileNotFoundError):  # transformers reads it unchecked
        if not isinstance(_read_json(path, flag, "tokenizer_config.json"), dict):
            raise ConfigError(flag, path, "tokenizer_config.json is no JSON object")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # missing or damaged tokenizer files
        raise ConfigError(flag, path, f"has no loadable tokenizer: {_reason(error)}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Files of which one marks a checkpoint directory as shipping its own tokenizer."""


def check_draft_tokenizer(path: str, target: Any) -> None:
    """A draft checkpoint that ships a tokenizer must share the target's token map: its
    drafts are token ids the target verifies, so a token numbered otherwise would be drafted
    as another (lossless still, but every such draft is wasted). One without tokenizer files
    is taken as drafting in the target's."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return
    ours, theirs = target.get_vocab(), hf_tokenizer(path, "--draft_model").get_vocab()
    if ours == theirs:
        return
    for token, index in sorted(ours.items(), key=lambda item: item[1]):
        if theirs.get(token) != index:
            other = theirs.get(token)
            given = "no id" if other is None else f"the id {other}"
            raise ConfigError("--draft_model", path, f"its tokenizer gives the token "
                              f"{json.dumps(token)} {given}, the target's the id {index}; "
                              "expected the target's tokenizer")
    # Every token of the target's has its id there: the draft's holds more.
    extra = min((index, token) for token, index in theirs.items() if token not in ours)
    raise ConfigError("--draft_model", path, f"its tokenizer holds the token "
                      f"{json.dumps(extra[1])} (id {extra[0]}), which the target's does not; "
                      "expected the target's tokenizer")


def checkpoint_tokenizer(path: str, config: dict[str, Any],
                         flag: str = "--model") -> "HfTokenizer":
    """The tokenizer of a checkpoint directory whose ``config`` ``read_config`` gave, with
    the checkpoint's end-of-sequence token ids. A tokenizer of more tokens than the model's
    vocabulary is refused: its ids past the vocabulary have no embedding, so every prompt
    holding one would be refused as if the prompt were at fault. One of fewer tokens is a
    padded vocabulary, as many checkpoints have, and loads; so does a special token its class
    adds past the vocabulary (Qwen2's pad), as in transformers: text never encodes to it
    unless it spells that token, and such a prompt is refused on its own."""
    eos = eos_token_ids(path, config, flag)
    tokenizer = hf_tokenizer(path, flag)
    vocab = _vocab_size(path, config)
    special = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    beyond = sorted(index for index in tokenizer.get_vocab().values()
                    if index >= vocab and index not in special)
    if beyond:
        size = len(tokenizer)
        held = (f"holds {size} tokens, more than" if size > vocab
                else f"gives a token the id {beyond[0]}, past")
        raise ConfigError(flag, path, f"its tokenizer {held} config.json vocab_size={vocab}; "
                          "expected a tokenizer of at most vocab_size tokens (the model's own)")
    return HfTokenizer(tokenizer, eos, vocab)


def eos_token_ids(path: str, config: dict[str, Any], flag: str = "--model") -> tuple[int, ...]:
    """The checkpoint's end-of-sequence token ids, sorted, each once, read as transformers'
    ``generate`` reads them: ``eos_token_id`` of generation_config.json where that file
    exists (absent or null there: none), else of ``config`` (its config.json); a token id or
    a list of them. An id outside the vocabulary, a value that is no id, or more ids than a
    request may stop at are refused: a stop on them would never come, come on another
    token, or refuse every request. config.json's ids are held to the same range even where
    generation_config.json overrides them. A logits processor that file turns on is refused
    (``refuse_unapplied_processors``)."""
    vocab = _vocab_size(path, config)
    try:
        fields, name = _read_json(path, flag, "generation_config.json"), "generation_config.json"
    except FileNotFoundError:  # transformers then derives its generation config from config
        fields, name = config, "config.json"
    if not isinstance(fields, dict):
        raise ConfigError(flag, path, f"{name} is no JSON object")
    if fields is not config:
        _eos_field(config, "config.json", vocab, flag, path)
    refuse_unapplied_processors(fields, name, flag, path)
    found = _eos_field(fields, name, vocab, flag, path)
    if len(found) > MAX_STOP_TOKENS:
        raise ConfigError(flag, path, f"{name} eos_token_id lists {len(found)} ids; expected "
                          f"at most {MAX_STOP_TOKENS} (a request stops at no more tokens)")
    return tuple(sorted(found))


_NEUTRAL_PROCESSORS: dict[str, tuple[object, ...]] = {
    # transformers compares the counts below as numbers: a float 1.0 is its 1. The last
    # neutral value is the one a refusal names.
    "repetition_penalty": (1, 1.0),
    "no_repeat_ngram_size": (0.0, 0),
    # A decoder-only generate passes the prompt as the "encoder" input: these apply too.
    "encoder_repetition_penalty": (1, 1.0),
    "encoder_no_repeat_ngram_size": (0.0, 0),
    "min_length": (0.0, 0),
    "min_new_tokens": (0.0, 0),
    "num_beams": (1.0, 1),
    "num_beam_groups": (1.0, 1),
    "diversity_penalty": (0, 0.0),
    "guidance_scale": (1, 1.0),
    "penalty_alpha": (0, 0.0),
    "bad_words_ids": ([],),
    "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],),
    "sequence_bias": ({}, []),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "exponential_decay_length_penalty": (),
    "dola_layers": (),
    "watermarking_config": (),
    # Need the tokenizer in generate: with it they change the output, without it they raise.
    "stop_strings": ([],),
    "token_healing": (False,),
}
"""Generation settings that change what transformers' greedy ``generate`` emits (logits
processors, beam or contrastive search), with the values that leave it unchanged (null is
always one). adaspec applies none of them."""


def refuse_unapplied_processors(fields: dict[str, Any], name: str, flag: str,
                                path: str) -> None:
    """Refuse a generation config that turns on a processor adaspec does not apply: the
    checkpoint's own output (transformers') would differ from adaspec's without a word."""
    for key, neutral in _NEUTRAL_PROCESSORS.items():
        value = fields.get(key)
        if value is None or is_neutral(value, neutral):
            continue
        unset = " or ".join(["unset", *(json.dumps(n) for n in neutral[-1:])])
        # As the file spells it: a string "1.5" is no number 1.5.
        raise ConfigError(flag, path, f"{name} {key}={show_value(json.dumps(value))}: "
                          "transformers' "
                          "generate applies it and adaspec does not, so their output would "
                          f"differ; expected {unset} (edit the file to run without it)")


def _vocab_size(path: str, config: dict[str, Any]) -> int:
    """The model's vocabulary: config.json's ``vocab_size``, or the config class's default
    when the file leaves it out."""
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)


def _eos_field(fields: dict[str, Any], name: str, vocab: int, flag: str,
               path: str) -> set[int]:
    value = fields.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise ConfigError(flag, path, f"{name} eos_token_id={value!r}: expected a token "
                              "id or a list of token ids")
        if not 0 <= token < vocab:
            raise ConfigError(flag, path, f"{name} eos_token_id {token} is outside the "
                              f"vocabulary of {vocab} tokens")
    return set(ids)


def _unknown_config_value(path: str, error: KeyError) -> str:
    """A value transformers found in no table of its own (an activation, a rope type), named
    by the config.json keys that hold it."""
    value = error.args[0] if error.args else None
    try:
        config = json.loads(Path(path, "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    keys = [key for key, held in _config_items(config) if held == value]
    if not isinstance(value, str) or not value or not keys:  # nothing that names one key
        return f"KeyError: {_reason(error)}"
    shown = value if len(value) <= 40 else value[:37] + "..."
    return _reason(ValueError(f"config.json {', '.join(keys)}={shown!r}: not a value this "
                              "transformers knows"))


def _config_items(config: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(config, dict):
        for key, value in config.items():
            yield from _config_items(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], config


def _reason(error: BaseException) -> str:
    """A library's error message on one line, at most 300 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of a completion's, so that a decoder's rule for the first token
of a text (SentencePiece strips its leading space) applies to the prompt, not the completion."""

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte-fallback token's spelling (Llama 2, Mistral): a run of them decodes as one group."""


class HfDetokenizer:
    """Text of growing token ids, decoded a window at a time: the window opens at the ids
    whose text was sent last (the prompt's last tokens at first), so a decoder's rule for a
    text's first token (SentencePiece strips its leading space) applies to them, and a feed
    costs the window, not the whole completion. What may still change is held back: the
    text of a trailing run of byte-fallback tokens (``byte_ids``), which decode as one group
    (an invalid group turns every byte into U+FFFD, a character read earlier included), and
    text that ends in U+FFFD (a character whose tokens have not all come). The
    ``end_ids`` (end-of-sequence tokens, which end a completion) add no text: as in
    transformers and vLLM, a completion reads without its ``</s>``."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 byte_ids: frozenset[int] = frozenset(),
                 end_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._byte_ids = byte_ids
        self._end_ids = end_ids
        self._ids = _context(prompt_ids, byte_ids)
        self._start = 0  # the window's first id
        self._read = len(self._ids)  # the ids whose text is sent end here

    def _decode(self, ids: list[int]) -> str:
        # No clean-up: it joins a space to the next token's punctuation, which would take
        # back a space already sent.
        return str(self._tokenizer.decode(ids, clean_up_tokenization_spaces=False))

    def _new_text(self, end: int) -> str:
        """The text the ids from the last read up to ``end`` add."""
        if end <= self._read:
            return ""
        read = self._decode(self._ids[self._start:self._read])
        text = self._decode(self._ids[self._start:end])
        if text.startswith(read):
            return text[len(read):]
        # The prompt ended inside a character that the completion's first tokens finish.
        return text[len(os.path.commonprefix([text, read])):]

    def _settled(self) -> int:
        """Where the ids end, less a trailing run of byte tokens."""
        end = len(self._ids)
        while end > self._read and self._ids[end - 1] in self._byte_ids:
            end -= 1
        return end

    def _advance(self, end: int) -> None:
        self._start, self._read = self._read, end

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids if t not in self._end_ids)
        end = self._settled()
        piece = self._new_text(end)
        if not piece or piece.endswith("\ufffd"):
            return ""
        self._advance(end)
        return piece

    def flush(self) -> str:
        piece = self.pending()
        self._advance(len(self._ids))
        return piece

    def pending(self) -> str:
        return self._new_text(len(self._ids))


def _context(prompt_ids: Sequence[int], byte_ids: frozenset[int]) -> list[int]:
    """The prompt's last tokens up to its last token that is no byte token: a run of byte
    tokens decodes as one group, so the prompt's closing run would join the completion's
    opening one (and read as U+FFFD with it were that invalid)."""
    ids = [int(t) for t in prompt_ids]
    end = len(ids)
    while end > 0 and ids[end - 1] in byte_ids:
        end -= 1
    if end == 0:  # byte tokens only: still a text before the completion's first token
        return ids[-PROMPT_CONTEXT_TOKENS:]
    return ids[max(0, end - PROMPT_CONTEXT_TOKENS):end]


def _comparable(text: str) -> str:
    """Text as NFKC, without white space or SentencePiece's space mark."""
    return NOT_COMPARED.sub("", unicodedata.normalize("NFKC", text))


NOT_COMPARED = re.compile(r"[\s\u2581]+")


class HfTokenizer:
    """A checkpoint's tokenizer as adaspec's ``Tokenizer`` (``adaspec.models.tokenizer``);
    ``eos_token_ids`` are the checkpoint's end-of-sequence token ids, as the function
    ``eos_token_ids`` reads them (``checkpoint_tokenizer`` passes them); ``vocab_size``
    the model's vocabulary, which a special token the tokenizer adds may lie past."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] = (),
                 vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """The text's token ids; text the vocabulary cannot hold (it would read as the
        unknown token, or be dropped) is refused, never substituted."""
        ids = list(self.tokenizer.encode(text))
        # The text's own tokens, without those the tokenizer adds (a BOS that may also be
        # its unknown token, as GPT-2's one special token is).
        own = list(self.tokenizer.encode(text, add_special_tokens=False))
        unknown, spelled = self._unknown
        # Each unknown id must be the unknown token spelled out: one more is a character the
        # vocabulary lacks, even beside a spelled one.
        if unknown is not None and own.count(unknown) > text.count(spelled):
            raise InvalidRequest("prompt", text, "holds characters the checkpoint's tokenizer "
                                 f"cannot encode (they would read as {spelled})")
        dropped = self._dropped(text, own)
        if dropped is not None:
            raise InvalidRequest("prompt", text, "holds characters the checkpoint's tokenizer "
                                 f"cannot encode ({dropped!r} would be dropped)")
        past = None if self.vocab_size is None else next(
            (i for i in ids if i >= self.vocab_size), None)
        if past is not None:
            token = self.tokenizer.convert_ids_to_tokens(past)
            raise InvalidRequest("prompt", text, f"spells the tokenizer's token {token} (id "
                                 f"{past}), which the model's vocabulary of "
                                 f"{self.vocab_size} tokens does not hold")
        return ids

    def _dropped(self, text: str, own_ids: list[int]) -> str | None:
        """The first character of ``text`` its own ids do not read back: a tokenizer's model
        without an unknown token drops what its vocabulary lacks. Both sides are compared
        as the tokenizer's normalizer writes them (case and accents it folds are no loss),
        then as NFKC, without white space or SentencePiece's space mark."""
        # Added tokens (special ones included) are matched before the normalizer runs and
        # read back as spelled: they are compared by taking their spelling out of the text.
        added = self._added
        rest = text
        for token in (added[i] for i in own_ids if i in added):
            rest = rest.replace(token, " ", 1)
        spelled = str(self.tokenizer.decode([i for i in own_ids if i not in added],
                                            clean_up_tokenization_spaces=False))
        # The space mark is left out of the comparison (normalizers write it for spaces),
        # so one the text spells must read back as itself.
        if spelled.count("\u2581") < rest.count("\u2581"):
            return "\u2581"
        decoded = _comparable(spelled)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalizer = getattr(backend, "normalizer", None)
        wanted = _comparable(rest if normalizer is None else normalizer.normalize_str(rest))
        if wanted == decoded:  # the common case, compared at C speed
            return None
        kept = Counter(decoded)
        for char in wanted:
            if kept[char] <= 0:
                return char
            kept[char] -= 1
        return None

    @functools.cached_property
    def _added(self) -> dict[int, str]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return {i: t.content for i, t in added.items()}

    @functools.cached_property
    def _unknown(self) -> tuple[int | None, str]:
        """The unknown token's id and spelling: the one transformers names, else the one
        the tokenizer's model falls back to (a checkpoint may name none it still uses)."""
        if self.tokenizer.unk_token_id is not None:
            return self.tokenizer.unk_token_id, str(self.tokenizer.unk_token)
        model = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "model", None)
        spelled = getattr(model, "unk_token", None)
        found = self.tokenizer.convert_tokens_to_ids(spelled) if isinstance(spelled, str) \
            else None
        return (found, str(spelled)) if isinstance(found, int) else (None, "")

    @functools.cached_property
    def _byte_ids(self) -> frozenset[int]:
        return frozenset(i for token, i in self.tokenizer.get_vocab().items()
                         if BYTE_TOKEN.fullmatch(token))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids)))

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> HfDetokenizer:
        return HfDetokenizer(self.tokenizer, prompt_ids, self._byte_ids,
                             frozenset(self.eos_token_ids))
