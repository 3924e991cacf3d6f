"""The JSON files named by launch flags: defaults, strictness, and checks against the launch."""

import json
from pathlib import Path

import pytest
from conftest import launch, rejection

from adaspec.config import CalibrationConfig, ContextInterval

ADS = "--speculative_algorithm=MTP --num_speculative_tokens=5 --enable_adaptive_draft_step=true"
ATV = ("--speculative_algorithm=DSpark --num_speculative_tokens=7 "
       "--enable_adaptive_target_verify=true")

SPEC_DRAFT_STEPS = {
    "version": 1,
    "policy": {"window_size": 20, "update_interval": 5, "switch_min_gain": 0.05},
    "calibration": {
        "model": "additive",
        "request_buckets": [1, 2, 4, 8, 16],
        "contexts": [{"prefill_tokens": 2048, "min_kv_length": 1, "max_kv_length": 4096}],
        "warmup_steps": 8, "window_steps": 32, "windows_per_point": 3, "token_seed": 1,
    },
}
SPEC_CALIBRATION = {
    "model": "additive",
    "request_buckets": [1, 2, 4, 8, 16],
    "contexts": [{"prefill_tokens": 1868, "min_kv_length": 1800, "max_kv_length": 4096}],
    "warmup_steps": 8, "window_steps": 32, "windows_per_point": 3, "token_seed": 1,
}


