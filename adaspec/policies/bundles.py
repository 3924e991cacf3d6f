"""Saved cost tables (bundles): the fitted costs of one launch, what they were measured on,
and what a later launch must share to reuse them.

A bundle is one versioned JSON object:

    {"version": 1, "format": "adaspec-cost-table",
     "compatibility": {algorithm, draft_width, dp_size, tp_size, unified, device,
                       target, draft, request_buckets, target_rows},
     "settings": {the calibration settings used},
     "profiles": [{"context": {prefill_tokens, min_kv_length, max_kv_length},
                   "over": "rows" or "depth", "table": {...},
                   "samples": [[Bcap, G or depth, seconds], ...]}]}

One profile per calibrated KV interval; a round whose KV length no profile covers has no
price and the policy keeps full width. Loading checks every compatibility field against the
launch and names the first that differs. A legacy table (a bare table object, no version)
carries no metadata beyond an optional ``draft_width``, which means width 7 when absent; its
other fields cannot be checked and are reported as unchecked. Its table's own axes are held
to the launch's captured geometry instead (``legacy_gap``): every value a captured shape, and
each axis reaching the launch's largest, so no round the launch runs goes unpriced.
"""

import json
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from adaspec.config.builtin import builtin_checkpoints
from adaspec.config.calibration import (
    MAX_BATCH_ROWS,
    MAX_STEPS,
    MAX_TOKENS_IN_CONTEXT,
    ContextInterval,
    check_disjoint,
    json_type,
    key_prefix,
    require_int,
)
from adaspec.config.files import read_json_object
from adaspec.config.flags import RETIRED_NAMES, retired_name_error
from adaspec.config.launch import Device, LaunchConfig
from adaspec.errors import MISSING, ConfigError, IncompatibleCostTable
from adaspec.policies.base import covering_tier
from adaspec.policies.costs import (
    MAX_PRICE_SECONDS,
    MIN_PRICE_SECONDS,
    CostSample,
    CostTable,
    UnpricedShape,
    table_from_dict,
)

BUNDLE_VERSION = 1
BUNDLE_FORMAT = "adaspec-cost-table"
LEGACY_DRAFT_WIDTH = 7
"""Width of a legacy table that does not say: those tables predate Draft5."""

ALL_CONTEXTS = ContextInterval(prefill_tokens=1, min_kv_length=1,
                               max_kv_length=MAX_TOKENS_IN_CONTEXT)
