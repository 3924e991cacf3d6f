"""The device work of prefill and of each stage of a round, as functions the stream runs.

``RoundWork`` holds one round's intermediate tensors from stage to stage. Its stages run back
to back as one stream item (``run_stages``, split mode with the task pipeline), one item each
(the task pipeline off: the host waits for each), or as one unit (unified mode). None of them
reads a device value back to the host; ``retire`` is the one device-to-host copy of a round.
The commit stage computes everything first and writes the KV slot states last, so a round whose
device work fails leaves every request's state as the previous round left it.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from adaspec.config.requests import MAX_STOP_TOKENS
from adaspec.models.protocols import (
    DSparkBlock,
    MtpStep,
    TargetModel,
    TargetOutput,
    VerifyRows,
    check_output,
    check_returned_kind,
    check_verify_output,
)
from adaspec.runtime.devices.allocation import allocate_prefixes, emit_budget, verify_caps
from adaspec.runtime.devices.collectives import Collectives
from adaspec.runtime.devices.commit import RUNNING, CommitResult, commit_rows
from adaspec.runtime.devices.packing import PackedRows, pack_rows
from adaspec.runtime.devices.retire import retire_copy
from adaspec.runtime.devices.sampling import SamplingTensors, sample_rows
from adaspec.runtime.drafting import Drafting
from adaspec.runtime.kv_slots import KvSlotSampling, KvSlotStates
from adaspec.runtime.states import STAGES

T = TypeVar("T")


class RoundAbandoned(Exception):
    """A stage skipped because an earlier stage of its round failed."""

    def __init__(self, round_index: int, stage: str) -> None:
        super().__init__(f"round {round_index} {stage} skipped: an earlier stage failed")


class Lockstep:
    """With several ranks, every rank issues the same collectives in the same order. Once
    device work failed on this rank (a stage, a prefill, a hook), the work after it would
    skip or reorder its collectives and meet another op on the other ranks, which the
    backend may answer by aborting the process; so from then on every device work item of
    this rank is refused before it starts, and the other ranks time out naming the
    collective they waited in. One rank has nothing to keep in step."""

    __slots__ = ("broken", "ranks")

    def __init__(self, ranks: int = 1) -> None:
        self.ranks = ranks
        self.broken: str | None = None

    def check(self, where: str) -> None:
        if self.broken is not None:
            raise RuntimeError(f"{where} skipped: {self.broken}")

    def fail(self, where: str, error: BaseException) -> None:
        if self.ranks > 1 and self.broken is None:
            self.broken = (f"{where} failed on this rank ({type(error).__name__}), so its "
                           "collectives are out of step with the other ranks")


class StageFailed(Exception):
    """A stage of a round run as one stream item raised: ``stage`` names it and ``error`` is
    what it raised (also the ``__cause__``)."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


StageHook = Callable[[int, str], None]
"""Called with (round, stage) as each stage's device work starts (fault injection in tests)."""


@dataclass(frozen=True, slots=True)
class RetiredRound:
    """The host copy of a round (its retire stage): per batch entry, what the host needs to
    deliver tokens, finish requests and feed the policies back. The round's one
    device-to-host transfer."""

    token_ids: Tensor  # [Bcap, w + 1] emitted tokens, the first num_emitted of each valid
    num_emitted: Tensor  # [Bcap]
    finish: Tensor  # [Bcap] RUNNING, FINISHED_STOP or FINISHED_LENGTH
    num_accepted: Tensor  # [Bcap] drafted tokens accepted
    verify_lengths: Tensor  # [Bcap] drafted tokens verified
    live: Tensor  # [Bcap] still decoding when the round ran
    confidences: Tensor | None = None  # [Bcap, w]; None when nothing was drafted


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The host copy of a prefill: each request's first token and whether it goes on."""

    first: Tensor  # [N]
    live: Tensor  # [N] goes on decoding
    stopped: Tensor  # [N] its first token is one of its stop tokens


