"""The documents stay true: their links resolve, the JSON examples of the configuration
formats are accepted by the real readers, and the module paths the specification page maps
each rule to exist and name what is there."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec.config import load_config
from adaspec.errors import ConfigError
from adaspec.policies.bundles import load_bundle

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_local_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: {target}"


def json_examples() -> list[dict[str, object]]:
    text = (DOCS / "config-formats.md").read_text()
    return [json.loads(block) for block in re.findall(r"```json\n(.+?)\n```", text, flags=re.S)]


def example(kind: str) -> dict[str, object]:
    """The calibration, draft-step or bundle example of docs/config-formats.md."""
    for data in json_examples():
        found = ("bundle" if "format" in data else "draft-step" if "policy" in data
                 else "calibration")
        if found == kind:
            return data
    raise AssertionError(f"no {kind} example")


def test_the_page_has_one_example_of_each_format() -> None:
    assert len(json_examples()) == 3
    for kind in ("calibration", "draft-step", "bundle"):
        example(kind)


DSPARK5 = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
           "enable_adaptive_target_verify": True}


def test_the_calibration_example_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "dspark-grid.json"
    path.write_text(json.dumps(example("calibration")))
    config = load_config({**DSPARK5, "adaptive_target_verify_calibration": str(path)})
    calibration = config.target_verify_calibration
    assert calibration is not None
    assert calibration.request_buckets == (1, 4)
    assert calibration.contexts[0].max_kv_length == 1024


def test_the_draft_step_example_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "draft-steps.json"
    path.write_text(json.dumps(example("draft-step")))
    config = load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 5,
                          "enable_adaptive_draft_step": True,
                          "adaptive_draft_step_config": str(path)})
    assert config.draft_step is not None
    assert config.draft_step.policy.switch_min_gain == 0.05
    assert config.draft_step.calibration.request_buckets == (1, 2, 4, 8, 16)


def test_the_draft_step_file_refuses_target_rows(tmp_path: Path) -> None:
    data = example("draft-step")
    data["calibration"] = {**data["calibration"], "target_graph_rows": [1]}  # type: ignore[dict-item]
    path = tmp_path / "draft-steps.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="target_graph_rows"):
        load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 5,
                     "enable_adaptive_draft_step": True,
                     "adaptive_draft_step_config": str(path)})


def test_the_bundle_example_loads_and_prices() -> None:
    bundle = load_bundle("bundle.json", example("bundle"))
    assert bundle.cost_ms(1, 4, 100) == pytest.approx(7.4)
    assert bundle.cost_ms(2, 3, 100) == pytest.approx(9.3)  # the next measured G: 4
    assert bundle.cost_ms(2, 12, 2000) is None  # beyond the profile's KV interval


def with_this_checkout() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_the_bundle_example_serves_its_launch(tmp_path: Path) -> None:
    # The identities and captured geometry are those of the shipped small family: a launch
    # reuses the example as it is.
    (tmp_path / "bundle.json").write_text(json.dumps(example("bundle")))
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "generate", "--speculative_algorithm=DSpark",
         "--num_speculative_tokens=5", "--enable_adaptive_target_verify=true",
         "--max_seqs_per_batch=2", "--adaptive_target_verify_cost_table=bundle.json",
         "--prompt", "ROMEO.", "--max_tokens", "16", "--temperature", "0"],
        cwd=tmp_path, env=with_this_checkout(), capture_output=True, text=True, timeout=300,
        check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ROMEO." in done.stdout


def test_config_refuses_the_bundle_example_for_another_width(tmp_path: Path) -> None:
    # The fields a launch fixes by itself are compared by `adaspec config`, as the page says.
    (tmp_path / "bundle.json").write_text(json.dumps(example("bundle")))
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "config", "--speculative_algorithm=DSpark",
         "--num_speculative_tokens=7", "--enable_adaptive_target_verify=true",
         "--max_seqs_per_batch=2", "--adaptive_target_verify_cost_table=bundle.json"],
        cwd=tmp_path, env=with_this_checkout(), capture_output=True, text=True, timeout=300,
        check=False)
    assert done.returncode == 2
    assert "draft_width" in done.stderr


MAPPED = re.compile(r"`(\w+)(?:\.\w+)?` in `(adaspec/[\w/]+\.py)`")


def test_the_specification_maps_to_what_exists() -> None:
    text = (DOCS / "specification.md").read_text()
    for path in set(re.findall(r"`(adaspec/[\w/.]*)`", text)):
        assert (ROOT / path).exists(), path
    for name, path in MAPPED.findall(text):
        assert re.search(rf"\b{name}\b", (ROOT / path).read_text()), f"{name} in {path}"


def test_the_glossary_defines_the_words_the_readme_uses() -> None:
    glossary = (DOCS / "glossary.md").read_text()
    for term in ("B", "Bcap", "G", "tiers", "width", "depth", "AL", "lag n-2", "round",
                 "pipeline slot", "KV slot", "plain loop", "verdict", "bundle"):
        assert f"**{term}**" in glossary, term
