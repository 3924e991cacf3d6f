"""Sampling parameters: ranges, refused features named by field, and launch-dependent rules."""

import dataclasses
import functools
import json
from collections import OrderedDict
from types import MappingProxyType

import numpy as np
import pytest

from adaspec.config import SamplingParams, check_request, load_config, load_config_from_argv
from adaspec.config.flags import launch_config_from_settings
from adaspec.config.requests import check_recorded_request, refuse_idle_filter
from adaspec.errors import InvalidRequest, UnsupportedRequest

ATV = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 7,
       "enable_adaptive_target_verify": True}
UNIFIED = {**ATV, "enable_unified_mtp_graph": True}


def test_request_fields_are_read_into_frozen_params() -> None:
    params = SamplingParams.from_request({"temperature": 0.5, "top_k": 40, "top_p": 0.9,
                                          "min_p": 0.05, "max_tokens": 64,
                                          "stop": [10, 0]})
    assert params == SamplingParams(temperature=0.5, top_k=40, top_p=0.9, min_p=0.05,
                                    max_tokens=64, stop=(10, 0))
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams().greedy


@pytest.mark.parametrize(("field", "value", "why"), [
    ("seed", 7, "per-request seeds are not supported"),
    ("logprobs", True, "logprobs are not supported"),
    ("logprobs", np.True_, "logprobs are not supported"),
    ("response_format", OrderedDict(type="json_object"), "structured-output constraints"),
    ("top_logprobs", 5, "logprobs are not supported"),
    ("prompt_logprobs", 1, "logprobs are not supported"),
    # 0 still asks for the chosen (or prompt) tokens' own logprobs: not a neutral value.
    ("logprobs", 0, "logprobs are not supported"),
    ("prompt_logprobs", 0, "logprobs are not supported"),
    ("min_tokens", 4, "minimum-length stops are not supported"),
    ("logit_bias", {"5": 1.0}, "token bias is not supported"),
    ("logit_bias", {"5": 0, "6": False}, "token bias is not supported"),
    # A zero bias is neutral only on token ids: anything else is a malformed bias.
    ("logit_bias", {"abc": 0}, "token bias is not supported"),
    ("logit_bias", {"-1": 0}, "token bias is not supported"),
    ("presence_penalty", 0.5, "non-neutral penalties are not supported"),
    ("frequency_penalty", -0.1, "non-neutral penalties are not supported"),
    ("repetition_penalty", 1.1, "non-neutral penalties are not supported"),
    ("response_format", {"type": "json_object"}, "structured-output constraints"),
    ("guided_json", {"type": "object"}, "structured-output constraints"),
    ("guided_regex", "a+", "structured-output constraints"),
    ("guided_choice", ["a"], "structured-output constraints"),
    ("guided_grammar", "root ::= x", "structured-output constraints"),
    ("structured_outputs", {"json": {}}, "structured-output constraints"),
])
def test_unsupported_feature_is_refused_by_field(field: str, value: object, why: str) -> None:
    with pytest.raises(UnsupportedRequest) as info:
        SamplingParams.from_request({"temperature": 0, field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"request field {field}=")
    assert why in str(info.value)


@pytest.mark.parametrize(("field", "value"), [
    ("seed", None), ("logprobs", False), ("min_tokens", 0), ("logit_bias", {}),
    ("presence_penalty", 0.0), ("frequency_penalty", 0), ("repetition_penalty", 1.0),
    # What OpenAI clients send by default: plain text, and a bias that moves no token.
    ("response_format", {"type": "text"}), ("logit_bias", {"65": 0, "66": 0.0}),
    ("logit_bias", {"65": np.int64(0), "66": np.float64(0.0)}),
    # An engine's own types: numpy's false is false, and any mapping reads as a dict.
    ("logprobs", np.False_), ("response_format", OrderedDict(type="text")),
    ("logit_bias", MappingProxyType({})), ("logit_bias", OrderedDict({"65": 0})),
])
def test_neutral_values_of_unsupported_features_are_accepted(field: str, value: object) -> None:
    assert SamplingParams.from_request({field: value}) == SamplingParams()


def test_a_string_where_a_neutral_number_goes_is_shown_as_a_string() -> None:
    with pytest.raises(UnsupportedRequest) as info:
        SamplingParams.from_request({"frequency_penalty": "0"})
    assert str(info.value).startswith("request field frequency_penalty='0': ")


@pytest.mark.parametrize(("fields", "message"), [
    ({"temperature": -0.1}, "request field temperature=-0.1: expected 0 (greedy) or a number in "
                            "1e-05..100"),
    ({"temperature": float("nan")}, "request field temperature=nan: expected 0 (greedy) or a "
                                    "number in 1e-05..100"),
    # A str that reads as a number in range is named by its type.
    ({"temperature": "0.5"}, "request field temperature=0.5: expected 0 (greedy) or a number in "
                             "1e-05..100, not a str"),
    ({"top_k": "5"}, "request field top_k=5: expected an integer in 0..2147483647 (0: off), "
                     "not a str"),
    ({"temperature": np.float32(-0.5)}, "request field temperature=-0.5: expected 0 (greedy) "
                                        "or a number in 1e-05..100"),
    ({"top_p": np.bool_(True)}, "request field top_p=True: expected a number in (0, 1], not a "
                                f"numpy.{np.bool_.__qualname__}"),
    # Logits over 5e-324 overflow to inf: the sampler would draw from NaN probabilities.
    ({"temperature": 5e-324}, "request field temperature=5e-324: expected 0 (greedy) or a "
                              "number in 1e-05..100"),
    ({"top_k": -1}, "request field top_k=-1: expected an integer in 0..2147483647 (0: off)"),
    ({"top_p": 0.0}, "request field top_p=0.0: expected a number in (0, 1]"),
    ({"top_p": 1.5}, "request field top_p=1.5: expected a number in (0, 1]"),
    ({"min_p": 2}, "request field min_p=2: expected a number in [0, 1]"),
    ({"max_tokens": 0}, "request field max_tokens=0: expected an integer in 1..1048576"),
    # An int past float's range is refused by the range check, not by an OverflowError.
    ({"temperature": 10**400}, "request field temperature=1" + "0" * 116 + "...: expected 0 "
                               "(greedy) or a number in 1e-05..100"),
    ({"top_p": 10**400}, "request field top_p=1" + "0" * 116 + "...: expected a number in "
                         "(0, 1]"),
    ({"min_p": -10**400}, "request field min_p=-1" + "0" * 115 + "...: expected a number in "
                          "[0, 1]"),
    ({"stop": [-1]}, "request field stop=[-1]: expected a list of non-negative token ids"),
    ({"stop": 5}, "request field stop=5: expected a list of non-negative token ids"),
    ({"stop_token_ids": [2]}, "request field stop_token_ids=[2]: give stop token ids as the "
                              "field stop"),
    ({"best_of": 2}, "request field best_of=2: unknown field; expected one of max_tokens, "
                     "min_p, stop, temperature, top_k, top_p"),
])
def test_invalid_values_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_request(fields)
    assert str(info.value) == message


@pytest.mark.parametrize("request_", [None, [("temperature", 0)], "temperature=0", 3])
def test_a_request_that_is_no_mapping_is_refused_naming_request(request_: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_request(request_)  # type: ignore[arg-type]
    assert info.value.field == "request"
    assert str(info.value).endswith(": expected a mapping of request fields (a dict such as "
                                    '{"temperature": 0, "max_tokens": 64})')


@pytest.mark.parametrize("stop", [[10, 3], (10, 3), np.array([10, 3]), range(10, 2, -7),
                                  np.array([10, 3], dtype=np.uint8)])
def test_stop_ids_of_any_sequence_or_array_are_kept_as_a_tuple_of_plain_ints(
        stop: object) -> None:
    params = SamplingParams(temperature=0, stop=stop)  # type: ignore[arg-type]
    assert params.stop == (10, 3)
    assert all(type(token) is int for token in params.stop)
    assert json.dumps(params.stop) == "[10, 3]"


@pytest.mark.parametrize(("stop", "message"), [
    ({1, 2}, "request field stop={1, 2}: expected a list of non-negative token ids, not a set"),
    (np.array([[10]]), "request field stop=[[10]]: expected a list of non-negative token ids, "
                       "not a numpy.ndarray"),
    ([1.5], "request field stop=[1.5]: expected a list of non-negative token ids"),
    ([True], "request field stop=[True]: expected a list of non-negative token ids"),
])
def test_stop_that_is_no_sequence_of_token_ids_is_refused(stop: object, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(temperature=0, stop=stop)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize("stop", ["\n\n", ["\n\n"]])
def test_a_stop_string_given_directly_is_refused_as_unsupported(stop: object) -> None:
    with pytest.raises(UnsupportedRequest, match="stop strings are matched by the engine's "
                                                  "tokenizer; give the stop token ids$"):
        SamplingParams(temperature=0, stop=stop)  # type: ignore[arg-type]


def test_stop_strings_are_refused_as_unsupported() -> None:
    with pytest.raises(UnsupportedRequest) as info:
        SamplingParams.from_request({"stop": ["\n\n"]})
    assert str(info.value) == ("request field stop=['\\n\\n']: stop strings are matched by "
                               "the engine's tokenizer; give the stop token ids")


def test_adaptive_target_verify_requires_an_explicit_temperature() -> None:
    launch = launch_config_from_settings(ATV)
    with pytest.raises(UnsupportedRequest) as info:
        check_request(SamplingParams(), launch)
    assert str(info.value).startswith("request field temperature: required with "
                                      "--enable_adaptive_target_verify=true")
    check_request(SamplingParams(temperature=0.0), launch)
    check_request(SamplingParams(temperature=0.5, top_k=20), launch)


def test_unified_graphs_refuse_positive_temperature_instead_of_decoding_greedily() -> None:
    launch = launch_config_from_settings(UNIFIED)
    with pytest.raises(UnsupportedRequest) as info:
        check_request(SamplingParams(temperature=0.5), launch)
    assert str(info.value) == (
        "request field temperature=0.5: expected 0: --enable_unified_mtp_graph=true captures "
        "greedy rounds only; use --enable_unified_mtp_graph=false for positive temperatures")
    check_request(SamplingParams(temperature=0.0), launch)


@pytest.mark.parametrize(("fields", "shown"), [
    ({"temperature": 0, "top_k": 3}, "top_k=3"), ({"top_p": 0.5}, "top_p=0.5"),
    ({"temperature": 0.0, "min_p": 0.2, "top_p": 0.9}, "top_p=0.9"),
])
def test_a_greedy_request_with_a_filter_is_refused_as_the_cli_and_http_refuse_it(
        fields: dict[str, object], shown: str) -> None:
    """Runtime.submit refuses it, and so does check_request, which says before execution
    what submit refuses (before, it passed such a request that submit then refused); an
    event log's requests are held to the launch alone, so logs that recorded one replay."""
    params = SamplingParams.from_request(fields)
    check_recorded_request(params, launch_config_from_settings({}))
    for check in (refuse_idle_filter, functools.partial(check_request,
                                                        launch=launch_config_from_settings({}))):
        with pytest.raises(InvalidRequest) as info:
            check(params)
        assert str(info.value) == (f"request field {shown}: filters sampled requests only; "
                                   "expected a positive temperature with it")
    check_request(SamplingParams(temperature=0.5, **{k: v for k, v in fields.items()
                                                     if k != "temperature"}),
                  launch_config_from_settings({}))


def test_temperature_is_optional_without_adaptive_target_verify() -> None:
    check_request(SamplingParams(), launch_config_from_settings({}))


def test_numpy_numbers_are_taken_as_the_python_numbers_they_equal() -> None:
    # Engines pass numpy scalars; the fields keep plain Python numbers (the event log writes
    # them as JSON).
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(40),
                            top_p=np.float64(0.875), min_p=np.float16(0.25),
                            max_tokens=np.int32(16), stop=(np.int64(10), np.uint8(2)))
    plain = {"temperature": 0.5, "top_k": 40, "top_p": 0.875, "min_p": 0.25, "max_tokens": 16,
             "stop": (10, 2)}
    assert dataclasses.asdict(params) == plain
    assert {name: type(value) for name, value in dataclasses.asdict(params).items()} == \
        {name: type(value) for name, value in plain.items()}
    assert all(type(token) is int for token in params.stop)
    assert json.loads(json.dumps(dataclasses.asdict(params)))["temperature"] == 0.5
    assert SamplingParams(temperature=np.int64(0)).greedy
    # A numpy zero penalty is as neutral as a Python one.
    assert SamplingParams.from_request({"presence_penalty": np.float32(0.0),
                                        "max_tokens": np.int64(16)}) == \
        SamplingParams(max_tokens=16)


def test_the_request_check_refuses_arguments_of_the_wrong_kind_naming_them() -> None:
    config = load_config({})
    with pytest.raises(TypeError, match=r"^check_request\(launch=EffectiveConf.*\): expected a "
                                        r"LaunchConfig \(an EffectiveConfig's \.launch\)$"):
        check_request(SamplingParams(temperature=0, max_tokens=3), config)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^check_request\(params=\{'temperature': 0\}\): "
                                        r"expected a SamplingParams"):
        check_request({"temperature": 0}, config.launch)  # type: ignore[arg-type]
    for settings in ([("speculative_algorithm", "MTP")], "speculative_algorithm=MTP", {1: 1}):
        with pytest.raises(TypeError, match=r"^load_config\(settings=.*\): expected a mapping "
                                            r"of launch setting names \(str\) to values"):
            load_config(settings)  # type: ignore[arg-type]
    for argv in ([1, 2], None, "--port=1"):
        with pytest.raises(TypeError, match=r"^load_config_from_argv\(argv=.*\): expected a "
                                            r"list of str tokens"):
            load_config_from_argv(argv)  # type: ignore[arg-type]