def write(tmp_path: Path, data: object, name: str = "file.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def draft_steps(tmp_path: Path, data: object) -> str:
    return f"{ADS} --adaptive_draft_step_config={write(tmp_path, data)}"


def calibration(tmp_path: Path, data: object) -> str:
    return f"{ATV} --adaptive_target_verify_calibration={write(tmp_path, data)}"


def with_calibration(**changes: object) -> dict[str, object]:
    return {**SPEC_CALIBRATION, **changes}


# --- adaptive draft-step file -------------------------------------------------------------


def test_spec_draft_step_file_is_accepted_and_sourced(tmp_path: Path) -> None:
    config = launch(draft_steps(tmp_path, SPEC_DRAFT_STEPS))
    assert config.draft_step is not None
    path = str(tmp_path / "file.json")
    assert config.draft_step.policy.source == path
    assert config.draft_step.calibration.source == path
    assert config.draft_step.calibration.request_buckets == (1, 2, 4, 8, 16)


def test_omitted_draft_step_section_keeps_its_defaults(tmp_path: Path) -> None:
    config = launch(draft_steps(tmp_path, {"version": 1, "policy": {"window_size": 40}}))
    assert config.draft_step is not None
    assert (config.draft_step.policy.window_size, config.draft_step.policy.update_interval) \
        == (40, 5)
    assert config.draft_step.calibration.source == "default"
    assert config.draft_step.calibration.request_buckets == (1, 2, 4, 8, 16)


def test_draft_step_default_buckets_stop_at_128() -> None:
    config = launch(f"{ADS} --max_seqs_per_batch=512")
    assert config.draft_step is not None
    assert config.draft_step.calibration.request_buckets[-1] == 128


@pytest.mark.parametrize(("data", "message"), [
    ({"policy": {}}, "version: expected 1 (the only file version)"),
    ({"version": 2}, "version=2: expected 1 (the only file version)"),
    ({"version": True}, "version=true: expected 1 (the only file version), got a boolean"),
    ({"version": "1"}, "version=1: expected 1 (the only file version), got a string"),
    ({"version": 1, "polcy": {}},
     "polcy={...}: unknown key; expected one of calibration, policy, version"),
    ({"version": 1, "policy": {"window_size": 0}},
     "policy.window_size=0: expected an integer in 1..1000000"),
    ({"version": 1, "policy": {"window_size": "20"}},
     "policy.window_size=20: expected an integer in 1..1000000, got a string"),
    ({"version": 1, "policy": {"update_interval": 2.5}},
     "policy.update_interval=2.5: expected an integer in 1..1000000, got a decimal number"),
    ({"version": 1, "policy": {"switch_min_gain": -0.1}},
     "policy.switch_min_gain=-0.1: expected a number in 0..10"),
    ({"version": 1, "policy": {"switch_min_gain": True}},
     "policy.switch_min_gain=true: expected a number in 0..10, got a boolean"),
    ({"version": 1, "policy": {"window": 20}},
     "policy.window=20: unknown key; expected one of switch_min_gain, update_interval, "
     "window_size"),
    ({"version": 1, "policy": []}, "policy=[...]: expected a JSON object"),
    ({"version": 1, "step_cost_models": {"1": [1.0]}},
     "step_cost_models={...}: precomputed cost tables are not accepted by this file; costs are "
     "measured at startup for every depth"),
    ({"version": 1, "calibration": {"step_cost_models": []}},
     "calibration.step_cost_models=[...]: precomputed cost tables are not accepted by this "
     "file; costs are measured at startup for every depth"),
    ({"version": 1, "calibration": {"target_graph_rows": [8, 16]}},
     "calibration.target_graph_rows=[...]: not a key of the draft-step calibration; the target "
     "rows follow from each candidate depth"),
    ({"version": 1, "calibration": {"draft_width": 7}},
     "calibration.draft_width=7: expected 5, the --num_speculative_tokens of this launch "
     "(costs of different widths must not be mixed)"),
    ({"version": 1, "enable_adaptive_spec_prune": True},
     "enable_adaptive_spec_prune=true: enable_adaptive_spec_prune was renamed to "
     "enable_adaptive_target_verify, which is a launch flag (--enable_adaptive_target_verify="
     "true), not a key of this file (the old name is not accepted as an alias)"),
])
def test_bad_draft_step_file_is_rejected(tmp_path: Path, data: object, message: str) -> None:
    path = tmp_path / "file.json"
    error = rejection(draft_steps(tmp_path, data))
    assert str(error) == f"--adaptive_draft_step_config={path}: {message}"


# --- target-verify calibration file ---------------------------------------------------------


def test_spec_calibration_file_is_accepted(tmp_path: Path) -> None:
    config = launch(calibration(tmp_path, SPEC_CALIBRATION))
    cal = config.target_verify_calibration
    assert cal is not None
    assert cal.contexts == (ContextInterval(prefill_tokens=1868, min_kv_length=1800,
                                            max_kv_length=4096),)
    assert (cal.draft_width, cal.source) == (7, str(tmp_path / "file.json"))


def test_calibration_defaults_follow_the_spec_table() -> None:
    cal = launch(ATV).target_verify_calibration
    assert cal == CalibrationConfig(model="additive", draft_width=7,
                                    request_buckets=(1, 2, 4, 8, 16), target_graph_rows=None,
                                    contexts=(ContextInterval(prefill_tokens=2048,
                                                              min_kv_length=1,
                                                              max_kv_length=4096),),
                                    warmup_steps=8, window_steps=32, windows_per_point=3,
                                    token_seed=1)
    assert cal.source == "default"


def test_empty_calibration_file_means_all_defaults(tmp_path: Path) -> None:
    cal = launch(calibration(tmp_path, {})).target_verify_calibration
    assert cal is not None
    assert cal == launch(ATV).target_verify_calibration


def test_matching_draft_width_and_explicit_rows_are_accepted(tmp_path: Path) -> None:
    data = with_calibration(draft_width=7, model="sps", request_buckets=[4, 8],
                            target_graph_rows=[8, 16, 32, 64])
    cal = launch(calibration(tmp_path, data)).target_verify_calibration
    assert cal is not None
    assert (cal.model, cal.target_graph_rows) == ("sps", (8, 16, 32, 64))


def two_contexts(first: tuple[int, int, int], second: tuple[int, int, int]) -> object:
    keys = ("prefill_tokens", "min_kv_length", "max_kv_length")
    return [dict(zip(keys, first, strict=True)), dict(zip(keys, second, strict=True))]


@pytest.mark.parametrize(("changes", "message"), [
    ({"model": "linear"}, "model=linear: expected sps or additive"),
    ({"draft_width": 5},
     "draft_width=5: expected 7, the --num_speculative_tokens of this launch (costs of "
     "different widths must not be mixed)"),
    ({"request_buckets": [1, 3]},
     "request_buckets=[1, 3]: 3 is not a prepared request bucket; prepared buckets are 1, 2, "
     "4, 8, 16 (from --acl_graph_decode_batch_size_limit=16)"),
    ({"request_buckets": [4, 2]},
     "request_buckets=[4, 2]: expected a non-empty list of strictly increasing integers in "
     "1..1048576"),
    ({"request_buckets": []},
     "request_buckets=[]: expected a non-empty list of strictly increasing integers in "
     "1..1048576"),
    ({"request_buckets": 8},
     "request_buckets=8: expected a non-empty list of strictly increasing integers in "
     "1..1048576"),
    ({"target_graph_rows": [0, 8]},
     "target_graph_rows=[0, 8]: expected a non-empty list of strictly increasing integers in "
     "1..1048576"),
    ({"warmup_steps": -1}, "warmup_steps=-1: expected an integer in 0..1000000"),
    ({"window_steps": 0}, "window_steps=0: expected an integer in 1..1000000"),
    ({"windows_per_point": 1.5},
     "windows_per_point=1.5: expected an integer in 1..1000000, got a decimal number"),
    ({"token_seed": "1"},
     "token_seed=1: expected an integer in 0..9223372036854775807, got a string"),
    ({"contexts": []}, "contexts=[]: expected a non-empty list of context intervals"),
    ({"contexts": [{"prefill_tokens": 8, "min_kv_length": 100, "max_kv_length": 10}]},
     "contexts[0].max_kv_length=10: expected at least min_kv_length=100 (the interval is "
     "inverted)"),
    ({"contexts": [{"prefill_tokens": 10, "min_kv_length": 500, "max_kv_length": 600}]},
     "contexts[0].prefill_tokens=10: expected at least min_kv_length=500 (windows are "
     "measured from the prefill on: a shorter prompt prices KV lengths outside the interval)"),
    ({"contexts": [{"prefill_tokens": 8, "min_kv_length": 1}]},
     "contexts[0].max_kv_length: missing; expected an integer"),
    ({"contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": 9, "x": 1}]},
     "contexts[0].x=1: unknown key; expected one of max_kv_length, min_kv_length, "
     "prefill_tokens"),
    ({"contexts": [{"prefill_tokens": 5000, "min_kv_length": 1, "max_kv_length": 4096}]},
     "contexts[0].prefill_tokens=5000: expected at most max_kv_length=4096 (the prompt alone "
     "would leave the KV interval)"),
    ({"contexts": ["2048"]},
     "contexts[0]=2048: expected an object with prefill_tokens, min_kv_length, max_kv_length"),
    ({"contexts": two_contexts((512, 1, 1024), (1500, 1024, 2048))},
     "contexts[1]={'prefill_tokens': 1500, 'min_kv_length': 1024, 'max_kv_length': 2048}: "
     "expected KV intervals that do not overlap; it overlaps 1..1024"),
    ({"contexts": two_contexts((2500, 2000, 4000), (512, 1, 2500))},
     "contexts[0]={'prefill_tokens': 2500, 'min_kv_length': 2000, 'max_kv_length': 4000}: "
     "expected KV intervals that do not overlap; it overlaps 1..2500"),
    ({"step_cost_models": {}},
     "step_cost_models={...}: precomputed cost tables are not accepted by this file; costs are "
     "measured at startup for every depth"),
    ({"enable_adaptive_speculative_decode": True},
     "enable_adaptive_speculative_decode=true: enable_adaptive_speculative_decode was renamed "
     "to enable_adaptive_target_verify, which is a launch flag (--enable_adaptive_target_verify="
     "true), not a key of this file (the old name is not accepted as an alias)"),
    ({"request_bucket": [1]},
     "request_bucket=[...]: unknown key; expected one of contexts, draft_width, model, "
     "request_buckets, target_graph_rows, token_seed, warmup_steps, window_steps, "
     "windows_per_point"),
    ({"version": 3}, "version=3: expected 1 (the only file version)"),
    ({"version": "1"}, "version=1: expected 1 (the only file version), got a string"),
])
def test_bad_calibration_file_is_rejected(tmp_path: Path, changes: dict[str, object],
                                          message: str) -> None:
    error = rejection(calibration(tmp_path, with_calibration(**changes)))
    assert str(error) == f"--adaptive_target_verify_calibration={tmp_path / 'file.json'}: " \
                         f"{message}"


