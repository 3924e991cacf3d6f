"""The round loop: admission, decisions, submission over two pipeline slots, retirement.

The loop is one asyncio task. Before it submits round n it retires, in submission order,
every prefill and round up to n-2 (n-1 without schedule overlap): it streams their tokens,
finishes requests, frees KV slots no round in flight still uses, and lets the policies
observe each round's feedback (a request the round still in flight must end is left out of
later batches from then on). Then it admits waiting requests (their prefill is enqueued
ahead of the round), decides depth and G for round n from what it has observed, and
enqueues the round's stages: back to back as one stream item by default, so one completion
a round reaches the loop and moves the round through all its states in order (one
completion per stage with the task pipeline off). A failed stage fails the round through
one handler.

With DP shards (ranks.py) the policies observe a round's feedback at the next loop turn
instead, once every shard's turn brought its own, so that every shard observes the same
feedback in the same order; each shard still logs its own round as it retires.
"""

import asyncio
import enum
import functools
import hashlib
import numbers
import operator
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from adaspec.config.launch import LaunchConfig
from adaspec.errors import AdaspecError
from adaspec.policies.base import (
    BudgetContext,
    BudgetPolicy,
    DepthContext,
    DepthPolicy,
    PolicyStatistics,
    RoundFeedback,
)
from adaspec.runtime.devices.buckets import Binding, BindingRegistry, BucketGeometry
from adaspec.runtime.devices.commit import FINISHED_LENGTH, FINISHED_STOP
from adaspec.runtime.devices.sampling import SamplingTensors
from adaspec.runtime.devices.streams import Completion, DeviceStream
from adaspec.runtime.events.bus import EventBus
from adaspec.runtime.events.clock import Clock, clock_fault
from adaspec.runtime.events.types import (
    BudgetDecided,
    DepthDecided,
    RequestArrived,
    RequestFinished,
    RoundFailed,
    RoundRetired,
    RoundSubmitted,
    ShardRetired,
    StageCompleted,
)
from adaspec.runtime.kv_slots import HoldsKvSlot, KvSlotPool
from adaspec.runtime.ranks import (
    Arrival,
    Delivery,
    ForcedPoint,
    Plan,
    RankFault,
    RankLink,
    ShardsView,
    ShardTurn,
)
from adaspec.runtime.requests import Request, RequestFailed
from adaspec.runtime.rounds import (
    DeviceContext,
    PrefillInputs,
    PrefillResult,
    RetiredRound,
    RoundInputs,
    RoundWork,
    StageFailed,
    prefill,
    stop_tensor,
)
from adaspec.runtime.split import SplitBinding
from adaspec.runtime.states import DONE_TRIGGER, FAIL_TRIGGER, STAGES, RoundHooks, RoundMachine

FINISH_REASONS = {FINISHED_STOP: "stop", FINISHED_LENGTH: "length"}
CONTEXT_LENGTH = operator.attrgetter("length")


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """A prefill on the stream. It retires together with ``round``, the first round that can
    include its requests, so it never adds a host wait of its own."""

    completion: Completion[PrefillResult]
    admitted: list[Request]
    inputs: PrefillInputs  # rides along until retirement: its device memory outlives the work
    round: int


class Step(enum.Enum):
    """What one turn of the loop left to do."""

    BUSY = "busy"  # it ran or retired something: take the next turn at once
    IDLE = "idle"  # nothing to run: wait for something to change
    DONE = "done"  # stopped, and nothing is left


@dataclass(frozen=True, slots=True)
class IdleRound:
    """A round that every other DP shard runs while this one has no request: it decides
    alike and takes the round's number, and has nothing to run or retire."""

    round: int


@dataclass(frozen=True, slots=True)
class CommonBatch:
    """What a round's decisions see of its batch: this shard's, or with DP shards every
    shard's (the common physical graph holds the largest)."""

    num_reqs: int  # B (the largest shard's with DP)
    bucket: int  # Bcap
    legal_rows: tuple[int, ...]
    request_ids: tuple[int, ...]
    max_kv_length: int
    shard_sizes: tuple[int, ...] = ()


@dataclass(slots=True)
class RoundRecord:
    """A submitted round as the host tracks it until it retires."""

    round: int
    slot: int
    batch: list[Request]
    num_reqs_bucket: int
    depth: int
    num_rows: int
    machine: RoundMachine
    work: RoundWork  # held until retirement: its device tensors must outlive the device work
    request_ids: tuple[int, ...] = ()  # [B] of the batch, in batch order
    retired: Completion[RetiredRound] | None = None
    error: BaseException | None = None
    failed_stage: str = ""
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What the host derives from the requests of a batch. A batch stays the same round after
    round until a request joins or ends, so this is built once per composition, not once per
    round."""

    batch: list[Request]  # never mutated: rounds in flight keep a reference to it
    bucket: int  # Bcap
    kv_slots: torch.Tensor  # [Bcap] KV slot of each entry, padded with the scratch KV slot
    request_ids: tuple[int, ...]  # [B]
    legal_rows: tuple[int, ...]  # legal G of the bucket
    all_greedy: bool
    any_stop: bool


@dataclass(slots=True, kw_only=True)
class Counters:
    """What a runtime counts while it serves. AL (acceptance length) counts the residual or
    bonus token."""

    rounds_submitted: int = 0
    rounds_retired: int = 0
    rounds_failed: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    tokens_generated: int = 0
    drafted_verified: int = 0
    drafted_accepted: int = 0
    request_rounds: int = 0  # sum over rounds of the requests each one advanced
    rows_verified: int = 0  # padded target rows G summed over retired rounds
    # (verify length, accepted) -> request-rounds
    outcomes: Counter[tuple[int, int]] = field(default_factory=Counter)
    max_rounds_in_flight: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Mean AL per request and round: (accepted + request-rounds) / request-rounds."""
        if not self.request_rounds:
            return 0.0
        return (self.drafted_accepted + self.request_rounds) / self.request_rounds


