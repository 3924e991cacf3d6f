"""Offline policy evaluation: run depth and budget policies over a workload, without models,
through the runtime's lag and tier rules, and price every round with a saved cost table.

A workload is a sequence of rounds; each gives its batch's requests, the per-position
confidences each request's drafter reported, and how many drafted tokens the target would
accept if offered the full width (``docs/workload.md``). For round n the simulator:

1. lets the policies observe the simulated feedback of every round through n - lag;
2. asks the depth policy for d and the budget policy for G among the legal rows of the
   request bucket (both read from the bundle's captured geometry);
3. allocates the G - B rows to the best surviving positions of this round (the device rule:
   survival order, ties to the lower request then the lower position, contiguous prefixes,
   at most d per request);
4. counts each request's accepted tokens as ``min(verified, accepted at full width)`` plus
   the residual or bonus token, and prices the round at ``cost_ms(Bcap, G, kv)`` (a table of
   adaptive draft steps: at depth d verifying G rows, as the runtime prices it).

DP shards (``dp_size`` > 1) share one decision per round, made from every shard's retired
feedback (what each shard of a DP launch receives); each shard allocates the G rows to its
own requests, the bucket holds the largest shard, and the round is priced once.

``oracle`` is not a policy: it knows each round's true acceptance and picks the G that
maximises this round's tokens per millisecond, an upper bound for any budget policy under the
same allocation rule. ``oracle-depth`` does the same for the depth (all drafts verified), the
bound for depth policies.
"""

import itertools
import json
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adaspec.config.calibration import MAX_TOKENS_IN_CONTEXT, DraftStepPolicyConfig, json_type
from adaspec.config.files import (
    UnheldNumber,
    check_doubles,
    json_fault,
    marked_double,
    past_int_digits,
)
from adaspec.config.limits import MAX_PARALLEL_SIZE
from adaspec.config.requests import MAX_REQUEST_ID
from adaspec.errors import MISSING, ConfigError, show_value
from adaspec.policies.base import (
    BudgetContext,
    BudgetPolicy,
    DepthContext,
    DepthPolicy,
    RoundFeedback,
    covering_rows,
    covering_tier,
)
from adaspec.policies.bundles import CostBundle
from adaspec.policies.costs import UnpricedShape
from adaspec.policies.depth import AdaptiveDepth, DepthPricing, bundle_pricing
from adaspec.policies.fixed import FixedDepth, FullBudget
from adaspec.policies.verify import AdaptiveVerify

WORKLOAD_FORMAT = "adaspec-workload"
WORKLOAD_VERSION = 1
LAG = 2


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    id: int
    confidences: tuple[float, ...]  # [w] conditional confidences the drafter reported
    accepted: int  # drafted tokens the target accepts when offered all w
    censored: bool = False  # accepted is only a lower bound (a recorded run verified fewer)
    shard: int = 0  # the DP shard that decodes it (ids are per shard)


@dataclass(frozen=True, slots=True)
class WorkloadRound:
    requests: tuple[WorkloadRequest, ...]
    kv_length: int | None = None  # longest context of the batch, for the table's coverage

    def shards(self, dp_size: int) -> list[tuple[WorkloadRequest, ...]]:
        """Every DP shard's batch, in shard order (a shard may be idle this round)."""
        return [tuple(r for r in self.requests if r.shard == shard) for shard in range(dp_size)]


@dataclass(frozen=True, slots=True)
class Workload:
    width: int
    rounds: tuple[WorkloadRound, ...]
    name: str = ""
    dp_size: int = 1
    source: str = field(default="", compare=False)  # the file it was read from, if any

    @property
    def where(self) -> str:
        """How a refusal names the workload: its file, else its name."""
        return self.source or self.name or "workload"

    def as_lines(self) -> list[str]:
        """The workload as JSON lines (``docs/workload.md``)."""
        dp = {"dp_size": self.dp_size} if self.dp_size > 1 else {}
        lines = [json.dumps({"format": WORKLOAD_FORMAT, "version": WORKLOAD_VERSION,
                             "width": self.width, "name": self.name, **dp})]
        for rnd in self.rounds:
            entry: dict[str, Any] = {"requests": [
                {"id": r.id, "confidences": list(r.confidences), "accepted": r.accepted,
                 **({"censored": True} if r.censored else {}),
                 **({"shard": r.shard} if self.dp_size > 1 else {})} for r in rnd.requests]}
            if rnd.kv_length is not None:
                entry["kv_length"] = rnd.kv_length
            lines.append(json.dumps(entry))
        return lines


