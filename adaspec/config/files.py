"""The JSON files named by launch flags: read strictly, checked against the launch.

Strict means: duplicate keys, NaN/Infinity, unknown keys, wrong types and retired names are
errors that name the flag, the file and the key path. A file never half-applies: it is turned
into frozen dataclasses in one go or rejected.
"""

import json
import math
import sys
from collections.abc import Iterable, Mapping

from adaspec.config.calibration import (
    DRAFT_STEP_DEFAULT_MAX_BUCKET,
    CalibrationConfig,
    ContextInterval,
    DraftStepConfig,
    DraftStepPolicyConfig,
    json_type,
    key_prefix,
    require_int,
)
from adaspec.config.flags import RETIRED_NAMES, retired_name_error
from adaspec.config.launch import LaunchConfig
from adaspec.config.paths import new_file, read_regular
from adaspec.errors import MISSING, ConfigError

CALIBRATION_KEYS = frozenset({
    "model", "draft_width", "request_buckets", "target_graph_rows", "contexts",
    "warmup_steps", "window_steps", "windows_per_point", "token_seed",
})
CONTEXT_KEYS = ("prefill_tokens", "min_kv_length", "max_kv_length")
POLICY_KEYS = frozenset({"window_size", "update_interval", "switch_min_gain"})
DRAFT_STEP_KEYS = frozenset({"version", "policy", "calibration"})
MAX_FILE_BYTES = 16 * 2**20

# Keys that look plausible but are refused on purpose, with the reason.
REFUSED_KEYS = {
    "step_cost_models": "precomputed cost tables are not accepted by this file; costs are "
                        "measured at startup for every depth",
}
DRAFT_STEP_REFUSED = {
    **REFUSED_KEYS,
    "target_graph_rows": "not a key of the draft-step calibration; the target rows follow "
                         "from each candidate depth",
}


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    data: dict[str, object] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKeyError(key)
        data[key] = value
    return data


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def underflows(text: str, value: float) -> bool:
    """Whether ``value``, read from the decimal ``text``, is a zero the text is not: 1e-400
    reads as 0.0, though what was written is a tiny nonzero number."""
    return value == 0 and any(digit in text.lower().split("e")[0] for digit in "123456789")


def exact_double(text: str) -> float:
    """A JSON number as a double, refused where the double is not the number: one too large
    for a double (1e400 reads as inf) or a nonzero one too small (``underflows``), as the
    flags refuse them too."""
    value = float(text)
    shown = text if len(text) <= 60 else f"{text[:30]}...{text[-20:]} ({len(text)} characters)"
    if not math.isfinite(value):
        raise ValueError(f"{shown} is beyond a double; expected a finite number")
    if underflows(text, value):
        raise ValueError(f"{shown} is a nonzero number below the smallest double; expected 0 "
                         "or a number a double can hold")
    return value


class UnheldNumber(ValueError):
    """A number of parsed JSON that no double holds, with where it stands: ``path`` (such
    as ``a.b[2]``) and ``key``, the top-level key it stands under (None at the top)."""

    def __init__(self, path: str, key: str | None, reason: str) -> None:
        shown = path if len(path) <= 120 else f"{path[:57]}...{path[-60:]}"  # deep nesting
        super().__init__(f"{shown}: {reason}" if path else reason)
        self.path, self.key, self.reason = path, key, reason


class _Unheld(float):
    """What ``marked_double`` reads a number no double holds as: 0.0, carrying why."""

    reason: str


def marked_double(text: str) -> float:
    """``parse_float`` for JSON whose reader then calls ``check_doubles``: the number may be
    refused only once the reader knows where it stands, so it can name its key."""
    try:
        return exact_double(text)
    except ValueError as error:
        marked = _Unheld(0.0)
        marked.reason = str(error)
        return marked


def marked_integer(text: str) -> int | float:
    """``parse_int`` for JSON whose reader then calls ``check_doubles``: an integer longer
    than this interpreter reads is refused there, naming its key, as a number no double
    holds is."""
    limit = sys.get_int_max_str_digits()
    digits = len(text.lstrip("-"))
    if 0 < limit < digits:
        marked = _Unheld(0.0)
        marked.reason = f"an integer of {digits} digits; expected at most {limit}"
        return marked
    return int(text)


def check_doubles(data: object) -> None:
    """Raise UnheldNumber for the first number of ``data`` (read with ``marked_double``)
    that no double holds, naming its path."""
    pending: list[tuple[str, str | None, object]] = [("", None, data)]
    while pending:  # no recursion: the JSON may nest as deeply as json reads
        path, key, value = pending.pop()
        if isinstance(value, _Unheld):
            raise UnheldNumber(path, key, value.reason)
        if isinstance(value, dict):
            pending.extend((f"{path}.{name}" if path else str(name), key or str(name), item)
                           for name, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", key, item)
                           for index, item in reversed(list(enumerate(value))))


def past_int_digits(error: ValueError) -> bool:
    """Whether json refused an integer longer than Python reads: valid JSON all the same."""
    return "int_max_str_digits" in str(error)


