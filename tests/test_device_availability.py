"""The launch's device is checked before anything runs, and torch_npu is never imported
unless an NPU is asked for."""

import subprocess
import sys

import pytest
import torch
from cuda_marks import needs_cuda

from adaspec.availability import require_device
from adaspec.errors import ConfigError, DeviceUnavailable


def test_cpu_is_always_available() -> None:
    require_device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_cuda_without_a_gpu_is_refused_naming_the_flag() -> None:
    with pytest.raises(DeviceUnavailable) as info:
        require_device("cuda")
    assert str(info.value).startswith("--device=cuda: no CUDA device is visible to torch")
    assert isinstance(info.value, ConfigError)


@needs_cuda
def test_cuda_with_a_gpu_is_accepted() -> None:
    require_device("cuda")


def test_npu_without_torch_npu_is_refused_with_the_install_hint() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed here")
    with pytest.raises(DeviceUnavailable, match=r"^--device=npu: torch_npu cannot be imported"):
        require_device("npu")


def test_configuration_and_cli_import_neither_torch_nor_torch_npu() -> None:
    probe = ("import sys, adaspec.cli, adaspec.config; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_npu')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.strip() == "[]"