@dataclass(slots=True, kw_only=True)
class RuntimeStatistics(Counters):
    """A snapshot of the counts (a copy: the runtime goes on counting in its own), with each
    policy's own statistics."""

    depth_policy: PolicyStatistics
    budget_policy: PolicyStatistics


class Pipeline:
    """The host side of the runtime once started (see the module docstring)."""

    def __init__(self, *, launch: LaunchConfig, ctx: DeviceContext, stream: DeviceStream,
                 geometry: BucketGeometry, registries: list[BindingRegistry] | None,
                 depth_policy: DepthPolicy, budget_policy: BudgetPolicy, bus: EventBus,
                 clock: Clock, hooks: RoundHooks, seed: int, link: RankLink | None = None
                 ) -> None:
        self.ctx = ctx
        self.stream = stream
        self.geometry = geometry
        self.registries = registries
        self.depth_policy = depth_policy
        self.budget_policy = budget_policy
        self.bus = bus
        self.publish = bus.publish
        self.now = clock.now
        self.clock = clock
        self.hooks = hooks
        self.seed = seed
        self.width = launch.num_speculative_tokens
        self.lag = 2 if launch.enable_schedule_overlap else 1
        self.split = not launch.enable_unified_mtp_graph
        self.pipelined = launch.enable_task_pipeline
        self.max_batch = launch.decode_batch_limit
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.kv_slots = KvSlotPool(ctx.states.scratch)
        self.ending: list[Request] = []  # left out of rounds until their last round retires
        # Device work not yet retired, in stream order.
        self.pending: deque[PendingPrefill | RoundRecord | IdleRound] = deque()
        self._legal_rows: dict[int, tuple[int, ...]] = {}
        # Bumped whenever a request joins ``active`` or ends: the batch facts are rebuilt then.
        self._composition = 0
        self._facts: tuple[int, BatchFacts | None] = (-1, None)
        self.next_round = 0
        self.retired_through = -1
        self.counters = Counters()
        self.in_flight: set[int] = set()  # rounds submitted and not yet retired
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while nothing waits, runs or awaits retirement
        self.stopping = False
        self.fault: BaseException | None = None
        # Several ranks: what reaches the front waits here for the next plan (ranks.py).
        self.link = link
        self.arrived: list[Request] = []
        self.cancelled: list[int] = []
        # Cancels asked while a round's retirement is told (a subscriber reacting to a
        # finish): applied once its round_retired is published, so a request ends after the
        # round whose tokens it holds, and one the round ended keeps its own reason.
        self.deferred_cancels: list[Request] | None = None
        self.stop_asked = False
        self.commits = hashlib.sha256()
        # DP shards (ranks.py): the shard's retired feedback until the next turn shares it;
        # behind the front, what its requests got since; on the front, the requests that
        # other shards decode, by id.
        self.sharded = link is not None and link.dp_size > 1
        self.shard = 0 if link is None else link.shard
        self.unshared: list[RoundFeedback] = []
        self.reported: dict[int, int] = {}  # tokens of each request sent to the front
        self.ended_since: list[Request] = []
        self.remote: dict[int, tuple[int, Request]] = {}
        self.decided: tuple[int, int, int] = (-1, 0, 0)  # the newest round's (n, d, G)
        # Calibration: how its forced policies take a window's point, and the point waiting
        # for the next plan.
        self.apply_point: Callable[[ForcedPoint], None] | None = None
        self.point: ForcedPoint | None = None

    def add(self, request: Request) -> None:
        # Runtime.submit refuses requests on a rank behind the front (FollowerRefused).
        assert self.link is None or self.link.front, "requests reach followers by plan"
        (self.waiting if self.link is None else self.arrived).append(request)
        self.idle.clear()
        self.wake.set()

    def find(self, request_id: int) -> Request | None:
        """A request that has not ended, by id (ended ones are forgotten)."""
        found = next((r for r in (*self.active, *self.waiting, *self.arrived)
                      if r.id == request_id), None)
        if found is None and request_id in self.remote:
            found = self.remote[request_id][1]
        return found

    def cancel(self, request: Request) -> None:
        """Cancellation between rounds: the request ends now (with several ranks, at the
        next plan, so every rank ends it after the same round; one that another DP shard
        decodes ends on the front when that shard's turn says so); rounds in flight that
        include it still run, their tokens for it are dropped, and its KV slot is freed after
        them."""
        if self.link is None:
            if self.deferred_cancels is not None:
                self.deferred_cancels.append(request)
            else:
                self._finish(request, "cancelled")
            return
        if request.id not in self.cancelled:
            self.cancelled.append(request.id)
        self.wake.set()

    def force(self, point: ForcedPoint) -> None:
        """Calibration: measure ``point`` from now on (with several ranks, from the next plan,
        so every rank decides the same G and depth in the same rounds)."""
        assert self.apply_point is not None
        if self.link is None:
            self.apply_point(point)
            return
        self.point = point
        self.wake.set()

    def stop(self) -> None:
        if self.link is None:
            self.stopping = True
        self.stop_asked = True
        self.wake.set()

    # --- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """The loop; an internal error fails every request (one line each, naming it) and
        stops the loop cleanly instead of leaving requests waiting forever."""
        try:
            await self._loop()
        except Exception as error:
            self.fault = error
            self.fail_all(f"runtime fault: {type(error).__name__}: {error}")
        except BaseException as error:  # cancelled or interrupted: no request is left waiting
            self.fault = error
            self.fail_all(f"runtime stopped: its loop was interrupted "
                                  f"({type(error).__name__})")
            raise
        finally:
            await self._drain()
            self.idle.set()  # nobody waits for a loop that has ended

    async def _drain(self) -> None:
        while self.pending:
            try:
                await self._retire_next()
            except Exception as error:  # a second fault while draining: still end cleanly
                self.fault = self.fault or error
                self.fail_all(f"runtime fault: {type(error).__name__}: {error}")

    def fail_all(self, reason: str) -> None:
        """Fail every request that has not ended (the loop can no longer serve them). An
        interrupt raised while one is retired (a subscriber's ``KeyboardInterrupt``) is raised
        once every request has ended, not before."""
        interrupt: BaseException | None = None
        for request in [*self.active, *self.waiting]:
            if request.running:
                try:
                    self._fail_request(request, reason)
                except BaseException as error:  # the request has ended: end the others too
                    interrupt = interrupt or error
        # No rank recorded these (the front's waiting for the next plan, other shards'
        # requests): each ends without an event of this rank's.
        for request in [*self.arrived, *(request for _, request in self.remote.values())]:
            if request.running:
                request.fail(RequestFailed(request.id, reason))
                self.counters.requests_failed += 1
        self.remote.clear()
        self.waiting.clear()
        self.arrived.clear()
        if interrupt is not None:
            raise interrupt

    async def _loop(self) -> None:
        while True:
            fault = clock_fault(self.clock)  # raised here, where failing every request is safe
            if fault is not None:
                raise fault
            await self._retire_due()
            if self.link is not None:
                await self._agree(self.link)
            self._admit()
            facts = self._batch_facts()
            step = await (self._shard_step(facts) if self.sharded else self._own_step(facts))
            if step is Step.DONE:
                return
            if step is Step.IDLE:
                await self._wait()

    async def _own_step(self, facts: BatchFacts | None) -> Step:
        """One rank, or TP ranks in lockstep: run a round if there is a batch, else retire
        what the device finished."""
        if facts is not None:
            await self._submit(facts, self._own_batch(facts))
            return Step.BUSY
        if self.pending:
            await self._retire_next()
            return Step.BUSY
        return Step.DONE if self.stopping and not self.waiting else Step.IDLE

    async def _shard_step(self, facts: BatchFacts | None) -> Step:
        """DP shards: every shard's turn decides for all of them whether a round runs (an
        idle shard takes part), whether to retire, and when to stop."""
        assert self.link is not None
        view = await self.link.exchange(self._turn(facts))
        view.check_decided()
        self._take_turns(view)
        if view.num_reqs:
            await self._submit(facts, self._common_batch(view))
            return Step.BUSY
        if view.pending:  # every shard retires all it has: round numbers stay common
            while self.pending:
                await self._retire_next()
            return Step.BUSY
        if self.stopping and not view.waiting:
            # Every shard has ended all it held; a handle still open here would wait forever.
            self.fail_all("runtime stopped: its shard ended without reporting the request")
            return Step.DONE
        return Step.IDLE


    async def _wait(self) -> None:
        """Nothing to run: wait for a request, a cancellation or the stop (with several
        ranks, for the next plan)."""
        self.wake.clear()
        self.idle.set()
        if self.link is None:
            await self.wake.wait()
        elif self.link.front and not (self.arrived or self.cancelled or self.stop_asked
                                      or self.point):
            # A follower goes straight to the next plan; the front sends one when
            # something changes, or an empty one each heartbeat.
            try:
                await asyncio.wait_for(self.wake.wait(), self.link.heartbeat_s)
            except TimeoutError:
                pass

    async def _agree(self, link: RankLink) -> None:
        """Apply the front's plan: its new requests of this shard join ``waiting``, its
        cancellations end this shard's requests, its stop stops the loop, on every rank at
        this same point."""
        proposal = Plan(arrivals=self._assign(self.arrived), cancels=tuple(self.cancelled),
                        stop=self.stop_asked, point=self.point)
        plan = await link.agree(proposal)
        # Taken off only once shared: a plan that failed leaves them for fail_all, and what
        # came in during the agreement waits for the next plan.
        arrived = self.arrived[:len(proposal.arrivals)]
        del self.arrived[:len(proposal.arrivals)], self.cancelled[:len(proposal.cancels)]
        if self.point is proposal.point:
            self.point = None
        if plan.point is not None and self.apply_point is not None:
            self.apply_point(plan.point)
        self._take_arrivals(plan.arrivals, arrived if link.front else
                            [a.request() for a in plan.arrivals])
        for request_id in plan.cancels:
            ended = self.find(request_id)
            if ended is not None and ended.running and request_id not in self.remote:
                self._finish(ended, "cancelled")  # a remote one: its shard's turn ends it
        if plan.stop:
            self.stopping = True

    def _take_arrivals(self, arrivals: tuple[Arrival, ...], requests: list[Request]) -> None:
        """This shard's arrivals join ``waiting``; the front keeps the others' handles, whose
        shards' turns bring their tokens."""
        mine = []
        for request, arrival in zip(requests, arrivals, strict=True):
            if arrival.shard == self.shard:
                mine.append(request)
            elif self.link is not None and self.link.front:
                self.remote[request.id] = (arrival.shard, request)
        if self.bus.listening:  # each rank's event log tells of every request it decodes
            for request in mine:
                self.publish(RequestArrived.of(request, self.now()))
        self.waiting.extend(mine)

    # --- DP shards (ranks.py) --------------------------------------------------------------
    def _assign(self, arrivals: list[Request]) -> tuple[Arrival, ...]:
        """The front puts each arrival on the shard with the fewest requests not ended
        (ties: the lowest shard)."""
        if not self.sharded:
            return tuple(map(Arrival.of, arrivals))
        assert self.link is not None
        load = [0] * self.link.dp_size
        ending = set(self.cancelled)  # their shards end them at this very plan

        def counts(request: Request) -> bool:
            return request.running and request.id not in ending

        load[self.shard] = sum(map(counts, (*self.active, *self.waiting)))
        for shard, request in self.remote.values():
            load[shard] += counts(request)
        assigned = []
        for request in arrivals:
            shard = load.index(min(load))
            load[shard] += 1
            assigned.append(Arrival.of(request, shard))
        return tuple(assigned)

    def _turn(self, facts: BatchFacts | None) -> ShardTurn:
        """This shard's turn: its feedback retired since the last one, its next batch, and
        (behind the front) what its requests got."""
        retired, self.unshared = tuple(self.unshared), []
        return ShardTurn(shard=self.shard, retired=retired,
                         deliveries=() if self.shard == 0 else self._deliveries(),
                         request_ids=() if facts is None else facts.request_ids,
                         max_kv_length=0 if facts is None else self._kv_bound(facts.batch),
                         waiting=len(self.waiting), pending=bool(self.pending),
                         decided=self.decided)

    def _deliveries(self) -> tuple[Delivery, ...]:
        out = []
        ended, self.ended_since = self.ended_since, []
        for request in (*self.active, *ended):
            sent = self.reported.get(request.id, 0)
            if len(request.tokens) == sent and request.running:
                continue
            end = "" if request.running else request.finish_reason or "failed"
            error = request.error
            message = getattr(error, "reason", str(error)) if error is not None else ""
            out.append(Delivery(id=request.id, tokens=tuple(request.tokens[sent:]),
                                rounds=request.rounds, verified=request.verified,
                                accepted=request.accepted, end=end, message=message))
            if request.running:
                self.reported[request.id] = len(request.tokens)
            else:
                self.reported.pop(request.id, None)
        return tuple(out)

    def _take_turns(self, view: ShardsView) -> None:
        """Observe every shard's retired feedback (each rank in the same order) and, on the
        front, hand other shards' requests what they got."""
        front = self.link is not None and self.link.front
        for feedback in view.retired():
            self.depth_policy.observe(feedback)
            self.budget_policy.observe(feedback)
            if feedback.shard == self.shard:
                continue  # its round_retired event was published as it retired
            if front:
                self._count_remote(feedback)
            if self.bus.listening:
                slot = feedback.round % 2 if self.lag == 2 else 0
                self.publish(ShardRetired(time=self.now(), round=feedback.round, slot=slot,
                                          feedback=feedback))
        if self.remote:
            for turn in view.turns:
                for delivery in turn.deliveries:
                    self._deliver_remote(delivery)

    def _count_remote(self, feedback: RoundFeedback) -> None:
        """The front's statistics count every shard's requests: another shard's round adds
        its request-rounds, drafts and rows (every shard takes part in every round, so the
        front counts each round once: rows per round sum over the shards)."""
        counters = self.counters
        counters.request_rounds += feedback.num_reqs
        counters.drafted_verified += sum(feedback.verify_lengths)
        counters.drafted_accepted += sum(feedback.num_accepted)
        counters.rows_verified += feedback.num_rows
        counters.outcomes.update(zip(feedback.verify_lengths, feedback.num_accepted,
                                     strict=True))

    def _deliver_remote(self, delivery: Delivery) -> None:
        entry = self.remote.get(delivery.id)
        if entry is None:
            return
        request = entry[1]
        request.rounds, request.verified = delivery.rounds, delivery.verified
        request.accepted = delivery.accepted
        if delivery.tokens:
            request.emit(list(delivery.tokens))
            self.counters.tokens_generated += len(delivery.tokens)
        if not delivery.end:
            return
        del self.remote[delivery.id]
        if delivery.end == "failed":
            request.fail(RequestFailed(request.id, delivery.message))
            self.counters.requests_failed += 1
        else:
            request.finish(delivery.end)
            self.counters.requests_finished += 1
        self.wake.set()

    def _common_batch(self, view: ShardsView) -> CommonBatch:
        """The decisions' view of a round every shard runs: the common graph's bucket holds
        the largest shard's batch."""
        num_reqs = view.num_reqs
        bucket = self.geometry.request_bucket(num_reqs)
        return CommonBatch(num_reqs=num_reqs, bucket=bucket, legal_rows=self._rows_of(bucket),
                           request_ids=view.request_ids, max_kv_length=view.max_kv_length,
                           shard_sizes=view.sizes)

    def _own_batch(self, facts: BatchFacts) -> CommonBatch:
        return CommonBatch(num_reqs=len(facts.batch), bucket=facts.bucket,
                           legal_rows=facts.legal_rows, request_ids=facts.request_ids,
                           max_kv_length=self._kv_bound(facts.batch))

    def _rows_of(self, bucket: int) -> tuple[int, ...]:
        legal_rows = self._legal_rows.get(bucket)
        if legal_rows is None:
            legal_rows = self._legal_rows[bucket] = self.geometry.legal_rows(bucket)
        return legal_rows

    async def _retire_due(self) -> None:
        """Retire everything submitted before round ``next_round - lag`` included."""
        due = self.next_round - self.lag
        while self.pending and self._first_pending_round() <= due:
            await self._retire_next()

    def _first_pending_round(self) -> int:
        return self.pending[0].round

    async def _retire_next(self) -> None:
        entry = self.pending.popleft()
        if isinstance(entry, PendingPrefill):
            await self._retire_prefill(entry.completion, entry.admitted)
        elif isinstance(entry, IdleRound):
            self._round_ended(entry.round)
            self.counters.rounds_retired += 1
        else:
            await self._retire_round(entry)
        # A KV slot is reused only once no round in flight includes its request: such a
        # round still writes it.
        self.kv_slots.reclaim(self.retired_through, self._prefill_pending)

    # --- admission and prefill -----------------------------------------------------------
    def _batch_facts(self) -> BatchFacts | None:
        """The next round's batch (None: nothing to decode), rebuilt only when it changed."""
        version, facts = self._facts
        if version == self._composition:
            return facts
        batch = [r for r in self.active if r.running and not r.ending][: self.max_batch]
        facts = self._derive_facts(batch) if batch else None
        self._facts = (self._composition, facts)
        return facts

    def _derive_facts(self, batch: list[Request]) -> BatchFacts:
        bucket = self.geometry.request_bucket(len(batch))
        return BatchFacts(batch=batch, bucket=bucket, kv_slots=self._padded(batch, bucket),
                          request_ids=tuple(r.id for r in batch),
                          legal_rows=self._rows_of(bucket),
                          all_greedy=not any(r.params.temperature for r in batch),
                          any_stop=any(r.params.stop for r in batch))

    def _padded(self, batch: list[Request], bucket: int) -> torch.Tensor:
        """[Bcap] the batch's KV slots, padded with the scratch KV slot: a host tensor, which
        the round's first stage copies to the device in stream order."""
        padded = [r.kv_slot for r in batch] + [self.ctx.states.scratch] * (bucket - len(batch))
        return torch.tensor(padded, dtype=torch.int64)

    def _admit(self) -> None:
        if not self.waiting:
            return
        room = self.max_batch - sum(r.running and not r.ending for r in self.active)
        admitted: list[Request] = []
        while self.waiting and room > 0 and self.kv_slots.available:
            request = self.waiting.popleft()
            if not request.running:  # cancelled while waiting
                continue
            request.kv_slot = self.kv_slots.take()
            prompt = len(request.prompt)
            request.end_length = prompt + min(request.params.max_tokens,
                                              self.ctx.context_limit - prompt)
            if request.end_length == prompt + 1:  # its prefill's token is its last
                request.ending = True
                self.ending.append(request)
            admitted.append(request)
            room -= 1
        if admitted:
            # Active before the prefill is enqueued: an enqueue that raises (a closed stream)
            # faults the loop, whose fail_all must still find them.
            self.active.extend(admitted)
            self._composition += 1
            self._enqueue_prefill(admitted)

    def _enqueue_prefill(self, admitted: list[Request]) -> None:
        # Host tensors: the prefill copies them to the device in stream order.
        host = torch.device("cpu")
        params = [r.params for r in admitted]
        inputs = PrefillInputs(
            prompts=[torch.tensor(r.prompt, dtype=torch.int64) for r in admitted],
            kv_slots=torch.tensor([r.kv_slot for r in admitted], dtype=torch.int64),
            max_tokens=torch.tensor([p.max_tokens for p in params], dtype=torch.int64),
            sampling=SamplingTensors.from_params(params, len(params), host),
            stop_token_ids=stop_tensor([p.stop for p in params], host),
            first_request=admitted[0].id)
        completion = self.stream.enqueue(functools.partial(prefill, self.ctx, inputs))
        self.pending.append(PendingPrefill(completion, admitted, inputs, self.next_round))

    async def _retire_prefill(self, completion: Completion[PrefillResult],
                              admitted: list[Request]) -> None:
        try:
            host = await completion
        except Exception as error:  # the prefill failed: so do its requests
            for request in admitted:
                self._fail_request(request, f"prefill failed: {type(error).__name__}: {error}")
            return
        first, live, stopped = host.first.tolist(), host.live.tolist(), host.stopped.tolist()
        for request, token, going, stop in zip(admitted, first, live, stopped, strict=True):
            if not request.running:
                continue
            request.emit([token])
            self.counters.tokens_generated += 1
            if not going:
                self._finish(request, "stop" if stop else "length")

    # --- decisions and submission ----------------------------------------------------------
    async def _submit(self, facts: BatchFacts | None, common: CommonBatch) -> None:
        """Decide round n from ``common`` and run it on this shard's batch ``facts`` (None:
        the shard is idle while other shards run the round)."""
        number = self.next_round
        self.next_round += 1
        slot = number % 2 if self.lag == 2 else 0
        bucket = common.bucket
        depth = self._decide_depth(number, slot, common)
        num_rows, binding = self._decide_rows(number, slot, common, depth)
        if facts is None:
            if self.bus.listening:
                self.publish(RoundSubmitted(time=self.now(), round=number, slot=slot,
                                            request_ids=(), num_reqs_bucket=bucket))
            self.counters.rounds_submitted += 1  # a round this shard took part in
            self.in_flight.add(number)
            self.pending.append(IdleRound(number))
            self.decided = (number, depth, num_rows)
            return
        batch = facts.batch
        kv_slots = facts.kv_slots if bucket == facts.bucket else self._padded(batch, bucket)
        verify: Binding = self.ctx.target.verify
        draft = pack = bound = None
        if binding is not None and self.split:  # a split round's draft, pack and verify
            assert isinstance(binding, SplitBinding)
            verify, draft, pack = binding.verify, binding.draft(depth), binding.pack
        elif binding is not None:  # a unified round's whole unit
            bound = binding
        inputs = RoundInputs(round=number, kv_slots=kv_slots, depth=depth, num_rows=num_rows,
                             all_greedy=facts.all_greedy, verify=verify,
                             any_stop=facts.any_stop, bound=bound, draft=draft, pack=pack)
        self.decided = (number, depth, num_rows)
        record = RoundRecord(round=number, slot=slot, batch=batch, num_reqs_bucket=bucket,
                             depth=depth, num_rows=num_rows,
                             machine=RoundMachine(number, self.hooks, slot,
                                                  completed=self._stage_completed),
                             work=RoundWork(self.ctx, inputs), started=self.now(),
                             request_ids=facts.request_ids)
        for request in batch:
            request.last_round = number
        if self.bus.listening:
            self.publish(RoundSubmitted(time=record.started, round=number, slot=slot,
                                        request_ids=facts.request_ids,
                                        num_reqs_bucket=bucket))
        self.counters.rounds_submitted += 1
        self.in_flight.add(number)
        self.counters.max_rounds_in_flight = max(self.counters.max_rounds_in_flight,
                                                 len(self.in_flight))
        if self.split and not self.pipelined:
            await self._enqueue_stages(record, record.work)
        else:
            self._enqueue_round(record, record.work)
        assert record.retired is not None
        self.pending.append(record)

    def _kv_bound(self, batch: list[Request]) -> int:
        """Bound on the longest context a round of this batch can reach, which both decisions
        price with. The host lags the device: the prefill's token and the round in flight
        (lag 2) may not have reached it, and this round itself writes up to w + 1
        positions; no context passes the target's limit, so neither does the bound."""
        longest: int = max(map(CONTEXT_LENGTH, batch))
        return min(longest + 1 + self.lag * (self.width + 1), self.ctx.target.context_limit)

    def _decide_depth(self, number: int, slot: int, common: CommonBatch) -> int:
        context = DepthContext(round=number, num_reqs=common.num_reqs,
                               num_reqs_bucket=common.bucket, width=self.width,
                               retired_through=self.retired_through,
                               max_kv_length=common.max_kv_length)
        chosen: object = self.depth_policy.decide(context)
        # Any integer type a policy computes with (numpy's too) is taken as the int it equals.
        whole = isinstance(chosen, numbers.Integral) and not isinstance(chosen, bool)
        depth = operator.index(chosen) if whole else -1  # type: ignore[arg-type]
        if not (self.width == 0 and depth == 0) and not 1 <= depth <= self.width:
            raise AdaspecError(f"depth policy {self.depth_policy.name} chose depth {chosen!r}; "
                               f"expected an integer 1..{self.width}")
        if self.bus.listening:
            self.publish(DepthDecided(time=self.now(), round=number, slot=slot,
                                      context=context, depth=depth))
        return depth

    def _decide_rows(self, number: int, slot: int, common: CommonBatch, depth: int
                     ) -> tuple[int, Binding | None]:
        """G and the prepared binding that runs it (None without graphs)."""
        bucket, legal_rows = common.bucket, common.legal_rows
        context = BudgetContext(round=number, num_reqs=common.num_reqs, num_reqs_bucket=bucket,
                                width=self.width, depth=depth, legal_rows=legal_rows,
                                retired_through=self.retired_through,
                                request_ids=common.request_ids,
                                max_kv_length=common.max_kv_length,
                                shard_sizes=common.shard_sizes)
        picked: object = self.budget_policy.decide(context)
        # Integers only, as for depths: 4.0 or True would reach the log and the device as such.
        whole = isinstance(picked, numbers.Integral) and not isinstance(picked, bool)
        chosen = operator.index(picked) if whole else -1  # type: ignore[arg-type]
        if chosen not in legal_rows:
            raise AdaspecError(f"budget policy {self.budget_policy.name} chose G={picked!r}; "
                               f"expected one of the legal rows {list(legal_rows)}")
        bound, binding = chosen, None
        if self.registries is not None:
            choice = self.registries[slot].lookup(bucket, chosen)
            bound, binding = choice.num_rows, choice.binding
        if self.bus.listening:
            self.publish(BudgetDecided(time=self.now(), round=number, slot=slot,
                                       context=context, num_rows=chosen, bound_rows=bound))
        return bound, binding

    def _enqueue_round(self, record: RoundRecord, work: RoundWork) -> None:
        """A unified round, or a split one with the task pipeline: one stream item."""
        if not self.split:
            record.retired = self.stream.enqueue(functools.partial(run_unified, work),
                                                 functools.partial(self._unit_done, record))
            return
        # The stages run back to back as one stream item with one completion: the host pays
        # for one delivery a round instead of seven, and the states still move stage by
        # stage, in order, from that completion.
        record.retired = self.stream.enqueue(work.run_stages,
                                             functools.partial(self._stages_done, record))

    async def _enqueue_stages(self, record: RoundRecord, work: RoundWork) -> None:
        """Without the task pipeline (a synchronous baseline): each stage its own stream item,
        waited for before the next is enqueued."""
        for stage in STAGES:
            completion = self.stream.enqueue(work.stage(stage),
                                             functools.partial(self._stage_done, record, stage))
            if stage == STAGES[-1]:  # its completion carries the retire copy
                record.retired = completion
            await asyncio.wait([completion.future])

    # --- stage completions (callbacks on the loop) ---------------------------------------
    def _stage_done(self, record: RoundRecord, stage: str, future: "asyncio.Future[Any]"
                    ) -> None:
        """A stage finished on the device: move the round on, or fail it. Anything raised
        here (a hook, a subscriber) fails the round too, never the stream's delivery."""
        error = None if future.cancelled() else future.exception()  # retrieved either way
        if record.error is not None:
            return
        try:
            if error is not None:
                self._round_failed(record, stage, error)
            else:
                self._advance(record, stage)
        except BaseException as raised:  # a hook's CancelledError fails its round too
            self._round_failed(record, stage, raised)
            if isinstance(raised, (KeyboardInterrupt, SystemExit)):
                raise

    def _stages_done(self, record: RoundRecord, future: "asyncio.Future[Any]") -> None:
        """The stages of a split round finished: each moves the round on in order, up to the
        one that failed, which fails the round (see ``_stage_done`` for hooks that raise)."""
        error = None if future.cancelled() else future.exception()
        if error is not None and not isinstance(error, StageFailed):
            # The stream's own error (an interrupt, a device fault seen only when the round
            # is synchronised) is named after the stage that ran last.
            error = StageFailed(record.work.current or STAGES[0], error)
        stage = STAGES[0]
        try:
            for stage in STAGES:
                if error is not None and stage == error.stage:
                    self._round_failed(record, stage, error.error)
                    return
                record.machine.fire(DONE_TRIGGER[stage])
        except BaseException as raised:  # a hook's CancelledError fails its round too
            self._round_failed(record, stage, raised)
            if isinstance(raised, (KeyboardInterrupt, SystemExit)):
                raise

    def _unit_done(self, record: RoundRecord, future: "asyncio.Future[Any]") -> None:
        """The whole round finished as one unit (unified mode); the failing stage of a unit
        is not known, so a failure is reported for the stage ``round``."""
        error = None if future.cancelled() else future.exception()
        try:
            if error is not None:
                self._round_failed(record, "round", error)
                return
            for stage in STAGES:
                self._advance(record, stage)
        except BaseException as raised:
            self._round_failed(record, "round", raised)
            if isinstance(raised, (KeyboardInterrupt, SystemExit)):
                raise

    def _advance(self, record: RoundRecord, stage: str) -> None:
        record.machine.fire(DONE_TRIGGER[stage])

    def _stage_completed(self, machine: RoundMachine, stage: str) -> None:
        """A round's move out of ``stage``: its event, made as the move happens."""
        if self.bus.listening:
            self.publish(StageCompleted(time=self.now(), round=machine.round_index,
                                        slot=machine.slot, stage=stage))

    def _round_failed(self, record: RoundRecord, stage: str, error: BaseException) -> None:
        """The one failure handler, as the failure arrives: the round ends failed and its
        remaining stages are skipped. Its requests are failed when the round retires (in
        order, like everything the policies and the batch depend on), so what the host
        decides never depends on when a failure arrived."""
        if record.error is not None:
            return
        record.error = error
        record.failed_stage = stage
        record.work.abandoned = True
        if not record.machine.terminal:
            try:
                record.machine.fire(FAIL_TRIGGER)
            except Exception as hook_error:  # a hook raising on failure: keep the cause
                error.__context__ = hook_error

    # --- retirement ------------------------------------------------------------------------
    async def _retire_round(self, record: RoundRecord) -> None:
        assert record.retired is not None
        try:
            host = await record.retired
        except Exception:  # the failure handler has the cause
            host = None
        self._round_ended(record.round)
        if record.error is not None:
            self._fail_round_requests(record, record.error)
            if self.link is not None:
                # The other ranks know nothing of it and would commit the round: this rank
                # stops, so they fail at their next collective instead of going on alone.
                raise RankFault(self.link.rank, record.round, record.failed_stage,
                                record.error)
            return
        assert host is not None
        self.deferred_cancels = []
        try:
            self._retired(record, host)
        finally:
            deferred, self.deferred_cancels = self.deferred_cancels, None
            for request in deferred:
                if request.running:
                    self._finish(request, "cancelled")

    def _retired(self, record: RoundRecord, host: RetiredRound) -> None:
        """Deliver a round that completed, let the policies observe it, and say so."""
        feedback = self._feedback(record, host)
        if self.ending:
            self._check_ending()
        self.counters.rounds_retired += 1
        self.counters.rows_verified += record.num_rows
        if self.sharded:  # observed once every shard's turn shared it (_take_turns)
            self.unshared.append(feedback)
        else:
            self.depth_policy.observe(feedback)
            self.budget_policy.observe(feedback)
        if self.bus.listening:
            self.publish(RoundRetired(time=self.now(), round=record.round, slot=record.slot,
                                      feedback=feedback))

    def _round_ended(self, number: int) -> None:
        self.in_flight.discard(number)
        self.retired_through = number
        # An idle loop retires rounds early; numbering the next round past them keeps the
        # lag rule: no decision for round n ever follows the feedback of round n-1.
        self.next_round = max(self.next_round, number + self.lag)

    def _fail_round_requests(self, record: RoundRecord, error: BaseException) -> None:
        stage = record.failed_stage
        self.counters.rounds_failed += 1
        # One line for the event and for each request: a device error often has several.
        first_line = str(error).splitlines()[0] if str(error) else ""
        self.publish(RoundFailed(time=self.now(), round=record.round, slot=record.slot,
                                 stage=stage, error=type(error).__name__, message=first_line,
                                 request_ids=tuple(r.id for r in record.batch)))
        reason = f"round {record.round} failed in {stage}: {type(error).__name__}: {first_line}"
        for request in record.batch:
            if request.running:
                self._fail_request(request, reason)

    def _feedback(self, record: RoundRecord, host: RetiredRound) -> RoundFeedback:
        """Stream each live request's tokens, finish those that ended, and build the round's
        feedback from the entries that were still decoding on the device."""
        num = len(record.batch)
        live = host.live.tolist()[:num]
        lengths = host.verify_lengths.tolist()[:num]
        accepted = host.num_accepted.tolist()[:num]
        confidences = None if host.confidences is None else host.confidences.tolist()[:num]
        # Entries no longer live on the device finished in an earlier round: they tell
        # nothing about this one.
        every = all(live)  # the usual round: every entry still decoding
        rows = range(num) if every else [index for index in range(num) if live[index]]
        self._deliver(record, rows, lengths, accepted, host)

        def column(values: list[Any]) -> tuple[Any, ...]:
            return tuple(values) if every else tuple(values[i] for i in rows)

        return RoundFeedback(
            round=record.round, num_reqs=len(rows), num_reqs_bucket=record.num_reqs_bucket,
            width=self.width, depth=record.depth, num_rows=record.num_rows,
            verify_lengths=column(lengths), num_accepted=column(accepted),
            confidences=() if confidences is None else tuple(map(tuple, column(confidences))),
            request_ids=record.request_ids if every else
            tuple(record.request_ids[i] for i in rows), shard=self.shard)

    def _deliver(self, record: RoundRecord, rows: "range | list[int]", lengths: list[int],
                 accepted: list[int], host: RetiredRound) -> None:
        """Hand the tokens of the live ``rows`` to their requests, count them, and finish
        the requests that ended; cancelled or failed requests' tokens are dropped."""
        batch = record.batch
        num = len(batch)
        emitted = host.num_emitted.tolist()[:num]
        tokens = host.token_ids.tolist()[:num]
        finish = host.finish.tolist()[:num]
        counters = self.counters
        if len(rows) == num and all(r.running for r in batch):
            self._deliver_all(record.round, batch, lengths, accepted, emitted, tokens, finish)
            return
        delivered = 0
        verified = accepted_total = emitted_total = 0
        pairs = []
        for index in rows:
            request = batch[index]
            if not request.running:
                continue
            length, accept, count = lengths[index], accepted[index], emitted[index]
            short = request.take_round(length, accept, tokens[index][:count])
            pairs.append((length, accept))
            delivered += 1
            verified += length
            accepted_total += accept
            emitted_total += count
            if finish[index]:
                self._finish(request, FINISH_REASONS[finish[index]])
            elif short:
                self._note_ending(request, record.round)
        counters.outcomes.update(pairs)
        counters.request_rounds += delivered
        counters.drafted_verified += verified
        counters.drafted_accepted += accepted_total
        counters.tokens_generated += emitted_total

    def _deliver_all(self, number: int, batch: list[Request], lengths: list[int],
                     accepted: list[int], emitted: list[int], tokens: list[list[int]],
                     finish: list[int]) -> None:
        """``_deliver`` for the usual round, where every entry is live and running: the
        counts are summed in one go."""
        short = []  # one token short of their end: a round in flight may end them
        for request, length, accept, count, row in zip(batch, lengths, accepted, emitted,
                                                       tokens, strict=True):
            if request.take_round(length, accept, row[:count]):
                short.append(request)
        if any(finish):
            for request, end in zip(batch, finish, strict=True):
                if end and request.running:  # a subscriber may have ended it meanwhile
                    self._finish(request, FINISH_REASONS[end])
        for request in short:
            self._note_ending(request, number)
        counters = self.counters
        counters.outcomes.update(zip(lengths, accepted, strict=True))
        counters.request_rounds += len(batch)
        counters.drafted_verified += sum(lengths)
        counters.drafted_accepted += sum(accepted)
        counters.tokens_generated += sum(emitted)

    def _note_ending(self, request: Request, number: int) -> None:
        """A running request one token short of its end after round ``number``, which a later
        round in flight includes, ends in that round: no round after it includes the request
        (its row there would commit nothing), and it no longer takes room in the batch."""
        if request.running and not request.ending and request.last_round > number:
            request.ending = True
            self.ending.append(request)
            self._composition += 1

    def _check_ending(self) -> None:
        """A request whose last round retired without ending it (the host's budget and the
        device's disagreed) takes part in rounds again: a missed end costs rounds, never a
        request left waiting for one."""
        keep = []
        for request in self.ending:
            if not request.running:
                continue
            if request.last_round <= self.retired_through and \
                    not self._prefill_pending(request):
                request.ending = False
                self._composition += 1
            else:
                keep.append(request)
        self.ending = keep

    # --- request ends and KV slots --------------------------------------------------------------
    def _finish(self, request: Request, reason: str) -> None:
        request.finish(reason)
        self.counters.requests_finished += 1
        self._retire_request(request, reason)

    def _fail_request(self, request: Request, reason: str) -> None:
        request.fail(RequestFailed(request.id, reason))
        self.counters.requests_failed += 1
        self._retire_request(request, "failed")

    def _retire_request(self, request: Request, reason: str) -> None:
        if self.link is not None:  # each rank's record of what it committed, in order
            self.commits.update(f"{request.id}:{reason}:{request.tokens}\n".encode())
        try:
            self.publish(RequestFinished(time=self.now(), request_id=request.id,
                                         reason=reason, num_tokens=len(request.tokens)))
        finally:  # an interrupt a subscriber raises leaves the request retired all the same
            self._composition += 1
            if request in self.active:
                self.active.remove(request)
            if self.sharded and self.shard != 0:
                self.ended_since.append(request)
            self.kv_slots.hold(request)
            self.wake.set()

    def _prefill_pending(self, request: HoldsKvSlot) -> bool:
        return any(isinstance(entry, PendingPrefill) and request in entry.admitted
                   for entry in self.pending)

    def statistics(self) -> RuntimeStatistics:
        counts: dict[str, Any] = {f.name: getattr(self.counters, f.name)
                                  for f in fields(Counters)}
        counts["outcomes"] = Counter(counts["outcomes"])  # a copy, not the live counter
        return RuntimeStatistics(**counts, depth_policy=self.depth_policy.statistics(),
                                 budget_policy=self.budget_policy.statistics())


def run_unified(work: RoundWork) -> RetiredRound:
    """A whole round as one device unit (its prepared round binding when graphs are on);
    the host sees every state from its completion."""
    bound = work.inputs.bound
    return work.run_all() if bound is None else bound(work)
