"""Whether a launch can run on its models at all, checked before any device work.

``Runtime.start`` calls ``check_model_limits(launch, models)`` with the models it was given
(``None`` for the built-in ones, checked without loading them): models that lack a method the
runtime calls, hold a value member of the wrong type or range (an ``identity`` that is no str,
a ``vocab_size`` of 0), or a DSpark launch wider than its drafter's ``max_width``, would
otherwise fail every request at its first round, or the run later. Each value member is read
once: the runtime then runs on the values checked (``ReadOnce``), so a property that fails or
changes on a later read cannot reach a round.
"""

import dataclasses
import numbers
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from adaspec.config.builtin import check_builtin_limits
from adaspec.config.launch import LaunchConfig
from adaspec.errors import MISSING, ConfigError
from adaspec.models.protocols import (
    DrafterContext,
    DSparkDrafter,
    ModelSet,
    MtpDrafter,
    TargetModel,
    has_member,
    missing_member,
    protocol_members,
)


def check_model_limits(launch: LaunchConfig, models: ModelSet | None) -> ModelSet | None:
    """Refuse models that do not provide what the launch uses (naming the missing member)
    and a DSpark width the drafter cannot draft (naming ``--num_speculative_tokens``);
    ``models=None`` means the built-in models of ``launch.model``. Returns the models as the
    runtime runs them: the target and the launch's drafter with the values checked
    (``ReadOnce``); None for the built-in models."""
    if models is None:
        check_builtin_limits(launch)
        return None
    checked = check_conformance(launch, models)
    if launch.speculative_algorithm == "DSpark":
        dspark = checked.dspark
        assert dspark is not None  # check_conformance refused a missing one
        limit = _positive_integer(dspark.max_width)
        if launch.num_speculative_tokens > limit:
            raise ConfigError("--num_speculative_tokens", launch.num_speculative_tokens,
                              f"expected 1..{limit}: the DSpark drafter passed to the runtime "
                              f"(identity {dspark.identity}) drafts at most {limit} tokens "
                              "per block")
    return checked


class ReadOnce:
    """A model whose value members (``identity``, ``vocab_size``, ``max_width``, ...) are
    those read and checked at the start; its methods and ``num_kv_slots`` (known only once
    ``allocate`` ran) are the model's own. ``model`` is the model itself."""

    def __init__(self, model: object, values: Mapping[str, object]) -> None:
        self.model = model
        for name, value in values.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        return getattr(self.model, name)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedModels:
    """The model set a runtime runs: what ``check_conformance`` passed, read once."""

    target: Any
    mtp: Any
    dspark: Any


DRAFTERS: dict[str, tuple[str, type]] = {"MTP": ("mtp", MtpDrafter),
                                         "DSpark": ("dspark", DSparkDrafter)}
"""The ``ModelSet`` attribute and protocol of each algorithm's drafter."""


def check_conformance(launch: LaunchConfig, models: ModelSet) -> CheckedModels:
    """Refuse, naming the first missing member, the first method that cannot be called as
    its protocol calls it or the first value member out of type or range, a model set whose
    target (or the drafter the launch's algorithm uses) does not provide its protocol; a
    DSpark drafter that publishes must keep a whole ``DrafterContext``. Returns the set with
    those models' value members as read (a drafter the launch does not use is left out)."""
    checked: dict[str, object] = {"target": None, "mtp": None, "dspark": None}
    parts: list[tuple[str, type]] = [("target", TargetModel)]
    if launch.speculative_algorithm in DRAFTERS:
        parts.append(DRAFTERS[launch.speculative_algorithm])
    for attribute, protocol in parts:
        model = getattr(models, attribute, None)
        if model is None:
            raise ConfigError("Runtime(models=...)", type(models).__name__,
                              f"expected a model set with {attribute} (a "
                              f"{protocol.__name__}) for --speculative_algorithm="
                              f"{launch.speculative_algorithm}")
        values = read_members(f"Runtime(models=...).{attribute}", model, protocol)
        missing = missing_member(model, protocol)
        if missing is not None:
            raise ConfigError(f"Runtime(models=...).{attribute}", type(model).__name__,
                              f"expected a {protocol.__name__}: it has {missing}")
        check_member_values(f"Runtime(models=...).{attribute}", values)
        checked[attribute] = ReadOnce(model, {name: values[name] for name in VALUE_MEMBERS
                                              if name in values})
    dspark = models.dspark if launch.speculative_algorithm == "DSpark" else None
    if callable(getattr(dspark, "publish", None)):
        # A DSpark drafter that keeps its own context gets it published, so all of it.
        missing = missing_member(dspark, DrafterContext)
        if missing is not None:
            raise ConfigError("Runtime(models=...).dspark", type(dspark).__name__,
                              f"expected a DrafterContext, as it has publish: it has {missing}")
    return CheckedModels(**checked)