W = TypeVar("W", bound="RoundWork")
_STAGE_METHODS: list[str] = []  # the names ``_stage`` made stages, in declaration order


def _stage(method: Callable[[W], T]) -> Callable[[W], T]:
    """A stage of ``RoundWork``: named after its state in the round graph, it enters that
    stage (skipped once the round failed, announced to the stage hook) before its work."""
    name = method.__name__
    _STAGE_METHODS.append(name)

    @functools.wraps(method)
    def run(work: W) -> T:
        lockstep = work.ctx.lockstep
        lockstep.check(f"round {work.inputs.round} {name}")
        try:
            work._enter(name)
            return method(work)
        except Exception as error:
            lockstep.fail(f"round {work.inputs.round} {name}", error)
            raise

    return run


@dataclass(frozen=True, slots=True)
class DeviceContext:
    """What every round's device work shares."""

    target: TargetModel
    drafting: Drafting
    collectives: Collectives
    states: KvSlotStates
    sampling: KvSlotSampling
    device: torch.device
    vocab_size: int  # the target's, read once: every output is checked against them
    hidden_size: int
    seed: int = 0
    stage_hook: StageHook | None = None
    lockstep: Lockstep = field(default_factory=Lockstep)

    @property
    def context_limit(self) -> int:
        return self.target.context_limit


@dataclass(frozen=True, slots=True)
class RoundInputs:
    """The host's decisions for one round, already on the device."""

    round: int
    kv_slots: Tensor  # [Bcap] KV slot of each batch entry (padding: the scratch KV slot)
    depth: int  # d: draft steps (w for DSpark)
    num_rows: int  # G of the binding that runs
    all_greedy: bool  # no entry samples: the sampler skips its random path
    verify: Callable[[VerifyRows], TargetOutput]  # the (Bcap, G) binding
    any_stop: bool = True  # some entry has stop token ids: commit looks for them
    bound: Callable[["RoundWork"], "RetiredRound"] | None = None  # unified: the round binding
    # Split mode with graphs: the prepared draft (Bcap, depth) and pack (Bcap, G) bindings.
    draft: Callable[[Tensor], tuple[KvSlotStates, Tensor, Tensor]] | None = None
    pack: Callable[[KvSlotStates, Tensor, Tensor, Tensor, int], tuple[Tensor, PackedRows]] \
        | None = None