def parse_workload(lines: Iterable[str], source: str) -> Workload:
    """A workload from its JSON lines; errors name the file, the line and the field."""
    rows = iter(enumerate(lines, start=1))
    header: Any = None
    at = f"{source}:1"  # the header's line: blank lines before it are skipped, as after it
    for number, text in rows:
        if text.strip():
            header, at = _json(source, number, text), f"{source}:{number}"
            break
    if not isinstance(header, dict) or header.get("format") != WORKLOAD_FORMAT:
        raise ConfigError("--workload", at,
                          f'expected a first line {{"format": "{WORKLOAD_FORMAT}", '
                          '"version": 1, "width": W}')
    version = header.get("version", MISSING)
    if type(version) is not int or version != WORKLOAD_VERSION:  # true is no version
        raise ConfigError("--workload", at, f"{_field('version', version)} "
                          f"expected {WORKLOAD_VERSION}")
    unknown = sorted(set(header) - _HEADER_FIELDS)
    if unknown:
        raise ConfigError("--workload", at, f"{show_value(unknown[0])}: not a "
                          f"header field; expected {', '.join(sorted(_HEADER_FIELDS))}")
    name = header.get("name", "")
    if not isinstance(name, str):
        raise ConfigError("--workload", at, f"{_field('name', name)} expected a "
                          "string")
    width = header.get("width", MISSING)
    if type(width) is not int or not 1 <= width <= 64:
        raise ConfigError("--workload", at, f"{_field('width', width)} expected an "
                          "integer in 1..64")
    dp_size = header.get("dp_size", 1)
    if type(dp_size) is not int or not 1 <= dp_size <= MAX_PARALLEL_SIZE:
        raise ConfigError("--workload", at, f"{_field('dp_size', dp_size)} expected "
                          f"an integer in 1..{MAX_PARALLEL_SIZE}")
    rounds = [_round(_json(source, number, text), width, dp_size, f"{source}:{number}")
              for number, text in rows if text.strip()]
    if not rounds:
        raise ConfigError("--workload", source, "expected at least one round line")
    return Workload(width=width, rounds=tuple(rounds), name=name,
                    dp_size=dp_size, source=source)


_HEADER_FIELDS = frozenset({"format", "version", "width", "name", "dp_size"})

_MAX_SPELLED = 120


def _field(name: str, value: object) -> str:
    """How a refusal opens on a workload field: ``name=VALUE:`` with the value as JSON writes
    it (``true``, ``null``, ``"5"``, ``[0.5, true]``), cut short to keep one line, so the
    message shows what the file holds (a string ``"5"`` never reads as the integer 5, nor
    ``true`` as Python's ``True``); ``name: missing;`` when the file leaves it out."""
    if value is MISSING:
        return f"{name}: missing;"
    text = json.dumps(value)
    if len(text) > _MAX_SPELLED:
        text = text[: _MAX_SPELLED - 3] + "..."
    return f"{name}={text}:"


