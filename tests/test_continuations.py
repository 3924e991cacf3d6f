"""The target's own greedy continuations used to train the drafters, and the training
script's reuse of a saved target."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from adaspec.bench.plain import plain_loop
from adaspec.models import load_reference_models
from adaspec.models.checkpoint import MODEL_CARD, load_target, save_module, shipped_folder
from adaspec.models.continuations import greedy_continuations
from adaspec.models.families import FAMILIES
from adaspec.models.quality import excerpts
from adaspec.models.report import format_report, models_report
from adaspec.models.target import ReferenceTarget
from adaspec.models.train import (
    TARGET_FIELDS,
    TrainSettings,
    replay_target_draws,
    reused_target,
    round_as_stored,
    target_batches,
    train_target,
)
from adaspec.models.train import main as train_main

TEXT = (b"ROMEO.\nBut soft, what light through yonder window breaks?\n"
        b"It is the east, and Juliet is the sun.\n") * 8


@pytest.fixture(scope="module")
def target() -> ReferenceTarget:
    return load_reference_models().target


def test_continuations_are_the_targets_greedy_decode(target: ReferenceTarget) -> None:
    prompts = excerpts(TEXT, 5, 8, 40, np.random.default_rng(0))
    found = greedy_continuations(target, prompts, 12)
    target.allocate(5)
    plain = plain_loop(target, [p.tolist() for p in prompts], 12, 5)
    assert found.prompt_lengths == [len(p) for p in prompts]
    for prompt, sequence, output in zip(prompts, found.sequences, plain.outputs, strict=True):
        assert sequence[:len(prompt)].tolist() == prompt.tolist()
        assert sequence[len(prompt):].tolist() == list(output)


def test_continuations_refuse_what_does_not_fit(target: ReferenceTarget) -> None:
    prompt = torch.zeros(target.context_limit - 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="exceed the target's context of 1024"):
        greedy_continuations(target, [prompt], 4)


def test_windows_and_contexts_stay_inside_the_sequences(target: ReferenceTarget) -> None:
    prompts = excerpts(TEXT, 3, 8, 16, np.random.default_rng(1))
    found = greedy_continuations(target, prompts, 30)
    window = next(found.windows(6, 20, torch.Generator().manual_seed(0)))
    assert window.shape == (6, 20)
    texts = [s.tolist() for s in found.sequences]
    for row in window.tolist():  # every window is a slice of one sequence
        assert any(row == s[i:i + 20] for s in texts for i in range(len(s) - 19))
    rng = np.random.default_rng(2)
    for context in found.contexts(40, 7, rng):
        owners = [i for i, s in enumerate(texts) if s[:len(context)] == context.tolist()]
        # It ends past the prompt, with the anchor and a block of 7 left in the sequence.
        assert any(found.prompt_lengths[i] < len(context) <= len(texts[i]) - 8 for i in owners)


def test_windows_and_contexts_that_cannot_fit_are_refused(target: ReferenceTarget) -> None:
    found = greedy_continuations(target, excerpts(TEXT, 2, 8, 8, np.random.default_rng(3)), 8)
    with pytest.raises(ValueError, match="16 tokens is shorter than a training window of 17"):
        next(found.windows(2, 17, torch.Generator()))
    with pytest.raises(ValueError, match="continuation of 8 tokens leaves no context"):
        found.contexts(1, 7, np.random.default_rng(0))
    with pytest.raises(ValueError, match="expected at least one prompt and one token"):
        greedy_continuations(target, [], 8)


def test_replayed_target_draws_leave_the_generator_where_training_does() -> None:
    settings = TrainSettings(target_steps=9, target_batch=3, target_seq_len=50)
    data = torch.arange(5000)
    trained, replayed = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    batches = target_batches(data, settings, trained)
    for _ in range(settings.target_steps):
        assert next(batches).shape == (3, 51)
    replay_target_draws(data, settings, replayed)
    assert torch.equal(torch.randint(0, 10**6, (8,), generator=trained),
                       torch.randint(0, 10**6, (8,), generator=replayed))


def test_reuse_target_takes_the_saved_weights_and_refuses_other_settings(
        tmp_path: Path) -> None:
    shutil.copy(shipped_folder() / "target.safetensors", tmp_path)
    with pytest.raises(FileNotFoundError, match="model_card.json"):
        reused_target(tmp_path, TrainSettings())  # no card: nothing says how it was trained
    card = json.loads((shipped_folder() / MODEL_CARD).read_text())
    (tmp_path / MODEL_CARD).write_text(json.dumps(card))
    reused, seconds = reused_target(tmp_path, TrainSettings())
    assert seconds == card["training"]["seconds"]["target"]
    for key, value in load_target(tmp_path).state_dict().items():
        assert torch.equal(reused.state_dict()[key], value)
    expected = FAMILIES["large"].target.as_dict()
    with pytest.raises(ValueError, match=re.escape(f"expected the large family's {expected}")):
        reused_target(tmp_path, TrainSettings(family="large"))
    with pytest.raises(ValueError, match="trained with seed=0, this run has 1"):
        reused_target(tmp_path, TrainSettings(seed=1))
    card["models"]["target"]["identity"] = "0" * 32
    (tmp_path / MODEL_CARD).write_text(json.dumps(card))
    with pytest.raises(ValueError, match="describes target 0000"):
        reused_target(tmp_path, TrainSettings())


@pytest.mark.parametrize("windows", [0, 16, 17])
def test_continuation_windows_leave_room_for_corpus_windows(windows: int) -> None:
    with pytest.raises(ValueError, match=rf"continuation_windows={windows}: expected 1..15"):
        TrainSettings(continuation_windows=windows)


def test_models_table_shows_acceptance_inside_continuations() -> None:
    report = models_report()
    text = format_report(report)
    dspark = report["quality"]["dspark"]["own_continuations"]  # type: ignore[index]
    assert "inside the target's own greedy continuations" in text
    assert f"AL {dspark['temperature_0']['acceptance_length']:.3f}" in text


def test_a_reused_target_leaves_every_generator_where_training_it_does(
        tmp_path: Path) -> None:
    settings = TrainSettings(target_steps=2, target_batch=2, target_seq_len=16)
    data = torch.arange(4000) % 256

    torch.manual_seed(settings.seed)
    trained_generator = torch.Generator().manual_seed(settings.seed)
    trained = train_target(data, settings, trained_generator)
    round_as_stored(trained)
    after_training = torch.get_rng_state()
    save_module(trained, trained.config.as_dict(), tmp_path / "target.safetensors")
    fields = {name: getattr(settings, name) for name in TARGET_FIELDS}
    card = {"training": {**fields, "seconds": {"target": 3}},
            "models": {"target": {"identity": load_target(tmp_path).identity}}}
    (tmp_path / MODEL_CARD).write_text(json.dumps(card))

    torch.manual_seed(settings.seed)
    reused_generator = torch.Generator().manual_seed(settings.seed)
    reused, seconds = reused_target(tmp_path, settings)
    replay_target_draws(data, settings, reused_generator)
    assert seconds == 3
    assert torch.equal(torch.get_rng_state(), after_training)  # drafter initialisation
    assert torch.equal(reused_generator.get_state(), trained_generator.get_state())
    for key, value in trained.state_dict().items():  # the rounded weights, as stored
        assert torch.equal(reused.state_dict()[key], value)


@pytest.mark.parametrize(("settings", "message"), [
    ({"seed": -1}, "seed=-1: expected a non-negative integer"),
    ({"continuation_prompts": 3}, "continuation_prompts=3: expected at least 4"),
    ({"continuation_tokens": 100}, "continuation_tokens=100: expected 248..768"),
    ({"continuation_tokens": 769}, "continuation_tokens=769: expected 248..768"),
    ({"confidence_contexts": 1}, "confidence_contexts=1: expected at least 2"),
])
def test_settings_a_run_would_trip_over_late_are_refused_at_once(
        settings: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainSettings(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("card", ["{not json", "[]", "{}", '{"training": [], "models": {}}',
                                  '{"training": {"seconds": 3}, "models": {"target": {}}}'])
def test_a_card_that_does_not_say_how_the_target_trained_is_refused(
        tmp_path: Path, card: str) -> None:
    shutil.copy(shipped_folder() / "target.safetensors", tmp_path)
    (tmp_path / MODEL_CARD).write_text(card)
    with pytest.raises(ValueError, match="does not say how its target was trained"):
        reused_target(tmp_path, TrainSettings())


def test_the_training_command_refuses_a_folder_without_a_target_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        train_main(["--reuse_target", "--output", str(tmp_path)])
    assert raised.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"no target checkpoint {tmp_path / 'target.safetensors'}")


def test_the_models_report_refuses_a_card_of_other_drafters() -> None:
    card = json.loads((shipped_folder() / MODEL_CARD).read_text())
    card["models"]["dspark"]["identity"] = "f" * 32
    with pytest.raises(ValueError, match="describes dspark ffff"):
        models_report(load_reference_models(), card)


def test_a_card_with_a_target_time_that_is_not_finite_is_refused(tmp_path: Path) -> None:
    shutil.copy(shipped_folder() / "target.safetensors", tmp_path)
    card = json.loads((shipped_folder() / MODEL_CARD).read_text())
    card["training"]["seconds"]["target"] = "inf"
    (tmp_path / MODEL_CARD).write_text(json.dumps(card))
    with pytest.raises(ValueError, match="does not say how its target was trained"):
        reused_target(tmp_path, TrainSettings())


def test_the_training_command_refuses_a_damaged_target_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = (shipped_folder() / "target.safetensors").read_bytes()
    (tmp_path / "target.safetensors").write_bytes(data[:len(data) // 2])
    shutil.copy(shipped_folder() / MODEL_CARD, tmp_path)
    with pytest.raises(SystemExit) as raised:
        train_main(["--reuse_target", "--output", str(tmp_path)])
    assert raised.value.code == 2
    assert "not a readable safetensors checkpoint" in capsys.readouterr().err