@dataclass(slots=True)
class RoundWork:
    """One round's tensors as its stages produce them."""

    ctx: DeviceContext
    inputs: RoundInputs
    kv_slots: Tensor | None = None  # [Bcap] the inputs' KV slots, on the device
    rows: KvSlotStates | None = None
    drafts: Tensor | None = None  # [Bcap, w]
    confidences: Tensor | None = None  # [Bcap, w]
    budget: Tensor | None = None  # [Bcap]
    packed: PackedRows | None = None
    out: TargetOutput | None = None
    sampled: Tensor | None = None  # [G]
    result: CommitResult | None = None
    abandoned: bool = False  # set by the host when the round failed: later stages skip
    current: str = ""  # the stage running or last run: names the stage an error came from

    def announce(self, stage: str) -> None:
        """Enter ``stage`` without running its work: a captured unit runs it (unified)."""
        where = f"round {self.inputs.round} {stage}"
        self.ctx.lockstep.check(where)
        try:
            self._enter(stage)
        except Exception as error:
            self.ctx.lockstep.fail(where, error)
            raise

    def adopt(self, unit: "RoundWork") -> None:
        """Take the tensors a captured unit's replay left, as if this round's stages had
        produced them (they stay the unit's buffers until its next replay)."""
        for name in ("kv_slots", "rows", "drafts", "confidences", "budget", "packed", "out",
                     "sampled", "result"):
            setattr(self, name, getattr(unit, name))

    def _enter(self, stage: str) -> None:
        self.current = stage
        if self.abandoned:
            raise RoundAbandoned(self.inputs.round, stage)
        hook = self.ctx.stage_hook
        if hook is not None:
            hook(self.inputs.round, stage)

    @_stage
    def draft(self) -> None:
        # The host gives its KV slots as a host tensor: copied here, in stream order, so the
        # host never waits for the device to take them (a no-op on the CPU).
        kv_slots = self.kv_slots = self.inputs.kv_slots.to(self.ctx.device, non_blocking=True)
        bound = self.inputs.draft
        drafted = draft_block(self.ctx, kv_slots, self.inputs.depth) if bound is None \
            else bound(kv_slots)
        self.rows, self.drafts, self.confidences = drafted

    @_stage
    def consensus(self) -> None:
        # TP ranks verify and commit TP rank 0's drafts: a drafter's local output head may
        # round differently on another rank, and every rank must pack the same rows.
        self.ctx.collectives.tp_broadcast(_have(self.confidences, "confidences"))
        self.ctx.collectives.tp_broadcast(_have(self.drafts, "drafts"))

    @_stage
    def pack(self) -> None:
        rows, drafts = _have(self.rows, "rows"), _have(self.drafts, "drafts")
        confidences = _have(self.confidences, "confidences")
        kv_slots = _have(self.kv_slots, "KV slots")
        inputs = self.inputs
        if inputs.pack is not None:
            self.budget, self.packed = inputs.pack(rows, drafts, confidences, kv_slots,
                                                   inputs.depth)
        else:
            self.budget, self.packed = pack_block(self.ctx, rows, drafts, confidences, kv_slots,
                                                  inputs.depth, inputs.num_rows)

    @_stage
    def verify(self) -> None:
        out = self.inputs.verify(_have(self.packed, "packed rows").rows)
        self.out = check_target_output("target.verify", out, self.inputs.num_rows, "G",
                                       self.ctx)

    @_stage
    def sample(self) -> None:
        out, packed = _have(self.out, "target output"), _have(self.packed, "packed rows")
        inputs = self.inputs
        if inputs.all_greedy:
            # Nothing is drawn, so no generator, uniforms or parameters are made: a greedy
            # round's work is the argmax (what sample_rows does for an all-greedy batch).
            self.sampled = out.logits.argmax(-1)
        else:
            # Seeded from the run's seed and the round number alone: the draws replay exactly.
            generator = seeded_generator(self.ctx.seed, 0, inputs.round, self.ctx.device)
            uniforms = torch.rand(inputs.num_rows, generator=generator, dtype=torch.float64,
                                  device=self.ctx.device)
            sampling = self.ctx.sampling.gather(_have(self.kv_slots, "KV slots"),
                                                inputs.all_greedy)
            self.sampled = sample_rows(out.logits, packed.rows.row_reqs, sampling, uniforms)
        self.ctx.collectives.tp_broadcast(self.sampled)

    @_stage
    def commit(self) -> None:
        rows, packed = _have(self.rows, "rows"), _have(self.packed, "packed rows")
        out = _have(self.out, "target output")
        kv_slots = _have(self.kv_slots, "KV slots")
        stop_token_ids = self.ctx.sampling.stop_token_ids.index_select(0, kv_slots) \
            if self.inputs.any_stop else None
        result = commit_rows(packed, _have(self.sampled, "sampled tokens"),
                             _have(self.drafts, "drafts"), stop_token_ids,
                             _have(self.budget, "budget"), rows.live)
        live = rows.live
        hidden = rows.hidden
        if hidden.shape[1]:
            hidden = torch.where(live[:, None], out.hidden.index_select(0, result.last_rows),
                                 hidden)
        updated = KvSlotStates(
            anchor_ids=torch.where(live, result.next_anchor_ids, rows.anchor_ids),
            anchor_positions=rows.anchor_positions + result.num_emitted,
            hidden=hidden, remaining=rows.remaining - result.num_emitted,
            live=live & (result.finish == RUNNING))
        # Everything above may fail without harm; from here on the round's result is written.
        self.ctx.states.scatter(kv_slots, updated)
        self.ctx.drafting.after_commit(out, packed, result)
        self.result = result

    @_stage
    def retire(self) -> RetiredRound:
        result, packed = _have(self.result, "commit result"), _have(self.packed, "packed rows")
        feedback = {"token_ids": result.token_ids, "num_emitted": result.num_emitted,
                    "finish": result.finish, "num_accepted": result.num_accepted,
                    "verify_lengths": packed.verify_lengths,
                    "live": _have(self.rows, "rows").live}
        if self.confidences is not None and self.confidences.shape[1]:
            feedback["confidences"] = self.confidences
        return RetiredRound(**retire_copy(feedback))

    def run_all(self) -> RetiredRound:
        """Every stage in order, the last (retire) giving the round's host copy."""
        for name in STAGES[:-1]:
            self.stage(name)()
        return self.retire()

    def run_stages(self) -> RetiredRound:
        """Every stage in order, back to back, as one stream item, and the retire copy. Each
        stage is still its own device work; only its completion is not reported on its own.
        A stage that raises ends the round there: ``StageFailed`` names it."""
        try:
            return self.run_all()
        except Exception as error:
            raise StageFailed(self.current, error) from error

    def stage(self, name: str) -> Callable[[], object]:
        """The bound method of stage ``name`` (the stream runs it)."""
        method: Callable[[], object] = getattr(self, name)
        return method