def test_adjacent_context_intervals_are_accepted(tmp_path: Path) -> None:
    data = with_calibration(contexts=two_contexts((512, 1, 1023), (1500, 1024, 2048)))
    cal = launch(calibration(tmp_path, data)).target_verify_calibration
    assert cal is not None
    assert len(cal.contexts) == 2


@pytest.mark.parametrize(("text", "expected"), [
    ('{"model": "sps", "model": "additive"}', "key model appears twice in one object"),
    ('{"warmup_steps": NaN}', "expected valid JSON; NaN is not JSON"),
    ('{"model": ', "expected valid JSON; Expecting value at line 1 column 11"),
    ("[1, 2]", "expected a JSON object at the top level"),
    # Numbers a double cannot be: the file means them as written, as a flag would.
    ('{"window_steps": 1e400}', "window_steps: 1e400 is beyond a double; expected a finite "
                                "number"),
    ('{"request_buckets": [1, 1.5e-400]}', "request_buckets[1]: 1.5e-400 is a nonzero number "
                                           "below the smallest double; expected 0 or a number "
                                           "a double can hold"),
])
def test_malformed_json_is_rejected(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    error = rejection(f"{ATV} --adaptive_target_verify_calibration={path}")
    assert str(error) == f"--adaptive_target_verify_calibration={path}: {expected}"


def test_missing_and_unreadable_files_are_rejected(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    assert str(rejection(f"{ATV} --adaptive_target_verify_calibration={missing}")) == \
        f"--adaptive_target_verify_calibration={missing}: expected an existing JSON file"
    assert str(rejection(f"{ATV} --adaptive_target_verify_calibration={tmp_path}")) == \
        f"--adaptive_target_verify_calibration={tmp_path}: expected a JSON file, got a directory"
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{")
    assert str(rejection(f"{ATV} --adaptive_target_verify_calibration={binary}")) == \
        f"--adaptive_target_verify_calibration={binary}: expected a UTF-8 JSON file"


# --- cost-table paths ------------------------------------------------------------------------


def test_existing_output_file_is_rejected_and_left_untouched(tmp_path: Path) -> None:
    output = write(tmp_path, {"keep": True}, "costs.json")
    error = rejection(f"{ATV} --adaptive_target_verify_cost_table_output={output}")
    assert str(error) == (f"--adaptive_target_verify_cost_table_output={output}: expected a "
                          f"file that does not exist yet; choose a new output file")
    assert json.loads(output.read_text()) == {"keep": True}


def test_output_in_a_missing_directory_is_rejected(tmp_path: Path) -> None:
    output = tmp_path / "results" / "costs.json"
    error = rejection(f"{ATV} --adaptive_target_verify_cost_table_output={output}")
    assert str(error) == (f"--adaptive_target_verify_cost_table_output={output}: expected an "
                          f"existing directory; create {tmp_path / 'results'} first")


def test_saved_table_must_exist_and_skips_calibration(tmp_path: Path) -> None:
    missing = tmp_path / "t.json"
    assert str(rejection(f"{ATV} --adaptive_target_verify_cost_table={missing}")) == \
        f"--adaptive_target_verify_cost_table={missing}: expected an existing JSON file"
    not_json = write(tmp_path, "root:x:0:0", "passwd")
    assert str(rejection(f"{ATV} --adaptive_target_verify_cost_table={not_json}")) == (
        f"--adaptive_target_verify_cost_table={not_json}: expected valid JSON; Expecting value "
        f"at line 1 column 1")
    table = write(tmp_path, {}, "t.json")
    config = launch(f"{ATV} --adaptive_target_verify_cost_table={table}")
    assert config.target_verify_calibration is None
    section = config.as_dict()["adaptive_target_verify"]
    assert section["calibration"] == {  # type: ignore[index]
        "source": f"skipped: costs come from the saved table {table}"}


# --- geometry: per-shard buckets and target rows ---------------------------------------------


def test_default_buckets_fit_every_dp_shard() -> None:
    config = launch(f"{ATV} --dp_size=2 --nnodes=2 --max_seqs_per_batch=16")
    cal = config.target_verify_calibration
    assert cal is not None
    assert cal.request_buckets == (1, 2, 4, 8)


def test_explicit_bucket_over_the_global_batch_is_rejected(tmp_path: Path) -> None:
    line = calibration(tmp_path, with_calibration(request_buckets=[4, 16]))
    error = rejection(f"{line} --dp_size=2 --nnodes=2")
    assert str(error).endswith(
        "request_buckets=[4, 16]: bucket 16 is per DP shard, so it drives 32 synthetic requests "
        "over --dp_size=2 shards; expected at most --max_seqs_per_batch=16")


@pytest.mark.parametrize(("rows", "message"), [
    ([3, 64], "target_graph_rows=[3, 64]: 3 is not a legal prepared G of the sampled request "
              "buckets; the legal rows are 4, 8, 16, 32, 64"),
    ([8, 1000], "target_graph_rows=[8, 1000]: 1000 is not a legal prepared G of the sampled "
                "request buckets; the legal rows are 4, 8, 16, 32, 64"),
    ([4, 8, 16, 32], "target_graph_rows=[4, 8, 16, 32]: expected full width 64 rows for request "
                     "bucket 8 (width 7); full width must stay covered"),
])
def test_target_rows_must_be_legal_prepared_tiers_with_full_width(
        tmp_path: Path, rows: list[int], message: str) -> None:
    data = with_calibration(request_buckets=[4, 8], target_graph_rows=rows)
    assert str(rejection(calibration(tmp_path, data))).endswith(message)


def test_prepared_geometry_matches_the_spec_tier_example() -> None:
    config = launch("--speculative_algorithm=DSpark --num_speculative_tokens=5 "
                    "--max_seqs_per_batch=8")
    assert config.launch.prepared_request_buckets() == (1, 2, 4, 8)
    assert config.launch.prepared_target_rows() == (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
    # Draft5 at B=8: the tiers covering B, 2B, 4B and B*(w+1) are among the legal rows.
    assert {8, 16, 32, 48} <= set(config.launch.legal_target_rows(8))
    assert config.launch.legal_target_rows(8) == (8, 12, 16, 24, 32, 48)


# --- hostile files ---------------------------------------------------------------------------


def test_deeply_nested_json_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, '{"contexts": ' + "[" * 100_000 + "]" * 100_000 + "}")
    error = rejection(f"{ATV} --adaptive_target_verify_calibration={path}")
    assert str(error) == (f"--adaptive_target_verify_calibration={path}: expected JSON nested "
                          f"less deeply")


def test_device_files_are_refused_without_reading_them() -> None:
    error = rejection(f"{ATV} --adaptive_target_verify_calibration=/dev/zero")
    assert str(error) == ("--adaptive_target_verify_calibration=/dev/zero: expected a regular "
                          "JSON file, got a character device")


def test_control_characters_in_keys_keep_the_message_on_one_line(tmp_path: Path) -> None:
    error = rejection(calibration(tmp_path, {"a\nb": 1}))
    assert "\n" not in str(error)
    assert "a\\nb=1: unknown key" in str(error)


def test_version_must_be_the_integer_one(tmp_path: Path) -> None:
    error = rejection(draft_steps(tmp_path, {"version": 1.0}))
    assert str(error).endswith("version=1.0: expected 1 (the only file version), got a "
                               "decimal number")
