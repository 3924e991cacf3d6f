"""The OpenAI completions request as adaspec reads it, and the error shape it answers with.

Every field is either read, accepted only at its neutral value, or refused by name before
anything is queued: a field the server does not implement is never ignored.
"""

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adaspec.config.files import (
    UnheldNumber,
    check_doubles,
    marked_double,
    marked_integer,
    past_int_digits,
)
from adaspec.config.requests import (
    IDLE_FILTER,
    MAX_STOP_TOKENS,
    UNSUPPORTED_FIELDS,
    SamplingParams,
    idle_filter,
    is_neutral,
    refusal,
)
from adaspec.errors import InvalidRequest, UnsupportedRequest, printable, show_value

MAX_BODY_BYTES = 8 * 2**20
"""The largest request body read; a larger one is answered 413 unread."""

MAX_PROMPTS = 256
"""Most prompts one completion request may hold."""

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_USER_CHARS = 256
"""The longest ``user`` taken: it goes into the request's log line."""

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``max_tokens``."""

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default for ``temperature``, where the launch does not require it."""


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape: ``message`` names the parameter
    (``param``), the value and what is expected."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None) -> None:
        message = printable(message)  # a newline in a JSON key stays escaped
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else printable(param)
        self.kind = kind
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_field(param: str, value: object, expected: str) -> ApiError:
    return ApiError(400, f"{param}={_shown(value)}: {expected}", param=param)


def _shown(value: object) -> str:
    """A value of the body as JSON spells it (an object or array too), short."""
    if isinstance(value, dict | list):
        try:
            return show_value(json.dumps(value))
        except (TypeError, ValueError):  # no JSON after all: a value the runtime built
            pass
    return show_value(value)


def refused(error: InvalidRequest | UnsupportedRequest) -> ApiError:
    """A runtime refusal as a 400 naming the field it names."""
    return bad_field(error.field, error.value, error.expected)


# Fields the server reads, besides those of ``SamplingParams``.
_READ = ("model", "prompt", "stream", "stream_options", "n", "best_of", "echo", "suffix",
         "user", "stop_token_ids")
_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "stop")
# Accepted only at these values: name -> (neutral values, why).
_NEUTRAL: dict[str, tuple[tuple[object, ...], str]] = {
    "n": ((None, 1), "one completion per prompt is supported; expected 1"),
    "best_of": ((None, 1), "best-of sampling is not supported; expected 1"),
    "echo": ((None, False), "echoing the prompt is not supported; expected false"),
    "suffix": ((None,), "suffixes (insertion) are not supported; expected null"),
    **UNSUPPORTED_FIELDS,
}
COMPLETION_FIELDS = frozenset({*_READ, *_SAMPLING, *_NEUTRAL})
"""Every field a completion request's body may name."""


@dataclass(frozen=True, slots=True)
class CompletionJob:
    """A checked completion request: one or more prompts decoded with the same sampling."""

    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids
    prompt_fields: tuple[str, ...]  # each prompt's place in the body: prompt, or prompt[i]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    stop_id_fields: tuple[tuple[str, int], ...]  # each stop token id and the field it came in
    stream: bool
    include_usage: bool
    user: str | None


def _read_json(text: str, parse_int: Callable[[str], object]) -> Any:
    body = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates,
                      parse_float=marked_double, parse_int=parse_int)
    check_doubles(body)  # 1e-400 would read as 0.0: a temperature of it, as greedy
    return body


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400 saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8; expected a JSON object") from None
    try:
        body = _read_json(text, int)
    except UnheldNumber as error:
        raise ApiError(400, str(error), param=error.key) from None
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON ({error.msg} at line "
                       f"{error.lineno} column {error.colno}); expected a JSON object") from None
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply; expected a JSON object of "
                       "completion parameters") from None
    except ValueError as error:  # an integer of thousands of digits
        if past_int_digits(error):  # read again to name its field; a hook on every integer
            try:  # would slow the token ids of every prompt
                _read_json(text, marked_integer)
            except UnheldNumber as marked:
                raise ApiError(400, str(marked), param=marked.key) from None
        raise ApiError(400, f"the request body holds a number JSON cannot be read into "
                       f"({' '.join(str(error).split())[:80]}); expected numbers of at most "
                       "a few digits") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {_json_kind(body)}; expected a JSON "
                       "object of completion parameters")
    return body