def draft_block(ctx: DeviceContext, kv_slots: Tensor, depth: int
                ) -> tuple[KvSlotStates, Tensor, Tensor]:
    """The draft stage's device work: the batch entries' states gathered from ``kv_slots
    [Bcap]`` (on the device), and their drafted token ids and confidences ``[Bcap, w]``."""
    rows = ctx.states.gather(kv_slots)
    drafts, confidences = ctx.drafting.draft(rows, kv_slots, depth)
    return rows, drafts, confidences


def pack_block(ctx: DeviceContext, rows: KvSlotStates, drafts: Tensor, confidences: Tensor,
               kv_slots: Tensor, depth: int | Tensor, num_rows: int
               ) -> tuple[Tensor, PackedRows]:
    """The pack stage's device work: each entry's emit budget and the G = ``num_rows``
    verify rows. ``depth`` is an int, or a 0-dim device tensor in a captured pack (one graph
    serves every depth); both give the same rows."""
    budget = emit_budget(rows.remaining, rows.anchor_positions, ctx.context_limit)
    if not drafts.shape[1]:  # nothing drafted: no entry verifies a draft
        return budget, pack_rows(torch.zeros_like(budget), rows.anchor_ids, drafts, kv_slots,
                                 rows.anchor_positions, rows.live, num_rows)
    caps = verify_caps(depth, budget, rows.live)
    if isinstance(depth, Tensor) or num_rows < kv_slots.shape[0] * (depth + 1):
        lengths = allocate_prefixes(confidences, num_rows, caps, rows.live)
    else:
        # G holds every entry's anchor and all its capped drafts: allocation would admit
        # every eligible position, which is the caps themselves.
        lengths = caps
    return budget, pack_rows(lengths, rows.anchor_ids, drafts, kv_slots, rows.anchor_positions,
                             rows.live, num_rows)


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    prompts: list[Tensor]  # [T_i] int64 each
    kv_slots: Tensor  # [N] KV slots
    max_tokens: Tensor  # [N] int64
    sampling: SamplingTensors
    stop_token_ids: Tensor  # [N, MAX_STOP_TOKENS] -1 padded
    first_request: int  # id of the first request: seeds the draws of its first tokens

    def to(self, device: torch.device) -> "PrefillInputs":
        """The inputs on ``device``: the host builds them as host tensors and the prefill
        copies them in stream order, so the host never waits for the device to take them."""
        def move(tensor: Tensor) -> Tensor:
            return tensor.to(device, non_blocking=True)
        return PrefillInputs(
            prompts=[move(prompt) for prompt in self.prompts], kv_slots=move(self.kv_slots),
            max_tokens=move(self.max_tokens), sampling=self.sampling.to(device),
            stop_token_ids=move(self.stop_token_ids), first_request=self.first_request)


