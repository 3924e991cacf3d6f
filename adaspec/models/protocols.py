"""What the runtime needs from a target model and from each kind of drafter.

An engine plugs its own models in by implementing these protocols; the reference models in
this package implement them on the CPU, CUDA or an NPU. Every method takes and returns device
tensors and never reads a value back to the host, so a round can be enqueued without waits.

Positions and rows. A request's committed tokens are ``x_0 .. x_n``; the target's KV cache
holds ``x_0 .. x_{n-1}`` and ``x_n`` (the newest token, sampled last round) is the **anchor**.
A round verifies rows ``[x_n, d_1, .., d_k]`` at positions ``n .. n+k``: the row at offset ``j``
yields the target's distribution for position ``n+j+1``. Rows of all requests are packed into
one padded tensor of G rows (a prepared bucket), with the anchor row always present.

KV consistency. ``verify`` writes each row's keys and values at its position before attending,
and a query at position p reads only positions <= p of its own slot. Rows of a rejected suffix
therefore sit past the committed length and are overwritten before anything can read them:
after a rejection the cache behaves as if the suffix had never been verified, with no
rollback copy (see tests/test_reference_models.py).
"""

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class VerifyRows:
    """Packed verification rows of one round, padded to a prepared row bucket G."""

    token_ids: Tensor  # [G] int64: each request's anchor token, then its drafted tokens
    row_reqs: Tensor  # [G] int64: batch index (0 .. Bcap-1) of each row's request
    row_offsets: Tensor  # [G] int64: 0 for the anchor row, k for draft position k
    row_valid: Tensor  # [G] bool: False for padding rows
    req_slots: Tensor  # [Bcap] int64: KV-cache slot of each batch entry (padding: scratch)
    req_starts: Tensor  # [Bcap] int64: position of each batch entry's anchor row
    rows_per_req: int  # R: the most rows one request can verify, min(w + 1, G) (static)

    @property
    def positions(self) -> Tensor:
        """[G] position of each row: its request's anchor position plus its offset. Derived,
        never packed separately, so it cannot disagree with the attention mask. The packer
        must keep every valid row below the context limit (cap the verify length at
        ``context_limit - 1 - anchor_position``)."""
        return self.req_starts.index_select(0, self.row_reqs) + self.row_offsets

    @classmethod
    def from_requests(cls, requests: list[tuple[int, int, list[int]]], *, num_rows: int,
                      num_reqs: int, rows_per_req: int, scratch_slot: int,
                      device: torch.device | str = "cpu") -> "VerifyRows":
        """Host-side factory for tests and eager callers: ``requests`` lists
        ``(slot, anchor_position, [anchor, d_1, ..])``; pads to ``num_reqs`` batch entries
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
        slots = [slot for slot, _, _ in requests] + [scratch_slot] * (num_reqs - len(requests))
        starts = [start for _, start, _ in requests] + [0] * (num_reqs - len(requests))

        def tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            token_ids=tensor(token_ids + [0] * padding),
            row_reqs=tensor(reqs + [0] * padding),
            row_offsets=tensor(offsets + [0] * padding),
            row_valid=torch.arange(num_rows, device=device) < used,
            req_slots=tensor(slots),
            req_starts=tensor(starts),
            rows_per_req=rows_per_req,
        )


@dataclass(frozen=True, slots=True)
class TargetOutput:
    """The target's output for packed rows (verify) or for each request's last prompt token."""

    logits: Tensor  # [G, vocab] (prefill: [B, vocab])
    hidden: Tensor  # [G, hidden_size] final hidden state a drafter conditions on


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """Prefill of whole prompts, right-padded to the longest; what ``hidden`` holds past a
    prompt's length is unspecified."""

    last: TargetOutput  # logits and hidden at each prompt's last position, [B, ...]
    hidden: Tensor  # [B, T, hidden_size] hidden state at every prompt position
    lengths: Tensor  # [B] int64 prompt lengths


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


@runtime_checkable
class CheckpointInfo(Protocol):
    identity: str
    """Stable hash of weights and configuration; cost tables are tied to it."""


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
    def num_slots(self) -> int:
        """Requests whose KV fits at once; slot ``num_slots`` is a scratch slot for padding."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the hidden states ``verify`` returns."""
        ...

    def allocate(self, num_slots: int) -> None:
        """(Re)allocate the KV cache for ``num_slots`` concurrent requests."""
        ...

    def prefill(self, prompts: list[Tensor], slots: Tensor) -> PrefillOutput:
        """Process whole prompts (``[T_i]`` int64 each) into the KV slots ``slots [B]``."""
        ...

    def verify(self, rows: VerifyRows) -> TargetOutput:
        """One forward over packed rows; writes their KV and returns logits and hidden."""
        ...


@runtime_checkable
class MtpDrafter(CheckpointInfo, Protocol):
    """A multi-token-prediction head drafting one token per sequential step."""

    def allocate(self, num_slots: int) -> None:
        """(Re)allocate the drafter's own KV context for ``num_slots`` requests."""
        ...

    def publish(self, hidden: Tensor, next_token_ids: Tensor, positions: Tensor,
                slots: Tensor) -> None:
        """Write the drafter's own context at committed positions: for position p, the
        target's hidden state at p and the token at p+1. Invalid rows use the scratch slot."""
        ...

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             slots: Tensor) -> MtpStep:
        """Draft the token after ``token_ids [N]`` from ``hidden [N, d]`` (the target's state
        for the first step, the previous step's ``MtpStep.hidden`` after that)."""
        ...


@runtime_checkable
class DSparkDrafter(CheckpointInfo, Protocol):
    """A parallel block drafter with a Markov head and a confidence head."""

    @property
    def max_width(self) -> int: ...

    def draft(self, hidden: Tensor, token_ids: Tensor, width: int) -> DSparkBlock:
        """Draft ``width`` tokens after ``token_ids [N]`` from the target's ``hidden [N, d]``."""
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
    """The first member of ``protocol`` that ``model`` lacks (a method must be callable),
    or None when it provides them all."""
    for name in protocol_members(protocol):
        if not hasattr(model, name):
            return name
        if callable(getattr(protocol, name, None)) and not callable(getattr(model, name)):
            return name
    return None
