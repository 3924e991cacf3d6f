"""Per-request sampling parameters, and what the configured runtime refuses to run.

Speculative decoding here is exact: greedy output equals target-only greedy output and random
sampling keeps the target distribution. A request feature that would break that, or that the
sampler does not implement, is refused before execution with the field named; it is never
dropped silently.
"""

import dataclasses
import json
import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from adaspec.config.launch import LaunchConfig
from adaspec.errors import MISSING, InvalidRequest, UnsupportedRequest

MAX_TEMPERATURE = 100.0
MIN_TEMPERATURE = 1e-5
"""The smallest positive temperature: logits divided by much less overflow the sampler's
floats (to inf, then NaN probabilities), which would decode garbage rather than sample."""
MAX_NEW_TOKENS = 1 << 20
MAX_STOP_TOKENS = 16
"""Most stop token ids one request may give (the sampler keeps them in a fixed-width row)."""
MAX_SEED = 1 << 40
"""Run seeds stay small enough that every generator seed derived from one fits torch's 64
bits."""
MAX_REQUEST_ID = 2**63 - 1
"""Request ids are numbered from 0 and fit a signed 64-bit integer."""

_STRUCTURED = "structured-output constraints are not supported"
_PENALTY = "non-neutral penalties are not supported (the verifier samples the plain target " \
           "distribution)"

def _zero_bias(value: object) -> bool:
    """A logit_bias that moves no token: 0 on every key, each a token id spelt in digits
    (a bias keyed by anything else is malformed, not neutral)."""
    return isinstance(value, Mapping) and all(
        isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 10
        and not isinstance(bias, bool) and isinstance(bias, numbers.Real) and bias == 0
        for token, bias in value.items())


# Request fields adaspec knows and refuses unless they carry their neutral value:
# name -> (neutral values, or predicates a neutral value meets; why).
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "seed": ((None,), "per-request seeds are not supported; draws come from the runtime's "
                      "seeded generator so that replay is exact"),
    # logprobs=0 and prompt_logprobs=0 still ask for the chosen tokens' own logprobs.
    "logprobs": ((None, False), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
    "prompt_logprobs": ((None,), "logprobs are not supported"),
    "min_tokens": ((None, 0), "minimum-length stops are not supported"),
    "logit_bias": ((None, {}, _zero_bias), "token bias is not supported; expected {} or a "
                                           "bias of 0 on each token id (a string of digits)"),
    "presence_penalty": ((None, 0, 0.0), _PENALTY),
    "frequency_penalty": ((None, 0, 0.0), _PENALTY),
    "repetition_penalty": ((None, 1, 1.0), _PENALTY),
    "response_format": ((None, {"type": "text"}), _STRUCTURED),
    "structured_outputs": ((None,), _STRUCTURED),
    "guided_json": ((None,), _STRUCTURED),
    "guided_regex": ((None,), _STRUCTURED),
    "guided_choice": ((None,), _STRUCTURED),
    "guided_grammar": ((None,), _STRUCTURED),
}


def refusal(neutral: tuple[object, ...], why: str) -> str:
    """Why a field's value is refused, ending in the neutral values it takes where ``why``
    does not say them already (``min_tokens``: ``...; expected null or 0``)."""
    if "expected" in why:
        return why
    spelled: list[str] = []
    for value in neutral:
        text = json.dumps(int(value) if isinstance(value, float) and value.is_integer()
                          else value)
        if text not in spelled:
            spelled.append(text)
    return f"{why}; expected {' or '.join(spelled)}"


def is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """Whether a field's value asks for nothing: one of its ``neutral`` values, of the same
    kind (true is no 1, but numpy's false is false and an OrderedDict is a dict), or one that
    a neutral predicate accepts."""
    return any(neutral_value(value) if callable(neutral_value)
               else _kind(value) is _kind(neutral_value) and _plain(value) == neutral_value
               for neutral_value in neutral)


def _kind(value: object) -> type:
    """What a neutral value is compared as: any bool, any integer, any other real number or
    any mapping alike; every other value only with its own type. An integer field's 1.0 is
    no 1, as its max_tokens of 8.0 is refused."""
    if _is_bool(value):
        return bool
    if isinstance(value, numbers.Integral):
        return numbers.Integral
    if isinstance(value, numbers.Real):
        return numbers.Real
    return Mapping if isinstance(value, Mapping) else type(value)


