"""What a policy sees and decides: the contexts of the two decisions of a round, the feedback
of a retired round, and the two policy protocols.

Policies are pure and replayable: they run on host values only (no torch, no runtime), see
feedback retired through round n-2 when they decide round n, and never read a clock. Given the
same sequence of ``observe`` and ``decide`` calls a policy makes the same decisions, which is
what ``adaspec replay`` checks.
"""

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundFeedback:
    """What one retired round tells the policies. Per-request fields are in batch order.

    Acceptance length (AL) of a request = its ``num_accepted`` + 1: it counts the residual or
    bonus token. Positions past a request's verify length were not verified: they say nothing
    about acceptance (censoring), which is why ``verify_lengths`` travels with the counts.
    """

    round: int
    num_reqs: int  # B: live requests in the round
    num_reqs_bucket: int  # Bcap: the physical request bucket
    width: int  # w: drafted tokens per request (MTP: depth d, padded to w)
    depth: int  # d: sequential draft steps run (w for DSpark and fixed MTP)
    num_rows: int  # G: padded target rows verified
    verify_lengths: tuple[int, ...]  # [B] drafted tokens verified per request
    num_accepted: tuple[int, ...]  # [B] drafted tokens accepted per request
    confidences: tuple[tuple[float, ...], ...] = ()  # [B, w] conditional confidences, if any
    request_ids: tuple[int, ...] = ()  # [B] which request each entry is
    shard: int = 0  # the DP shard that ran it (request ids are per shard)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RoundFeedback":
        """Rebuild from ``as_dict`` output (JSON lists become tuples again)."""
        return cls(round=data["round"], num_reqs=data["num_reqs"],
                   num_reqs_bucket=data["num_reqs_bucket"], width=data["width"],
                   depth=data["depth"], num_rows=data["num_rows"],
                   verify_lengths=tuple(data["verify_lengths"]),
                   num_accepted=tuple(data["num_accepted"]),
                   confidences=tuple(tuple(row) for row in data["confidences"]),
                   request_ids=tuple(data.get("request_ids", ())), shard=data.get("shard", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class DepthContext:
    """Inputs of the draft-depth decision of round ``round``."""

    round: int
    num_reqs: int  # B
    num_reqs_bucket: int  # Bcap
    width: int  # w: the largest depth
    retired_through: int  # newest round whose feedback was observed (-1: none yet)
    max_kv_length: int = 0
    """Bound on the longest context this round can reach, which selects the depth profile
    (the same bound as the round's ``BudgetContext``). 0: not recorded (a log written before
    depth decisions recorded it; its depths were priced by the first depth profile)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetContext:
    """Inputs of the verification-budget decision of round ``round``."""

    round: int
    num_reqs: int  # B
    num_reqs_bucket: int  # Bcap
    width: int  # w
    depth: int  # d chosen for this round: at most B * (d + 1) rows are useful
    legal_rows: tuple[int, ...]  # legal padded target rows G for this bucket, ascending
    retired_through: int  # newest round whose feedback was observed (-1: none yet)
    request_ids: tuple[int, ...] = ()  # [B] the batch's requests, in batch order
    max_kv_length: int = 0  # bound on the longest context this round can reach (coverage)
    shard_sizes: tuple[int, ...] = ()
    """DP: every shard's B, in shard order; ``request_ids`` then lists shard 0's requests,
    then shard 1's, and ``num_reqs`` is the largest B (the common physical graph must hold
    it). Every shard builds the same context, so all choose one G and allocate their own
    rows. Empty: one shard."""

    def batches(self) -> list[tuple[int, tuple[int, ...]]]:
        """(shard, its request ids) of every shard, in shard order."""
        if not self.shard_sizes:
            return [(0, self.request_ids)]
        out, start = [], 0
        for shard, size in enumerate(self.shard_sizes):
            out.append((shard, self.request_ids[start:start + size]))
            start += size
        return out

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PolicyStatistics:
    """A frozen snapshot of a policy's counters."""

    name: str
    decisions: int
    observed: int
    values: Mapping[str, object] = field(default_factory=dict)


@runtime_checkable
class DepthPolicy(Protocol):
    """Chooses the draft depth d (1..w) of a round before its draft stage."""

    name: str

    def decide(self, context: DepthContext) -> int: ...

    def observe(self, feedback: RoundFeedback) -> None: ...

    def statistics(self) -> PolicyStatistics: ...

    def settings(self) -> dict[str, object]:
        """What rebuilds this policy for replay (recorded in the event log header)."""
        ...


@runtime_checkable
class BudgetPolicy(Protocol):
    """Chooses the padded target rows G of a round, among ``context.legal_rows``."""

    name: str

    def decide(self, context: BudgetContext) -> int: ...

    def observe(self, feedback: RoundFeedback) -> None: ...

    def statistics(self) -> PolicyStatistics: ...

    def settings(self) -> dict[str, object]: ...


def covering_tier(legal_rows: Sequence[int], num_reqs: int, depth: int) -> int:
    """The smallest tier that verifies every drafted token of every request: B * (d + 1)
    rows rounded up (the largest tier when none covers it)."""
    need = num_reqs * (depth + 1)
    for rows in legal_rows:
        if rows >= need:
            return rows
    return legal_rows[-1]


def covering_rows(context: BudgetContext, depth: int) -> int:
    """``covering_tier`` among a budget decision's legal rows."""
    return covering_tier(context.legal_rows, context.num_reqs, depth)
