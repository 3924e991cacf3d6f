"""What the runtime needs from a target model and from each kind of drafter.

An engine plugs its own models in by implementing these protocols; the reference models in
this package implement them on the CPU, CUDA or an NPU. docs/embedding.md states every
contract below in one place, with the reasons; this docstring is its summary.

Device tensors, no host reads. Every method takes and returns device tensors and never reads
a value back to the host (no ``.item()``, ``.tolist()``, ``bool(tensor)``, boolean-mask
indexing or ``nonzero``), so a round can be enqueued without waits and ``verify`` can be
captured as a graph. The runtime calls the models from its device stream only, one call at a
time, in submission order, under ``torch.no_grad``, possibly from a thread other than the one
that built them.

Positions and rows. A request's committed tokens are ``x_0 .. x_n``; the target's KV cache
holds ``x_0 .. x_{n-1}`` and ``x_n`` (the newest token, sampled last round) is the **anchor**.
A round verifies rows ``[x_n, d_1, .., d_k]`` at positions ``n .. n+k``: the row at offset ``j``
yields the target's distribution for position ``n+j+1``. Rows of all requests are packed into
one padded tensor of G rows (a prepared bucket), with the anchor row always present. The
hidden state ``h_p`` of position p is the target's final hidden state after reading ``x_p``
(what a drafter conditions on); the drafters continue from ``h_{n-1}``, the state of the row
that produced the anchor.

KV slots. ``allocate(n)`` provides n + 1 KV slots: 0 .. n-1 hold requests, slot n is
**scratch**. Padding rows (``row_valid`` False), padding batch entries and a drafter call past
the context edge all use the scratch KV slot, so no shape depends on the batch; nothing read from
scratch is ever used.

KV consistency. ``verify`` writes each row's keys and values at its position before attending,
and a query at position p reads only positions <= p of its own KV slot. Rows of a rejected suffix
therefore sit past the committed length and are overwritten before anything can read them:
after a rejection the cache behaves as if the suffix had never been verified, with no
rollback copy (see tests/test_reference_models.py). A drafter that keeps a context of its own
(``DrafterContext``) relies on the same rule.
"""

import inspect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from adaspec.errors import ModelOutputError


@dataclass(frozen=True, slots=True)
class VerifyRows:
    """Packed verification rows of one round, padded to a prepared row bucket G."""

    token_ids: Tensor  # [G] int64: each request's anchor token, then its drafted tokens
    row_reqs: Tensor  # [G] int64: batch index (0 .. Bcap-1) of each row's request
    row_offsets: Tensor  # [G] int64: 0 for the anchor row, k for draft position k
    row_valid: Tensor  # [G] bool: False for padding rows
    req_kv_slots: Tensor  # [Bcap] int64: KV-cache slot of each batch entry (padding: scratch)
    req_starts: Tensor  # [Bcap] int64: position of each batch entry's anchor row
    rows_per_req: int  # R: the most rows one request can verify, min(w + 1, G) (static)

    @property
    def positions(self) -> Tensor:
        """[G] position of each row: its request's anchor position plus its offset. Derived,
        never packed separately, so it cannot disagree with the attention mask. Valid rows
        sit at positions <= context_limit - 2: the packer caps each request's verify length
        by its token budget (``emit_budget``)."""
        return self.req_starts.index_select(0, self.row_reqs) + self.row_offsets

    @classmethod
    def from_requests(cls, requests: list[tuple[int, int, list[int]]], *, num_rows: int,
                      num_reqs: int, rows_per_req: int, scratch_kv_slot: int,
                      device: torch.device | str = "cpu") -> "VerifyRows":
        """Host-side factory for tests and eager callers: ``requests`` lists
        ``(kv_slot, anchor_position, [anchor, d_1, ..])``; pads to ``num_reqs`` batch entries
        and ``num_rows`` rows (padding rows sit at the first entry's anchor position). The
        runtime packs on device instead."""
        token_ids: list[int] = []
        reqs: list[int] = []
        offsets: list[int] = []
        for index, (_, _, tokens) in enumerate(requests):
            assert 1 <= len(tokens) <= rows_per_req
            token_ids += tokens
            reqs += [index] * len(tokens)
            offsets += range(len(tokens))
        used = len(token_ids)
        assert used <= num_rows
        assert len(requests) <= num_reqs
        padding = num_rows - used
        kv_slots = [slot for slot, _, _ in requests] + \
            [scratch_kv_slot] * (num_reqs - len(requests))
        starts = [start for _, start, _ in requests] + [0] * (num_reqs - len(requests))

        def tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            token_ids=tensor(token_ids + [0] * padding),
            row_reqs=tensor(reqs + [0] * padding),
            row_offsets=tensor(offsets + [0] * padding),
            row_valid=torch.arange(num_rows, device=device) < used,
            req_kv_slots=tensor(kv_slots),
            req_starts=tensor(starts),
            rows_per_req=rows_per_req,
        )


