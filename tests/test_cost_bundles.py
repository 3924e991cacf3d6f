"""Saved cost tables: a bundle reloads bit for bit, every incompatible launch is refused with
the field, the saved value and the launch value named, legacy tables read as Draft7 and held
to the launch's captured geometry, and a damaged file is refused with its key path."""

import dataclasses
import json
from pathlib import Path

import pytest
from cost_tables import CONTEXT, LAUNCH, SAMPLES, SETTINGS, bundle, depth_bundle, saved

from adaspec import cli
from adaspec.errors import ConfigError, IncompatibleCostTable
from adaspec.policies.bundles import (
    COMPATIBILITY_FIELDS,
    CostProfile,
    bundle_from_dict,
    fitted_bundle,
    load_bundle,
)
from adaspec.policies.costs import CostSample, fit, fit_sps
from adaspec.policies.workloads import shaped_table, synthetic
from adaspec.runtime.events.log import LogHeader
from adaspec.runtime.events.replay import recorded_costs


def test_a_saved_bundle_reloads_bit_for_bit(tmp_path: Path) -> None:
    original = bundle()
    path = str(tmp_path / "costs.json")
    original.save(path)
    reloaded = load_bundle(path, json.loads(Path(path).read_text()))
    assert reloaded == original
    assert reloaded.source == f"saved table {path}"
    assert reloaded.unchecked == ()
    for b, rows in zip(LAUNCH.request_buckets, LAUNCH.target_rows, strict=True):
        for g in rows:
            assert reloaded.cost_ms(b, g, 900) == original.cost_ms(b, g, 900)  # exact
    reloaded.check_compatible(LAUNCH, path)  # the launch that saved it


def test_an_existing_output_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text("keep me")
    with pytest.raises(ConfigError, match="expected a file that does not exist yet"):
        bundle().save(str(path))
    assert path.read_text() == "keep me"


OTHER_VALUES = {"algorithm": "MTP", "draft_width": 7, "dp_size": 2, "tp_size": 2,
                "unified": True, "device": "cuda", "target": "other-target",
                "draft": "other-draft", "request_buckets": (1, 2, 4),
                "target_rows": ((1, 2, 4, 6), (2, 4, 6, 8, 12), (4, 8, 16, 24))}


@pytest.mark.parametrize("name", COMPATIBILITY_FIELDS)
def test_every_incompatible_field_is_refused_naming_saved_and_launch_values(
        name: str) -> None:
    launch = dataclasses.replace(LAUNCH, **{name: OTHER_VALUES[name]})
    with pytest.raises(IncompatibleCostTable) as info:
        bundle().check_compatible(launch, "/results/costs.json")
    error = info.value
    assert (error.field, error.saved, error.launch) == \
        (name, LAUNCH.as_dict()[name], launch.as_dict()[name])
    assert str(error).startswith(f"--adaptive_target_verify_cost_table=/results/costs.json: "
                                 f"{name} is ")


def test_the_specification_refusals_read_plainly() -> None:
    cases = [("algorithm", "MTP", "algorithm is DSpark in the saved table but MTP"),
             ("draft_width", 7, "draft_width is 5 in the saved table but 7"),
             ("dp_size", 2, "dp_size is 1 in the saved table but 2"),
             ("unified", True, "unified is false in the saved table but true")]
    for name, value, message in cases:
        with pytest.raises(IncompatibleCostTable, match=message):
            bundle().check_compatible(dataclasses.replace(LAUNCH, **{name: value}), "t.json")


def test_an_unversioned_legacy_table_without_width_is_draft7(tmp_path: Path) -> None:
    table = fit_sps(SAMPLES).as_dict()
    path, data = saved(tmp_path, table)
    legacy = load_bundle(path, data)
    assert legacy.version is None
    assert legacy.compatibility == {"draft_width": 7}
    with pytest.raises(IncompatibleCostTable, match="draft_width is 7 in the saved table "
                                                    "but 5 in this launch"):
        legacy.check_compatible(LAUNCH, path)
    draft7 = dataclasses.replace(LAUNCH, draft_width=7)
    legacy.check_compatible(draft7, path)
    assert "algorithm" in legacy.unchecked
    assert "draft_width" not in legacy.unchecked
    # It records no coverage, so it prices every KV length.
    assert legacy.cost_ms(1, 4, 100_000) == fit_sps(SAMPLES).cost_ms(1, 4)
    # A bare table that records its width is held to it; "model" names the kind too.
    bare = {**{k: v for k, v in table.items() if k != "kind"}, "model": "sps",
            "draft_width": 5}
    path5, data5 = saved(tmp_path, bare, "draft5.json")
    load_bundle(path5, data5).check_compatible(LAUNCH, path5)