def read_members(setting: str, model: object, protocol: type) -> dict[str, object]:
    """Read every member of ``protocol`` that ``model`` has (``num_kv_slots`` aside: it is read
    once ``allocate`` has run, by ``check_num_kv_slots``) and refuse, naming ``setting.member``
    and what it raised, the first whose reading raises: a property that fails would otherwise
    fail the start, or a request, with the model's raw exception. A member it lacks is left
    to ``missing_member`` to name. Returns what was read, by name."""
    values: dict[str, object] = {}
    for name in protocol_members(protocol):
        if name == "num_kv_slots":
            continue
        try:
            values[name] = getattr(model, name)
        except AttributeError as error:
            if has_member(model, name):  # a property that raised AttributeError itself
                raise _raised(f"{setting}.{name}", error) from error
        except Exception as error:
            raise _raised(f"{setting}.{name}", error) from error
    return values


def _raised(setting: str, error: BaseException, what: str = "reading it") -> ConfigError:
    text = str(error)
    if len(text) > 200:
        text = text[:197] + "..."
    return ConfigError(setting, MISSING, f"{what} raised {type(error).__name__}"
                       f"{': ' + text if text else ''}; expected a member that can be read")


def check_num_kv_slots(setting: str, model: object, requested: int, before: object) -> None:
    """Refuse, naming ``setting.num_kv_slots``, a model whose ``num_kv_slots`` after
    ``allocate(requested)`` is not ``requested`` (``before`` is what it read before the call):
    the runtime gives requests KV slots 0 .. requested - 1 and pads with KV slot ``requested``, the
    scratch KV slot, so a smaller count would make the scratch KV slot a request's and a larger one
    (or a value that is no int) is no cache ``allocate`` made."""
    member = f"{setting}.num_kv_slots"
    try:
        value = model.num_kv_slots  # type: ignore[attr-defined]
    except Exception as error:
        raise _raised(member, error, f"reading it after allocate({requested})") from error
    if _integer(value) and value == requested:
        return
    kind = type(value)
    found = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
    expected = (f"expected {requested} after allocate({requested}): {requested} + 1 KV slots, "
                f"0 .. {requested - 1} for requests and {requested} the scratch KV slot")
    if not _integer(value):
        expected += f"; got type {found}"
    else:
        if value < requested:
            expected += " (with fewer, the scratch KV slot would be a request's)"
        if value == before:
            expected += "; allocate left it unchanged"
    raise ConfigError(member, repr(value), expected)


def _identity(value: object) -> bool:
    return isinstance(value, str) and value != "" and value.isprintable()


def _integer(value: object) -> bool:
    """Any integer type (a numpy integer included), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int_at_least(low: int) -> Callable[[object], bool]:
    # Exactly an int (bool excluded): the runtime uses these as they are, and writes some to
    # the event log's JSON, which a numpy integer would break.
    return lambda value: type(value) is int and value >= low


def _float_dtype(value: object) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point


MEMBER_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "identity": (_identity, "a non-empty printable str: the stable hash of the checkpoint "
                            "(adaspec.models.checkpoint_identity) that cost tables record"),
    "vocab_size": (_int_at_least(1), "a positive int: the number of logits per row"),
    "hidden_size": (_int_at_least(1), "a positive int: the width of the hidden states"),
    "context_limit": (_int_at_least(2), "an int >= 2: positions 0 .. context_limit-1 per "
                                        "request, a prompt token and a generated one at least"),
    "dtype": (_float_dtype, "a floating torch.dtype: that of the hidden states verify "
                            "returns"),
}
"""What each value member of the protocols must hold (``max_width`` is read, as any integer
type, by ``check_model_limits``); ``num_kv_slots`` is left out, as it is only known once the
runtime has called ``allocate`` (``check_num_kv_slots`` reads it then)."""


VALUE_MEMBERS = (*MEMBER_VALUES, "max_width")
"""The members a model holds as values: read once at the start (``ReadOnce``)."""


def check_member_values(setting: str, values: Mapping[str, object]) -> None:
    """Refuse, naming ``setting.member``, the value and its type, the first value member
    (``identity``, ``vocab_size``, ...) of the members ``read_members`` read that has a wrong
    type or is out of range: the runtime would otherwise fail later, mid-run or in the event
    log."""
    for name, value in values.items():
        if name not in MEMBER_VALUES:
            continue
        valid, expected = MEMBER_VALUES[name]
        if not valid(value):
            kind = type(value)
            found = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
            raise ConfigError(f"{setting}.{name}", repr(value),
                              f"expected {expected}; got type {found}")


def _positive_integer(max_width: object) -> int:
    """A drafter's ``max_width`` as an int (any integer type), or the one-line refusal naming
    its type."""
    try:
        limit = operator.index(max_width)  # type: ignore[arg-type]
    except TypeError:
        limit = 0
    if isinstance(max_width, bool) or limit < 1:
        raise ConfigError("Runtime(models=...).dspark.max_width", repr(max_width),
                          f"expected a positive integer: the most tokens the drafter drafts "
                          f"(got a {type(max_width).__name__})")
    return limit
