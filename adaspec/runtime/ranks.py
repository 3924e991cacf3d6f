"""Ranks in lockstep: the front (rank 0) takes requests, every rank decodes them in step.

Each rank runs its own pipeline loop. What a loop decides (which requests join, which end,
when it stops) must be the same on every rank, or the ranks would issue different
collectives and hang. Requests, cancellations and the stop reach the front only, so once
per loop turn the front shares a ``Plan`` with every rank, and every rank applies it at
the same point of its loop. Within a DP shard everything else a loop decides follows from
state its TP ranks already share: the same admitted requests, the same tokens (TP rank 0's
draws are broadcast in the round) and therefore the same feedback for the policies.

A plan travels as JSON over the host group's broadcast: it holds only ints, floats and
lists. While the front has nothing to do it still sends an empty plan every
``heartbeat_s``, so a rank that waits for the next plan can tell a quiet front from a dead
one by the collective timeout.

With DP shards the ranks no longer decode the same requests: the front assigns each
arrival to a shard in the plan, and each shard's state (its batch, what its rounds
retired) is its own. So once per loop turn, after admission, every rank also gathers every
shard's ``ShardTurn``: the feedback its rounds retired, the batch its next round holds and
whether it still has work. From that every rank observes the same feedback in the same
order (round, then shard) and builds the same decision contexts, so every shard decides the
same depth and G, and every rank agrees whether a round runs at all, and when to stop. The
front takes the tokens of the requests other shards decode from their turns.
"""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError, ConsensusMismatch
from adaspec.policies.base import RoundFeedback
from adaspec.runtime.devices.collectives import Collectives
from adaspec.runtime.requests import Request


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as the front received it."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    shard: int = 0  # the DP shard the front assigned it to

    @classmethod
    def of(cls, request: Request, shard: int = 0) -> "Arrival":
        return cls(id=request.id, prompt=request.prompt, params=request.params, shard=shard)

    def request(self) -> Request:
        return Request(id=self.id, prompt=self.prompt, params=self.params)


@dataclass(frozen=True, slots=True)
class ForcedPoint:
    """The (Bcap, depth, G) a calibration window measures: its forced policies decide it for
    a full bucket of the window's requests."""

    bucket: int
    depth: int
    rows: int