def test_coverage_gaps_have_no_price() -> None:
    costs = bundle()
    assert costs.cost_ms(2, 12, 1024) is not None
    assert costs.cost_ms(2, 12, 1025) is None  # beyond the calibrated KV interval
    assert costs.cost_ms(4, 16, 500) is None  # a bucket above everything measured
    assert costs.cost_ms(1, 3, 500) == costs.cost_ms(1, 4, 500)  # priced at the next step


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=2), "version=2: expected the integer 1"),
    (lambda d: d.update(version="1"), "version=1: expected the integer 1 .*, got a string$"),
    # A bundle that lost its version is no legacy table: before, it was read as one and
    # refused only as "kind=null: expected sps, additive or log-additive".
    (lambda d: d.pop("version"),
     r': version: missing; expected the integer 1 \(an object with "format", '
     r'"compatibility", "settings" and "profiles" is a versioned bundle; a legacy table is a '
     r"bare table object\)$"),
    (lambda d: [d.pop(key) for key in ("version", "format", "compatibility", "settings")],
     r': version: missing; expected the integer 1 \(an object with "profiles" is a versioned '
     r"bundle; "),
    (lambda d: d["compatibility"].pop("device"), r"compatibility\.device=missing"),
    # Before, any string passed: simulate priced a "Foo" run, a launch named a mismatch.
    (lambda d: d["compatibility"].update(algorithm="Foo"),
     r"compatibility\.algorithm=Foo: expected DSpark or MTP$"),
    (lambda d: d["compatibility"].update(algorithm="none"),
     r"compatibility\.algorithm=none: expected DSpark or MTP$"),
    (lambda d: d["compatibility"].update(device="tpu"),
     r"compatibility\.device=tpu: expected cpu, cuda or npu$"),
    (lambda d: d["compatibility"].update(device="CPU"),
     r"compatibility\.device=CPU: expected cpu, cuda or npu$"),
    (lambda d: d["compatibility"].update(unified="no"),
     r"compatibility\.unified=no: expected true or false, got a string$"),
    # Before, "unified=false: expected true or false": a string that reads as the boolean.
    (lambda d: d["compatibility"].update(unified="false"),
     r"compatibility\.unified=false: expected true or false, got a string$"),
    (lambda d: d["compatibility"].update(unified=0),
     r"compatibility\.unified=0: expected true or false, got an integer$"),
    (lambda d: d["profiles"][0]["table"].update(theta=[0.0, 0.002, 0.001, 0.003, 0.004, 0.005]),
     r"profiles\[0\]\.table\.theta=.*expected values that never fall"),
    (lambda d: d["profiles"][0]["table"].update(alpha=[0.0]),
     r"profiles\[0\]\.table\.alpha=1 values: expected 2 numbers"),
    (lambda d: d["profiles"][0]["context"].update(max_kv_length=0),
     r"profiles\[0\]\.context\.max_kv_length=0"),
    (lambda d: d["profiles"][0]["samples"].append([1, 2, -1.0]),
     r"profiles\[0\]\.samples\[27\]=\[1, 2, -1\.0\]: expected \[Bcap, G, seconds\]"),
    (lambda d: d.update(extra=1), "extra=1: is not a key here"),
    (lambda d: d["profiles"][0]["table"].update(kind="log-additive"),
     r"profiles\[0\]\.table\.kind=log-additive: expected sps or additive for a table over G"),
    # Prices at infinity (or absurdly high) would make adaptive verify pick the smallest tier,
    # verifying no draft; every price must lie in 1e-06..3600 s.
    (lambda d: d["profiles"][0]["table"].update(bias=1e308),
     r"profiles\[0\]\.table\.bias=1e\+308: expected every price in 1e-06\.\.3600 s; "
     r"Bcap=1 G=1 costs 1e\+308 s"),
    (lambda d: d["profiles"][0]["table"].update(bias=1e6),
     r"profiles\[0\]\.table\.bias=1000000\.0: expected every price in 1e-06\.\.3600 s"),
    # Too low with no negative term: the bias is the floor every other term adds to.
    (lambda d: (d["profiles"][0]["table"].update(bias=5e-324, alpha=[0.0, 0.0]),
                d["profiles"][0]["table"]["theta"].__setitem__(0, 0.0)),
     r"profiles\[0\]\.table\.bias=5e-324: expected every price in 1e-06\.\.3600 s; "
     r"Bcap=1 G=1 costs 5e-324 s"),
    (lambda d: d["profiles"][0]["table"]["theta"].__setitem__(5, 1e308),
     r"profiles\[0\]\.table\.theta\[5\]=1e\+308: expected every price .* Bcap=2 G=12 "
     r"costs 1e\+308 s"),
    (lambda d: d["profiles"][0]["table"].update(alpha=[0.0, 1e308], theta=[0.0] * 5 + [1e308]),
     r"profiles\[0\]\.table\.alpha\[1\]=1e\+308: expected every price .* Bcap=2 G=12 "
     r"costs inf s"),
    (lambda d: d["profiles"][0]["samples"].append([1, 2, 1e308]),
     r"profiles\[0\]\.samples\[27\]=\[1, 2, 1e\+308\]: expected \[Bcap, G, seconds\] with "
     r"seconds in 1e-06\.\.3600"),
    # A tier no bucket can verify: past every request's drafts, or below its anchor rows.
    (lambda d: d["compatibility"]["target_rows"][1].append(13),
     r"target_rows\[1\]=\[2, 4, 6, 8, 12, 13\]: expected G in 2\.\.12 for request bucket 2 "
     r".* got 13"),
    (lambda d: d["compatibility"]["target_rows"][1].insert(0, 1),
     r"target_rows\[1\]=\[1, 2, 4, 6, 8, 12\]: expected G in 2\.\.12 .* got 1"),
    # Settings that contradict the compatibility (or the profiles) they were saved with.
    (lambda d: d["settings"].update(step_cost_models={}),
     r"settings\.step_cost_models=\{\}: is not a calibration setting; expected some of model, "),
    (lambda d: d["settings"].update(enable_adaptive_spec_prune=True),
     r"settings\.enable_adaptive_spec_prune=true: enable_adaptive_spec_prune was renamed to "
     r"enable_adaptive_target_verify"),
    (lambda d: d["settings"].update(draft_width=7),
     r"settings\.draft_width=7: expected the integer 5, the draft_width of the compatibility$"),
    (lambda d: d["settings"].update(draft_width="5"),
     r"settings\.draft_width=5: expected the integer 5, .* got a string"),
    (lambda d: d["settings"].update(request_buckets=[1, 4]),
     r"settings\.request_buckets=\[1, 4\]: expected a non-empty, strictly increasing list of "
     r"values from compatibility\.request_buckets \[1, 2\]"),
    (lambda d: d["settings"].update(target_graph_rows=[3]),
     r"settings\.target_graph_rows=\[3\]: expected a non-empty, strictly increasing list of "
     r"values from compatibility\.target_rows"),
    # Lists calibration records in order, each value once, never empty.
    (lambda d: d["settings"].update(request_buckets=[2, 1]),
     r"settings\.request_buckets=\[2, 1\]: expected a non-empty, strictly increasing list"),
    (lambda d: d["settings"].update(request_buckets=[1, 1]),
     r"settings\.request_buckets=\[1, 1\]: expected a non-empty, strictly increasing list"),
    (lambda d: d["settings"].update(request_buckets=[]),
     r"settings\.request_buckets=\[\]: expected a non-empty, strictly increasing list"),
    (lambda d: d["settings"].update(target_graph_rows=[12, 1, 1]),
     r"settings\.target_graph_rows=\[12, 1, 1\]: expected a non-empty, strictly increasing"),
    (lambda d: d["settings"].update(target_graph_rows=[]),
     r"settings\.target_graph_rows=\[\]: expected a non-empty, strictly increasing"),
    (lambda d: d["settings"]["points"].append(d["settings"]["points"][0]),
     r"settings\.points\[9\]=\[1, 1\]: expected each point once"),
    (lambda d: d["settings"].update(points=[]),
     r"settings\.points=\[\]: expected at least one point"),
    (lambda d: d["settings"]["contexts"][0].update(min_kv_length=True),
     r"settings\.contexts\[0\]=.*expected an object of exactly the integers max_kv_length, "
     r"min_kv_length, prefill_tokens"),
    (lambda d: d["settings"]["contexts"][0].update(max_kv_length=1024.0),
     r"settings\.contexts\[0\]=.*expected an object of exactly the integers"),
    # A kind that is no string at all (a list or an object) is named like any other.
    (lambda d: d["profiles"][0]["table"].update(kind=["additive"]),
     r"profiles\[0\]\.table\.kind=\['additive'\]: expected sps, additive or "
     r"log-additive"),
    (lambda d: d["profiles"][0]["table"].update(kind={}),
     r"profiles\[0\]\.table\.kind=\{\}: expected sps, additive or log-additive"),
    # A kind left out (or misspelt) is missing, as any other key: before, it showed as null.
    (lambda d: d["profiles"][0]["table"].pop("kind"),
     r"profiles\[0\]\.table\.kind=missing: expected this key: sps, additive or "
     r"log-additive$"),
    (lambda d: d["profiles"][0]["table"].update(kind=None),
     r"profiles\[0\]\.table\.kind=null: expected sps, additive or log-additive$"),
    # Before, an entry held only to its keys' types: a negative or inverted interval, or one
    # listed twice, loaded (simulate priced with the table as if calibrated so).
    (lambda d: d["settings"]["contexts"].append({"prefill_tokens": -5, "min_kv_length": -9,
                                                 "max_kv_length": -20}),
     r"settings\.contexts\[1\]\.prefill_tokens=-5: expected an integer in 1\.\.16777216$"),
    (lambda d: d["settings"]["contexts"].append({"prefill_tokens": 5, "min_kv_length": 9,
                                                 "max_kv_length": 2}),
     r"settings\.contexts\[1\]\.max_kv_length=2: expected at least min_kv_length=9"),
    (lambda d: d["settings"]["contexts"].append(d["settings"]["contexts"][0]),
     r"settings\.contexts\[1\]=.*expected KV intervals that do not overlap; it overlaps "
     r"1\.\.1024$"),
    (lambda d: d["settings"]["points"].append([2, 1]),
     r"settings\.points\[9\]=\[2, 1\]: expected \[Bcap, G\] with Bcap in "
     r"compatibility\.request_buckets and G one of its compatibility\.target_rows"),
    (lambda d: d["settings"].update(model="sps"),
     r"settings\.model=sps: expected additive, the model of profiles\[0\]\.table"),
    (lambda d: d["profiles"][0]["context"].update(max_kv_length=1 << 24),
     r"settings\.contexts=.*expected to list the interval of profiles\[0\] \(prefill 772, "
     r"KV 1\.\.16777216\)"),
    (lambda d: d["profiles"].append(d["profiles"][0]),
     r"profiles\[1\]\.context=.*expected KV intervals that do not overlap; it overlaps "
     r"1\.\.1024"),
    # A table's axes are the shapes its samples were measured at: one cut short leaves a
    # captured bucket unpriced (verified whole, unsaid), one past them prices guesses.
    (lambda d: d["profiles"][0]["table"].update(buckets=[1], alpha=[0.0]),
     r"profiles\[0\]\.table\.buckets=\[1\]: expected the values the profile's samples were "
     r"measured at \[1, 2\]$"),
    (lambda d: d["profiles"][0]["table"].update(buckets=[1, 4]),
     r"profiles\[0\]\.table\.buckets=\[1, 4\]: expected values from the shapes the "
     r"compatibility captured \[1, 2\]$"),
    (lambda d: d["profiles"][0]["table"].update(rows=[1, 2, 4, 6, 8, 13]),
     r"profiles\[0\]\.table\.rows=\[1, 2, 4, 6, 8, 13\]: expected values from the shapes "
     r"the compatibility captured \[1, 2, 4, 6, 8, 12\]$"),
    (lambda d: (d["profiles"][0].update(samples=[s for s in d["profiles"][0]["samples"]
                                                 if s[1] != 8])),
     r"profiles\[0\]\.table\.rows=\[1, 2, 4, 6, 8, 12\]: expected the values the profile's "
     r"samples were measured at \[1, 2, 4, 6, 12\]$"),
])
def test_a_damaged_bundle_is_refused_naming_the_key(tmp_path: Path, change: object,
                                                     message: str) -> None:
    data = json.loads(bundle().to_json())
    change(data)  # type: ignore[operator]
    path, data = saved(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as info:
        load_bundle(path, data)
    assert str(info.value).startswith(f"--adaptive_target_verify_cost_table={path}: ")


def test_complete_settings_of_a_depth_profile_load() -> None:
    depth_samples = tuple(CostSample(b, d, 0.004 * b * (1 + 0.1 * d)) for b in (1, 2)
                          for d in range(1, 6))
    profile = CostProfile(CONTEXT, fit("additive", depth_samples, over="depth"), depth_samples,
                          over="depth")
    points = [[b, d] for b in (1, 2) for d in range(1, 6)]
    depth = fitted_bundle(LAUNCH, {**SETTINGS, "points": points}, [profile], "calibrated")
    assert bundle_from_dict(json.loads(depth.to_json()), "saved") == depth
    points[-1] = [2, 6]  # deeper than the width
    with pytest.raises(ConfigError, match=r"settings\.points\[9\]=\[2, 6\]: expected"):
        bundle_from_dict({**json.loads(depth.to_json()),
                          "settings": {**SETTINGS, "points": points}}, "saved")


def test_a_profile_beyond_the_model_context_limit_is_refused() -> None:
    costs = bundle()
    costs.check_compatible(LAUNCH, "costs.json", context_limit=1024)
    with pytest.raises(ConfigError) as info:
        costs.check_compatible(LAUNCH, "costs.json", context_limit=512)
    assert str(info.value) == ("--adaptive_target_verify_cost_table=costs.json: profiles[0]."
                               "context.max_kv_length=1024: expected at most the model's "
                               "context limit 512")


ABSURD = r"bias=1e\+300: expected every price in 1e-06\.\.3600 s; Bcap=8 G=8 costs 1e\+300 s"


def test_every_reader_of_bundles_refuses_absurd_prices(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "costs.json"
    absurd = shaped_table((0.0, 0.0, 0.006, 0.006), bias=1e300)
    absurd.save(str(table))
    data = json.loads(table.read_text())
    with pytest.raises(ConfigError, match=rf"^--adaptive_target_verify_cost_table=.*{ABSURD}"):
        load_bundle(str(table), data)  # a launch, adaspec simulate
    with pytest.raises(ConfigError, match=rf"^cost_table\.profiles\[0\]\.table\.{ABSURD}"):
        recorded_costs(LogHeader(config={}, cost_table=data, models={}, context_limit=2,
                                 seed=0, lag=2, policies={}))  # replay, from a log's header
    with pytest.raises(ConfigError, match=rf"^profiles\[0\]\.table\.{ABSURD}"):
        bundle_from_dict(data, "rank 0's table")  # what every rank installs
    legacy, legacy_data = saved(tmp_path, data["profiles"][0]["table"], "legacy.json")
    with pytest.raises(ConfigError, match=rf"^--adaptive_target_verify_cost_table=.*: {ABSURD}"):
        load_bundle(legacy, legacy_data)
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(synthetic("high", rounds=10).as_lines()))
    assert cli.run(["simulate", "--workload", str(workload), "--cost_table", str(table),
                    "--policy", "adaptive-verify"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "bias=1e+300: expected every price in 1e-06..3600 s" in captured.err


def test_a_launch_refuses_a_saved_table_priced_at_infinity_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(bundle().to_json())
    data["profiles"][0]["table"]["bias"] = 1e308
    path, _ = saved(tmp_path, data)
    assert cli.run(["generate", "--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
                    "--max_seqs_per_batch=2", "--enable_adaptive_target_verify=true",
                    f"--adaptive_target_verify_cost_table={path}", "--prompt", "ROMEO.",
                    "--max_tokens=4", "--temperature=0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"adaspec generate: error: --adaptive_target_verify_cost_table="
                            f"{path}: profiles[0].table.bias=1e+308: expected every price in "
                            "1e-06..3600 s; Bcap=1 G=1 costs 1e+308 s\n")


def test_a_depth_price_moves_to_the_rows_the_round_verifies() -> None:
    costs = depth_bundle()
    # Bucket 4 at depth 3 was measured verifying 16 rows; at 12 rows it costs the 8 ms less
    # that the rows profile of the same interval says 12 rows save at full depth.
    assert costs.depth_cost_ms(4, 3, 100) == pytest.approx(24.0)
    assert costs.depth_cost_ms(4, 3, 100, num_rows=16) == pytest.approx(24.0)
    assert costs.depth_cost_ms(4, 3, 100, num_rows=12) == pytest.approx(16.0)
    assert costs.depth_cost_ms(4, 3, 3000, num_rows=12) == pytest.approx(52.0)
    assert costs.depth_cost_ms(4, 3, None, num_rows=12) == pytest.approx(16.0)  # first ones
    assert costs.depth_cost_ms(4, 3, 5000, num_rows=12) is None  # no interval covers it
    assert costs.legal_rows(4) == (4, 6, 8, 12, 16)
    assert costs.legal_rows(8) == () == shaped_table((0.0,) * 4).legal_rows(4)
    # A rows profile that takes more off than the whole depth costs contradicts the table.
    rows = next(p for p in costs.profiles if p.over == "rows")
    dear = dataclasses.replace(rows, table=dataclasses.replace(
        rows.table, theta=(0.0, 0.001, 0.002, 0.040)))
    contradicting = dataclasses.replace(costs, profiles=(costs.profiles[0], dear))
    assert contradicting.depth_cost_ms(4, 3, 100, num_rows=12) is None
    assert contradicting.depth_cost_ms(4, 2, 100, num_rows=12) == pytest.approx(14.0)


def test_a_run_priced_by_a_legacy_table_writes_a_log_that_replays(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The header records a legacy table in its own form, which reads back as the same
    table: before, it was written as a bundle of version null, which no reader takes."""
    path = tmp_path / "legacy.json"
    path.write_text(json.dumps({**fit_sps(SAMPLES).as_dict(), "draft_width": 5}),
                    encoding="utf-8")
    log = tmp_path / "run.jsonl"
    assert cli.run(["generate", "--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
                    "--enable_adaptive_target_verify=true", "--max_seqs_per_batch=2",
                    f"--adaptive_target_verify_cost_table={path}", "--prompt=ROMEO.",
                    "--max_tokens=8", "--temperature=0", f"--event_log={log}"]) == 0
    header = json.loads(log.read_text(encoding="utf-8").splitlines()[0])
    assert header["cost_table"]["draft_width"] == 5
    assert "version" not in header["cost_table"]
    capsys.readouterr()
    assert cli.run(["replay", str(log)]) == 0
    assert "decisions match the log" in capsys.readouterr().out


def test_a_table_priced_per_draft_depth_is_no_verify_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Adaptive verify would find no G priced in it and verify full width in silence."""
    path = tmp_path / "depth.json"
    depth_bundle().save(str(path))
    assert cli.run(["config", "--speculative_algorithm=MTP", "--num_speculative_tokens=5",
                    "--enable_adaptive_target_verify=true",
                    f"--adaptive_target_verify_cost_table={path}"]) == 2
    assert capsys.readouterr().err == (
        f"adaspec config: error: --adaptive_target_verify_cost_table={path}: is priced per "
        "draft depth (adaptive draft steps); expected a table priced over target rows G, as "
        "--adaptive_target_verify_cost_table_output saves one\n")


STEEP_LEGACY = {"bias": 0.005, "buckets": [1, 2], "alpha": [0.0, 0.001],
                "rows": [1, 2, 4, 6, 8, 12], "theta": [0.0, 0.001, 0.003, 0.005, 0.007, 0.011],
                "residual_rms": 0.1, "residual_max_relative": 3.1, "kind": "additive",
                "draft_width": 5}
"""A legacy table of Draft5 measured on request buckets 1 and 2 and every G they capture (the
geometry of --max_seqs_per_batch=2)."""
DRAFT5 = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
          "--enable_adaptive_target_verify=true"]
"""A launch of the default graph limit: request buckets 1, 2, 4, 8 and 16."""


def test_a_legacy_table_that_leaves_a_launch_bucket_unpriced_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, config and the start took it, and every round of more than two requests had
    no price: adaptive verify kept full width there, unsaid."""
    path, _ = saved(tmp_path, STEEP_LEGACY, "legacy.json")
    flag = f"--adaptive_target_verify_cost_table={path}"
    refusal = (f"{flag}: buckets=[1, 2]: expected values from the launch's request buckets "
               "[1, 2, 4, 8, 16], up to 16: a round at Bcap above 2 has no price and verifies "
               "full width\n")
    assert cli.run(["config", *DRAFT5, flag]) == 2
    assert capsys.readouterr().err == f"adaspec config: error: {refusal}"
    # The start checks it as config does (a launch that never ran config).
    assert cli.run(["generate", *DRAFT5, flag, "--prompt=ROMEO.", "--max_tokens=4",
                    "--temperature=0"]) == 2
    assert capsys.readouterr() == ("", f"adaspec generate: error: {refusal}")
    # The launch it was measured on takes it.
    assert cli.run(["config", *DRAFT5, "--max_seqs_per_batch=2", flag]) == 0


def test_a_legacy_table_priced_at_rows_no_launch_bucket_captures_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # G = 3 and 5 are no tier of buckets 1 and 2 of Draft5: another launch's geometry.
    path, data = saved(tmp_path, {**STEEP_LEGACY, "rows": [1, 2, 3, 4, 5, 6]}, "legacy.json")
    refusal = (f"--adaptive_target_verify_cost_table={path}: rows=[1, 2, 3, 4, 5, 6]: expected "
               "values from the launch's legal target rows (of every request bucket) "
               "[1, 2, 4, 6, 8, 12]; 3 is not one (it was measured on another geometry)")
    assert cli.run(["config", *DRAFT5, "--max_seqs_per_batch=2",
                    f"--adaptive_target_verify_cost_table={path}"]) == 2
    assert capsys.readouterr().err == f"adaspec config: error: {refusal}\n"
    with pytest.raises(ConfigError) as info:  # what the start runs on its own geometry
        load_bundle(path, data).check_compatible(LAUNCH, path)
    assert str(info.value) == refusal


def test_a_legacy_table_whose_rows_stop_below_full_width_is_refused(tmp_path: Path) -> None:
    # An sps table records rows alone; bucket 2's full width, 12 rows, would have no price.
    short = fit_sps([s for s in SAMPLES if s.num_rows <= 6]).as_dict()
    path, data = saved(tmp_path, {**short, "draft_width": 5}, "legacy.json")
    legacy = load_bundle(path, data)
    with pytest.raises(ConfigError, match=r"^--adaptive_target_verify_cost_table=.*: "
                       r"rows=\[1, 2, 4, 6\]: expected values from the launch's legal target "
                       r"rows \(of every request bucket\) \[1, 2, 4, 6, 8, 12\], up to 12: a "
                       r"round at G above 6 has no price and verifies full width$"):
        legacy.check_compatible(LAUNCH, path)


def test_a_legacy_table_that_prices_every_captured_shape_is_accepted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Covering is what the policy needs: each value a shape the launch captures and each
    axis reaching the launch's largest; a shape between two measured ones is priced at the
    next larger, so buckets and tiers may be left out below the largest."""
    sparse = {**STEEP_LEGACY, "buckets": [2], "alpha": [0.0], "rows": [2, 6, 12],
              "theta": [0.0, 0.004, 0.011]}
    path, data = saved(tmp_path, sparse, "legacy.json")
    legacy = load_bundle(path, data)
    legacy.check_compatible(LAUNCH, path)
    for b, rows in zip(LAUNCH.request_buckets, LAUNCH.target_rows, strict=True):
        for g in rows:
            assert legacy.cost_ms(b, g, 500) is not None
    assert cli.run(["config", *DRAFT5, "--max_seqs_per_batch=2",
                    f"--adaptive_target_verify_cost_table={path}"]) == 0
    assert capsys.readouterr().err == ""
