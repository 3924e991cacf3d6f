"""A launch that asks its models for more than they can draft is refused before anything loads:
by the library check the runtime calls, by `adaspec config` and by every command."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from adaspec import cli
from adaspec.config import load_config
from adaspec.config.builtin import (
    BUILTIN_DSPARK_MAX_WIDTH,
    BUILTIN_FOLDERS,
    builtin_checkpoints,
    check_builtin_limits,
)
from adaspec.config.limits import BUILTIN_TARGETS
from adaspec.errors import ConfigError
from adaspec.models import load_reference_models
from adaspec.models.families import FAMILIES
from adaspec.models.limits import check_model_limits
from adaspec.runtime.plans import check_calibration

DSPARK_8 = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=8"]


def too_wide(width: int, model: str = "builtin:target") -> str:
    return (f"--num_speculative_tokens={width}: expected 1..7: the built-in DSpark drafter of "
            f"--model={model} drafts at most 7 tokens per block")


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model load in the process fails the test: a refusal must come before it."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("models were loaded before the launch was refused")
    monkeypatch.setattr("adaspec.models.checkpoint.load_models", refuse)


@pytest.mark.parametrize("family", sorted(BUILTIN_DSPARK_MAX_WIDTH))
def test_the_builtin_limits_are_those_of_the_shipped_drafters(family: str) -> None:
    assert set(BUILTIN_DSPARK_MAX_WIDTH) == set(BUILTIN_TARGETS.values())
    models = load_reference_models(name=family)
    assert BUILTIN_DSPARK_MAX_WIDTH[family] == models.dspark.max_width
    assert BUILTIN_FOLDERS[family] == FAMILIES[family].folder
    model = next(name for name, value in BUILTIN_TARGETS.items() if value == family)
    for algorithm, drafter in (("MTP", models.mtp), ("DSpark", models.dspark)):
        launch = load_config({"model": model, "speculative_algorithm": algorithm,
                              "num_speculative_tokens": 3}).launch
        assert builtin_checkpoints(launch) == ({"target": models.target.identity,
                                                "draft": drafter.identity},
                                               models.target.context_limit)


@pytest.mark.parametrize("model", sorted(BUILTIN_TARGETS))
@pytest.mark.parametrize("width", [8, 16])
def test_dspark_wider_than_the_builtin_drafter_is_refused(model: str, width: int) -> None:
    launch = load_config({"model": model, "speculative_algorithm": "DSpark",
                          "num_speculative_tokens": width}).launch
    with pytest.raises(ConfigError) as raised:
        check_builtin_limits(launch)
    assert str(raised.value) == too_wide(width, model)
    # The runtime's check, for the built-in models (None: checked without loading them).
    with pytest.raises(ConfigError, match="drafts at most 7 tokens per block"):
        check_model_limits(launch, None)


@pytest.mark.parametrize("settings", [
    {"speculative_algorithm": "DSpark", "num_speculative_tokens": 7},
    {"speculative_algorithm": "MTP", "num_speculative_tokens": 16},
    {"model": "/models/t", "draft_model": "/models/d", "speculative_algorithm": "DSpark",
     "num_speculative_tokens": 16},
])
def test_what_the_models_can_draft_passes(settings: dict[str, object]) -> None:
    launch = load_config(settings).launch
    check_builtin_limits(launch)
    check_model_limits(launch, None)


def test_the_runtime_check_reads_the_drafter_it_is_given() -> None:
    launch = load_config({"speculative_algorithm": "DSpark",
                          "num_speculative_tokens": 8}).launch
    models = load_reference_models()
    with pytest.raises(ConfigError) as raised:
        check_model_limits(launch, models)
    assert str(raised.value) == (
        f"--num_speculative_tokens=8: expected 1..7: the DSpark drafter passed to the runtime "
        f"(identity {models.dspark.identity}) drafts at most 7 tokens per block")
    # An engine's own drafter is held to its own limit, whatever --model says.
    wide = SimpleNamespace(target=models.target, mtp=None,
                           dspark=SimpleNamespace(max_width=16, identity="own", draft=print))
    check_model_limits(launch, wide)


@pytest.mark.parametrize(("width", "model"), [
    (8, "builtin:target"), (16, "builtin:target"), (8, "builtin:target-large")])
def test_config_refuses_what_the_builtin_models_cannot_draft(width: int, model: str) -> None:
    done = subprocess.run([sys.executable, "-m", "adaspec", "config", f"--model={model}",
                           "--speculative_algorithm=DSpark", f"--num_speculative_tokens={width}"],
                          capture_output=True, text=True, check=False, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"adaspec config: error: {too_wide(width, model)}\n"


@pytest.mark.parametrize(("flags", "tp_size"), [
    (["--nnodes=3"], 3), (["--nnodes=65536", "--node_rank=65535"], 65536),
    (["--nnodes=8", "--tp_size=8", "--dp_size=1"], 8),
])
def test_config_refuses_a_tp_size_the_builtin_models_cannot_split(
        flags: list[str], tp_size: int) -> None:
    """Every rank would refuse it after the rendezvous and the model load: config, and
    every command, refuse it from the model card."""
    done = subprocess.run([sys.executable, "-m", "adaspec", "config", *flags],
                          capture_output=True, text=True, check=False, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"adaspec config: error: --tp_size={tp_size}: expected a divisor "
                           "of the model's attention heads (4): each TP rank keeps an equal "
                           "share\n")
    check_builtin_limits(load_config({"nnodes": 4}).launch)  # 4 splits them


CONTEXTS_PAST_1024 = {"request_buckets": [1, 2], "contexts": [
    {"prefill_tokens": 512, "min_kv_length": 1, "max_kv_length": 2000}]}
VERIFY_SETTINGS = {"speculative_algorithm": "DSpark", "num_speculative_tokens": 5,
                   "enable_adaptive_target_verify": True, "max_seqs_per_batch": 2}
VERIFY_CALIBRATION = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
                      "--enable_adaptive_target_verify=true",
                      "--adaptive_target_verify_calibration=c.json"]


@pytest.mark.parametrize(("flags", "settings", "words"), [
    (VERIFY_CALIBRATION, CONTEXTS_PAST_1024, "--adaptive_target_verify_calibration=c.json: "
     "contexts[0].max_kv_length=2000: expected at most the model's context limit 1024"),
    (VERIFY_CALIBRATION, {"request_buckets": [1, 2], "contexts": [
        {"prefill_tokens": 1020, "min_kv_length": 1, "max_kv_length": 1024}]},
     "contexts[0].prefill_tokens=1020: expected at most 772: measuring a point adds up to "
     "252 tokens, which must stay within max_kv_length=1024"),
    (VERIFY_CALIBRATION, {"request_buckets": [1, 2], "warmup_steps": 1000000,
                          "window_steps": 1000000},
     "contexts=built-in default: a context limit of 1024 tokens cannot hold 12000012 tokens"),
    (["--speculative_algorithm=MTP", "--num_speculative_tokens=3",
      "--enable_adaptive_draft_step=true", "--adaptive_draft_step_config=c.json"],
     {"version": 1, "calibration": CONTEXTS_PAST_1024},
     "--adaptive_draft_step_config=c.json: calibration.contexts[0].max_kv_length=2000: "
     "expected at most the model's context limit 1024"),
])
def test_config_refuses_calibration_contexts_the_builtin_target_cannot_hold(
        tmp_path: Path, flags: list[str], settings: dict[str, Any], words: str) -> None:
    """Before, config passed them and the start refused them once the models had loaded."""
    (tmp_path / "c.json").write_text(json.dumps(settings))
    done = subprocess.run([sys.executable, "-m", "adaspec", "config", *flags,
                           "--max_seqs_per_batch=2"], capture_output=True, text=True,
                          check=False, timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (2, "", 1), done.stderr
    assert words in done.stderr


@pytest.mark.parametrize(("settings", "flags"), [
    (CONTEXTS_PAST_1024, ["--max_seqs_per_batch=2"]),
    # Buckets 1 and 16 share no legal tier: the additive fit cannot join them (round 33).
    ({"request_buckets": [1, 16]}, ["--max_seqs_per_batch=16"]),
])
def test_config_and_the_start_refuse_a_calibration_in_the_same_words(
        tmp_path: Path, settings: dict[str, Any], flags: list[str]) -> None:
    (tmp_path / "c.json").write_text(json.dumps(settings))
    lines = [subprocess.run([sys.executable, "-m", "adaspec", *command, *VERIFY_CALIBRATION,
                             *flags], capture_output=True, text=True, check=False,
                            timeout=120, cwd=tmp_path).stderr.partition("error: ")[2]
             for command in (["config"], ["calibrate",
                                          "--adaptive_target_verify_cost_table_output=t.json"])]
    assert lines[0] == lines[1] != ""
    assert "given twice" not in lines[0]


def test_a_calibration_is_checked_without_the_models_context_where_it_is_not_known(
        tmp_path: Path) -> None:
    """A checkpoint's context limit is known once it loads: ``config`` checks the grid."""
    def launch(settings: dict[str, Any], **flags: object) -> Any:
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(settings))
        return load_config({**VERIFY_SETTINGS, **flags,
                            "adaptive_target_verify_calibration": str(path)})

    past = launch(CONTEXTS_PAST_1024)
    check_calibration(past, None)
    with pytest.raises(ConfigError, match=r"max_kv_length=2000: expected at most the model's "):
        check_calibration(past, 1024)
    apart = launch({"request_buckets": [1, 16]}, max_seqs_per_batch=16)
    with pytest.raises(ConfigError, match=r"json: request_buckets=\[1, 16\]: the additive "
                                          r"grid of their legal tiers"):
        check_calibration(apart, None)