"""Coverage of a legacy table, which records none: it prices every KV length."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Compatibility:
    """What a launch must share with the one that measured a table to reuse it."""

    # Checked in this order, so a refusal names the most telling difference first.
    algorithm: str  # DSpark or MTP: their tables are never interchangeable
    draft_width: int  # w
    dp_size: int
    tp_size: int
    unified: bool  # unified (whole-round) graphs rather than split ones
    device: str  # cpu, cuda or npu
    target: str  # target checkpoint identity
    draft: str  # draft checkpoint identity (the DSpark head or the MTP layer)
    request_buckets: tuple[int, ...]  # captured Bcap
    target_rows: tuple[tuple[int, ...], ...]  # captured tiers G, one tuple per bucket

    def as_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["request_buckets"] = list(self.request_buckets)
        data["target_rows"] = [list(rows) for rows in self.target_rows]
        return data


COMPATIBILITY_FIELDS = tuple(Compatibility.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class CostProfile:
    """The table fitted for one KV interval, with the samples it was fitted to.

    ``over="rows"``: the table prices (Bcap, G) at full depth (adaptive target verify).
    ``over="depth"``: its second axis is the draft depth d, each measured with the rows that
    verify every drafted token (adaptive draft steps); the samples' second value is then d.
    """

    context: ContextInterval
    table: CostTable
    samples: tuple[CostSample, ...] = ()
    over: str = "rows"

    def as_dict(self) -> dict[str, object]:
        return {"context": self.context.as_dict(), "over": self.over,
                "table": self.table.as_dict(),
                "samples": [[s.num_reqs_bucket, s.num_rows, s.seconds] for s in self.samples]}


@dataclass(frozen=True, slots=True, kw_only=True)
class CostBundle:
    """The immutable cost model installed before ready, and what saves or reloads it."""

    compatibility: Mapping[str, object]
    """The saved compatibility fields (all of them, except in a legacy table)."""
    settings: Mapping[str, object]
    """The calibration settings the samples were taken with ({} for a legacy table)."""
    profiles: tuple[CostProfile, ...]
    version: int | None = BUNDLE_VERSION
    """None for a legacy (unversioned) table."""
    source: str = field(default="calibrated at startup", compare=False)
    """Where the costs came from: calibrated at startup (and from which settings) or the
    saved file."""

    def profile(self, kv_length: int, over: str = "rows") -> CostProfile | None:
        """The profile of that axis covering a KV length, None when none does."""
        for profile in self.profiles:
            if (profile.over == over and profile.context.min_kv_length <= kv_length
                    <= profile.context.max_kv_length):
                return profile
        return None

    def depth_cost_ms(self, num_reqs_bucket: int, depth: int, kv_length: int | None = None,
                      num_rows: int | None = None) -> float | None:
        """Predicted full-cycle milliseconds of a round at depth d in bucket Bcap whose longest
        KV is ``kv_length``, verifying ``num_rows`` target rows; None when no depth profile
        covers it. Without a KV length (a log that did not record one) the first profile of
        each axis prices it.

        A depth profile measured full buckets: Bcap requests at depth d verifying the tier
        that covers Bcap * (d + 1) rows. A batch of B < Bcap requests verifies only the tier
        covering B * (d + 1). Its price is then the rows profile of the same KV interval
        (full depth, every tier such a batch runs) at the rows it verifies, less what the
        depth saves at full rows: ``rows(G) - (rows(G_d) - depth(d))``, which is
        ``depth(d) - (rows(G_d) - rows(G))``; draft steps and verification run one after
        the other, so the rows' difference does not depend on the depth. A table without
        that profile (fitted before calibration measured it) or without a price for both
        tiers leaves the depth's own price; one whose rows difference exceeds the whole
        depth price contradicts itself and prices nothing.
        """
        price = _priced(self._profile_of(kv_length, "depth"), num_reqs_bucket, depth)
        tiers = self.legal_rows(num_reqs_bucket)
        if price is None or num_rows is None or not tiers:
            return price
        measured = covering_tier(tiers, num_reqs_bucket, depth)
        if num_rows == measured:
            return price
        rows = self._profile_of(kv_length, "rows")
        high, low = _priced(rows, num_reqs_bucket, measured), _priced(rows, num_reqs_bucket,
                                                                       num_rows)
        if high is None or low is None:
            return price
        moved = price - (high - low)
        return moved if moved >= 1000 * MIN_PRICE_SECONDS else None

    def legal_rows(self, num_reqs_bucket: int) -> tuple[int, ...]:
        """The captured tiers G of a request bucket (``compatibility.target_rows``); () when
        the bundle does not record them (a legacy table) or did not capture the bucket."""
        buckets = self.compatibility.get("request_buckets")
        rows = self.compatibility.get("target_rows")
        if not isinstance(buckets, list | tuple) or not isinstance(rows, list | tuple):
            return ()
        for bucket, tiers in zip(buckets, rows, strict=False):
            if bucket == num_reqs_bucket:
                return tuple(tiers)
        return ()

    def _profile_of(self, kv_length: int | None, over: str) -> CostProfile | None:
        """The profile of that axis covering a KV length; the first of the axis without one."""
        if kv_length is None:
            return next((p for p in self.profiles if p.over == over), None)
        return self.profile(kv_length, over)

    def cost_ms(self, num_reqs_bucket: int, num_rows: int, kv_length: int) -> float | None:
        """Predicted full-step milliseconds at (Bcap, G) for a batch whose longest KV is
        ``kv_length``; None when no profile covers it or the shape lies above everything
        measured (the policy then keeps the prewarmed full width)."""
        return _priced(self.profile(kv_length), num_reqs_bucket, num_rows)

    @property
    def unchecked(self) -> tuple[str, ...]:
        """Compatibility fields the table does not record (a legacy table)."""
        return tuple(name for name in COMPATIBILITY_FIELDS if name not in self.compatibility)

    def as_dict(self) -> dict[str, object]:
        if self.version is None:  # a legacy table as it was read: it reads back the same
            table = self.profiles[0].as_dict()["table"]
            assert isinstance(table, dict)
            return {**table, "draft_width": self.compatibility["draft_width"]}
        return {"version": self.version, "format": BUNDLE_FORMAT,
                "compatibility": dict(self.compatibility), "settings": dict(self.settings),
                "profiles": [profile.as_dict() for profile in self.profiles]}

    def to_json(self) -> str:
        # repr-exact floats: a reloaded table prices every shape bit for bit the same.
        return json.dumps(self.as_dict(), indent=1, sort_keys=False) + "\n"

    def save(self, path: str) -> None:
        """Write the bundle to a new file; an existing file is never overwritten, and a write
        that fails part way (a full disk) removes what it created, so no truncated table is
        left for a later launch to refuse."""
        setting = "--adaptive_target_verify_cost_table_output"
        try:
            handle = open(path, "x", encoding="utf-8")  # noqa: SIM115 - closed below
        except FileExistsError:
            raise ConfigError(setting, path, "expected a file that does not exist yet; choose "
                              "a new output file") from None
        except OSError as error:
            raise ConfigError(setting, path,
                              f"expected a writable file: {error.strerror}") from None
        try:
            with handle:
                handle.write(self.to_json())
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            os.unlink(path)
            raise ConfigError(setting, path, f"cannot write the cost table "
                              f"({error.strerror}); nothing was kept") from None

    def check_compatible(self, launch: Compatibility, path: str, *,
                         context_limit: int = MAX_TOKENS_IN_CONTEXT) -> None:
        """Refuse the table unless every field it records equals this launch's and every
        profile lies within the target's ``context_limit`` (calibration never measures
        beyond it, so such a profile was measured on another model)."""
        self.check_fields(launch.as_dict(), path)
        self.check_geometry(launch.request_buckets, launch.target_rows, path)
        self.check_context_limit(path, context_limit)

    def check_geometry(self, request_buckets: Sequence[int],
                       target_rows: Sequence[Sequence[int]], path: str) -> None:
        """Refuse a legacy table that does not price every shape the launch captures (its
        ``request_buckets`` and each bucket's legal ``target_rows``). A bundle records the
        geometry it was measured on, which ``check_fields`` compares; a legacy table records
        only the axes of its table (``buckets`` and ``rows``, or ``rows`` alone for sps)."""
        if self.version is None and request_buckets:
            gap = legacy_gap(self.profiles[0].table, request_buckets, target_rows)
            if gap is not None:
                raise ConfigError(f"--adaptive_target_verify_cost_table={path}: {gap[0]}",
                                  gap[1], gap[2])

    def check_context_limit(self, path: str, context_limit: int) -> None:
        """Refuse a profile beyond the target's context limit: calibration never measures
        past it, so such a profile was measured on another model."""
        index = self.measured_past(context_limit)
        if index is not None:
            raise ConfigError(f"--adaptive_target_verify_cost_table={path}: profiles"
                              f"[{index}].context.max_kv_length",
                              self.profiles[index].context.max_kv_length,
                              f"expected at most the model's context limit {context_limit}")

    def measured_past(self, context_limit: int) -> int | None:
        """The index of the first profile measured beyond ``context_limit``, or None. A legacy
        table records no coverage (its one profile covers every length): it is measured past
        no limit."""
        if self.version is None:
            return None
        return next((index for index, profile in enumerate(self.profiles)
                     if profile.context.max_kv_length > context_limit), None)


    def check_fields(self, wanted: Mapping[str, object], path: str) -> None:
        """Refuse the table when a field it records differs from ``wanted`` (a subset of the
        compatibility fields: what is known before the models load, say); the first that
        differs, in ``COMPATIBILITY_FIELDS`` order, is named."""
        for name in COMPATIBILITY_FIELDS:
            if name in wanted and name in self.compatibility \
                    and self.compatibility[name] != wanted[name]:
                raise IncompatibleCostTable(path, name, self.compatibility[name], wanted[name])


def launch_fields(launch: LaunchConfig) -> dict[str, object]:
    """The compatibility fields a launch fixes by itself, before any model or device is
    known (the checkpoint identities and the captured geometry come at start)."""
    return {"algorithm": launch.speculative_algorithm,
            "draft_width": launch.num_speculative_tokens, "dp_size": launch.dp_size,
            "tp_size": launch.resolved.tp_size, "unified": launch.enable_unified_mtp_graph,
            "device": launch.device}


def check_saved_table(launch: LaunchConfig) -> None:
    """A launch's saved cost table (when it names one): its contents checked as a load
    checks them, and the fields the launch fixes compared (for the built-in models also
    their identities and context limit, from the model card) and the captured geometry (a
    legacy table's axes against it), so ``adaspec config`` refuses what the start would."""
    path = launch.adaptive_target_verify_cost_table
    if path is None or not launch.enable_adaptive_target_verify:
        return
    bundle = load_bundle(path, read_json_object("adaptive_target_verify_cost_table", path))
    known = builtin_checkpoints(launch)
    identities = {} if known is None else known[0]
    bundle.check_fields({**launch_fields(launch), **geometry_fields(launch), **identities},
                        path)
    buckets = launch.prepared_request_buckets()
    bundle.check_geometry(buckets, [launch.legal_target_rows(b) for b in buckets], path)
    if known is not None:
        bundle.check_context_limit(path, known[1])


def legacy_gap(table: CostTable, request_buckets: Sequence[int],
               target_rows: Sequence[Sequence[int]]) -> tuple[str, list[int], str] | None:
    """The axis of a legacy table that does not fit a launch's captured geometry, with its
    values and what it should hold; None when the table fits.

    The policy prices a round at (Bcap, G) up to its bucket's full width, and a table prices
    a shape at the next larger one it measured: it prices every round when its largest
    bucket is the launch's largest and its largest G the largest legal G (full width of that
    bucket). Past them, a round has no price and verifies full width, unsaid. A value the
    launch never captures (G=3 on a ladder of 2, 4, ...) was measured on another geometry:
    it would price the launch's shapes below it with a shape the launch never runs."""
    legal = sorted({g for rows in target_rows for g in rows})
    axes = [("rows", "G", "legal target rows (of every request bucket)", legal)]
    if hasattr(table, "buckets"):  # sps pools every bucket: it records rows alone
        axes.insert(0, ("buckets", "Bcap", "request buckets", list(request_buckets)))
    for name, symbol, what, captured in axes:
        values = list(getattr(table, name))
        foreign = [v for v in values if v not in captured]
        expected = f"expected values from the launch's {what} {captured}"
        if foreign:
            return name, values, (f"{expected}; {foreign[0]} is not one (it was measured "
                                  "on another geometry)")
        if values[-1] < captured[-1]:
            return name, values, (f"{expected}, up to {captured[-1]}: a round at {symbol} "
                                  f"above {values[-1]} has no price and verifies full width")
    return None


def geometry_fields(launch: LaunchConfig) -> dict[str, object]:
    """The captured geometry a launch prepares, as a saved table records it (the start
    compares the same from its bucket geometry)."""
    buckets = launch.prepared_request_buckets()
    return {"request_buckets": list(buckets),
            "target_rows": [list(launch.legal_target_rows(b)) for b in buckets]}


def _priced(profile: CostProfile | None, num_reqs_bucket: int, second: int) -> float | None:
    """A profile's price at (Bcap, G or d); None without a profile or above its shapes."""
    if profile is None:
        return None
    try:
        return profile.table.cost_ms(num_reqs_bucket, second)
    except UnpricedShape:
        return None


_BUNDLE_ONLY_KEYS = ("format", "compatibility", "settings", "profiles")
"""Keys of a versioned bundle that no legacy table has."""

_ALGORITHMS = ("DSpark", "MTP")
"""The algorithms whose rounds a cost table prices."""


def bundle_from_dict(data: Mapping[str, object], source: str) -> CostBundle:
    """A bundle from its JSON object, every field checked (errors name the key path).

    An object without ``version`` is a legacy table, unless it has a versioned bundle's own
    keys: then it is a bundle that lost its version, and is refused saying so (read as a
    table, it would only be refused for lacking a table's ``kind``)."""
    if "version" not in data:
        _refuse_versionless_bundle(data)
        return _legacy(data, source)
    version = data["version"]
    if type(version) is not int or version != BUNDLE_VERSION:
        got = "" if type(version) is int else f", got {json_type(version)}"
        raise ConfigError("version", version, f"expected the integer {BUNDLE_VERSION} (the "
                          "only bundle version; a table without a version is read as a legacy "
                          f"table){got}")
    _exact_keys("", data, {"version", "format", "compatibility", "settings", "profiles"})
    if data["format"] != BUNDLE_FORMAT:
        raise ConfigError("format", data["format"], f"expected {BUNDLE_FORMAT}")
    compatibility = _object("compatibility", data["compatibility"])
    with key_prefix("compatibility."):
        _exact_keys("", compatibility, set(COMPATIBILITY_FIELDS))
        _check_compatibility_types(compatibility)
    profiles = _list("profiles", data["profiles"])
    if not profiles:
        raise ConfigError("profiles", [], "expected at least one profile")
    parsed = []
    for index, profile in enumerate(profiles):
        checked = _object(f"profiles[{index}]", profile)
        with key_prefix(f"profiles[{index}]."):
            parsed.append(_profile(checked))
    _check_disjoint(parsed)
    settings = _object("settings", data["settings"])
    with key_prefix("settings."):
        _check_settings(settings, compatibility, parsed)
        for name, low, high in COUNTED_SETTINGS:
            if name in settings:
                require_int(name, settings[name], low, high)
    _check_samples(compatibility, parsed)
    _check_table_axes(compatibility, parsed)
    return CostBundle(compatibility=compatibility, settings=settings, profiles=tuple(parsed),
                      source=source)


def _refuse_versionless_bundle(data: Mapping[str, object]) -> None:
    present = [f'"{key}"' for key in _BUNDLE_ONLY_KEYS if key in data]
    if not present:
        return
    keys = present[0] if len(present) == 1 else \
        f"{', '.join(present[:-1])} and {present[-1]}"
    raise ConfigError("version", MISSING, f"missing; expected the integer {BUNDLE_VERSION} "
                      f"(an object with {keys} is a versioned bundle; a legacy table is a "
                      "bare table object)")


def _check_disjoint(profiles: Sequence[CostProfile]) -> None:
    """Profiles of one axis must not overlap: a KV length in two would be priced by whichever
    comes first, the other silently ignored."""
    for index, profile in enumerate(profiles):
        for earlier in profiles[:index]:
            if earlier.over == profile.over and earlier.context.overlaps(profile.context):
                raise ConfigError(f"profiles[{index}].context", profile.context.as_dict(),
                                  "expected KV intervals that do not overlap; it overlaps "
                                  f"{earlier.context.min_kv_length}.."
                                  f"{earlier.context.max_kv_length}")


def _legacy(data: Mapping[str, object], source: str) -> CostBundle:
    """An unversioned bare table: the table's own keys, plus an optional draft_width."""
    table = dict(data)
    width = table.pop("draft_width", LEGACY_DRAFT_WIDTH)
    require_int("draft_width", width, 1, 64)
    if "model" in table and "kind" not in table:
        table["kind"] = table.pop("model")
    return CostBundle(compatibility={"draft_width": width}, settings={},
                      profiles=(CostProfile(ALL_CONTEXTS,
                                            _checked_axis(table_from_dict(table), "rows")),),
                      version=None, source=source)


def _checked_axis(table: CostTable, over: str) -> CostTable:
    """Log seconds are fitted to depths only; a table over G is sps or additive."""
    if table.kind == "log-additive" and over != "depth":
        raise ConfigError("kind", table.kind, "expected sps or additive for a table over G "
                          "(log-additive prices draft depths only)")
    return table


def _profile(profile: Mapping[str, object]) -> CostProfile:
    _exact_keys("", profile, {"context", "over", "table", "samples"})
    if profile["over"] not in ("rows", "depth"):
        raise ConfigError("over", profile["over"], "expected rows or depth")
    context = _object("context", profile["context"])
    with key_prefix("context."):
        _exact_keys("", context, {"prefill_tokens", "min_kv_length", "max_kv_length"})
        interval = ContextInterval(**context)
    table_data = _object("table", profile["table"])
    with key_prefix("table."):
        table = _checked_axis(table_from_dict(table_data), str(profile["over"]))
    samples = []
    for index, sample in enumerate(_list("samples", profile["samples"])):
        if (not isinstance(sample, list) or len(sample) != 3
                or not all(type(v) is int for v in sample[:2])
                or type(sample[2]) not in (int, float)
                or not MIN_PRICE_SECONDS <= sample[2] <= MAX_PRICE_SECONDS):
            raise ConfigError(f"samples[{index}]", sample, "expected [Bcap, G, seconds] with "
                              f"seconds in {MIN_PRICE_SECONDS}..{MAX_PRICE_SECONDS:g}")
        samples.append(CostSample(sample[0], sample[1], float(sample[2])))
    return CostProfile(interval, table, tuple(samples), over=str(profile["over"]))


MODEL_OF_KIND = {"sps": "sps", "additive": "additive", "log-additive": "additive"}
"""The calibration setting ``model`` that fits each table kind (depth profiles fit the additive
model on log seconds)."""


def _check_settings(settings: Mapping[str, object], compatibility: Mapping[str, Any],
                    profiles: Sequence[CostProfile]) -> None:
    """Refuse settings that contradict the compatibility or the profiles: the bundle would
    claim measurements that its own launch could not have taken, so one of them is wrong.
    Keys the settings do not record are not checked (an embedding may record fewer); a key
    calibration never records is refused."""
    _check_setting_names(settings)
    width = compatibility["draft_width"]
    given = settings.get("draft_width", width)
    if type(given) is not int or given != width:
        got = "" if type(given) is int else f", got {json_type(given)}"
        raise ConfigError("draft_width", given, f"expected the integer {width}, the "
                          f"draft_width of the compatibility{got}")
    captured = dict(zip(compatibility["request_buckets"], compatibility["target_rows"],
                        strict=True))
    if "request_buckets" in settings:
        _require_members("request_buckets", settings["request_buckets"], set(captured),
                         "compatibility.request_buckets")
    if settings.get("target_graph_rows", ALL_TIERS) != ALL_TIERS:
        tiers = {g for rows in captured.values() for g in rows}
        _require_members("target_graph_rows", settings["target_graph_rows"], tiers,
                         "compatibility.target_rows")
    axis = "depth" if any(profile.over == "depth" for profile in profiles) else "rows"
    if "points" in settings:  # on the bundle's own axis; a depth bundle's rows apart
        _check_points("points", settings["points"], captured, width, axis)
    if "rows_points" in settings:
        _check_points("rows_points", settings["rows_points"], captured, width, "rows")
    if "model" in settings:
        for index, profile in enumerate(profiles):
            if MODEL_OF_KIND[profile.table.kind] != settings["model"]:
                raise ConfigError("model", settings["model"], f"expected "
                                  f"{MODEL_OF_KIND[profile.table.kind]}, the model of "
                                  f"profiles[{index}].table (kind {profile.table.kind})")
    if "contexts" in settings:
        _check_contexts_listed(settings["contexts"], profiles)


def _check_setting_names(settings: Mapping[str, object]) -> None:
    for name in settings:
        if name in RETIRED_NAMES:
            raise retired_name_error(name, name, settings[name])
        if name not in SETTINGS_KEYS:
            raise ConfigError(name, settings[name], f"is not a calibration setting; expected "
                              f"some of {', '.join(SETTINGS_KEYS)}")


SETTINGS_KEYS = ("model", "draft_width", "request_buckets", "target_graph_rows", "contexts",
                 "warmup_steps", "window_steps", "windows_per_point", "token_seed", "points",
                 "rows_points")
"""Every key a bundle's settings may record (``CalibrationPlan.settings_dict``)."""

COUNTED_SETTINGS = (("warmup_steps", 0, MAX_STEPS), ("window_steps", 1, MAX_STEPS),
                    ("windows_per_point", 1, MAX_STEPS), ("token_seed", 0, 2**63 - 1))
"""Calibration counts a bundle's settings may record, with the ranges a launch accepts."""


def _check_samples(compatibility: Mapping[str, Any], profiles: Sequence[CostProfile]) -> None:
    """Every sample was taken at a shape the launch captured: a bucket of the compatibility
    with one of its tiers (a rows profile) or a depth 1..draft_width (a depth profile)."""
    captured = dict(zip(compatibility["request_buckets"], compatibility["target_rows"],
                        strict=True))
    width = compatibility["draft_width"]
    for index, profile in enumerate(profiles):
        for number, sample in enumerate(profile.samples):
            legal = _legal_seconds(sample.num_reqs_bucket, captured, width, {profile.over})
            if sample.num_rows not in legal:
                raise ConfigError(f"profiles[{index}].samples[{number}]",
                                  [sample.num_reqs_bucket, sample.num_rows, sample.seconds],
                                  "expected [Bcap, G or depth, seconds] at a shape of the "
                                  "compatibility (Bcap in request_buckets and G one of its "
                                  "target_rows, or a depth 1..draft_width)")


def _check_table_axes(compatibility: Mapping[str, Any], profiles: Sequence[CostProfile]
                      ) -> None:
    """A table prices the shapes its profile's samples were measured at, which the launch
    captured: an axis cut short would leave captured shapes unpriced (the policy then
    verifies them whole, unsaid), one past them would price shapes never measured."""
    captured = dict(zip(compatibility["request_buckets"], compatibility["target_rows"],
                        strict=True))
    width = compatibility["draft_width"]
    for index, profile in enumerate(profiles):
        table = profile.table
        legal_rows = {g for bucket in captured for g in _legal_seconds(
            bucket, captured, width, {profile.over})}
        axes = [("rows", tuple(getattr(table, "rows", ())), legal_rows,
                 {s.num_rows for s in profile.samples})]
        if hasattr(table, "buckets"):
            axes.insert(0, ("buckets", tuple(table.buckets), set(captured),
                            {s.num_reqs_bucket for s in profile.samples}))
        for name, values, legal, sampled in axes:
            key = f"profiles[{index}].table.{name}"
            if not set(values) <= legal:
                raise ConfigError(key, list(values), f"expected values from the shapes the "
                                  f"compatibility captured {sorted(legal)}")
            if profile.samples and set(values) != sampled:
                raise ConfigError(key, list(values), f"expected the values the profile's "
                                  f"samples were measured at {sorted(sampled)}")


ALL_TIERS = "all legal prepared tiers"
"""What the settings record for target_graph_rows when calibration sampled every tier."""


def _require_members(name: str, values: object, allowed: set[int], source: str) -> None:
    """A non-empty, strictly increasing list of integers from ``allowed`` (as calibration
    records them)."""
    if (not isinstance(values, list) or not values or not _increasing(values)
            or not all(v in allowed for v in values)):
        raise ConfigError(name, values, f"expected a non-empty, strictly increasing list of "
                          f"values from {source} {sorted(allowed)}")


def _check_points(name: str, points: object, captured: Mapping[int, Sequence[int]],
                  width: int, axis: str) -> None:
    """Each sampled point of ``axis`` is a captured bucket with one of its tiers (rows) or
    with a depth 1..w (depth)."""
    second = "G one of its compatibility.target_rows" if axis == "rows" else \
        "a depth 1..draft_width"
    listed = _list(name, points)
    if not listed:
        raise ConfigError(name, listed, "expected at least one point")
    for index, point in enumerate(listed):
        if point in listed[:index]:
            raise ConfigError(f"{name}[{index}]", point, "expected each point once")
        if not (isinstance(point, list) and len(point) == 2
                and all(type(v) is int for v in point)
                and point[1] in _legal_seconds(point[0], captured, width, {axis})):
            raise ConfigError(f"{name}[{index}]", point, f"expected [Bcap, {second.split()[0]}] "
                              f"with Bcap in compatibility.request_buckets and {second}")


def _legal_seconds(bucket: int, captured: Mapping[int, Sequence[int]], width: int,
                   axes: set[str]) -> set[int]:
    """The second values a point of ``bucket`` may have: its tiers, the depths, or both."""
    if bucket not in captured:
        return set()
    tiers = set(captured[bucket]) if "rows" in axes else set()
    return tiers | (set(range(1, width + 1)) if "depth" in axes else set())


def _check_contexts_listed(contexts: object, profiles: Sequence[CostProfile]) -> None:
    """Each profile covers one of the intervals the settings say were calibrated."""
    listed = _list("contexts", contexts)
    keys = {"prefill_tokens", "min_kv_length", "max_kv_length"}
    intervals = []
    for index, entry in enumerate(listed):
        if not (isinstance(entry, dict) and set(entry) == keys
                and all(type(v) is int for v in entry.values())):
            raise ConfigError(f"contexts[{index}]", entry, "expected an object of exactly the "
                              f"integers {', '.join(sorted(keys))}")
        with key_prefix(f"contexts[{index}]."):  # held to the calibration file's rules
            intervals.append(ContextInterval(**entry))
    check_disjoint(intervals)
    for index, profile in enumerate(profiles):
        context = profile.context
        if context.as_dict() not in listed:
            raise ConfigError("contexts", listed, f"expected to list the interval of "
                              f"profiles[{index}] (prefill {context.prefill_tokens}, KV "
                              f"{context.min_kv_length}..{context.max_kv_length})")


def _check_names(data: Mapping[str, object]) -> None:
    """The compatibility's strings; a table prices one algorithm's rounds on one device, so
    another value there would be priced as if it were one of them (or refused only as a
    launch's mismatch)."""
    for name in ("target", "draft", "algorithm", "device"):
        if not isinstance(data[name], str):
            raise ConfigError(name, data[name], f"expected a string, got {json_type(data[name])}")
    for name, allowed in (("algorithm", _ALGORITHMS), ("device", typing.get_args(Device))):
        if data[name] not in allowed:
            raise ConfigError(name, data[name],
                              f"expected {', '.join(allowed[:-1])} or {allowed[-1]}")


def _check_compatibility_types(data: Mapping[str, object]) -> None:
    _check_names(data)
    for name in ("draft_width", "dp_size", "tp_size"):
        require_int(name, data[name], 1, 1 << 20)
    if not isinstance(data["unified"], bool):
        raise ConfigError("unified", data["unified"], f"expected true or false, got "
                          f"{json_type(data['unified'])}")
    buckets = data["request_buckets"]
    if not isinstance(buckets, list) or not _increasing(buckets):
        raise ConfigError("request_buckets", buckets, f"expected a list of strictly increasing "
                          f"integers in 1..{MAX_BATCH_ROWS}")
    rows = data["target_rows"]
    if (not isinstance(rows, list) or len(rows) != len(buckets)
            or not all(isinstance(r, list) and _increasing(r) for r in rows)):
        raise ConfigError("target_rows", rows, f"expected one list of strictly increasing "
                          f"integers in 1..{MAX_BATCH_ROWS} (the legal G) per request bucket")
    width = data["draft_width"]
    assert isinstance(width, int)  # checked above
    for index, (bucket, legal_rows) in enumerate(zip(buckets, rows, strict=True)):
        high = bucket * (width + 1)
        outside = [g for g in legal_rows if not bucket <= g <= high]
        if outside:
            raise ConfigError(f"target_rows[{index}]", legal_rows, f"expected G in {bucket}.."
                              f"{high} for request bucket {bucket} (every request keeps its "
                              f"anchor row and verifies at most draft_width={width} drafts), "
                              f"got {outside[0]}")


def _increasing(values: list[object]) -> bool:
    """A list of strictly increasing integers in 1..MAX_BATCH_ROWS (buckets, legal G)."""
    return (all(type(v) is int and 1 <= v <= MAX_BATCH_ROWS for v in values)
            and all(a < b for a, b in zip(values, values[1:], strict=False)))  # type: ignore[operator]


def _exact_keys(where: str, data: Mapping[str, object], keys: set[str]) -> None:
    missing = sorted(keys - set(data))
    if missing:
        raise ConfigError(f"{where}{missing[0]}", "missing", "expected this key")
    extra = sorted(set(data) - keys)
    if extra:
        raise ConfigError(f"{where}{extra[0]}", data[extra[0]],
                          f"is not a key here; expected only {sorted(keys)}")


def _object(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(name, value, f"expected an object, got {json_type(value)}")
    return value


def _list(name: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(name, value, f"expected a list, got {json_type(value)}")
    return value


def load_bundle(path: str, data: Mapping[str, object], *,
                flag: str = "--adaptive_target_verify_cost_table",
                verify: bool = True) -> CostBundle:
    """The bundle saved at ``path`` (already read as ``data``), errors prefixed with the flag
    that named it; with ``verify``, one priced over target rows G, as adaptive target verify
    reads it (a table priced per draft depth would price nothing it asks)."""
    with key_prefix(f"{flag}={path}: "):
        bundle = bundle_from_dict(data, source=f"saved table {path}")
    if verify and any(profile.over != "rows" for profile in bundle.profiles):
        raise ConfigError(flag, path, "is priced per draft depth (adaptive draft steps); "
                          "expected a table priced over target rows G, as "
                          "--adaptive_target_verify_cost_table_output saves one")
    return bundle


def fitted_bundle(compatibility: Compatibility, settings: Mapping[str, object],
                  profiles: Sequence[CostProfile], source: str) -> CostBundle:
    return CostBundle(compatibility=compatibility.as_dict(), settings=dict(settings),
                      profiles=tuple(profiles), source=source)
