"""The mark of a test that needs a CUDA device: skipped without one, selected by
``pytest -m cuda`` (``benchmarks/device_check.sh``)."""

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable[..., object])


def needs_cuda(test: F) -> F:
    marked: F = pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="needs a CUDA device")(test))
    return marked
