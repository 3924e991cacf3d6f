"""Fixed-shape entry points (bindings) for the prepared buckets of a target model.

A bucket is one ``(num_reqs, num_rows)`` shape of ``VerifyRows`` (Bcap batch entries, G rows)
whose ``rows_per_req`` is ``grid_width``: w + 1, or G where that is smaller. On the CPU a
bucket is prewarmed by running it once eagerly (allocator and kernel caches warm, so the first
real round costs what later ones do); on CUDA it can be captured once as a graph and replayed
with new inputs copied into its buffers. Warm-up and capture run on padding rows only, which
write to the scratch KV slot, so no request's KV changes.
"""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor

from adaspec.config.limits import GRAPH_BACKEND_FOR_DEVICE
from adaspec.errors import ConfigError
from adaspec.models.protocols import (
    TargetModel,
    TargetOutput,
    VerifyRows,
    check_verify_output,
)
from adaspec.runtime.devices.packing import grid_width

T = TypeVar("T")


def padding_rows(num_reqs: int, num_rows: int, rows_per_req: int, scratch_kv_slot: int,
                 device: torch.device | str) -> VerifyRows:
    """A bucket-shaped batch of padding only: every row and entry on the scratch KV slot."""
    zeros = torch.zeros(num_rows, dtype=torch.int64, device=device)
    return VerifyRows(
        token_ids=zeros.clone(), row_reqs=zeros.clone(), row_offsets=zeros.clone(),
        row_valid=torch.zeros(num_rows, dtype=torch.bool, device=device),
        req_kv_slots=torch.full((num_reqs,), scratch_kv_slot, dtype=torch.int64, device=device),
        req_starts=torch.zeros(num_reqs, dtype=torch.int64, device=device),
        rows_per_req=rows_per_req)


def prewarm(target: TargetModel, buckets: Iterable[tuple[int, int]], rows_per_req: int,
            device: torch.device | str) -> None:
    """Run ``verify`` once for every ``(num_reqs, num_rows)`` bucket."""
    for num_reqs, num_rows in buckets:
        check_prewarmed(target, target.verify(padding_rows(
            num_reqs, num_rows, rows_per_req, target.num_kv_slots, device)), num_rows)


def check_prewarmed(target: TargetModel, out: object, num_rows: int) -> None:
    """A binding's first ``verify`` gives what the protocol states (shapes by the target's
    own ``vocab_size`` and ``hidden_size``): a model that does not is refused at start, not
    at its first request."""
    check_verify_output("target.verify (prewarmed at start)", out, num_rows,
                        target.vocab_size, target.hidden_size)


def check_shape(rows: VerifyRows, num_reqs: int, num_rows: int, rows_per_req: int) -> None:
    """A binding runs only the shape it was prepared for (a silent reshape would change the
    padded cost and, for a graph, read stale buffers)."""
    shape = (rows.req_kv_slots.shape[0], rows.token_ids.shape[0], rows.rows_per_req)
    if shape != (num_reqs, num_rows, rows_per_req):
        raise ValueError(f"(num_reqs, num_rows, rows_per_req)={shape}: this binding was "
                         f"prepared for {(num_reqs, num_rows, rows_per_req)}")


class EagerBinding:
    """One bucket's ``verify`` on the CPU: prewarmed once, then called eagerly."""

    def __init__(self, target: TargetModel, num_reqs: int, num_rows: int,
                 rows_per_req: int, device: torch.device | str) -> None:
        self.target = target
        self.shape = (num_reqs, num_rows, rows_per_req)
        prewarm(target, [(num_reqs, num_rows)], rows_per_req, device)

    def __call__(self, rows: VerifyRows) -> TargetOutput:
        check_shape(rows, *self.shape)
        return self.target.verify(rows)