def json_fault(error: ValueError) -> str:
    """What json's own ValueError says, in the user's terms: an integer past Python's digit
    limit and a byte-order mark come with advice for a programmer
    (``sys.set_int_max_str_digits``, ``utf-8-sig``)."""
    if past_int_digits(error):
        return (f"a number of more than {sys.get_int_max_str_digits()} digits; no value of "
                "the file is that long")
    if str(error).startswith("Unexpected UTF-8 BOM"):
        return "a byte-order mark before the JSON; expected UTF-8 without one"
    return str(error)


def read_json_object(flag: str, path: str) -> dict[str, object]:
    """The top-level object of a JSON file, or a ConfigError naming the flag and file."""
    setting = f"--{flag}"
    text = _read_text(setting, path)
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constants,
                          parse_float=marked_double)
        check_doubles(data)
    except json.JSONDecodeError as error:
        raise ConfigError(setting, path, f"expected valid JSON; {error.msg} at line "
                                         f"{error.lineno} column {error.colno}") from None
    except _DuplicateKeyError as error:
        raise ConfigError(setting, path, f"key {error} appears twice in one object") from None
    except RecursionError:
        raise ConfigError(setting, path, "expected JSON nested less deeply") from None
    except UnheldNumber as error:
        raise ConfigError(setting, path, str(error)) from None
    except ValueError as error:
        raise ConfigError(setting, path, f"expected valid JSON; {json_fault(error)}") from None
    if not isinstance(data, dict):
        raise ConfigError(setting, path, "expected a JSON object at the top level")
    return data


def _read_text(setting: str, path: str) -> str:
    data = read_regular(setting, path, "JSON file", MAX_FILE_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(setting, path, "expected a UTF-8 JSON file") from None


def _check_keys(data: Mapping[str, object], allowed: frozenset[str],
                refused: Mapping[str, str]) -> None:
    for key, value in data.items():
        if key in RETIRED_NAMES:
            raise retired_name_error(key, key, value)
        if key in refused:
            raise ConfigError(key, _brief(value), refused[key])
        if key not in allowed:
            raise ConfigError(key, _brief(value),
                              f"unknown key; expected one of {', '.join(sorted(allowed))}")


def _brief(value: object) -> object:
    """Tables and lists are summarised in messages; scalars are shown as given."""
    if isinstance(value, dict):
        return "{...}"
    if isinstance(value, list):
        return "[...]"
    return value


def _object(key: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(key, _brief(value), "expected a JSON object")
    return value


def _tuple(value: object) -> object:
    # Lists become tuples so the frozen configs stay hashable; anything else is left for the
    # dataclass to reject with its own message.
    return tuple(value) if isinstance(value, list) else value


def _contexts(value: object) -> object:
    if not isinstance(value, list):
        return value
    contexts = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"contexts[{index}]", _brief(item),
                              "expected an object with " + ", ".join(CONTEXT_KEYS))
        with key_prefix(f"contexts[{index}]."):
            _check_keys(item, frozenset(CONTEXT_KEYS), {})
            for key in CONTEXT_KEYS:
                if key not in item:
                    raise ConfigError(key, MISSING, "missing; expected an integer")
            contexts.append(ContextInterval(**item))
    return tuple(contexts)


def calibration_from_mapping(data: Mapping[str, object], *, launch: LaunchConfig,
                             default_buckets: tuple[int, ...], source: str,
                             refused: Mapping[str, str] = REFUSED_KEYS) -> CalibrationConfig:
    """A calibration section, checked against the launch's width and prepared buckets."""
    _check_keys(data, CALIBRATION_KEYS - set(refused), refused)
    values: dict[str, object] = {}
    for key, value in data.items():
        if key in ("request_buckets", "target_graph_rows"):
            value = _tuple(value)
        elif key == "contexts":
            value = _contexts(value)
        values[key] = value
    width = launch.num_speculative_tokens
    given_width = require_int("draft_width", values.setdefault("draft_width", width), 1, 64)
    if given_width != width:
        raise ConfigError("draft_width", given_width,
                          f"expected {width}, the --num_speculative_tokens of this launch "
                          f"(costs of different widths must not be mixed)")
    values.setdefault("request_buckets", default_buckets)
    config = CalibrationConfig(**values, source=source)  # type: ignore[arg-type]
    _check_request_buckets(config.request_buckets, launch)
    if config.target_graph_rows is not None:
        _check_target_rows(config.target_graph_rows, config.request_buckets, launch)
    return config


def _check_request_buckets(buckets: tuple[int, ...], launch: LaunchConfig) -> None:
    """Each bucket is prepared, and its synthetic requests fit the batch on every shard."""
    prepared = launch.prepared_request_buckets()
    for bucket in buckets:
        if bucket not in prepared:
            raise ConfigError("request_buckets", list(buckets),
                              f"{bucket} is not a prepared request bucket; prepared buckets "
                              f"are {_listed(prepared)} (from "
                              f"--acl_graph_decode_batch_size_limit="
                              f"{launch.resolved.acl_graph_decode_batch_size_limit})")
        if bucket * launch.dp_size > launch.max_seqs_per_batch:
            raise ConfigError("request_buckets", list(buckets),
                              f"bucket {bucket} is per DP shard, so it drives "
                              f"{bucket * launch.dp_size} synthetic requests over "
                              f"--dp_size={launch.dp_size} shards; expected at most "
                              f"--max_seqs_per_batch={launch.max_seqs_per_batch}")


def _check_target_rows(rows: tuple[int, ...], buckets: tuple[int, ...],
                       launch: LaunchConfig) -> None:
    """Each G is a legal prepared G of some sampled bucket; full width stays sampled."""
    legal = {g for bucket in buckets for g in launch.legal_target_rows(bucket)}
    for g in rows:
        if g not in legal:
            raise ConfigError("target_graph_rows", list(rows),
                              f"{g} is not a legal prepared G of the sampled request "
                              f"buckets; the legal rows are {_listed(sorted(legal))}")
    width = launch.num_speculative_tokens
    for bucket in buckets:
        if bucket * (width + 1) not in rows:
            raise ConfigError("target_graph_rows", list(rows),
                              f"expected full width {bucket * (width + 1)} rows for request "
                              f"bucket {bucket} (width {width}); full width must stay covered")


def _listed(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))


