"""A guard that turns any device-to-host value read into an error, for tests and debugging.

The stages of a round (allocation, packing, sampling, commit) must be enqueued without the
host waiting on device values; the only such wait is the retire copy of round n-2. On CUDA,
torch's sync debug mode reports every synchronising call. On the CPU nothing synchronises,
so the guard patches the ``Tensor`` methods that turn tensor values into Python values
(``item``, ``tolist``, ``numpy``, truth and number conversions): code that calls them would
stall a GPU stream. It does not see data-dependent shapes (a boolean-mask index,
``nonzero``, a size taken from a tensor), which sync a GPU too; running the stage on torch's
``meta`` device catches those. The patch is process-wide while the block runs, so use it in
tests or single-threaded debugging only.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from adaspec.errors import HostReadError

# Tensor methods that hand a value to Python; each would be a device sync on a GPU.
READING_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__",
                   "__index__", "__complex__")


def _refuse(name: str) -> Callable[..., Any]:
    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> Any:
        raise HostReadError(f"Tensor.{name} read a {tuple(self.shape)} tensor back to the "
                            "host inside forbid_host_reads()")
    return refuse


@contextmanager
def forbid_host_reads(device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside the block, reading a tensor value to the host raises ``HostReadError`` (on the
    CPU) or torch's sync error (on CUDA)."""
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    saved = {name: torch.Tensor.__dict__.get(name) for name in READING_METHODS}
    for name in READING_METHODS:
        setattr(torch.Tensor, name, _refuse(name))
    try:
        yield
    finally:
        for name, original in saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
