"""Whether the launch's device can be used by this process, checked before anything runs.

torch_npu is imported here and nowhere else, and only when ``--device=npu`` is asked for: it
cannot import without Ascend CANN, and importing it on other hosts is never wanted.
"""

import importlib

from adaspec.errors import DeviceUnavailable

NPU_INSTALL_HINT = "install adaspec[npu] with the torch_npu release matching CANN on an Ascend host"


def require_device(device: str) -> None:
    """Raise ``DeviceUnavailable`` naming ``--device`` when the device cannot be used here."""
    if device == "cpu":
        return
    import torch  # deferred: configuration checks must not pay for importing torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device", device,
                                    "no CUDA device is visible to torch "
                                    f"(torch {torch.__version__}); use --device=cpu, or a CUDA "
                                    "build of torch on a host with a GPU")
        return
    if device == "npu":
        _require_npu(torch.__version__)
        return
    raise DeviceUnavailable("--device", device, "expected one of cpu|cuda|npu")


def _require_npu(torch_version: str) -> None:
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as error:
        raise DeviceUnavailable("--device", "npu",
                                f"torch_npu cannot be imported ({error}); {NPU_INSTALL_HINT}"
                                ) from None
    if not torch_npu.npu.is_available():
        raise DeviceUnavailable("--device", "npu",
                                f"torch_npu (with torch {torch_version}) sees no NPU; check the "
                                f"CANN installation and ASCEND_RT_VISIBLE_DEVICES")