GENERATE = ["--prompt", "ROMEO.", "--max_tokens=4", "--temperature=0"]


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize(("argv", "message"), [
    (["generate", *DSPARK_8, *GENERATE], too_wide(8)),
    (["bench", *DSPARK_8], too_wide(8)),
    (["bench", "--speculative_algorithm=DSpark", "--num_speculative_tokens=16"], too_wide(16)),
    (["bench", *DSPARK_8, "--enable_adaptive_target_verify=true"], too_wide(8)),
    (["bench", *DSPARK_8, "--arms=none,fixed:8"], too_wide(8)),
    (["generate", "--nnodes=3", "--node_rank=1", "--master_node_addr=127.0.0.1:1", *GENERATE],
     "--tp_size=3: expected a divisor of the model's attention heads (4)"),
    # The adaptive arm a launch turns on is refused with its reason, never skipped.
    (["bench", "--speculative_algorithm=DSpark", "--num_speculative_tokens=6",
      "--enable_adaptive_target_verify=true"],
     "--enable_adaptive_target_verify=true: asks for the adaptive-verify arm, which this "
     "launch cannot run (--num_speculative_tokens=6: --enable_adaptive_target_verify=true "
     "needs --num_speculative_tokens=5 or 7)"),
    (["bench", "--enable_adaptive_draft_step=true"],
     "--enable_adaptive_draft_step=true: asks for the adaptive-depth arm"),
    # Adaptive target verify takes widths 5 and 7 only, so calibrate never reaches the limit.
    (["calibrate", *DSPARK_8, "--enable_adaptive_target_verify=true",
      "--adaptive_target_verify_cost_table_output=/nonexistent/t.json"],
     "--num_speculative_tokens=8: --enable_adaptive_target_verify=true needs "
     "--num_speculative_tokens=5 or 7"),
])
def test_commands_refuse_a_width_beyond_the_drafter_before_loading_models(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"adaspec {argv[0]}: error: {message}")
    assert captured.err.count("\n") == 1