def _no_constant(name: str) -> object:
    raise ApiError(400, f"the request body holds {name}, which is not JSON; expected finite "
                   "numbers")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise ApiError(400, f"{key}: given twice in one JSON object; expected each "
                           "parameter once", param=key)
        body[key] = value
    return body


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, dict):
        return "object"
    return "number"


def read_completion(body: Mapping[str, Any], model: str, *,
                    temperature_rule: str | None,
                    eos_token_ids: tuple[int, ...] = ()) -> CompletionJob:
    """``temperature_rule``: why this launch needs every request's temperature (None: it
    defaults to OpenAI's 1). Every request also stops at the model's ``eos_token_ids``."""
    for name, value in body.items():
        _check_known(name, value)
    given = body.get("model")
    if given is None:
        raise ApiError(400, f"model: missing; expected the served model's name, {model!r}",
                       param="model")
    if not isinstance(given, str):
        raise bad_field("model", given, f"expected a string, the served model's name "
                        f"({model!r})")
    if given != model:
        raise ApiError(404, f"model={show_value(given)}: no such model; this server serves "
                       f"{model!r}", param="model", code="model_not_found")
    stream = _flag(body, "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    prompts, prompt_fields = _prompts(body.get("prompt"))
    stop_strings, stop_ids = _stops(body.get("stop"), body.get("stop_token_ids"))
    params = _sampling(body, tuple(i for _, i in stop_ids), temperature_rule)
    try:
        params = params.ending_at(eos_token_ids, "stop_token_ids")
    except InvalidRequest as error:
        raise refused(error) from None
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= MAX_USER_CHARS):
        raise bad_field("user", user, f"expected a string of at most {MAX_USER_CHARS} "
                        "characters (it is logged)")
    return CompletionJob(prompts=prompts, prompt_fields=prompt_fields, params=params,
                         stop_strings=stop_strings,
                         stop_id_fields=stop_ids, stream=stream, include_usage=include_usage,
                         user=user)


def _check_known(name: str, value: object) -> None:
    if name in _NEUTRAL:
        neutral, why = _NEUTRAL[name]
        if not is_neutral(value, neutral):
            raise ApiError(400, f"{name}={_shown(value)}: {refusal(neutral, why)}"
                           f"{_spelled(value)}", param=name)
    elif name not in _READ and name not in _SAMPLING:
        raise ApiError(400, f"{name}: unknown parameter; expected one of "
                       f"{', '.join(sorted({*_READ, *_SAMPLING}))}", param=name)


def _spelled(value: object) -> str:
    """A string shows unquoted: one that reads as JSON ("1", "false", "{}") would read as the
    very value expected."""
    if not isinstance(value, str):
        return ""
    try:
        json.loads(value)
    except (ValueError, RecursionError):
        return ""
    return ", not a JSON string"


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    return _true_or_false(name, value)