@dataclass(frozen=True, slots=True)
class TargetOutput:
    """The target's output for packed rows (verify) or for each request's last prompt token.
    Padding rows hold finite values that nothing reads."""

    logits: Tensor  # [G, vocab] (prefill: [B, vocab]) next-token logits of each row
    hidden: Tensor  # [G, hidden_size] h_p of each row, in ``TargetModel.dtype``


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """Prefill of whole prompts, in the order given, right-padded to the longest (T). What
    ``hidden`` holds past a prompt's length is unspecified: the runtime never reads it."""

    last: TargetOutput  # logits and h_{T_i - 1} at each prompt's last position, [B, ...]
    hidden: Tensor  # [B, T, hidden_size] h_p at every prompt position p (what verify returns)
    lengths: Tensor  # [B] int64 prompt lengths T_i


@dataclass(frozen=True, slots=True)
class ContextRows:
    """Committed positions a drafter keeps as its own context (``DrafterContext.publish``).

    Row i is position p = ``positions[i]`` of the request in KV slot ``slots[i]``: the token
    ``x_p``, the target's state ``h_p`` after reading it, and the committed token ``x_{p+1}``
    after it. Rows of one KV slot come in increasing position order; a row whose slot is the
    scratch KV slot (a rejected or padding row) carries nothing to keep.
    """

    token_ids: Tensor  # [N] int64 x_p
    hidden: Tensor  # [N, hidden_size] h_p
    next_token_ids: Tensor  # [N] int64 x_{p+1}
    positions: Tensor  # [N] int64 p: 0 .. context_limit - 2 in a request's KV slot
    kv_slots: Tensor  # [N] int64 KV slot of each row (scratch: nothing to keep)

    @classmethod
    def of_prompts(cls, prefill: PrefillOutput, prompts: list[Tensor], kv_slots: Tensor,
                   first_token_ids: Tensor) -> "ContextRows":
        """Every position of newly prefilled prompts: ``x_0 .. x_{T-1}`` of each prompt, its
        ``prefill.hidden``, and after the last prompt token the request's first generated
        token (``first_token_ids [B]``), so a one-token prompt publishes one row. Index
        tensors are built on the host from the prompts' lengths (shapes, not values) and
        copied to the device once; nothing is read back."""
        device = prefill.hidden.device
        lengths = torch.tensor([len(prompt) for prompt in prompts])
        prompt_of_row = torch.repeat_interleave(torch.arange(len(prompts)), lengths)
        ends = lengths.cumsum(0)
        positions = torch.arange(int(ends[-1])) - (ends - lengths).index_select(0, prompt_of_row)
        flat_rows = prompt_of_row * prefill.hidden.shape[1] + positions
        rows = len(positions)
        layout = torch.cat([prompt_of_row, positions, flat_rows, ends - 1]).to(device)
        token_ids = torch.cat([prompt.to(device) for prompt in prompts])
        next_token_ids = torch.cat([token_ids[1:], token_ids[:1]]).index_copy_(
            0, layout[3 * rows:], first_token_ids.to(token_ids.dtype))
        hidden = prefill.hidden.reshape(-1, prefill.hidden.shape[-1]).index_select(
            0, layout[2 * rows:3 * rows])
        return cls(token_ids=token_ids, hidden=hidden, next_token_ids=next_token_ids,
                   positions=layout[rows:2 * rows],
                   kv_slots=kv_slots.index_select(0, layout[:rows]))


