"""Launch tokens: both spellings, strict booleans, unknown, repeated and retired flags."""

import dataclasses

import pytest
from conftest import launch, rejection

from adaspec.config import LaunchConfig, load_config, load_config_from_argv
from adaspec.config.flags import field_docs, launch_config_from_settings, parse_argv
from adaspec.config.launch import launch_field_types
from adaspec.errors import ConfigError


def test_equals_and_space_spellings_give_the_same_config() -> None:
    joined = launch("--speculative_algorithm=MTP --num_speculative_tokens=3 --dp_size=1")
    spaced = launch("--speculative_algorithm MTP --num_speculative_tokens 3 --dp_size 1")
    assert joined.launch == spaced.launch


def test_choices_match_without_case_and_keep_the_canonical_spelling() -> None:
    config = launch("--speculative_algorithm=dspark --num_speculative_tokens=5 --device=CPU")
    assert (config.launch.speculative_algorithm, config.launch.device) == ("DSpark", "cpu")


@pytest.mark.parametrize(("line", "message"), [
    ("--enable_graph=yes", "--enable_graph=yes: expected true|false"),
    ("--enable_graph=1", "--enable_graph=1: expected true|false"),
    ("--enable_graph", "--enable_graph: missing value; expected true|false"),
    ("--enable_graph --dp_size=1", "--enable_graph: missing value; expected true|false"),
    ("--dp_size=two", "--dp_size=two: expected an integer"),
    ("--dp_size=1.5", "--dp_size=1.5: expected an integer"),
    ("--device=tpu", "--device=tpu: expected one of cpu|cuda|npu"),
    ("--speculative_algorithm=EAGLE", "--speculative_algorithm=EAGLE: expected one of "
                                      "none|MTP|DSpark"),
    ("--model=", "--model='': expected a non-empty value"),
    ("--host=' '", "--host=' ': expected a non-empty value"),
    ("--backend=vlm", "--backend=vlm: expected one of llm"),
    ("--model_impl=native", "--model_impl=native: expected one of python"),
    ("--npu_kernel_backend=ATB", "--npu_kernel_backend=ATB: expected one of TORCH"),
    ("--enable_grpah=true", "--enable_grpah=true: unknown flag; did you mean --enable_graph?"),
    ("--zzz=1", "--zzz=1: unknown flag; see `adaspec config --help`"),
    ("--dp_size=1 --dp_size=2", "--dp_size=2: given twice (first as 1); give each flag once"),
    ("dp_size=2", "argument=dp_size=2: expected --name=value or --name value"),
    ("-d", "argument=-d: expected --name=value or --name value"),
    ("--enable_adaptive_spec_prune=true",
     "--enable_adaptive_spec_prune=true: --enable_adaptive_spec_prune was renamed to "
     "--enable_adaptive_target_verify; use --enable_adaptive_target_verify (the old name is not "
     "accepted as an alias)"),
    ("--enable_adaptive_speculative_decode true",
     "--enable_adaptive_speculative_decode=true: --enable_adaptive_speculative_decode was "
     "renamed to --enable_adaptive_target_verify; use --enable_adaptive_target_verify (the old "
     "name is not accepted as an alias)"),
])
def test_bad_token_is_rejected_with_pinned_message(line: str, message: str) -> None:
    assert str(rejection(line)) == message


def test_retired_names_are_rejected_through_the_python_api_too() -> None:
    with pytest.raises(ConfigError, match="the old name is not accepted as an alias"):
        launch_config_from_settings({"enable_adaptive_spec_prune": True})


def test_python_api_takes_native_values_and_checks_their_types() -> None:
    config = launch_config_from_settings({"dp_size": 2, "nnodes": 2, "enable_graph": True})
    assert (config.dp_size, config.resolved.tp_size) == (2, 1)
    with pytest.raises(ConfigError, match=r"^--dp_size=true: expected an integer$"):
        launch_config_from_settings({"dp_size": True})
    with pytest.raises(ConfigError, match=r"^--enable_graph=1: expected true\|false$"):
        LaunchConfig(enable_graph=1)  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    config = LaunchConfig()
    with pytest.raises(AttributeError):
        config.dp_size = 2  # type: ignore[misc]


def test_argv_keeps_values_that_look_like_negative_numbers() -> None:
    assert parse_argv(["--cp_size", "-1"]) == {"cp_size": "-1"}


def test_every_flag_has_a_docstring() -> None:
    assert set(launch_field_types()) <= set(field_docs())


def test_retired_or_unknown_name_wins_over_a_missing_value() -> None:
    assert "was renamed to --enable_adaptive_target_verify" in str(
        rejection("--enable_adaptive_spec_prune"))
    assert str(rejection("--enable_adaptiv_draft_step")) == (
        "--enable_adaptiv_draft_step: unknown flag; did you mean --enable_adaptive_draft_step?")


def test_only_ascii_digits_make_an_integer() -> None:
    assert str(rejection("--dp_size=\u0663")) == "--dp_size=\u0663: expected an integer"


def test_control_characters_in_a_flag_name_keep_the_message_on_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        load_config_from_argv(["--a\nb=1"])
    assert str(info.value) == "--a\\nb=1: unknown flag; see `adaspec config --help`"


def test_dataclasses_replace_re_derives_unset_settings() -> None:
    config = LaunchConfig(speculative_algorithm="MTP", num_speculative_tokens=3)
    assert config.resolved.python_graph_backend == "eager_buckets"
    on_cuda = dataclasses.replace(config, device="cuda")
    assert on_cuda.resolved.python_graph_backend == "cudagraph"
    smaller = dataclasses.replace(config, max_seqs_per_batch=8)
    assert smaller.resolved.acl_graph_decode_batch_size_limit == 8
    dspark = dataclasses.replace(config, speculative_algorithm="DSpark")
    assert dspark.resolved.draft_model == "builtin:dspark"
    assert config.draft_model is None


HOST = ("expected a hostname (letters, digits, '-', '_' and '.'-separated labels of at most 63 "
        "characters) or an IP address, without spaces or control characters")


@pytest.mark.parametrize(("host", "shown"), [
    ("a\nb", "'a\\nb'"), ("a b", "a b"), ("\x00", "'\\x00'"), ("-lead", "-lead"),
    ("a..b", "a..b"), ("[::1]", "[::1]"), ("x" * 64, None),
])
def test_a_host_that_is_no_hostname_or_ip_address_is_refused(host: str, shown: str | None
                                                              ) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_from_argv([f"--host={host}"])
    message = str(info.value)
    assert message.endswith(f": {HOST}")
    if shown is not None:
        assert message == f"--host={shown}: {HOST}"
    assert message.isprintable()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "localhost",
                                  "node-1.cluster.local", "host_1", "node.", "x" * 63])
def test_hostnames_and_ip_addresses_are_taken_as_host(host: str) -> None:
    assert load_config_from_argv([f"--host={host}"]).launch.host == host


def test_a_setting_named_with_the_flags_dashes_says_to_drop_them() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"--port": 1})
    assert str(info.value) == ("--port=1: unknown setting; settings are named without dashes: "
                               "port")
