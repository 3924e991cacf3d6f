"""Saved cost tables: a bundle reloads bit for bit, every incompatible launch is refused with
the field, the saved value and the launch value named, legacy tables read as Draft7, and a
damaged file is refused with its key path."""

import dataclasses
import json
from pathlib import Path

import pytest

from adaspec.config.calibration import ContextInterval
from adaspec.errors import ConfigError, IncompatibleCostTable
from adaspec.policies.bundles import (
    COMPATIBILITY_FIELDS,
    Compatibility,
    CostBundle,
    CostProfile,
    fitted_bundle,
    load_bundle,
)
from adaspec.policies.costs import CostSample, fit_additive, fit_sps

LAUNCH = Compatibility(
    algorithm="DSpark", draft_width=5, dp_size=1, tp_size=1, unified=False, device="cpu",
    target="target-id", draft="dspark-id", request_buckets=(1, 2),
    target_rows=((1, 2, 4, 6), (2, 4, 6, 8, 12)))
SAMPLES = tuple(CostSample(b, g, 0.004 + 0.001 * b + 0.0001 * g + 0.0001 * k)
                for b, rows in ((1, (1, 2, 4, 6)), (2, (2, 4, 6, 8, 12)))
                for g in rows for k in range(3))
CONTEXT = ContextInterval(prefill_tokens=772, min_kv_length=1, max_kv_length=1024)


def bundle(compatibility: Compatibility = LAUNCH) -> CostBundle:
    profile = CostProfile(CONTEXT, fit_additive(SAMPLES), SAMPLES)
    return fitted_bundle(compatibility, {"model": "additive", "warmup_steps": 8}, [profile],
                         "calibrated at startup from built-in defaults")


def saved(tmp_path: Path, data: object, name: str = "table.json") -> tuple[str, dict]:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path), json.loads(path.read_text())


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
    (lambda d: d.update(version=2), "version=2: expected 1"),
    (lambda d: d["compatibility"].pop("device"), r"compatibility\.device=missing"),
    (lambda d: d["compatibility"].update(unified="no"),
     r"compatibility\.unified=no: expected true or false"),
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
])
def test_a_damaged_bundle_is_refused_naming_the_key(tmp_path: Path, change: object,
                                                     message: str) -> None:
    data = json.loads(bundle().to_json())
    change(data)  # type: ignore[operator]
    path, data = saved(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as info:
        load_bundle(path, data)
    assert str(info.value).startswith(f"--adaptive_target_verify_cost_table={path}: ")