def capture(fn: Callable[[], T], pool: Any = None) -> tuple["torch.cuda.CUDAGraph", T]:
    """``fn`` run once on a side stream (kernels, workspaces and lazy buffers exist before
    capture), then captured as a CUDA graph in memory ``pool`` (an opaque handle from
    ``torch.cuda.graph_pool_handle()``); the graph and the outputs of the captured call."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


class CapturedVerify:
    """One bucket's ``verify`` captured as a CUDA graph.

    ``__call__`` copies the rows into the captured input buffers and replays; the returned
    tensors are the graph's output buffers, valid until the next replay of a graph sharing
    its memory ``pool``. Graphs of one kind (verify, draft, pack) and slot share one pool:
    only one of them replays per round, and the round is retired before another replays, so
    their scratch memory is shared; each keeps its own outputs.
    """

    def __init__(self, target: TargetModel, num_reqs: int, num_rows: int,
                 rows_per_req: int, pool: Any = None) -> None:
        self.shape = (num_reqs, num_rows, rows_per_req)
        self.inputs = padding_rows(num_reqs, num_rows, rows_per_req, target.num_kv_slots, "cuda")
        self.graph, self.outputs = capture(lambda: target.verify(self.inputs), pool)
        check_prewarmed(target, self.outputs, num_rows)

    def __call__(self, rows: VerifyRows) -> TargetOutput:
        check_shape(rows, *self.shape)
        for name in ("token_ids", "row_reqs", "row_offsets", "row_valid", "req_kv_slots",
                     "req_starts"):
            getattr(self.inputs, name).copy_(getattr(rows, name))
        self.graph.replay()
        return self.outputs


class BoundCall:
    """``fn`` over fixed-shape arguments, prepared once on example arguments: captured as a
    CUDA graph on cuda (every argument a tensor: a call copies them into the graph's input
    buffers and replays; the result is the graph's own output, valid until a graph of its
    pool replays again), prewarmed and then called eagerly elsewhere. ``outputs`` is what
    the capture (or the prewarm) returned; ``warm=False`` skips the CPU prewarm (another
    binding of the same shapes already warmed the allocator).

    An argument of another shape, dtype or type than its example is refused: a copy would
    broadcast it silently, and a graph would read stale buffers."""

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 pool: Any = None, warm: bool = True) -> None:
        self.name = name
        self.fn = fn
        self.specs = _specs(args)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None
        if args and isinstance(args[0], Tensor) and args[0].device.type == "cuda":
            self.buffers = tuple(arg.clone() for arg in args)
            self.graph, self.outputs = capture(lambda: fn(*self.buffers), pool)
        elif warm:
            self.outputs = fn(*args)

    def __call__(self, *args: Any) -> Any:
        specs = _specs(args)
        if specs != self.specs:
            raise ValueError(f"{self.name}: arguments {specs}; this binding was prepared "
                             f"for {self.specs}")
        if self.graph is None:
            return self.fn(*args)
        for buffer, arg in zip(self.buffers, args, strict=True):
            buffer.copy_(arg, non_blocking=True)
        self.graph.replay()
        return self.outputs


def _specs(args: tuple[Any, ...]) -> tuple[object, ...]:
    """What a bound call's arguments must keep: a tensor's shape and dtype, another value's
    type."""
    return tuple((tuple(arg.shape), arg.dtype) if isinstance(arg, Tensor) else type(arg)
                 for arg in args)


def binding_factory(target: TargetModel, width: int, device: str
                    ) -> Callable[[int, int], Callable[[VerifyRows], TargetOutput]]:
    """How one pipeline slot's ``BindingRegistry`` prepares a (Bcap, G) binding on ``device``:
    a CUDA graph in the pipeline slot's shared memory pool on cuda, a prewarmed eager call on
    the CPU. ACL graph capture on an NPU is not built yet; asking for it fails here, at
    startup, rather than silently running eager."""
    if device == "cuda":
        pool = torch.cuda.graph_pool_handle()
        return lambda num_reqs, num_rows: CapturedVerify(
            target, num_reqs, num_rows, grid_width(width, num_rows), pool)
    if device == "cpu":
        return lambda num_reqs, num_rows: EagerBinding(
            target, num_reqs, num_rows, grid_width(width, num_rows), device)
    raise ConfigError("--python_graph_backend", GRAPH_BACKEND_FOR_DEVICE.get(device, device),
                      f"graph capture on {device} is not built yet; launch with "
                      "--enable_graph=false to run unpadded eager shapes")