@dataclass(frozen=True, slots=True)
class MtpStep:
    """One sequential MTP draft step for a batch."""

    hidden: Tensor  # [N, hidden_size] the step's output state, input of the next step
    token_ids: Tensor  # [N] int64 greedy draft tokens
    probs: Tensor  # [N] selected-token probability exp(selected_logit - logsumexp(logits))
    logits: Tensor  # [N, vocab] the step's logits


@dataclass(frozen=True, slots=True)
class DSparkBlock:
    """A whole draft block from one parallel DSpark pass."""

    token_ids: Tensor  # [N, width] int64 greedy draft tokens, each given the previous one
    confidences: Tensor  # [N, width] conditional acceptance estimate of each position
    logits: Tensor  # [N, width, vocab] each position's draft logits


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_returned_kind(method: str, out: object, kind: str, fields: tuple[str, ...]) -> None:
    """Refuse a value of another kind than the protocol's (a tuple, None) by its type, before
    its fields are read: their absence would otherwise be blamed on the first field."""
    if not all(hasattr(out, name) for name in fields):
        if inspect.iscoroutine(out):  # an async method: its coroutine never runs
            out.close()
        given = type(out)
        raise ModelOutputError(method, "a value", f"{kind} ({', '.join(fields)})",
                               f"of type {given.__module__}.{given.__qualname__}"
                               .replace("builtins.", ""))


def check_verify_output(method: str, out: object, num_rows: int, vocab_size: int,
                        hidden_size: int, rows: str = "G", *,
                        hidden_dtype: torch.dtype | None = None,
                        device: torch.device | None = None) -> TargetOutput:
    """``out`` when it is a TargetOutput of ``logits [rows, vocab_size]`` and ``hidden [rows,
    hidden_size]`` (the hidden states in ``hidden_dtype`` and both on ``device`` where given;
    metadata only: no device read); else the ``ModelOutputError`` naming ``method``."""
    logits, hidden = _ROW_SHAPES[rows]
    check_returned_kind(method, out, "a TargetOutput", ("logits", "hidden"))
    check_output(method, "logits", getattr(out, "logits", None), (num_rows, vocab_size),
                 logits, device=device)
    check_output(method, "hidden", getattr(out, "hidden", None), (num_rows, hidden_size),
                 hidden, dtype=hidden_dtype, device=device)
    return out  # type: ignore[return-value]


_ROW_SHAPES = {rows: (f"[{rows}, vocab_size]", f"[{rows}, hidden_size]") for rows in "GB"}
"""How a refusal spells the verify (G rows) and prefill (B rows) shapes: made once, since
every round checks its output."""


