"""Retire: the one place where a round's feedback travels from the device to the host.

The feedback is small (accepted lengths, confidences, committed token ids ...), and it is the
only device-to-host traffic of a round, so no other stage ever makes the host wait on the
device. The copy is stream work, enqueued after commit on the same stream, so it reads what
commit wrote without any extra synchronization.

The host copy never aliases the pipeline slot's device buffers: slot n % 2 is reused by round
n + 2, which may overwrite them while the policies are still reading round n's feedback.
"""

from collections.abc import Mapping
from functools import partial

import torch
from torch import Tensor

from adaspec.runtime.devices.streams import Completion, DeviceStream


def retire_copy(feedback: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Host copies of the round's feedback tensors, to be run as stream work.

    cpu tensors are cloned. cuda / npu tensors are copied into pinned host memory with
    ``non_blocking=True``: the returned tensors hold valid values only once the completion
    of the work that made them has resolved, never when this function returns.
    """
    return {name: _host_copy(tensor) for name, tensor in feedback.items()}


def enqueue_retire(stream: DeviceStream,
                   feedback: Mapping[str, Tensor]) -> Completion[dict[str, Tensor]]:
    """Enqueue the retire copy of a round; its completion carries the host feedback."""
    # Snapshot the mapping now: the caller may rebind its entries for the next round before
    # the stream reaches this work.
    return stream.enqueue(partial(retire_copy, dict(feedback)))


def _host_copy(tensor: Tensor) -> Tensor:
    if tensor.requires_grad:  # never under the stream's no_grad; an embedder's own call
        tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    # Pinned memory is what lets the copy run asynchronously on the stream.
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
