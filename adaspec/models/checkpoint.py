"""Checkpoints: safetensors files with their configuration, and stable identities.

A checkpoint's identity (``checkpoint_identity``) hashes its configuration and every tensor
(name, dtype, shape, bytes); a drafter's identity also covers the target whose embedding and
head it shares. Cost tables record identities, so a table fitted for one set of weights is
never reused for another.
"""

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from adaspec.models.drafters import DSparkConfig, MtpConfig, ReferenceDSpark, ReferenceMtp
from adaspec.models.families import DEFAULT_FAMILY, family
from adaspec.models.target import ReferenceTarget, TargetConfig
from adaspec.runtime.devices.availability import require_device

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
    """The ``identity`` of a checkpoint: 32 hex digits of a SHA-256 over ``config`` (any
    JSON-serialisable mapping, written with sorted keys), ``parent`` (the identity of the
    checkpoint whose weights this one shares, e.g. a drafter's target; empty for none) and
    every tensor of ``weights`` in name order: its name, dtype, shape and raw bytes.

    It depends on values alone: not on the mapping's order, the process, the machine, the
    device a tensor sits on, or its memory layout. It does depend on each tensor's dtype, so
    hash the weights as the checkpoint stores them (the reference models hash their stored
    float16 tensors and keep that identity when loaded in float32 or onto a GPU). Any changed
    weight, name, shape or config value gives another identity. Reading a device tensor
    copies it to the host: compute it once, when the model is loaded, never while serving.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(dict(config), sort_keys=True).encode())
    digest.update(parent.encode())
    for name in sorted(weights):
        tensor = weights[name].detach()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        flat = tensor.cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


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
    module.load_state_dict({k: v.float() for k, v in state.items()})
    # Identity of the stored (float16) tensors, so it does not depend on the load dtype.
    module.identity = checkpoint_identity(config, state,  # type: ignore[assignment]
                                          parent=parent)


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


def load_models(folder: Path, device: torch.device | str = "cpu") -> ReferenceModels:
    """Load the three checkpoints of a folder onto ``device`` in float32, in eval mode."""
    require_device(torch.device(device).type)
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
