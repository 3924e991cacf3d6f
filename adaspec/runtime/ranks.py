"""Ranks in lockstep: the front (rank 0) takes requests, every rank decodes them in step.

Each rank runs its own pipeline loop. What a loop decides (which requests join, which end,
when it stops) must be the same on every rank, or the ranks would issue different
collectives and hang. Requests, cancellations and the stop reach the front only, so once
per loop turn the front shares a ``Plan`` with every rank, and every rank applies it at
the same point of its loop. Everything else a loop decides follows from state the ranks
already share: the same admitted requests, the same tokens (TP rank 0's draws are
broadcast in the round) and therefore the same feedback for the policies.

A plan travels as JSON over the host group's broadcast: it holds only ints, floats and
lists. While the front has nothing to do it still sends an empty plan every
``heartbeat_s``, so a rank that waits for the next plan can tell a quiet front from a dead
one by the collective timeout.
"""

import asyncio
import json
from dataclasses import asdict, dataclass

from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError
from adaspec.runtime.devices.collectives import Collectives
from adaspec.runtime.requests import Request


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as the front received it."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams

    @classmethod
    def of(cls, request: Request) -> "Arrival":
        return cls(id=request.id, prompt=request.prompt, params=request.params)

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
        return json.dumps({"arrivals": [[a.id, list(a.prompt), asdict(a.params)]
                                        for a in self.arrivals],
                           "cancels": list(self.cancels), "stop": self.stop,
                           "point": None if self.point is None else asdict(self.point)}
                          ).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Plan":
        raw = json.loads(data)
        arrivals = tuple(Arrival(id=number, prompt=tuple(prompt),
                                 params=SamplingParams(**{**params, "stop": tuple(params["stop"])}))
                         for number, prompt, params in raw["arrivals"])
        point = None if raw["point"] is None else ForcedPoint(**raw["point"])
        return cls(arrivals=arrivals, cancels=tuple(raw["cancels"]), stop=raw["stop"],
                   point=point)


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

    async def agree(self, proposal: Plan) -> Plan:
        """The front's plan on every rank; a follower's ``proposal`` is ignored. Runs in a
        worker thread: a follower waits here for the front, and the loop stays free."""
        data = proposal.encode() if self.front else b""
        shared = await asyncio.to_thread(self.collectives.share_from_first_rank, data,
                                         "plan")
        return proposal if self.front else Plan.decode(shared)