def _true_or_false(param: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise bad_field(param, value, f"expected true or false{_spelled(value)}")
    return value


def _stream_options(options: object, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_field("stream_options", options, "allowed only with \"stream\": true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_field("stream_options", options, "expected {\"include_usage\": true|false}")
    return _true_or_false("stream_options.include_usage", options.get("include_usage", False))


PROMPT_EXPECTED = ("expected a string, an array of token ids, or an array of (at most "
                   f"{MAX_PROMPTS}) strings or arrays of token ids")


def _prompts(prompt: object) -> tuple[tuple[str | tuple[int, ...], ...], tuple[str, ...]]:
    """The body's prompts, and the field each one is named by in an error: ``prompt`` for
    the one prompt of a string or an array of ids, ``prompt[i]`` for an array's item."""
    if prompt is None:
        raise ApiError(400, f"prompt: missing; {PROMPT_EXPECTED}", param="prompt")
    if isinstance(prompt, str):
        return (_text(prompt, "prompt"),), ("prompt",)
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", prompt, PROMPT_EXPECTED)
    if all(_is_id(token) for token in prompt):
        return (tuple(prompt),), ("prompt",)
    if isinstance(prompt[0], int | float) and not isinstance(prompt[0], bool):
        # An array that starts with a number is one prompt's token ids: name what is not one.
        index, item = next((i, t) for i, t in enumerate(prompt) if not _is_id(t))
        raise bad_field(f"prompt[{index}]", item, "expected a token id (an integer): an array "
                        "that starts with a number is one prompt's token ids")
    if len(prompt) > MAX_PROMPTS:
        raise bad_field("prompt", f"{len(prompt)} prompts", PROMPT_EXPECTED)
    fields = tuple(f"prompt[{index}]" for index in range(len(prompt)))
    return tuple(_prompt_item(item, field) for item, field in zip(prompt, fields, strict=True)), \
        fields


def _prompt_item(item: object, field: str) -> str | tuple[int, ...]:
    """One prompt of an array of prompts: a string, or an array of token ids."""
    if isinstance(item, str):
        return _text(item, field)
    if isinstance(item, list) and item and all(_is_id(token) for token in item):
        return tuple(item)
    if isinstance(item, list) and any(_is_id(token) for token in item):  # ids, one is not
        place, token = next((i, t) for i, t in enumerate(item) if not _is_id(t))
        raise bad_field(f"{field}[{place}]", token, "expected a token id (an integer)")
    raise bad_field(field, item, "expected a non-empty string or a non-empty array of token "
                    "ids")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: object) -> bool:
    return _is_id(value) and value >= 0  # type: ignore[operator]


def _text(text: str, field: str) -> str:
    if not text:
        raise bad_field(field, text, "expected a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape in the JSON ("\ud800")
        raise bad_field(field, text, "expected text without lone UTF-16 surrogates") from None
    return text


def _stops(stop: object, stop_token_ids: object
           ) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """Stop strings (matched on the text, left out of it) and stop token ids (kept, as the
    runtime keeps them), from ``stop`` and ``stop_token_ids``."""
    items: list[object]
    if stop is None:
        items = []
    elif isinstance(stop, str):
        items = [stop]
    elif isinstance(stop, list):
        items = list(stop)
    else:
        raise bad_field("stop", stop, "expected a string or an array of strings and token ids")
    strings = tuple(item for item in items if isinstance(item, str))
    ids = [("stop", item) for item in items if not isinstance(item, str)]
    if any(not _is_token(i) for _, i in ids):
        raise bad_field("stop", stop, "expected a string or an array of strings and token ids")
    _check_stop_strings(strings)
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or not all(_is_token(i) for i in stop_token_ids):
            raise bad_field("stop_token_ids", stop_token_ids, "expected an array of token ids")
        ids.extend(("stop_token_ids", i) for i in stop_token_ids)
    distinct = len({token for _, token in ids})  # a repeated id stops at nothing more
    if distinct > MAX_STOP_TOKENS:  # named by the field that brought the last of them
        raise bad_field(ids[-1][0], f"{distinct} token ids",
                        f"expected at most {MAX_STOP_TOKENS} stop token ids in all")
    return strings, tuple(ids)  # type: ignore[arg-type]


def _check_stop_strings(strings: tuple[str, ...]) -> None:
    if len(strings) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"{len(strings)} strings",
                        f"expected at most {MAX_STOP_STRINGS} stop strings")
    for text in strings:
        if not text or len(text) > MAX_STOP_STRING_CHARS:
            raise bad_field("stop", text, f"expected stop strings of 1..{MAX_STOP_STRING_CHARS} "
                            "characters")
        _text(text, "stop")


def _sampling(body: Mapping[str, Any], stop_ids: tuple[int, ...],
              temperature_rule: str | None) -> SamplingParams:
    values: dict[str, object] = {name: body[name] for name in
                                 ("temperature", "top_k", "top_p", "min_p", "max_tokens")
                                 if body.get(name) is not None}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                isinstance(value, float) and not math.isfinite(value):
            kind = f", not a JSON {_json_kind(value)}" if not isinstance(value, float) else ""
            what = "an integer" if name in ("max_tokens", "top_k") else "a number"
            raise bad_field(name, value, f"expected {what}{kind}")
    values.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if "temperature" not in values:
        if temperature_rule is not None:
            raise ApiError(400, f"temperature: missing; {temperature_rule}",
                           param="temperature")
        values["temperature"] = DEFAULT_TEMPERATURE
    if isinstance(values.get("top_k"), int) and values["top_k"] == -1:
        values["top_k"] = 0  # vLLM's spelling of "off"
    try:
        params = SamplingParams(stop=stop_ids, **values)  # type: ignore[arg-type]
    except (InvalidRequest, UnsupportedRequest) as error:
        if error.field == "top_k":  # the runtime's range, and the spelling of off read above
            error.expected = error.expected.replace("(0: off)", "(0 or -1: off)")
        raise refused(error) from None
    idle = idle_filter(params)
    if idle is not None:
        raise bad_field(idle, values[idle], IDLE_FILTER)
    return params