def prefill(ctx: DeviceContext, inputs: PrefillInputs) -> PrefillResult:
    """Process new prompts into their KV slots, draw each request's first token, set its slot
    state, and return the host copy of the first tokens and whether each request goes on.

    The first token sits at the prompt's length; a request goes on when that token is not a
    stop token, it may generate more, and the context has room after it."""
    ctx.lockstep.check("prefill")
    try:
        return _prefill(ctx, inputs)
    except Exception as error:
        ctx.lockstep.fail("a prefill", error)
        raise


def _prefill(ctx: DeviceContext, inputs: PrefillInputs) -> PrefillResult:
    inputs = inputs.to(ctx.device)
    out = ctx.target.prefill(inputs.prompts, inputs.kv_slots)
    num = len(inputs.prompts)
    check_prefill_output(out, num, max(len(prompt) for prompt in inputs.prompts), ctx)
    if inputs.sampling.all_greedy:
        first = out.last.logits.argmax(-1)
    else:
        generator = seeded_generator(ctx.seed, 1, inputs.first_request, ctx.device)
        uniforms = torch.rand(num, generator=generator, dtype=torch.float64, device=ctx.device)
        first = sample_rows(out.last.logits, torch.arange(num, device=ctx.device),
                            inputs.sampling, uniforms)
    # TP ranks commit TP rank 0's first tokens, as they do every round's sampled ones.
    ctx.collectives.tp_broadcast(first)
    stopped = (first[:, None] == inputs.stop_token_ids).any(dim=1)
    # In int64, whatever integer dtype the model gave: a narrow one cannot hold the limit.
    lengths = out.lengths.to(torch.int64, copy=True)
    room = lengths < ctx.context_limit - 1
    remaining = inputs.max_tokens - 1
    live = ~stopped & (remaining > 0) & room
    hidden = out.last.hidden if ctx.states.keeps_hidden else out.last.hidden[:, :0]
    ctx.states.scatter(inputs.kv_slots, KvSlotStates(
        anchor_ids=first, anchor_positions=lengths,
        hidden=hidden,
        remaining=remaining, live=live))
    ctx.sampling.write(inputs.kv_slots, inputs.sampling, inputs.stop_token_ids)
    ctx.drafting.after_prefill(out, inputs.prompts, inputs.kv_slots, first)
    return PrefillResult(**retire_copy({"first": first, "live": live, "stopped": stopped}))


def check_target_output(method: str, out: object, num_rows: int, rows: str,
                        ctx: DeviceContext) -> TargetOutput:
    """``out`` when it is the TargetOutput the protocol states for ``num_rows`` rows on the
    runtime's device; else the ``ModelOutputError`` naming ``method``. The hidden states
    are stored beside earlier rounds' when a drafter reads them (KvSlotStates): then they
    must be in their dtype."""
    states = ctx.states
    return check_verify_output(method, out, num_rows, ctx.vocab_size, ctx.hidden_size, rows,
                               hidden_dtype=states.hidden.dtype if states.keeps_hidden
                               else None, device=ctx.device)


def check_prefill_output(out: object, num: int, longest: int, ctx: DeviceContext) -> None:
    """Refuse a ``PrefillOutput`` of other shapes than the protocol's for ``num`` prompts of
    at most ``longest`` tokens."""
    check_returned_kind("target.prefill", out, "a PrefillOutput", ("last", "hidden", "lengths"))
    check_target_output("target.prefill (last)", getattr(out, "last", None), num, "B", ctx)
    hidden = getattr(out, "hidden", None)
    # T may be padded past the longest prompt (a prefill bucket): at least that long.
    padded = hidden.shape[1] if isinstance(hidden, Tensor) and hidden.dim() == 3 and \
        hidden.shape[1] >= longest else longest
    # A drafter that keeps a context reads these beside the verify rows' hidden states: then
    # in their dtype (others never read them).
    published = ctx.drafting.context is not None
    check_output("target.prefill", "hidden", hidden, (num, padded, ctx.hidden_size),
                 "[B, T, hidden_size], T at least the longest prompt",
                 dtype=ctx.states.hidden.dtype if published else None, device=ctx.device)
    check_output("target.prefill", "lengths", getattr(out, "lengths", None), (num,), "[B]",
                 integer=True, device=ctx.device)