def check_output(method: str, field: str, value: object, shape: tuple[int, ...],
                 meaning: str, *, integer: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
    """Refuse (``ModelOutputError``) an output that is no tensor of ``shape`` (of an integer
    dtype where ``integer``: token ids, lengths; of ``dtype`` where given: hidden states the
    runtime stores beside the target's own; else of a floating dtype: logits, probabilities)
    on ``device`` where given; ``meaning`` spells the shape as the protocol does
    (``[G, vocab_size]``). Metadata only: nothing is read from the device."""
    if isinstance(value, Tensor) and value.shape == shape and _dtype_fits(
            value.dtype, integer, dtype) and (device is None or _on(value, device)):
        return
    # The refusal names the shape and a dtype the protocol fixes; a floating dtype and the
    # device only when they are what is wrong.
    wanted = f"{_dims(shape)} ({meaning})" + (" of an integer dtype" if integer else "") + \
        (f" in {dtype} (the target's dtype)" if dtype is not None else "")
    if not isinstance(value, Tensor):
        given = type(value)
        got = f"of type {given.__module__}.{given.__qualname__}".replace("builtins.", "")
    elif value.shape != shape:
        got = f"of shape {_dims(tuple(value.shape))}"
    elif not _dtype_fits(value.dtype, integer, dtype):
        got = f"of dtype {value.dtype}"
        wanted += "" if integer or dtype is not None else " of a floating dtype"
    else:
        got = f"on {value.device}"
        wanted += f" on {device}"
    raise ModelOutputError(method, field, wanted, got)


def _dtype_fits(dtype: torch.dtype, integer: bool, wanted: torch.dtype | None) -> bool:
    if wanted is not None:
        return dtype == wanted
    return _integral(dtype) if integer else dtype.is_floating_point


def _on(value: Tensor, device: torch.device) -> bool:
    """Whether ``value`` lies on ``device``; a CUDA device that names no index is the
    current one, where the runtime's stream runs."""
    index: int | None = device.index
    if index is None and device.type == "cuda":
        index = torch.cuda.current_device()
    return value.device.type == device.type and index in (None, value.device.index)


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


@runtime_checkable
class CheckpointInfo(Protocol):
    identity: str
    """Stable hash of weights and configuration (``adaspec.models.checkpoint_identity``);
    cost tables record it, and a table fitted for one identity is refused for another."""


@runtime_checkable
class TargetModel(CheckpointInfo, Protocol):
    # Read-only properties: a model may compute them from its configuration.
    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def context_limit(self) -> int:
        """Positions 0 .. context_limit-1 can be held per request."""
        ...

    @property
    def num_kv_slots(self) -> int:
        """Requests whose KV fits at once; KV slot ``num_kv_slots`` is the scratch one, for
        padding."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the hidden states ``verify`` returns."""
        ...

    def allocate(self, num_kv_slots: int) -> None:
        """(Re)allocate the KV cache: ``num_kv_slots + 1`` KV slots, the last one scratch (the
        runtime calls it once at start, with twice ``max_seqs_per_batch``)."""
        ...

    def prefill(self, prompts: list[Tensor], kv_slots: Tensor) -> PrefillOutput:
        """Process whole prompts (``[T_i]`` int64 each, 1 <= T_i <= context_limit - 1) into
        KV slots ``slots [B]``, positions 0 .. T_i - 1: afterwards each slot's cache holds
        exactly its prompt, whatever an earlier request left there."""
        ...

    def verify(self, rows: VerifyRows) -> TargetOutput:
        """One forward over packed rows; writes each valid row's KV at its position before
        attending (padding rows write only to the scratch KV slot) and returns logits and
        hidden per row. Shapes depend only on ``(Bcap, G, rows_per_req)``, never on values."""
        ...


@runtime_checkable
class DrafterContext(Protocol):
    """A drafter's own per-request context (a KV cache of its own), kept by the runtime.

    After each prefill the runtime publishes every prompt position (``ContextRows.of_prompts``:
    ``x_0`` included, the first generated token after the last), and after each round's
    commit every packed row, committed ones in their request's KV slot and the rest in scratch.
    So before a request's first round the drafter holds positions 0 .. T-1, and before each
    later round every position below the anchor's. An ``MtpDrafter`` must provide this; a
    ``DSparkDrafter`` may (the runtime then allocates and publishes to it the same way)."""

    def allocate(self, num_kv_slots: int) -> None:
        """(Re)allocate the context: ``num_kv_slots + 1`` KV slots, the last one scratch (the
        target's ``num_kv_slots``; called once at start)."""
        ...

    def publish(self, rows: ContextRows) -> None:
        """Keep ``rows`` in the context, writing before anything reads (a row may read the
        rows before it of its KV slot). Positions past the committed length may hold stale
        values (rejected drafts, an earlier request of the KV slot): the drafter's own calls
        write them before reading them, as ``verify`` does."""
        ...


@runtime_checkable
class MtpDrafter(DrafterContext, CheckpointInfo, Protocol):
    """A multi-token-prediction head drafting one token per sequential step."""

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        """Draft the token at p + 2 from ``hidden [N, d]`` at p = ``positions [N]`` and
        ``token_ids [N]`` at p + 1: step j of a round gets ``h_{n-1}`` and the anchor
        ``x_n`` at p = n - 1 (j = 0), then the previous step's ``MtpStep.hidden`` and
        token at p = n - 1 + j. Positions lie in 0 .. context_limit - 2, so the token at
        p + 1 is always inside the context; a step that would sit past that (or before 0,
        a padding entry) gets the scratch KV slot at a clamped position, and its draft is
        never verified."""
        ...


@runtime_checkable
class DSparkDrafter(CheckpointInfo, Protocol):
    """A parallel block drafter with a Markov head and a confidence head."""

    @property
    def max_width(self) -> int: ...

    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        """Draft tokens at p + 2 .. p + 1 + ``width`` after the anchor ``token_ids [N]`` at
        p + 1, from the target's ``hidden [N, d]`` at p = ``positions [N]`` of ``kv_slots
        [N]`` (the convention of ``MtpDrafter.step``'s first step: p in 0 ..
        context_limit - 2, padding entries on the scratch KV slot). A drafter with a context
        of its own also implements ``DrafterContext``; one without ignores KV slots and
        positions. Tokens past position context_limit - 1 are never verified."""
        ...


@runtime_checkable
class ModelSet(Protocol):
    """What ``Runtime(models=...)`` takes: the target and the drafters a launch may use.

    A drafter the launch's algorithm does not use may be None (an engine with only an MTP
    head gives ``dspark=None``); ``ReferenceModels`` is one such set."""

    @property
    def target(self) -> TargetModel: ...

    @property
    def mtp(self) -> MtpDrafter | None: ...

    @property
    def dspark(self) -> DSparkDrafter | None: ...


def protocol_members(protocol: type) -> tuple[str, ...]:
    """The attributes and methods a protocol requires, its bases' included, in a stable
    order (what ``isinstance`` checks, by name, so a refusal can say which one is missing)."""
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*getattr(cls, "__annotations__", {}), *vars(cls)):
            if not name.startswith("_"):
                names[name] = None
    return tuple(names)