CHECKPOINT_PAIRINGS = [
    (["--draft_model=/models/d", "--speculative_algorithm=MTP", "--num_speculative_tokens=3"],
     "--draft_model=/models/d: a drafter checkpoint drafts for a target checkpoint; expected "
     "--model=DIR with it, or a builtin: drafter"),
    (["--model=/models/t", "--draft_model=/models/d", "--speculative_algorithm=DSpark",
      "--num_speculative_tokens=3"],
     "--speculative_algorithm=DSpark: a Hugging Face checkpoint drafts MTP-style"),
    (["--model=/models/t", "--draft_model=/models/d", "--speculative_algorithm=MTP",
      "--num_speculative_tokens=3", "--tp_size=2", "--nnodes=2"],
     "--tp_size=2: a Hugging Face checkpoint runs whole on each rank"),
]


@pytest.mark.usefixtures("no_model_loads")
@pytest.mark.parametrize("command", [["config"], ["generate", *GENERATE], ["bench"]])
@pytest.mark.parametrize(("flags", "message"), CHECKPOINT_PAIRINGS)
def test_config_refuses_a_checkpoint_launch_every_command_refuses(
        command: list[str], flags: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Checked from the flags alone, so `config` never passes a line the commands refuse."""
    assert cli.run([command[0], *flags, *command[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"adaspec {command[0]}: error: {message}")
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize("models", ["builtin", "passed"])
def test_runtime_start_refuses_a_width_beyond_the_drafter_before_any_device_work(
        models: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from adaspec.runtime import engine

    def no_stream(*args: object) -> None:
        raise AssertionError("a stream was opened before the width was checked")

    monkeypatch.setattr(engine, "open_stream", no_stream)
    given = load_reference_models() if models == "passed" else None
    runtime = engine.Runtime(load_config({"speculative_algorithm": "DSpark",
                                          "num_speculative_tokens": 9}), models=given)
    with pytest.raises(ConfigError, match=r"^--num_speculative_tokens=9: expected 1\.\.7"):
        asyncio.run(runtime.start())


class NoVerify:
    """A target an engine forgot to finish: everything but ``verify``."""

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str) -> object:
        if name == "verify":
            raise AttributeError(name)
        return getattr(self._target, name)


@pytest.mark.parametrize(("algorithm", "width", "make", "message"), [
    ("none", 0, lambda m: SimpleNamespace(target=NoVerify(m.target), mtp=None, dspark=None),
     r"^Runtime\(models=\.\.\.\)\.target=NoVerify: expected a TargetModel: it has no verify$"),
    ("DSpark", 3, lambda m: SimpleNamespace(target=m.target, mtp=m.mtp, dspark=None),
     r"^Runtime\(models=\.\.\.\)=SimpleNamespace: expected a model set with dspark \(a "
     r"DSparkDrafter\) for --speculative_algorithm=DSpark$"),
    ("MTP", 2, lambda m: SimpleNamespace(target=m.target, mtp=SimpleNamespace(
        identity="x", allocate=print, publish=print), dspark=None),
     r"^Runtime\(models=\.\.\.\)\.mtp=SimpleNamespace: expected a MtpDrafter: it has no step$"),
    # A drafter written to the protocol before drafts took positions and slots: it used to
    # pass the start and fail every request at its first round.
    ("DSpark", 3, lambda m: SimpleNamespace(target=m.target, mtp=None, dspark=SimpleNamespace(
        identity="old", max_width=7,
        draft=lambda hidden, token_ids, width: m.dspark.draft(hidden, token_ids, None, None,
                                                              width))),
     r"^Runtime\(models=\.\.\.\)\.dspark=SimpleNamespace: expected a DSparkDrafter: it has "
     r"a draft that cannot be called as draft\(hidden, token_ids, positions, kv_slots, width\)$"),
    ("DSpark", 3, lambda m: SimpleNamespace(target=m.target, mtp=None, dspark=SimpleNamespace(
        identity="half", max_width=7, draft=m.dspark.draft, publish=print)),
     r"^Runtime\(models=\.\.\.\)\.dspark=SimpleNamespace: expected a DrafterContext, as it "
     r"has publish: it has no allocate$"),
])
def test_runtime_start_names_what_a_model_set_lacks_before_any_device_work(
        algorithm: str, width: int, make: Any, message: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from adaspec.runtime import engine

    def no_stream(*args: object) -> None:
        raise AssertionError("a stream was opened before the models were checked")

    monkeypatch.setattr(engine, "open_stream", no_stream)
    launch = {"speculative_algorithm": algorithm, "num_speculative_tokens": width}
    runtime = engine.Runtime(load_config(launch), models=make(load_reference_models()))
    with pytest.raises(ConfigError, match=message):
        asyncio.run(runtime.start())


def test_a_model_set_without_the_unused_drafter_decodes() -> None:
    import asyncio

    from adaspec.config import SamplingParams
    from adaspec.runtime.engine import Runtime

    full = load_reference_models()
    models = SimpleNamespace(target=full.target, mtp=full.mtp, dspark=None)
    runtime = Runtime(load_config({"speculative_algorithm": "MTP",
                                   "num_speculative_tokens": 2}), models=models)

    async def run() -> int:
        await runtime.start()
        result = await runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                      max_tokens=8)).result()
        await runtime.stop()
        return len(result.token_ids)

    assert asyncio.run(run()) == 8


@pytest.mark.parametrize("max_width", [None, "7", 0, True])
def test_a_drafter_max_width_that_is_no_positive_integer_is_refused(max_width: object) -> None:
    launch = load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": 3}).launch
    models = load_reference_models()
    own = SimpleNamespace(target=models.target, mtp=None,
                          dspark=SimpleNamespace(max_width=max_width, identity="own",
                                                 draft=print))
    with pytest.raises(ConfigError, match=r"^Runtime\(models=\.\.\.\)\.dspark\.max_width=.*: "
                                          r"expected a positive integer"):
        check_model_limits(launch, own)


def test_a_drafter_max_width_of_any_integer_type_is_read_as_an_integer() -> None:
    import numpy as np

    launch = load_config({"speculative_algorithm": "DSpark", "num_speculative_tokens": 5}).launch
    models = load_reference_models()
    own = SimpleNamespace(target=models.target, mtp=None,
                          dspark=SimpleNamespace(max_width=np.int64(4), identity="own",
                                                 draft=print))
    with pytest.raises(ConfigError, match=r"expected 1\.\.4"):
        check_model_limits(launch, own)
    own.dspark.max_width = "7"
    with pytest.raises(ConfigError, match=r"max_width='7': .*\(got a str\)"):
        check_model_limits(launch, own)


def test_config_refuses_a_checkpoint_flag_naming_no_checkpoint_directory(
        tmp_path: Path) -> None:
    """generate refuses them before loading anything: so does config."""
    (tmp_path / "config.json").write_text("{}")
    cases = [
        ([f"--model={tmp_path / 'none'}"], f"--model={tmp_path / 'none'}: expected a directory "
         "holding a Hugging Face causal LM (config.json and *.safetensors)"),
        ([f"--model={tmp_path / 'config.json'}"], f"--model={tmp_path / 'config.json'}: "
         "expected a directory"),
        ([f"--model={tmp_path}", f"--draft_model={tmp_path / 'none'}",
          "--speculative_algorithm=MTP", "--num_speculative_tokens=3"],
         f"--draft_model={tmp_path / 'none'}: expected a directory"),
        ([f"--model={tmp_path.parent}"], f"--model={tmp_path.parent}: has no config.json; "
         "expected a Hugging Face causal LM checkpoint directory"),
    ]
    for flags, message in cases:
        done = subprocess.run([sys.executable, "-m", "adaspec", "config", *flags],
                              capture_output=True, text=True, check=False, timeout=120)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert done.stderr.startswith(f"adaspec config: error: {message}"), done.stderr


def test_a_batch_whose_kv_caches_the_device_cannot_hold_is_refused_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 131,073 KV slots of the built-in target's context need about a terabyte: more than
    # any machine the suite runs on, so the check refuses before allocating anything.
    assert cli.run(["generate", "--max_seqs_per_batch=65536", *GENERATE]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        "adaspec generate: error: --max_seqs_per_batch=65536: the KV caches of its 131072 KV "
        "slots (two per sequence, one waiting for the rounds in flight) do not fit: a KV cache "
        "of ")
    assert "bytes of cpu memory; expected fewer sequences per batch\n" in captured.err
    assert captured.err.count("\n") == 1