@dataclass(frozen=True, slots=True)
class Plan:
    """What every rank applies at the same point of one loop turn."""

    arrivals: tuple[Arrival, ...] = ()
    cancels: tuple[int, ...] = ()
    stop: bool = False
    point: ForcedPoint | None = None  # calibration: the next window's point

    def encode(self) -> bytes:
        return json.dumps({"arrivals": [[a.id, list(a.prompt), asdict(a.params), a.shard]
                                        for a in self.arrivals],
                           "cancels": list(self.cancels), "stop": self.stop,
                           "point": None if self.point is None else asdict(self.point)}
                          ).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Plan":
        raw = json.loads(data)
        arrivals = tuple(Arrival(id=number, prompt=tuple(prompt),
                                 params=SamplingParams(**{**params, "stop": tuple(params["stop"])}),
                                 shard=shard)
                         for number, prompt, params, shard in raw["arrivals"])
        point = None if raw["point"] is None else ForcedPoint(**raw["point"])
        return cls(arrivals=arrivals, cancels=tuple(raw["cancels"]), stop=raw["stop"],
                   point=point)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a request that a shard behind the front decodes got since that shard's last turn:
    its new tokens and its counts so far, and its end once it ended."""

    id: int
    tokens: tuple[int, ...]
    rounds: int
    verified: int
    accepted: int
    end: str = ""  # "" while it runs, else its finish reason ("failed": ``message`` says why)
    message: str = ""


@dataclass(frozen=True, slots=True)
class ShardTurn:
    """What one DP shard tells every rank once per loop turn, after admission."""

    shard: int
    retired: tuple[RoundFeedback, ...] = ()  # its rounds retired since its last turn
    deliveries: tuple[Delivery, ...] = ()  # for the front (empty on the front's own shard)
    request_ids: tuple[int, ...] = ()  # its next round's batch; empty: the shard is idle
    max_kv_length: int = 0  # the KV bound of that batch (``Pipeline._kv_bound``)
    waiting: int = 0  # requests it holds that no round includes yet
    pending: bool = False  # device work it has not retired yet
    decided: tuple[int, int, int] = (-1, 0, 0)  # its newest round's (n, depth, G)

    def encode(self) -> bytes:
        return json.dumps({"shard": self.shard,
                           "retired": [f.as_dict() for f in self.retired],
                           "deliveries": [asdict(d) for d in self.deliveries],
                           "request_ids": list(self.request_ids),
                           "max_kv_length": self.max_kv_length, "waiting": self.waiting,
                           "pending": self.pending, "decided": list(self.decided)}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "ShardTurn":
        raw = json.loads(data)
        return cls(shard=raw["shard"],
                   retired=tuple(map(RoundFeedback.from_dict, raw["retired"])),
                   deliveries=tuple(Delivery(**{**d, "tokens": tuple(d["tokens"])})
                                    for d in raw["deliveries"]),
                   request_ids=tuple(raw["request_ids"]), max_kv_length=raw["max_kv_length"],
                   waiting=raw["waiting"], pending=raw["pending"],
                   decided=tuple(raw["decided"]))


@dataclass(frozen=True, slots=True)
class ShardsView:
    """Every shard's turn, in shard order: what every rank decides the next round from."""

    turns: tuple[ShardTurn, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every shard's B for the next round."""
        return tuple(len(turn.request_ids) for turn in self.turns)

    @property
    def num_reqs(self) -> int:
        """The largest B: the common physical graph must hold it (0: no round runs)."""
        return max(self.sizes)

    @property
    def request_ids(self) -> tuple[int, ...]:
        return tuple(id for turn in self.turns for id in turn.request_ids)

    @property
    def max_kv_length(self) -> int:
        return max(turn.max_kv_length for turn in self.turns)

    @property
    def pending(self) -> bool:
        return any(turn.pending for turn in self.turns)

    @property
    def waiting(self) -> bool:
        return any(turn.waiting for turn in self.turns)

    def check_decided(self) -> None:
        """Every shard decided its newest round's depth and G alike. A shard that diverged
        (a bug) is stopped here, before it runs another round unlike the others: no
        collective inside a round spans the shards, so nothing else would notice."""
        if len({turn.decided for turn in self.turns}) > 1:
            raise ConsensusMismatch("each shard's newest (round, depth, G)",
                                    tuple(value for turn in self.turns
                                          for value in turn.decided))

    def retired(self) -> list[RoundFeedback]:
        """Every shard's retired feedback in the order each rank observes it: by round, then
        by shard."""
        return sorted((f for turn in self.turns for f in turn.retired),
                      key=lambda f: (f.round, f.shard))


class FollowerRefused(AdaspecError):
    """A request given to a rank that only follows the front."""


class RankFault(AdaspecError):
    """A round failed on this rank alone: the others would commit it, so this rank stops
    serving and they fail at their next collective."""

    def __init__(self, rank: int, round: int, stage: str, error: BaseException) -> None:
        first_line = str(error).splitlines()[0] if str(error) else ""
        super().__init__(f"rank {rank}: round {round} failed in {stage} "
                         f"({type(error).__name__}: {first_line}); the ranks can no longer "
                         "commit alike")


class RankLink:
    """One rank's side of the lockstep: the front proposes each plan, the others follow."""

    def __init__(self, collectives: Collectives, rank: int, heartbeat_s: float) -> None:
        self.collectives = collectives
        self.rank = rank
        self.front = rank == 0
        self.heartbeat_s = heartbeat_s
        self.shard, self.dp_size = collectives.dp_rank, collectives.dp_size
        self.tp_size = collectives.tp_size
        # Its own worker thread: a follower waits there for the front most of the time, and
        # several runtimes in one process (the bench's arms) would otherwise fill the
        # default executor with waits and hold back the runtime that has work.
        self._worker = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix=f"adaspec-rank{rank}")

    def close(self) -> None:
        """Let the worker thread go once its collective returned (a failed or closed process
        group ends it)."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, op: str, data: bytes, share: bool) -> "bytes | list[bytes]":
        call = self.collectives.share_from_first_rank if share else \
            self.collectives.gather_from_every_rank
        return await asyncio.get_running_loop().run_in_executor(self._worker, call, data, op)

    async def agree(self, proposal: Plan) -> Plan:
        """The front's plan on every rank; a follower's ``proposal`` is ignored. Runs in a
        worker thread: a follower waits here for the front, and the loop stays free."""
        data = proposal.encode() if self.front else b""
        shared = await self._off_loop("plan", data, share=True)
        assert isinstance(shared, bytes)
        return proposal if self.front else Plan.decode(shared)

    async def exchange(self, turn: ShardTurn) -> ShardsView:
        """Every shard's turn on every rank. The TP ranks of a shard hold the same state, so
        only its TP rank 0 sends one; the others send nothing."""
        data = turn.encode() if self.rank % self.tp_size == 0 else b""
        gathered = await self._off_loop("shard_turn", data, share=False)
        assert isinstance(gathered, list)
        return ShardsView(tuple(ShardTurn.decode(gathered[shard * self.tp_size])
                                for shard in range(self.dp_size)))