def missing_member(model: object, protocol: type) -> str | None:
    """What ``model`` lacks of ``protocol``, said as what it has ("no verify", "a draft that
    cannot be called as draft(hidden, ...)": a drafter written to another version of the
    protocol, say), or None when it provides it all."""
    for name in protocol_members(protocol):
        if not has_member(model, name):
            return f"no {name}"
        required = getattr(protocol, name, None)
        if not callable(required):
            continue
        method = getattr(model, name)
        if not callable(method):
            return f"no {name}"
        if not _callable_as(method, required):
            return (f"a {name} that cannot be called as "
                    f"{name}({', '.join(_parameters(required))})")
    return None


def has_member(model: object, name: str) -> bool:
    """Whether ``model`` has ``name``, found without running a property where it can be (a
    ``num_kv_slots`` that only works once ``allocate`` ran, an ``identity`` that raises: those
    are read, and their errors named, elsewhere); a member only ``__getattr__`` provides is
    read, and one whose reading raises anything but AttributeError counts as present."""
    try:
        inspect.getattr_static(model, name)
        return True
    except AttributeError:
        pass
    try:
        getattr(model, name)
    except AttributeError:
        return False
    except Exception:
        return True
    return True


def _parameters(function: object) -> list[str]:
    """The parameters a protocol method is called with, ``self`` left out."""
    return list(inspect.signature(function).parameters)[1:]  # type: ignore[arg-type]


def _callable_as(method: object, required: object) -> bool:
    """Whether ``method`` accepts the positional arguments the protocol's ``required`` is
    called with (a method whose signature cannot be read is given the benefit)."""
    try:
        signature = inspect.signature(method)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*_parameters(required))
    except TypeError:
        return False
    return True