def _json(source: str, number: int, text: str) -> Any:
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                          parse_float=marked_double)
        check_doubles(data)
        return data
    except UnheldNumber as error:  # valid JSON, with a number no double holds
        raise ConfigError("--workload", f"{source}:{number}", str(error)) from None
    except ValueError as error:
        if past_int_digits(error):  # one JSON object all the same
            raise ConfigError("--workload", f"{source}:{number}",
                              f"invalid JSON: {json_fault(error)}") from None
        raise ConfigError("--workload", f"{source}:{number}",
                          f"expected one JSON object per line ({json_fault(error)})") from None
    except RecursionError:
        raise ConfigError("--workload", f"{source}:{number}", "expected one JSON object per "
                          "line (this one is nested too deeply)") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """With a repeated key json keeps the last value silently; a workload line is refused."""
    data = dict(pairs)
    if len(data) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice "
                         "in one object")
    return data


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON; expected a finite number")


def _round(data: Any, width: int, dp_size: int, where: str) -> WorkloadRound:
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list) \
            or not data["requests"]:
        raise ConfigError("--workload", where, 'expected {"requests": [...]} with at least '
                          "one request")
    unknown = sorted(set(data) - {"requests", "kv_length"})
    if unknown:
        raise ConfigError("--workload", where, f"{unknown[0]}: not a round field; expected "
                          "requests, kv_length")
    kv = data.get("kv_length")  # optional, but never null: absent is how it is left out
    if "kv_length" in data and (type(kv) is not int or not 1 <= kv <= MAX_TOKENS_IN_CONTEXT):
        raise ConfigError("--workload", where, f"{_field('kv_length', kv)} expected an "
                          f"integer in 1..{MAX_TOKENS_IN_CONTEXT}")
    requests = tuple(_request(r, width, dp_size, f"{where}, requests[{i}]")
                     for i, r in enumerate(data["requests"]))
    seen: set[tuple[int, int]] = set()
    for request in requests:
        if (request.shard, request.id) in seen:
            raise ConfigError("--workload", where, f"request id {request.id} appears twice in "
                              f"shard {request.shard}'s batch")
        seen.add((request.shard, request.id))
    return WorkloadRound(requests=requests, kv_length=kv)


def _request(data: Any, width: int, dp_size: int, where: str) -> WorkloadRequest:
    if not isinstance(data, dict):
        raise ConfigError("--workload", where, f"expected an object, got {json_type(data)}")
    unknown = sorted(set(data) - {"id", "confidences", "accepted", "censored", "shard"})
    if unknown:
        raise ConfigError("--workload", where, f"{unknown[0]}: not a request field")
    rid, confidences, accepted = (data.get(key, MISSING)
                                  for key in ("id", "confidences", "accepted"))
    if type(rid) is not int or not 0 <= rid <= MAX_REQUEST_ID:
        raise ConfigError("--workload", where, f"{_field('id', rid)} expected an integer in "
                          f"0..{MAX_REQUEST_ID}")
    if (not isinstance(confidences, list) or len(confidences) != width
            or not all(type(c) in (int, float) and 0.0 <= c <= 1.0 for c in confidences)):
        raise ConfigError("--workload", where, f"{_field('confidences', confidences)} "
                          f"expected {width} numbers in 0..1 (one per drafted position, the "
                          "header's width)")
    if type(accepted) is not int or not 0 <= accepted <= width:
        raise ConfigError("--workload", where, f"{_field('accepted', accepted)} expected an "
                          f"integer in 0..{width}")
    shard = data.get("shard", 0)
    if type(shard) is not int or not 0 <= shard < dp_size:
        raise ConfigError("--workload", where, f"{_field('shard', shard)} expected an integer in "
                          f"0..{dp_size - 1} (the header's dp_size is {dp_size})")
    return WorkloadRequest(id=rid, confidences=tuple(float(c) for c in confidences),
                           accepted=accepted, censored=_censored(data, accepted, width, where),
                           shard=shard)


def _censored(data: Mapping[str, Any], accepted: int, width: int, where: str) -> bool:
    value = data.get("censored", False)
    if type(value) is not bool:
        raise ConfigError("--workload", where, f"{_field('censored', value)} expected true "
                          "or false")
    if value and accepted == width:
        # Censored: a run verified fewer than the width and accepted them all, so fewer.
        raise ConfigError("--workload", where, f"censored=true with accepted={accepted}: "
                          f"expected accepted < {width} (a censored count is what a round "
                          "that verified fewer than the width accepted)")
    return value


