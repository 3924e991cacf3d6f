"""Checkpoints: safetensors files with their configuration, and stable identities.

A checkpoint's identity (``checkpoint_identity``) hashes its configuration and every tensor
(name, dtype, shape, bytes); a drafter's identity also covers the target whose embedding and
head it shares. Cost tables record identities, so a table fitted for one set of weights is
never reused for another.
"""

import hashlib
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from adaspec.availability import require_device
from adaspec.errors import ConfigError
from adaspec.models.drafters import DSparkConfig, MtpConfig, ReferenceDSpark, ReferenceMtp
from adaspec.models.families import DEFAULT_FAMILY, family
from adaspec.models.target import ReferenceTarget, TargetConfig

WEIGHTS_PACKAGE = "adaspec.models.weights"
FILES = {"target": "target.safetensors", "mtp": "mtp.safetensors",
         "dspark": "dspark.safetensors"}
MODEL_CARD = "model_card.json"
STORED_DTYPE = torch.float16


def own_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own tensors (shared target weights are not submodules, so excluded)."""
    state = module.state_dict()
    return {name: tensor.detach().contiguous() for name, tensor in sorted(state.items())}


def checkpoint_identity(config: Mapping[str, object], weights: Mapping[str, torch.Tensor],
                        *, parent: str = "") -> str:
    """The ``identity`` of a checkpoint: 32 hex digits of a SHA-256 over ``config`` (a
    mapping of JSON values with str keys, written with sorted keys), ``parent`` (the identity
    of the checkpoint whose weights this one shares, e.g. a drafter's target; empty for none)
    and every tensor of ``weights`` in name order: its name, dtype, shape and raw bytes.

    It depends on values alone: not on the mapping's order, the process, the machine, the
    device a tensor sits on, or its memory layout. It does depend on each tensor's dtype, so
    hash the weights as the checkpoint stores them (the reference models hash their stored
    float16 tensors and keep that identity when loaded in float32 or onto a GPU). Any changed
    weight, name, shape or config value gives another identity. Reading a device tensor
    copies it to the host: compute it once, when the model is loaded, never while serving.

    Different inputs never share an encoding (see ``_identity_stream``): inputs it could not
    tell apart are refused with a ``ConfigError`` naming the argument, the key and what is
    expected (a config key that is no str, as ``{1: ..}`` would hash as ``{"1": ..}``; a
    value that is no JSON value: NaN, an infinity, an int too long to write as text, nesting
    deeper than 100 levels; a weight that is no dense tensor: sparse, meta, quantized or
    nested; a tensor name with ``:``). A conjugate or negative view (``x.conj()``) is hashed
    as the tensor of its values, as a memory layout is.
    """
    digest = hashlib.sha256()
    for chunk in _identity_stream(config, weights, parent):
        digest.update(chunk)
    return digest.hexdigest()[:32]


_IDENTITY = re.compile(r"[0-9a-f]{32}")
"""What ``checkpoint_identity`` returns, and so what a ``parent`` usually is."""


def _identity_stream(config: object, weights: object, parent: object) -> Iterator[bytes]:
    """The bytes ``checkpoint_identity`` hashes, in an encoding no two different inputs share.

    The encoding is the one identities have always had (so those of the shipped checkpoints,
    recorded in their model cards and in saved cost tables, stay what they are), restricted
    to inputs it reads back unambiguously:

    * the config as sorted-key JSON text: a JSON object ends at its closing brace, and
      refusing non-str keys (which JSON would turn into strings) makes the text name one
      config only;
    * the parent: an identity (32 lowercase hex digits) or "" is written as is; any other
      parent (an engine's own identity scheme), and "" before a first tensor name that itself
      starts with 32 hex digits, is written ``:<length>:<parent>``, which cannot be mistaken
      for the rest, as tensor names never contain ``:``;
    * each tensor as ``name:dtype:shape`` then its raw bytes: the name ends at its first
      ``:`` (names with one are refused), the dtype and the shape (a tuple of ints) contain
      none, and they fix how many bytes follow.
    """
    if not isinstance(config, Mapping):
        raise ConfigError("checkpoint_identity(config=...)", type(config).__name__,
                          "expected a mapping of JSON values with str keys")
    plain = _plain_json("checkpoint_identity(config=...)", config, set())
    if not isinstance(weights, Mapping):
        raise ConfigError("checkpoint_identity(weights=...)", type(weights).__name__,
                          "expected a mapping of tensor names to torch.Tensor")
    for name in weights:
        _check_name(name)
    names = sorted(weights)
    tensors = [_dense_tensor(name, weights[name]) for name in names]
    if not isinstance(parent, str):
        raise ConfigError("checkpoint_identity(parent=...)", type(parent).__name__,
                          "expected a str: the identity of the checkpoint whose weights this "
                          "one shares, or \"\" for none")
    yield json.dumps(plain, sort_keys=True).encode()
    first_hex = bool(names) and _IDENTITY.match(names[0]) is not None
    if _IDENTITY.fullmatch(parent) or (parent == "" and not first_hex):
        yield parent.encode()
    else:
        text = parent.encode("utf-8", "surrogatepass")
        yield f":{len(text)}:".encode() + text
    for name, tensor in zip(names, tensors, strict=True):
        yield f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode("utf-8", "surrogatepass")
        flat = tensor.cpu().contiguous().reshape(-1)
        yield flat.view(torch.uint8).numpy().tobytes()


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise ConfigError("checkpoint_identity(weights=...)", repr(name),
                          f"expected tensor names that are str, got a key of type "
                          f"{type(name).__name__}")
    if ":" in name:
        raise ConfigError("checkpoint_identity(weights=...)", repr(name),
                          "expected tensor names without ':' (the identity ends a name with "
                          "it, so such a name could hash like another set of tensors)")


def _dense_tensor(name: str, value: object) -> torch.Tensor:
    """A weight as the dense host-readable tensor hashed, or the one-line refusal naming its
    key and the type found."""
    setting = f"checkpoint_identity(weights=...)[{name!r}]"
    if not isinstance(value, torch.Tensor):
        kind = type(value)
        raise ConfigError(setting, f"{kind.__module__}.{kind.__qualname__}".removeprefix(
            "builtins."), "expected a torch.Tensor")
    what = _not_dense(value)
    if what is not None:
        where = "" if what == "meta" else f" on {value.device}"
        raise ConfigError(setting, f"{what} tensor{where}", "expected a dense "
                          "(strided) tensor with values (not meta, sparse, quantized or "
                          "nested)")
    # A conjugate or negative view holds its values behind a bit that the byte view below
    # cannot read: resolving it gives the tensor of the same values, so equal values keep
    # equal identities whichever way they are held (as a layout does not count either).
    return value.detach().resolve_conj().resolve_neg()


def _not_dense(value: torch.Tensor) -> str | None:
    """What makes ``value`` no dense tensor with readable values ("quantized", "meta",
    "nested", "sparse_coo", ...), or None."""
    if value.is_nested:  # first: a nested tensor has no sizes to ask the rest about
        return "nested"
    if value.is_quantized:
        return "quantized"
    if value.is_meta:
        return "meta"
    if value.layout != torch.strided:
        return str(value.layout).removeprefix("torch.")
    return None


_JSON_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 100
"""How deeply a config may nest lists and mappings: far beyond any model configuration, and
far below the recursion limit of this walk and of ``json.dumps``."""


def _check_number(path: str, value: object) -> None:
    """Refuse a number JSON has no text for: NaN, an infinity, an int too long to write."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(path, repr(float(value)), "expected a JSON value: a finite number "
                          "(JSON has no NaN or infinity)")
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            int.__repr__(value)  # what json.dumps writes; very long ints cannot be written
        except ValueError:
            raise ConfigError(path, f"an int of {value.bit_length()} bits",
                              f"expected an int of at most {sys.get_int_max_str_digits()} "
                              "decimal digits (Python writes no longer one as text)") from None


def _plain_json(path: str, value: object, seen: set[int], depth: int = 0) -> object:
    """``value`` as plain JSON data (dicts, lists, scalars), or the one-line refusal naming the
    key path of its first part that JSON would not write, or would write like another value
    (a non-str key: ``{1: x}`` as ``{"1": x}``). A tuple is written as the list it equals."""
    if isinstance(value, _JSON_SCALARS):
        _check_number(path, value)
        return value
    if depth > _MAX_DEPTH:
        shown = path if len(path) <= 120 else f"{path[:100]}...{path[-15:]}"
        raise ConfigError(shown, type(value).__name__, f"expected a JSON value nested at "
                          f"most {_MAX_DEPTH} levels deep")
    if not isinstance(value, Mapping | list | tuple):
        kind = type(value)
        raise ConfigError(path, f"{kind.__module__}.{kind.__qualname__}".removeprefix(
            "builtins."), "expected a JSON value (str, int, float, bool, None, a list or a "
            "mapping with str keys)")
    if id(value) in seen:
        raise ConfigError(path, type(value).__name__, "expected a JSON value, not one that "
                          "contains itself")
    seen = seen | {id(value)}
    if isinstance(value, Mapping):
        plain: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(path, repr(key), f"expected str keys (JSON object keys), got "
                                  f"a key of type {type(key).__name__}, which would hash like "
                                  f"the string {json.dumps(str(key))}")
            plain[key] = _plain_json(f"{path}[{key!r}]", item, seen, depth + 1)
        return plain
    return [_plain_json(f"{path}[{index}]", item, seen, depth + 1)
            for index, item in enumerate(value)]


def save_module(module: nn.Module, config: dict[str, int], path: Path) -> None:
    """Store floats as float16 (a few MB in all); the config goes in the file's metadata."""
    state = {name: (t.to(STORED_DTYPE) if t.is_floating_point() else t)
             for name, t in own_state(module).items()}
    save_file(state, str(path), metadata={"config": json.dumps(config, sort_keys=True)})


def _read(path: Path) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return json.loads(metadata["config"]), load_file(str(path))


def _restore(module: nn.Module, state: dict[str, torch.Tensor], parent: str,
             config: dict[str, int]) -> None:
    # Identity of the stored (float16) tensors, so it does not depend on the load dtype; taken
    # first, so a state holding anything but tensors is refused naming the key.
    identity = checkpoint_identity(config, state, parent=parent)
    module.load_state_dict({k: v.float() for k, v in state.items()})
    module.identity = identity  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class ReferenceModels:
    target: ReferenceTarget
    mtp: ReferenceMtp
    dspark: ReferenceDSpark


def load_target(folder: Path) -> ReferenceTarget:
    """The target checkpoint of a folder alone, on the CPU in float32, in eval mode."""
    path = folder / FILES["target"]
    if not path.is_file():
        raise FileNotFoundError(f"no target checkpoint {path}")
    from safetensors import SafetensorError

    try:
        config, state = _read(path)
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors checkpoint ({error})") from error
    target = ReferenceTarget(TargetConfig(**config))
    _restore(target, state, "", config)
    return target.eval()


def _device_type(device: object) -> str:
    """The type of a torch device given as a ``torch.device`` or its name; anything else is
    refused naming ``device``."""
    if not isinstance(device, torch.device | str):
        raise ConfigError("device", repr(device), "expected a torch.device or a device name "
                          "such as cpu, cuda or cuda:0")
    try:
        return torch.device(device).type
    except RuntimeError:
        raise ConfigError("device", device, "expected a device name such as cpu, cuda or "
                          "cuda:0") from None


def load_models(folder: Path, device: torch.device | str = "cpu") -> ReferenceModels:
    """Load the three checkpoints of a folder onto ``device`` in float32, in eval mode."""
    require_device(_device_type(device))
    target_config, target_state = _read(folder / FILES["target"])
    target = ReferenceTarget(TargetConfig(**target_config))
    _restore(target, target_state, "", target_config)
    mtp_config, mtp_state = _read(folder / FILES["mtp"])
    mtp = ReferenceMtp(MtpConfig(**mtp_config), target)
    _restore(mtp, mtp_state, target.identity, mtp_config)
    dspark_config, dspark_state = _read(folder / FILES["dspark"])
    dspark = ReferenceDSpark(DSparkConfig(**dspark_config), target)
    _restore(dspark, dspark_state, target.identity, dspark_config)
    for module in (target, mtp, dspark):
        module.to(device).eval()
    return ReferenceModels(target=target, mtp=mtp, dspark=dspark)


def shipped_folder(name: str = DEFAULT_FAMILY) -> Path:
    """The folder of a reference family's weights, installed with the package."""
    return Path(str(resources.files(WEIGHTS_PACKAGE))) / family(name).folder


def load_reference_models(device: torch.device | str = "cpu", *,
                          name: str = DEFAULT_FAMILY) -> ReferenceModels:
    """A shipped reference family (``small`` unless named); no download, ever."""
    return load_models(shipped_folder(name), device)


def load_model_card(folder: Path | None = None) -> dict[str, object]:
    path = (folder or shipped_folder()) / MODEL_CARD
    card: dict[str, object] = json.loads(path.read_text())
    return card