def calibration_buckets(launch: LaunchConfig, cap: int | None = None) -> tuple[int, ...]:
    """Default request buckets: every prepared bucket whose synthetic requests fit."""
    return tuple(b for b in launch.prepared_request_buckets()
                 if b * launch.dp_size <= launch.max_seqs_per_batch and (cap is None or b <= cap))


def load_draft_step_config(launch: LaunchConfig) -> DraftStepConfig:
    """The adaptive draft-step settings: the file's sections, defaults for omitted ones."""
    flag = "adaptive_draft_step_config"
    path = launch.adaptive_draft_step_config
    buckets = calibration_buckets(launch, cap=DRAFT_STEP_DEFAULT_MAX_BUCKET)
    default_calibration = CalibrationConfig(draft_width=launch.num_speculative_tokens,
                                            request_buckets=buckets)
    if path is None:
        return DraftStepConfig(policy=DraftStepPolicyConfig(), calibration=default_calibration)
    data = read_json_object(flag, path)
    with key_prefix(f"--{flag}={path}: "):
        _check_keys(data, DRAFT_STEP_KEYS, REFUSED_KEYS)
        _check_version(data, required=True)
        policy = DraftStepPolicyConfig()
        if "policy" in data:
            section = _object("policy", data["policy"])
            with key_prefix("policy."):
                _check_keys(section, POLICY_KEYS, REFUSED_KEYS)
                policy = DraftStepPolicyConfig(**section, source=path)  # type: ignore[arg-type]
        calibration = default_calibration
        if "calibration" in data:
            section = _object("calibration", data["calibration"])
            with key_prefix("calibration."):
                calibration = calibration_from_mapping(
                    section, launch=launch, default_buckets=buckets, source=path,
                    refused=DRAFT_STEP_REFUSED)
    return DraftStepConfig(policy=policy, calibration=calibration)


def _check_version(data: Mapping[str, object], *, required: bool) -> None:
    """The file's ``version`` must be the JSON integer 1; a value of another type names its
    type, as the other integer keys do (``"1"`` would otherwise read as ``version=1``)."""
    version = data.get("version", MISSING)
    if version is MISSING and not required:
        return
    if type(version) is not int or version != 1:
        got = "" if version is MISSING or type(version) is int else \
            f", got {json_type(version)}"
        raise ConfigError("version", version, f"expected 1 (the only file version){got}")


def load_target_verify_calibration(launch: LaunchConfig) -> CalibrationConfig | None:
    """Calibration settings of adaptive target verify; None when a saved table is reused."""
    if not launch.enable_adaptive_target_verify or launch.adaptive_target_verify_cost_table:
        return None
    buckets = calibration_buckets(launch)
    path = launch.adaptive_target_verify_calibration
    if path is None:
        return CalibrationConfig(draft_width=launch.num_speculative_tokens,
                                 request_buckets=buckets)
    flag = "adaptive_target_verify_calibration"
    data = read_json_object(flag, path)
    with key_prefix(f"--{flag}={path}: "):
        _check_version(data, required=False)
        section = {key: value for key, value in data.items() if key != "version"}
        return calibration_from_mapping(section, launch=launch, default_buckets=buckets,
                                        source=path)


def check_cost_table_paths(launch: LaunchConfig) -> None:
    """The saved table must be a file; the output must be new, in an existing directory."""
    table = launch.adaptive_target_verify_cost_table
    if table is not None:
        # Only the envelope here; the bundle's contents and compatibility are checked when
        # the cost table is loaded.
        read_json_object("adaptive_target_verify_cost_table", table)
    output = launch.adaptive_target_verify_cost_table_output
    if output is None:
        return
    new_file("--adaptive_target_verify_cost_table_output", output)