def survivals_of(confidences: Sequence[float], depth: int) -> list[float]:
    """Running products of the first ``depth`` conditional confidences."""
    return list(itertools.accumulate(confidences[:depth], operator.mul))


def allocate(survivals: Sequence[Sequence[float]], num_rows: int) -> list[int]:
    """Verify lengths of the device's allocation rule (``runtime.devices.allocation``) in
    plain Python: the top ``G - B`` survivals, ties to the lower request then position."""
    candidates = [(-s, request, position) for request, row in enumerate(survivals)
                  for position, s in enumerate(row)]
    candidates.sort()
    admitted = {(request, position) for _, request, position in
                candidates[:max(0, num_rows - len(survivals))]}
    lengths = []
    for request, row in enumerate(survivals):
        length = 0
        while length < len(row) and (request, length) in admitted:
            length += 1
        lengths.append(length)
    return lengths


@dataclass(slots=True)
class SimulationResult:
    """What one policy did over a workload, priced by the cost table."""

    policy: str
    rounds: int = 0
    request_rounds: int = 0
    tokens: int = 0  # accepted drafts plus one residual or bonus per request-round
    cost_ms: float = 0.0
    rows: int = 0
    depth_changes: int = 0  # rounds whose depth differs from the round before (probes too)
    depth_switches: int = 0  # changes of the depth the policy settled on (probes excluded)
    probes: int = 0
    censored_rounds: int = 0  # rounds where a recorded (censored) acceptance bound was used
    decisions: list[tuple[int, int]] = field(default_factory=list)  # (depth, G) per round

    def as_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "rounds": self.rounds,
                "tokens_per_round": round(self.tokens / self.rounds, 4),
                "mean_acceptance_length": round(self.tokens / self.request_rounds, 4),
                "predicted_cost_ms_per_round": round(self.cost_ms / self.rounds, 4),
                "predicted_tokens_per_second": round(1000 * self.tokens / self.cost_ms, 2),
                "mean_rows": round(self.rows / self.rounds, 2),
                "depth_changes_per_1000_rounds": round(1000 * self.depth_changes
                                                       / self.rounds, 2),
                "depth_switches_per_1000_rounds": round(1000 * self.depth_switches
                                                        / self.rounds, 2),
                "probes_per_1000_rounds": round(1000 * self.probes / self.rounds, 2),
                "censored_rounds": self.censored_rounds}

    @property
    def tokens_per_second(self) -> float:
        return 1000 * self.tokens / self.cost_ms


class Geometry:
    """Buckets and tiers of the launch a bundle was calibrated on."""

    def __init__(self, bundle: CostBundle, path: str) -> None:
        compat: Mapping[str, Any] = bundle.compatibility
        if "request_buckets" not in compat or "target_rows" not in compat:
            raise ConfigError("--cost_table", path, "expected a versioned bundle (a legacy "
                              "table records no buckets or tiers to simulate with)")
        self.buckets: tuple[int, ...] = tuple(compat["request_buckets"])
        self.legal_rows: dict[int, tuple[int, ...]] = {
            b: tuple(rows) for b, rows in zip(self.buckets, compat["target_rows"], strict=True)}
        self.width = int(compat["draft_width"])
        self.dp_size = int(compat.get("dp_size", 1))

    def bucket(self, num_reqs: int, where: str) -> int:
        for bucket in self.buckets:
            if bucket >= num_reqs:
                return bucket
        raise ConfigError("--workload", where, f"{num_reqs} requests in one round exceed the "
                          f"largest captured bucket {self.buckets[-1]} of the cost table")


class Oracle:
    """Marker for the policy that knows each round's true acceptance."""

    name = "oracle"


class OracleDepth(FixedDepth):
    """Marker for the depth chooser that knows each round's true acceptance: the depth with
    the most true tokens per millisecond this round (all drafts verified), an upper bound
    for any depth policy."""

    name = "oracle-depth"