class CheckedDrafter:
    """A drafter whose ``step``/``draft`` outputs are checked against the protocol's shapes
    (shape metadata only, a few tuple compares a call); every other member is the drafter's
    own. ``model`` is the drafter, ``setting`` how refusals name it."""

    def __init__(self, name: str, model: object, vocab_size: int) -> None:
        self.model = model
        self.name = name
        self.setting = f"Runtime(models=...).{name}"
        self.vocab_size = vocab_size

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        return getattr(self.model, name)

    def step(self, hidden: Tensor, token_ids: Tensor, positions: Tensor,
             kv_slots: Tensor) -> MtpStep:
        out: MtpStep = self.model.step(hidden, token_ids, positions,  # type: ignore[attr-defined]
                                       kv_slots)
        n, method = token_ids.shape[0], "mtp.step"
        check_returned_kind(method, out, "an MtpStep", ("hidden", "token_ids", "probs"))
        on = hidden.device  # every output lies where its inputs were given
        check_output(method, "token_ids", getattr(out, "token_ids", None), (n,), "[N]",
                     integer=True, device=on)
        check_output(method, "probs", getattr(out, "probs", None), (n,), "[N]", device=on)
        check_output(method, "hidden", getattr(out, "hidden", None), tuple(hidden.shape),
                     "[N, hidden_size], the shape of the hidden it was given", device=on)
        return out  # its logits are never read: a drafter may draft from its own vocabulary

    def draft(self, hidden: Tensor, token_ids: Tensor, positions: Tensor, kv_slots: Tensor,
              width: int) -> DSparkBlock:
        out: DSparkBlock = self.model.draft(  # type: ignore[attr-defined]
            hidden, token_ids, positions, kv_slots, width)
        n, method = token_ids.shape[0], "dspark.draft"
        check_returned_kind(method, out, "a DSparkBlock", ("token_ids", "confidences"))
        check_output(method, "token_ids", getattr(out, "token_ids", None), (n, width),
                     "[N, width]", integer=True, device=hidden.device)
        check_output(method, "confidences", getattr(out, "confidences", None), (n, width),
                     "[N, width]", device=hidden.device)
        return out  # its logits are never read, as step's


def stop_tensor(stops: list[tuple[int, ...]], device: torch.device) -> Tensor:
    """[N, MAX_STOP_TOKENS] stop token ids, -1 padded."""
    rows = [list(stop) + [-1] * (MAX_STOP_TOKENS - len(stop)) for stop in stops]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def seeded_generator(seed: int, stream_id: int, index: int, device: torch.device
                     ) -> torch.Generator:
    """A generator for one round (stream 0) or one prefill (stream 1), seeded from the run's
    seed alone, so the draws never depend on timing."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + index) * 2 + stream_id)
    return generator


def _have(value: T | None, name: str) -> T:
    """A stage's input from an earlier stage; missing only if stages ran out of order."""
    if value is None:
        raise RuntimeError(f"round stages ran out of order: no {name} yet")
    return value


def _check_stage_methods() -> None:
    """Each stage of the round graph is a ``RoundWork`` stage method, and no other: a graph
    that gains or renames a stage fails the import, not a round."""
    if tuple(_STAGE_METHODS) != STAGES:
        raise TypeError(f"RoundWork stages {_STAGE_METHODS} differ from the round graph's "
                        f"{list(STAGES)}")


_check_stage_methods()