def _is_bool(value: object) -> bool:
    """A bool, or numpy's bool scalar (known by its dtype: config imports no numpy)."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(value, "shape", None) == () and getattr(dtype, "kind", None) == "b"


def _plain(value: object) -> object:
    if _is_bool(value):
        return bool(value)
    return dict(value) if isinstance(value, Mapping) else value


def _number(value: object) -> bool:
    """A finite int or float (an int past float's range is finite: range checks refuse it)."""
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and (isinstance(value, int) or math.isfinite(value))


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request samples from the target. The distribution is scaled by temperature,
    then filtered by top-k, top-p and min-p in that order, each with its usual meaning (the
    order of Hugging Face's logits warpers). vLLM's v1 sampler applies min-p before top-k and
    top-p, so with top-p and min-p both set the two keep slightly different token sets."""

    temperature: float | None = None
    """Zero decodes the target greedily; above zero, the target is sampled. Required with
    adaptive target verify; elsewhere unset means 0."""

    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps every token."""

    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""

    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""

    max_tokens: int = 256
    """Most tokens to generate."""

    stop: tuple[int, ...] = ()
    """Stop token ids: generation ends after emitting any of them (the token is kept). Any
    sequence or one-dimensional array of ints is taken and kept as a tuple of plain ints."""

    def __post_init__(self) -> None:
        # An engine's numbers are often numpy scalars: kept as the Python int or float they
        # equal, so the fields hold plain values (the event log writes them as JSON).
        for name in ("temperature", "top_k", "top_p", "min_p", "max_tokens"):
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        object.__setattr__(self, "stop", _stop_ids(self.stop))
        temperature = self.temperature
        if temperature is not None and not (_number(temperature) and (
                temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
            raise InvalidRequest("temperature", temperature,
                                 f"expected 0 (greedy) or a number in "
                                 f"{MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}"
                                 f"{_not_number(temperature)}")
        self._check_filters()
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise InvalidRequest("max_tokens", self.max_tokens,
                                 f"expected an integer in 1..{MAX_NEW_TOKENS}"
                                 f"{_not_number(self.max_tokens)}")
        ids: object = self.stop  # any value an engine passed, until checked
        if not isinstance(ids, tuple) or not all(_is_int(i) and i >= 0 for i in ids):
            if isinstance(ids, str) or (isinstance(ids, tuple) and any(
                    isinstance(i, str) for i in ids)):
                raise UnsupportedRequest("stop", ids if isinstance(ids, str) else list(ids),
                                         "stop strings are matched by the engine's tokenizer; "
                                         "give the stop token ids")
            raise InvalidRequest("stop", list(ids) if isinstance(ids, tuple) else ids,
                                 "expected a list of non-negative token ids"
                                 f"{'' if isinstance(ids, tuple) else _not_number(ids)}")

    def _check_filters(self) -> None:
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest("top_k", self.top_k,
                                 f"expected an integer in 0..{MAX_TOP_K} (0: off)"
                                 f"{_not_number(self.top_k)}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", self.top_p, "expected a number in (0, 1]"
                                 f"{_not_number(self.top_p)}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", self.min_p, "expected a number in [0, 1]"
                                 f"{_not_number(self.min_p)}")

    def ending_at(self, eos_token_ids: tuple[int, ...], field: str = "stop"
                  ) -> "SamplingParams":
        """These parameters, also stopping at the model's end-of-sequence ids (as the
        model's own ``generate`` does); ``field`` names the request's own stop ids when, with
        them, there are more than MAX_STOP_TOKENS."""
        stop = tuple(dict.fromkeys((*self.stop, *eos_token_ids)))
        if len(stop) > MAX_STOP_TOKENS:
            raise InvalidRequest(field, f"{len(self.stop)} token ids",
                                 f"expected at most {MAX_STOP_TOKENS - len(eos_token_ids)}: "
                                 f"the model's {len(eos_token_ids)} end-of-sequence ids "
                                 "take the rest")
        return dataclasses.replace(self, stop=stop)

    @property
    def greedy(self) -> bool:
        """Whether the target decodes greedily (temperature 0 or unset)."""
        return not self.temperature

    @classmethod
    def from_request(cls, request: Mapping[str, object]) -> "SamplingParams":
        """Read an engine's request fields (a mapping of field name to value); refuse
        unsupported features by name."""
        if not isinstance(request, Mapping):
            raise InvalidRequest("request", request,
                                 "expected a mapping of request fields (a dict such as "
                                 "{\"temperature\": 0, \"max_tokens\": 64})")
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for name, value in request.items():
            if name in UNSUPPORTED_FIELDS:
                neutral, why = UNSUPPORTED_FIELDS[name]
                value = plain_number(value)  # numpy 0.0 is as neutral as 0.0
                if not is_neutral(value, neutral):
                    shown = repr(value) if isinstance(value, str) else value
                    raise UnsupportedRequest(name, shown, refusal(neutral, why))
            elif name in known:
                values[name] = tuple(value) if isinstance(value, list) else value
            elif name == "stop_token_ids":
                raise InvalidRequest(name, value, "give stop token ids as the field stop")
            else:
                raise InvalidRequest(name, value, "unknown field; expected one of "
                                     + ", ".join(sorted(known)))
        return cls(**values)  # type: ignore[arg-type]


MAX_TOP_K = 2**31 - 1
"""Any k at or above the vocabulary keeps every token; larger values would not fit the
sampler's integer tensors."""


def _stop_ids(value: object) -> object:
    """Stop token ids given as any sequence (a list, a tuple, a range) or one-dimensional
    array (numpy, torch) as the tuple of plain ints the field holds; anything else (a str,
    a set, a number, a 2-D array) as it is, for the check to refuse."""
    if isinstance(value, str | bytes | bytearray):
        return value
    if isinstance(value, tuple | Sequence):
        items: object = value
    elif getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None)):
        items = value.tolist()  # type: ignore[attr-defined]  # numpy or torch: plain values
    else:
        return value
    return tuple(plain_number(i) for i in items)  # type: ignore[attr-defined]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plain_number(value: object) -> object:
    """A real number of any type (``numpy.float32(0.5)``, ``numpy.int64(8)``, an int
    subclass) as the Python int or float it equals; anything else (a bool, None, a str, a
    tensor) as it is, for the field's check to refuse or keep."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value)


def _not_number(value: object) -> str:
    """What a refusal adds when the value is no number at all: its type, so that "0.5" (a
    str) is not taken for a number out of range."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return ""
    kind = type(value)
    return f", not a {f'{kind.__module__}.{kind.__qualname__}'.removeprefix('builtins.')}"


def check_request(params: SamplingParams, launch: LaunchConfig) -> None:
    """Refuse, before execution, what ``Runtime.submit`` refuses of the request alone: what
    this launch cannot decode exactly, and a filter on a greedy request. What needs the
    prompt or the model (room in the context, stop ids in the vocabulary) submit checks."""
    check_recorded_request(params, launch)
    refuse_idle_filter(params)


def check_recorded_request(params: SamplingParams, launch: LaunchConfig) -> None:
    """Refuse a request this launch cannot decode exactly: what an event log's requests are
    held to (a filter on a greedy one decodes exactly, and logs recorded before that was
    refused still replay)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"check_request(params={reprlib.repr(params)}): expected a "
                        "SamplingParams (SamplingParams.from_request reads a dict)")
    if not isinstance(launch, LaunchConfig):
        raise TypeError(f"check_request(launch={reprlib.repr(launch)}): expected a "
                        "LaunchConfig (an EffectiveConfig's .launch)")
    if launch.enable_adaptive_target_verify and params.temperature is None:
        raise UnsupportedRequest("temperature", MISSING,
                                 "required with --enable_adaptive_target_verify=true; give 0 "
                                 "for greedy decoding or a positive value to sample")
    if launch.enable_unified_mtp_graph and not params.greedy:
        raise UnsupportedRequest("temperature", params.temperature,
                                 "expected 0: --enable_unified_mtp_graph=true captures greedy "
                                 "rounds only; use --enable_unified_mtp_graph=false for "
                                 "positive temperatures")
    if len(params.stop) > MAX_STOP_TOKENS:
        raise InvalidRequest("stop", f"{len(params.stop)} token ids",
                             f"expected at most {MAX_STOP_TOKENS} stop token ids")


def refuse_idle_filter(params: SamplingParams) -> None:
    """Refuse a filter on a greedy request, as the commands and the server do."""
    name = idle_filter(params)
    if name is not None:
        raise InvalidRequest(name, getattr(params, name), IDLE_FILTER)


IDLE_FILTER = "filters sampled requests only; expected a positive temperature with it"


def idle_filter(params: SamplingParams) -> str | None:
    """The first filter a greedy request sets, which would filter nothing (greedy decoding
    takes the argmax), so it is refused rather than taken silently; None when there is none."""
    if not params.greedy:
        return None
    if params.top_k:
        return "top_k"
    if params.top_p < 1.0:
        return "top_p"
    return "min_p" if params.min_p else None


def check_room(context_limit: int, num_prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a ``max_tokens`` the context cannot hold after the prompt: it would be cut
    short at the context's end rather than decoded as asked."""
    room = context_limit - num_prompt_tokens
    if max_tokens > room:
        raise InvalidRequest("max_tokens", max_tokens,
                             f"expected at most {room}: the context limit {context_limit} "
                             f"less the prompt's {num_prompt_tokens} tokens")