PolicySpec = tuple[DepthPolicy, BudgetPolicy | Oracle]


def depth_pricing(costs: CostBundle, geometry: "Geometry") -> DepthPricing:
    """Depth d's price for a context's batch: from a table measured per depth, the runtime's
    own pricing (``bundle_pricing``: the batch's KV interval, the rows it verifies);
    otherwise the verification table at the tier verifying every drafted token,
    ``B * (d + 1)`` rows (draft steps then not priced apart)."""
    if any(p.over == "depth" for p in costs.profiles):  # a table measured per depth
        return bundle_pricing(costs)
    default_kv = costs.profiles[0].context.max_kv_length

    def price(context: DepthContext, depth: int) -> float | None:
        rows = covering_tier(geometry.legal_rows[context.num_reqs_bucket], context.num_reqs, depth)
        return costs.cost_ms(context.num_reqs_bucket, rows, context.max_kv_length or default_kv)

    return price


def make_policies(spec: str, costs: CostBundle, width: int,
                  geometry: "Geometry | None" = None,
                  depth_settings: Mapping[str, Any] | None = None) -> PolicySpec:
    """``fixed:K``, ``adaptive-depth``, ``adaptive-verify`` or ``oracle`` as a (depth,
    budget) pair."""
    if spec.startswith("fixed:"):
        value = spec.partition(":")[2]
        # ASCII and short first: int() refuses "²" and strings of thousands of digits.
        if not (value.isascii() and value.isdigit() and len(value) <= 4) \
                or not 1 <= int(value) <= width or value != str(int(value)):
            raise ConfigError("--policy", spec, f"expected fixed:K with K in 1..{width}")
        return FixedAt(int(value)), FullBudget()
    if spec in ("adaptive-verify", "oracle") and any(p.over == "depth"
                                                   for p in costs.profiles):
        raise ConfigError("--policy", spec, "needs a cost table priced over target rows G; "
                          "this one is priced per draft depth (adaptive draft steps)")
    if spec == "adaptive-verify":
        return FixedDepth(), AdaptiveVerify(costs)
    if spec == "oracle":
        return FixedDepth(), Oracle()
    algorithm = costs.compatibility.get("algorithm")
    if spec in ("adaptive-depth", "oracle-depth") and algorithm not in (None, "MTP"):
        raise ConfigError("--policy", spec, f"chooses MTP draft depths; the cost table "
                          f"prices a {algorithm} run")
    if spec == "oracle-depth":
        return OracleDepth(), FullBudget()
    if spec == "adaptive-depth":
        pricing = depth_pricing(costs, geometry) if geometry is not None else None
        config = DraftStepPolicyConfig(**depth_settings or {})
        return AdaptiveDepth(config, pricing), FullBudget()
    raise ConfigError("--policy", spec, f"expected fixed:K (K in 1..{width}), "
                      "adaptive-depth, adaptive-verify, oracle or oracle-depth")


