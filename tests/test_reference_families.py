"""The built-in reference families: each ships, loads as its launch name says, and is refused
in one line when named wrongly."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaspec.config import load_config
from adaspec.config.limits import BUILTIN_TARGETS
from adaspec.errors import ConfigError
from adaspec.models.checkpoint import load_model_card, load_reference_models, shipped_folder
from adaspec.models.families import FAMILIES, family
from adaspec.runtime.engine import Runtime, builtin_models


def test_every_builtin_target_names_a_family() -> None:
    assert set(BUILTIN_TARGETS.values()) == set(FAMILIES)


def test_an_unknown_family_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="reference family 'huge': expected one of small, large"):
        family("huge")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_ships_the_configs_it_declares(name: str) -> None:
    chosen = FAMILIES[name]
    models = load_reference_models(name=name)
    assert models.target.config == chosen.target
    assert models.mtp.config == chosen.mtp
    assert models.dspark.config.as_dict() == {**chosen.dspark.as_dict(), "max_width": 7}
    card = load_model_card(shipped_folder(name))
    assert card["training"]["family"] == name  # type: ignore[index]
    assert card["models"]["target"]["identity"] == models.target.identity  # type: ignore[index]


def test_the_large_family_is_wider_than_the_small_one() -> None:
    # What makes its rows cost against a forward's fixed cost: each layer's products are
    # four times as large (twice the multiply-adds per row in all, with half the layers).
    small, large = FAMILIES["small"].target, FAMILIES["large"].target
    assert large.hidden_size == 2 * small.hidden_size
    assert large.vocab_size == small.vocab_size
    assert large.context_limit == small.context_limit


def test_the_runtime_loads_the_family_of_its_builtin_target() -> None:
    launch = load_config({"model": "builtin:target-large"}).launch
    models = builtin_models(launch, torch.device("cpu"))
    assert models.target.config == FAMILIES["large"].target
    # The drafts are the ones trained beside that target.
    assert models.mtp.head.target is models.target
    assert models.dspark.head.target is models.target
    card = load_model_card(shipped_folder("large"))
    for name in ("target", "mtp", "dspark"):
        assert getattr(models, name).identity == card["models"][name]["identity"]  # type: ignore[index]


@pytest.mark.parametrize(("settings", "flag"), [
    ({"model": "/models/llama.safetensors"}, "--model=/models/llama.safetensors: expected "),
    ({"draft_model": "/models/draft.safetensors", "speculative_algorithm": "MTP",
      "num_speculative_tokens": 2}, "--draft_model=/models/draft.safetensors: expected "),
])
def test_a_checkpoint_path_without_models_is_refused_before_loading(
        settings: dict[str, object], flag: str) -> None:
    # Loading the built-in models in its place would be a silent substitution.
    runtime = Runtime(load_config(settings))
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    assert str(raised.value).startswith(flag)
    assert "Runtime(models=...)" in str(raised.value)
    assert "\n" not in str(raised.value)


def models_command(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaspec", "models", *argv],
                          capture_output=True, text=True, check=False, timeout=300)


def test_models_command_describes_the_large_family() -> None:
    done = models_command("--model", "builtin:target-large", "--json")
    assert (done.returncode, done.stderr) == (0, "")
    report = json.loads(done.stdout)
    assert report["model"] == "builtin:target-large"
    assert report["models"]["target"]["config"]["hidden_size"] == 256
    card = load_model_card(shipped_folder("large"))
    assert report["quality"] == card["quality"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--model=builtin:gpt"], "--model=builtin:gpt: expected one of builtin:target, "
                              "builtin:target-large: adaspec models describes the built-in "
                              "reference models"),
    (["--model"], "--model: expected a value (--model BUILTIN, or --model=BUILTIN for a value "
                  "that starts with --)"),
    (["--model=builtin:target-large", "--model", "builtin:target"],
     "--model=builtin:target: given twice (first as builtin:target-large); give each flag "
     "once"),
    (["--json", "--json"], "--json: given twice; give each flag once"),
])
def test_models_command_refuses_a_bad_model_in_one_line(argv: list[str], message: str) -> None:
    done = models_command(*argv)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"adaspec models: error: {message}\n"


def test_models_report_pairs_models_with_their_own_card_only() -> None:
    from adaspec.models.report import models_report

    large = load_reference_models(name="large")
    assert models_report(large)["quality"] == load_model_card(shipped_folder("large"))["quality"]
    with pytest.raises(ValueError, match="describes target .*: pass the card written with these"):
        models_report(large, load_model_card())


@pytest.mark.parametrize("command", ["bench", "generate", "calibrate"])
def test_commands_refuse_a_draft_checkpoint_before_running(command: str,
                                                          tmp_path: Path) -> None:
    # Refused before any arm, model or calibration runs (nothing is written, nothing loads).
    launch = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
              "--draft_model=/models/draft.safetensors"]
    done = subprocess.run([sys.executable, "-m", "adaspec", command, *launch,
                           *COMMAND_ARGS[command],
                           *([f"--adaptive_target_verify_cost_table_output={tmp_path}/t.json"]
                             if command == "calibrate" else [])],
                          capture_output=True, text=True, check=False, timeout=300)
    assert (done.returncode, done.stdout) == (2, "")
    assert not (tmp_path / "t.json").exists()
    assert done.stderr == (f"adaspec {command}: error: --draft_model=/models/draft.safetensors: "
                           "a drafter checkpoint drafts for a target checkpoint; expected "
                           "--model=DIR with it, or a builtin: drafter\n")


COMMAND_ARGS = {"bench": [],
                "generate": ["--prompt", "A", "--temperature", "0", "--max_tokens", "4"],
                "calibrate": ["--enable_adaptive_target_verify=true"]}