class FixedAt(FixedDepth):
    """Draft (and verify) exactly K positions every round: fixed width K."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.name = f"fixed:{depth}"

    def decide(self, context: DepthContext) -> int:
        self._decisions += 1
        return self.depth


def simulate(spec: str, workload: Workload, costs: CostBundle, path: str = "cost table",
             depth_settings: Mapping[str, Any] | None = None) -> SimulationResult:
    """Run one policy over the workload (fresh policy instances); ``adaptive-depth`` with
    ``depth_settings`` (a recorded run's), else with the default settings."""
    geometry = Geometry(costs, path)
    if workload.width != geometry.width:
        raise ConfigError("--workload", workload.where,
                          f"width {workload.width} differs from the cost table's draft_width "
                          f"{geometry.width}")
    if workload.dp_size != geometry.dp_size:
        raise ConfigError("--workload", workload.where,
                          f"dp_size {workload.dp_size} differs from the cost table's dp_size "
                          f"{geometry.dp_size}")
    depth_policy, budget_policy = make_policies(spec, costs, workload.width, geometry,
                                                depth_settings)
    result = SimulationResult(policy=spec)
    pending: list[RoundFeedback] = []
    default_kv = costs.profiles[0].context.max_kv_length
    last_depth: int | None = None
    for number, rnd in enumerate(workload.rounds):
        while pending and pending[0].round <= number - LAG:
            feedback = pending.pop(0)
            depth_policy.observe(feedback)
            if not isinstance(budget_policy, Oracle):
                budget_policy.observe(feedback)
        shards = rnd.shards(workload.dp_size)
        # DP shards run one physical graph: the bucket holds the largest shard's batch.
        num_reqs = max(len(batch) for batch in shards)
        bucket = geometry.bucket(num_reqs, f"{workload.where}, round {number}")
        legal_rows = geometry.legal_rows[bucket]
        kv = rnd.kv_length if rnd.kv_length is not None else default_kv
        retired = number - LAG
        depth_context = DepthContext(round=number, num_reqs=num_reqs, num_reqs_bucket=bucket,
                                     width=workload.width, retired_through=retired,
                                     max_kv_length=kv)
        if isinstance(depth_policy, OracleDepth):
            depth = _oracle_depth(rnd, depth_context, legal_rows, kv, costs, path)
        else:
            depth = depth_policy.decide(depth_context)
        context = BudgetContext(
            round=number, num_reqs=num_reqs, num_reqs_bucket=bucket, width=workload.width,
            depth=depth, legal_rows=legal_rows, retired_through=retired,
            request_ids=tuple(r.id for batch in shards for r in batch), max_kv_length=kv,
            shard_sizes=tuple(len(batch) for batch in shards) if workload.dp_size > 1 else ())
        if isinstance(budget_policy, Oracle):
            rows = _oracle_rows(shards, context, costs, path)
        else:
            rows = budget_policy.decide(context)
        cost = _price(costs, bucket, rows, kv, path, depth)
        result.rounds += 1
        result.cost_ms += cost
        result.rows += rows
        result.censored_rounds += any(r.censored for r in rnd.requests)
        result.depth_changes += last_depth is not None and depth != last_depth
        result.decisions.append((depth, rows))
        last_depth = depth
        for shard, batch in enumerate(shards):
            if not batch:
                continue  # an idle shard retires nothing
            lengths, accepted = _verify(batch, depth, rows)
            result.request_rounds += len(batch)
            result.tokens += sum(accepted) + len(batch)
            pending.append(RoundFeedback(
                round=number, num_reqs=len(batch), num_reqs_bucket=bucket,
                width=workload.width, depth=depth, num_rows=rows,
                verify_lengths=tuple(lengths), num_accepted=tuple(accepted),
                confidences=tuple(r.confidences[:depth] + (0.0,) * (workload.width - depth)
                                  for r in batch),
                request_ids=tuple(r.id for r in batch), shard=shard))
    values = depth_policy.statistics().values
    # A policy that probes says which changes were switches; otherwise every change is one.
    switches, probes = values.get("switches"), values.get("probes")
    result.depth_switches = switches if isinstance(switches, int) else result.depth_changes
    result.probes = probes if isinstance(probes, int) else 0
    return result


def rounds_outside_contexts(workload: Workload, costs: CostBundle) -> int:
    """How many rounds have a KV length that no interval of the table covers: ``simulate``
    prices those with the nearest interval (a policy deciding in the runtime finds no price
    there, as in the simulation)."""
    default_kv = costs.profiles[0].context.max_kv_length
    return sum(not any(p.context.min_kv_length <= kv <= p.context.max_kv_length
                       for p in costs.profiles)
               for kv in (default_kv if r.kv_length is None else r.kv_length
                          for r in workload.rounds))


def covered_contexts(costs: CostBundle) -> str:
    """The table's KV intervals, as the simulate report names them."""
    spans = sorted({(p.context.min_kv_length, p.context.max_kv_length) for p in costs.profiles})
    return ", ".join(f"{low}..{high}" for low, high in spans)


def _price(costs: CostBundle, bucket: int, rows: int, kv: int, path: str,
           depth: int | None = None) -> float:
    """A round's predicted milliseconds: from the (Bcap, G) profiles, or, for a table of
    adaptive draft steps, as the runtime prices a round at depth d verifying G rows
    (``CostBundle.depth_cost_ms``). A KV length outside the coverage is priced with the
    nearest interval."""
    over = "depth" if depth is not None and any(p.over == "depth" for p in costs.profiles) \
        else "rows"
    profiles = [p for p in costs.profiles if p.over == over]
    if profiles and costs.profile(kv, over) is None:
        nearest = min(profiles, key=lambda p: min(abs(kv - p.context.min_kv_length),
                                                  abs(kv - p.context.max_kv_length)))
        kv = min(max(kv, nearest.context.min_kv_length), nearest.context.max_kv_length)
    shape = f"Bcap={bucket} G={rows}" + (f" d={depth}" if over == "depth" else "")
    cost = (costs.depth_cost_ms(bucket, depth, kv, rows) if depth is not None and over == "depth"
            else costs.cost_ms(bucket, rows, kv))
    if cost is None:
        raise ConfigError("--cost_table", path, f"cannot price {shape} "
                          f"({_unpriced(costs, over, bucket, rows, kv, depth)}); calibrate "
                          "the buckets the workload uses")
    if not math.isfinite(cost) or cost <= 0:
        raise ConfigError("--cost_table", path, f"prices {shape} at {cost} ms")
    return cost


def _unpriced(costs: CostBundle, over: str, bucket: int, rows: int, kv: int,
              depth: int | None) -> str:
    """Why a covered KV length has no price: the shape lies above the measured ones, or the
    rows profile's difference exceeds the depth's whole price."""
    profile = costs.profile(kv, over)
    if profile is None:
        return f"the table has no {over} profile"
    try:
        profile.table.cost_ms(bucket, depth if over == "depth" and depth is not None else rows)
    except UnpricedShape as error:
        return str(error)
    return "its rows profile takes more off the depth's price than the depth costs"


def _verify(batch: Sequence[WorkloadRequest], depth: int, rows: int
            ) -> tuple[list[int], list[int]]:
    """One shard's verify lengths under the device's allocation of ``rows`` rows to the
    round's own survivals, and the drafted tokens each request then accepts."""
    lengths = allocate([survivals_of(r.confidences, depth) for r in batch], rows)
    return lengths, [min(length, r.accepted) for length, r in zip(lengths, batch, strict=True)]


def _oracle_rows(shards: Sequence[Sequence[WorkloadRequest]], context: BudgetContext,
                 costs: CostBundle, path: str) -> int:
    """The tier with the most true tokens per millisecond this round, summed over the
    shards (ties: smaller G)."""
    best, best_rate = covering_rows(context, context.depth), -1.0
    for rows in context.legal_rows:
        tokens = sum(sum(_verify(batch, context.depth, rows)[1]) + len(batch)
                     for batch in shards)
        rate = tokens / _price(costs, context.num_reqs_bucket, rows, context.max_kv_length,
                               path)
        if rate > best_rate:
            best, best_rate = rows, rate
    return best


def _oracle_depth(rnd: WorkloadRound, context: DepthContext, legal_rows: Sequence[int], kv: int,
                  costs: CostBundle, path: str) -> int:
    """The depth with the most true tokens per millisecond this round (ties: shallower)."""
    best, best_rate = context.width, -1.0
    for depth in range(1, context.width + 1):
        rows = covering_tier(legal_rows, context.num_reqs, depth)
        tokens = sum(min(depth, r.accepted) + 1 for r in rnd.requests)
        rate = tokens / _price(costs, context.num_reqs_bucket, rows, kv, path, depth)
        if rate > best_rate:
            best, best_rate = depth, rate
    return best
