"""Hugging Face checkpoints through the protocols: tiny Llama (grouped-query attention) and
GPT-2 models built from configs offline, saved as safetensors, run by the runtime with MTP-style
drafting (the target as its own drafter, and a second smaller model), against transformers'
own ``generate(do_sample=False)``."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_job import PROCESS_LIMIT_S, peer_environment
from serve_process import start_server

transformers = pytest.importorskip("transformers")

from adaspec.config import SamplingParams, load_config  # noqa: E402
from adaspec.errors import ConfigError, InvalidRequest  # noqa: E402
from adaspec.models.hf import HfModels, load_hf_models  # noqa: E402
from adaspec.runtime.engine import Runtime  # noqa: E402
from adaspec.runtime.requests import RequestResult  # noqa: E402

CONTEXT = 96
VOCAB = 97  # <unk>, the 95 printable ASCII characters and a newline
PROMPTS = [[5, 9, 3, 17, 2, 8], [40, 41, 42], [7] * 20, [90]]


def _config(family: str, layers: int) -> Any:
    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
            initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=None,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4,
                                   n_positions=CONTEXT, initializer_range=0.2,
                                   bos_token_id=None, eos_token_id=None)


def _save(family: str, folder: Path, layers: int, seed: int) -> Any:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(family, layers), attn_implementation="eager")
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return model.eval()


def _save_tokenizer(folder: Path) -> None:
    """A character tokenizer of <unk>, the 95 printable ASCII characters and a newline (all
    the shipped prompts hold): 97 tokens."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Fast

    vocab = {"<unk>": 0, **{chr(code): code - 31 for code in range(32, 127)}, "\n": 96}
    tokenizer = Fast(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                         unk_token="<unk>").save_pretrained(folder)


Family = tuple[str, Path, Path, Any]


def _family(name: str, tmp_path_factory: pytest.TempPathFactory) -> Family:
    """A family's target checkpoint, a smaller drafter checkpoint, and the target itself as
    transformers runs it."""
    target_dir = tmp_path_factory.mktemp(f"{name}-target")
    draft_dir = tmp_path_factory.mktemp(f"{name}-draft")
    reference = _save(name, target_dir, 2, 0)
    _save(name, draft_dir, 1, 1)
    return name, target_dir, draft_dir, reference


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family("gpt2", tmp_path_factory)


@pytest.fixture(params=["llama", "gpt2"])
def family(request: pytest.FixtureRequest) -> Family:
    """Each family in turn, for what both must show; the slower tests take one family."""
    found: Family = request.getfixturevalue(request.param)
    return found


def _generate(reference: Any, prompt: list[int], max_tokens: int) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long))
    return list(out[0, len(prompt):].tolist())


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaspec", *argv], capture_output=True,
                          text=True, env=peer_environment(), timeout=PROCESS_LIMIT_S,
                          check=False)


def _decode(models: HfModels, launch: dict[str, Any], prompts: list[list[int]],
            params: list[SamplingParams]) -> list[RequestResult]:
    async def run() -> list[RequestResult]:
        runtime = Runtime(load_config({"max_seqs_per_batch": 4} | launch), models=models)
        await runtime.start()
        try:
            handles = [runtime.submit(p, q) for p, q in zip(prompts, params, strict=True)]
            return [await handle.result() for handle in handles]
        finally:
            await runtime.stop()
    return asyncio.run(run())


# A calibration grid that fits the tiny models' context of 96 positions.
CALIBRATION = {"request_buckets": [1, 2], "warmup_steps": 1, "window_steps": 2,
               "windows_per_point": 1,
               "contexts": [{"prefill_tokens": 8, "min_kv_length": 1, "max_kv_length": CONTEXT}]}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The DSpark-free modes a launch allows: MTP fixed, adaptive depth, adaptive verify."""
    folder = tmp_path_factory.mktemp("calibration")
    steps, verify = folder / "draft-steps.json", folder / "verify.json"
    steps.write_text(json.dumps({"version": 1, "calibration": CALIBRATION}))
    verify.write_text(json.dumps(CALIBRATION))
    return {
        "mtp-fixed": {"speculative_algorithm": "MTP", "num_speculative_tokens": 3},
        "mtp-adaptive-depth": {"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                               "enable_adaptive_draft_step": True,
                               "adaptive_draft_step_config": str(steps)},
        "mtp-adaptive-verify": {"speculative_algorithm": "MTP", "num_speculative_tokens": 5,
                                "enable_adaptive_target_verify": True,
                                "adaptive_target_verify_calibration": str(verify)},
    }


TEXTS = ["Hello there", "abc", "z" * 12, "Q"]


# Every mode and both drafters once on Llama; GPT-2 (its own attention layout and tied
# head) in the mode that exercises the most (adaptive verify, drafts rejected too).
@pytest.mark.parametrize(("name", "launch", "drafter"), [
    ("llama", "mtp-fixed", "self"), ("llama", "mtp-adaptive-depth", "smaller"),
    ("llama", "mtp-adaptive-verify", "self"), ("gpt2", "mtp-adaptive-verify", "smaller"),
])
def test_generate_gives_transformers_greedy_output_in_every_mtp_mode(
        request: pytest.FixtureRequest, launches: dict[str, dict[str, Any]], name: str,
        launch: str, drafter: str) -> None:
    """``adaspec generate`` on the checkpoint directories, each prompt encoded by the
    checkpoint's tokenizer, against transformers' ``generate(do_sample=False)``."""
    _, target_dir, draft_dir, reference = request.getfixturevalue(name)
    flags = [f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
             for key, value in launches[launch].items()]
    done = _run("generate", "--json", f"--model={target_dir}",
                f"--draft_model={target_dir if drafter == 'self' else draft_dir}", *flags,
                *(f"--prompt={text}" for text in TEXTS), "--max_tokens=24", "--temperature=0",
                "--max_seqs_per_batch=4")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)["results"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    assert [r["token_ids"] for r in results] == [
        _generate(reference, tokenizer.encode(text), 24) for text in TEXTS]
    if drafter == "self":  # the target's own weights draft: every draft is accepted
        assert all(r["drafted_accepted"] == r["drafted_verified"] > 0 for r in results)


def test_up_to_the_context_limit_and_with_a_stop_token(
        family: Family) -> None:
    _, target_dir, _, reference = family
    models = load_hf_models(str(target_dir))
    prompt = PROMPTS[0]
    expected = _generate(reference, prompt, CONTEXT - len(prompt))
    stop = expected[10]
    params = [SamplingParams(temperature=0.0, max_tokens=CONTEXT - len(prompt)),
              SamplingParams(temperature=0.0, max_tokens=30, stop=(stop,))]
    full, stopped = _decode(models, {"speculative_algorithm": "MTP",
                                     "num_speculative_tokens": 3}, [prompt, prompt], params)
    assert list(full.token_ids) == expected
    assert list(stopped.token_ids) == expected[:expected.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def test_built_in_calibration_shrinks_its_windows_to_a_short_context(llama: Family) -> None:
    """With no calibration file, 8 + 32 + 2 rounds of 4 tokens outgrow the 96 positions; the
    windows shrink to 17 steps (4 + 17 + 2 rounds, 92 tokens) and decoding stays lossless."""
    _, target_dir, _, reference = llama
    models = load_hf_models(str(target_dir), str(target_dir))
    launch = {"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
              "enable_adaptive_draft_step": True, "max_seqs_per_batch": 1}
    runtime = Runtime(load_config(launch), models=models)

    async def run() -> list[int]:
        await runtime.start()
        try:
            result = await runtime.submit(PROMPTS[0], SamplingParams(temperature=0.0,
                                                                     max_tokens=30)).result()
            return list(result.token_ids)
        finally:
            await runtime.stop()

    assert asyncio.run(run()) == _generate(reference, PROMPTS[0], 30)
    assert runtime.costs is not None
    settings = runtime.costs.settings
    assert (settings["warmup_steps"], settings["window_steps"]) == (4, 17)
    assert settings["contexts"] == [{"prefill_tokens": 4, "min_kv_length": 1,
                                     "max_kv_length": CONTEXT}]


@pytest.mark.parametrize(("kind", "fields"), [
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
    ("mistral", {}),
], ids=["qwen2-no-layer-slides", "qwen2-second-layer-slides", "mistral-every-layer-slides"])
def test_a_sliding_window_applies_to_the_layers_transformers_applies_it_to(
        tmp_path: Path, kind: str, fields: dict[str, Any]) -> None:
    """A window of 4 positions, far shorter than prompt and output: Qwen2 slides only in the
    layers ``layer_types`` names (its config derives them from ``max_window_layers``: none of
    2 layers for 2, the second for 1), Mistral in every layer."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, sliding_window=4, **fields)
    reference = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    reference.save_pretrained(tmp_path)
    prompt = PROMPTS[0]
    (result,) = _decode(load_hf_models(str(tmp_path)), {"speculative_algorithm": "MTP",
                        "num_speculative_tokens": 3}, [prompt],
                        [SamplingParams(temperature=0.0, max_tokens=16)])
    assert list(result.token_ids) == _generate(reference, prompt, 16)


@pytest.mark.parametrize(("fields", "words"), [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
     "config.json rope_parameters rope_type=longrope: its frequencies follow the longest "
     "position of each forward, so verifying several tokens at once would not decode as "
     "transformers does; expected another rope type"),
    ({"rope_scaling": {"type": "longrope"}}, "config.json rope_scaling rope_type=longrope: "),
    ({"rope_parameters": {"full_attention": {"rope_type": "longrope"}}},
     "config.json rope_parameters rope_type=longrope: "),
    ({"dtype": "int8"}, "config.json dtype=int8: expected a floating dtype (float32, "
                        "bfloat16, float16, ...)"),
    ({"torch_dtype": "bool"}, "config.json torch_dtype=bool: expected a floating dtype"),
    # Before, transformers' or torch's own words, naming no field: a division by zero, a
    # padding index outside the embedding, a torch attribute, its type names.
    ({"dtype": "float64x"}, "config.json dtype=float64x: expected a floating dtype"),
    ({"num_key_value_heads": 0}, "config.json num_key_value_heads=0: expected a positive "
                                 "integer"),
    ({"num_attention_heads": -2}, "config.json num_attention_heads=-2: expected a positive "),
    ({"model_type": "gpt2", "n_head": 0}, "config.json n_head=0: expected a positive integer"),
    ({"vocab_size": 97, "pad_token_id": 5000}, "config.json pad_token_id 5000 is outside the "
                                               "vocabulary of 97 tokens; expected an id in "
                                               "0..96, or null"),
    ({"rope_parameters": "default"}, "config.json rope_parameters='default': expected an "
                                     "object (rope_type and its settings), or null"),
    # Before, the first verify of the graph preparation failed in transformers' masks.
    ({"model_type": "qwen2", "layer_types": ["sliding_attention", "full_attention"],
      "use_sliding_window": False, "sliding_window": None},
     "config.json layer_types names sliding_attention layers while use_sliding_window=false "
     "and sliding_window=null give them no window; expected use_sliding_window=true with a "
     "sliding_window, or no sliding_attention layer"),
    ({"model_type": "qwen2", "layer_types": ["sliding_attention"], "use_sliding_window": True},
     "config.json layer_types names sliding_attention layers while use_sliding_window=true "
     "and sliding_window=null"),
])
def test_a_config_adaspec_cannot_decode_as_transformers_does_is_refused(
        tmp_path: Path, fields: dict[str, object], words: str) -> None:
    """longrope switches its frequencies with the longest position of a forward: a verify
    crossing the switch decoded otherwise than transformers (from the 17th token of a
    40-token greedy run); transformers refuses a dtype that is not floating; a field
    transformers or torch would trip on is named before they run."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value).startswith(f"--model={tmp_path}: {words}")
    # Rope types whose frequencies are fixed, and floating dtypes, go on to the next check.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0},
        "dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match="has no \\*.safetensors weights"):
        load_hf_models(str(tmp_path))


@pytest.mark.parametrize("window", [0, -3, 2.5, "4", True])
def test_a_sliding_window_in_use_must_be_a_positive_integer(tmp_path: Path,
                                                            window: object) -> None:
    """A window of 0 hides every key: decoding would emit token 0 for ever."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral",
                                                      "sliding_window": window}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value) == (f"--model={tmp_path}: config.json sliding_window={window!r}: "
                               "expected a positive integer, or null for no window")
    # Mistral slides whatever use_sliding_window says: still refused.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mistral", "sliding_window": window, "use_sliding_window": False}))
    with pytest.raises(ConfigError, match="sliding_window"):
        load_hf_models(str(tmp_path))
    # Qwen2 ignores the window when it is off (or unset), and so does adaspec.
    for switched_off in ({"use_sliding_window": False}, {}):
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "sliding_window": 0, **switched_off}))
        with pytest.raises(ConfigError, match="has no \\*.safetensors weights"):
            load_hf_models(str(tmp_path))
    # Switched on, it applies only on the layers from max_window_layers up.
    for layers, slides in ((2, False), (1, True)):
        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "sliding_window": 0, "use_sliding_window": True,
            "num_hidden_layers": 2, "max_window_layers": layers}))
        with pytest.raises(ConfigError, match="sliding_window" if slides else "safetensors"):
            load_hf_models(str(tmp_path))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_sliding_window_on_a_model_type_whose_attention_applies_none_is_refused(
        tmp_path: Path, kind: str) -> None:
    """Before, a Llama config with a window of 4 loaded and decoded with no window, while
    transformers' generate, whose cache keeps only the window's keys, gave other tokens from
    the fifth on: a silent difference from the reference."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind,
                                                      "sliding_window": 4}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value) == (
        f"--model={tmp_path}: config.json sliding_window=4: a {kind} layer's attention "
        "applies no window (transformers' generate only trims its cache to it); expected "
        "null, or a model_type whose attention applies it (mistral, qwen2)")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind,
                                                      "sliding_window": None}))
    with pytest.raises(ConfigError, match="has no \\*.safetensors weights"):
        load_hf_models(str(tmp_path))


def test_chunked_attention_is_refused_by_its_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "attention_chunk_size": 8}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value) == (f"--model={tmp_path}: config field attention_chunk_size=8: "
                               "chunked attention is not supported")


def test_a_checkpoint_adaspec_cannot_load_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^--model=") as info:
        load_hf_models(str(tmp_path / "missing"))
    assert "expected a directory" in str(info.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ConfigError, match="model_type='t5': expected one of"):
        load_hf_models(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="has no \\*.safetensors weights"):
        load_hf_models(str(tmp_path))


def test_a_config_value_transformers_does_not_know_is_named_by_its_key(
        tmp_path: Path, llama: Family) -> None:
    shutil.copytree(llama[1], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "bogus"}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value) == (f"--model={tmp_path}: cannot be loaded: config.json "
                               "hidden_act='bogus': not a value this transformers knows")
    long = "x" * 5000
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": long}))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(tmp_path))
    assert str(info.value).endswith(f"hidden_act='{'x' * 37}...': not a value this "
                                    "transformers knows")


def test_a_drafter_of_another_vocabulary_is_refused(tmp_path: Path,
                                                    llama: Family) -> None:
    name, target_dir, _, _ = llama
    other = _config(name, 1)
    other.vocab_size = 80
    model = transformers.AutoModelForCausalLM.from_config(other)
    model.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="^--draft_model=.*expected the target's 97"):
        load_hf_models(str(target_dir), str(tmp_path))


def test_a_draft_checkpoint_with_another_tokenizer_is_refused_naming_a_token(
        tmp_path: Path, llama: Family) -> None:
    """Its drafts are ids the target verifies: a token numbered otherwise is drafted as
    another. A draft without tokenizer files drafts in the target's."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, draft_dir, _ = llama
    draft = _copy(draft_dir, tmp_path / "draft")
    launch = load_config({"model": str(target_dir), "draft_model": str(draft),
                          "speculative_algorithm": "MTP", "num_speculative_tokens": 3}).launch
    command_tokenizer(launch)  # the fixture's draft shares the target's tokenizer
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["E"], vocab["F"] = vocab["F"], vocab["E"]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as info:
        command_tokenizer(launch)
    assert str(info.value) == (f"--draft_model={draft}: its tokenizer gives the token \"E\" "
                               "the id 39, the target's the id 38; expected the target's "
                               "tokenizer")
    for name in os.listdir(draft):
        if name.startswith(("tokenizer", "special_tokens")):
            (draft / name).unlink()
    command_tokenizer(launch)


@pytest.mark.parametrize(("config", "words"), [
    ('{"model_type": "falcon"}', "model_type='falcon': expected one of llama, mistral, "
                                 "qwen2, gpt2 (tested: llama, gpt2)"),
    ("{not json", "config.json is unreadable: "),
    # Before, json's advice to call sys.set_int_max_str_digits() ended the line.
    pytest.param('{"vocab_size": ' + "1" * 4301 + "}",
                 "config.json is unreadable: a number of more than 4300 digits; no value of "
                 "the file is that long", id="4301-digits"),
    ('\ufeff{"model_type": "llama"}', "config.json is unreadable: a byte-order mark before "
                                       "the JSON; expected UTF-8 without one"),
])
def test_a_draft_checkpoint_with_a_bad_config_is_blamed_on_its_config_not_its_tokenizer(
        tmp_path: Path, llama: Family, config: str, words: str) -> None:
    """Before, the launch read the draft's tokenizer (through its config) first: the line
    said "has no loadable tokenizer", after 38 lines transformers printed for a falcon."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, draft_dir, _ = llama
    draft = _copy(draft_dir, tmp_path / "draft")
    (draft / "config.json").write_text(config)
    launch = load_config({"model": str(target_dir), "draft_model": str(draft),
                          "speculative_algorithm": "MTP", "num_speculative_tokens": 3}).launch
    with pytest.raises(ConfigError) as info:
        command_tokenizer(launch)
    assert str(info.value).startswith(f"--draft_model={draft}: {words}")


# --- the commands ---------------------------------------------------------------------------
TEXT = "Once upon a time"


def test_generate_decodes_a_checkpoint_directory_as_transformers_does_to_the_context_limit(
        gpt2: Family) -> None:
    _, target_dir, draft_dir, reference = gpt2
    ids = transformers.AutoTokenizer.from_pretrained(target_dir).encode(TEXT)
    room = CONTEXT - len(ids)
    done = _run("generate", "--json", f"--model={target_dir}", f"--draft_model={draft_dir}",
                "--speculative_algorithm=MTP", "--num_speculative_tokens=3", f"--prompt={TEXT}",
                f"--max_tokens={room}", "--temperature=0")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no progress bars or warnings of transformers
    result = json.loads(done.stdout)["results"][0]
    assert result["token_ids"] == _generate(reference, ids, room)
    too_long = _run("generate", f"--model={target_dir}", f"--draft_model={draft_dir}",
                    "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                    f"--prompt={TEXT}", f"--max_tokens={room + 1}", "--temperature=0")
    assert too_long.returncode == 2
    assert too_long.stderr.startswith(f"adaspec generate: error: --max_tokens={room + 1}: "
                                      f"expected at most {room}")


def test_serve_answers_a_checkpoints_text_and_cuts_it_at_a_stop_string(
        llama: Family) -> None:
    _, target_dir, _, reference = llama
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer.encode(TEXT)
    text = tokenizer.decode(_generate(reference, ids, 24))
    stop = text[8:10]
    served = start_server(f"--model={target_dir}", f"--draft_model={target_dir}",
                          "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                          "--served_model_name=tiny")
    try:
        base = {"model": "tiny", "prompt": TEXT, "max_tokens": 24, "temperature": 0}
        status, body = served.post(base)
        assert (status, body["choices"][0]["text"]) == (200, text)
        status, body = served.post({**base, "stop": stop})
        assert (status, body["choices"][0]["text"]) == (200, text[:text.index(stop)])
        assert body["choices"][0]["finish_reason"] == "stop"
    finally:
        assert served.stop() == 0, served.other


@pytest.mark.parametrize(("flags", "words"), [
    (["--speculative_algorithm=DSpark", "--num_speculative_tokens=5", "--draft_model=DIR"],
     "--speculative_algorithm=DSpark: a Hugging Face checkpoint drafts MTP-style"),
    (["--speculative_algorithm=MTP", "--num_speculative_tokens=3",
      "--draft_model=builtin:mtp"], "--draft_model=builtin:mtp: expected your draft's path"),
    # Even the shortest built-in windows, (1 + 4 + 2) rounds of 16 tokens, outgrow 96.
    (["--speculative_algorithm=MTP", "--num_speculative_tokens=15", "--draft_model=DIR",
      "--enable_adaptive_draft_step=true"],
     "--adaptive_draft_step_config: not given, and the built-in calibration needs a "
     "context of at least 113 tokens at width 15, more than the model's limit of 96"),
])
def test_what_a_checkpoint_launch_cannot_run_is_one_line(
        llama: Family, flags: list[str], words: str) -> None:
    _, target_dir, _, _ = llama
    flags = [flag.replace("DIR", str(target_dir)) for flag in flags]
    done = _run("generate", f"--model={target_dir}", *flags, "--prompt=a", "--max_tokens=2",
                "--temperature=0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr


def test_bench_runs_a_checkpoint_and_its_greedy_outputs_agree_in_every_arm(
        llama: Family) -> None:
    _, target_dir, draft_dir, _ = llama
    done = _run("bench", "--quick", "--json", f"--model={target_dir}",
                f"--draft_model={draft_dir}", "--speculative_algorithm=MTP",
                "--num_speculative_tokens=3", "--concurrency=2", "--arms=plain,none,fixed:3",
                "--max_tokens=8")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["greedy_outputs_identical"] is True
    assert "prompts cut to their last" in done.stderr  # the shipped prompts outgrow 96
    assert {(a["arm"], a["concurrency"]) for a in report["arms"]} == {
        ("plain", 2), ("none", 2), ("fixed:3", 2)}
    assert all(a["tokens_per_second"] > 0 for a in report["arms"])


def _rss_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_memory_stays_flat_over_thousands_of_tokens(llama: Family) -> None:
    """No autograd graph is kept: the weights need no gradient and every call runs without
    one, so a long run holds no more memory than a short one (bound: 16 MiB)."""
    _, target_dir, _, _ = llama
    models = load_hf_models(str(target_dir))
    assert not any(p.requires_grad for p in models.target.model.parameters())
    launch = {"speculative_algorithm": "MTP", "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.0, max_tokens=CONTEXT - 8) for _ in range(4)]
    prompts = [[3 + i] * 8 for i in range(4)]
    _decode(models, launch, prompts, params)  # warm: every allocation made once
    before = _rss_kib()
    tokens = 0
    for _ in range(6):
        tokens += sum(len(r.token_ids) for r in _decode(models, launch, prompts, params))
    assert tokens >= 2000
    assert _rss_kib() - before < 16 * 1024


def _filtered(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    from adaspec.runtime.devices.sampling import target_probs

    rows = logits.shape[0]
    return target_probs(logits.float(), torch.ones(rows), torch.full((rows,), top_k),
                        torch.ones(rows), torch.zeros(rows))


def test_random_sampling_with_a_checkpoint_keeps_the_target_distribution(
        llama: Family) -> None:
    """Tokens 1 and 2 of 600 seeded requests of one prompt at temperature 1, top-k 8 (token 1
    from the prefill, token 2 from the first speculative round, drafted by the smaller model
    so drafts are rejected too), against the exact filtered probabilities of transformers'
    own forward: a one-sample chi-square over the cells with an expected count of at least 5
    (the rest pooled) must give p > 1e-3, and no pair of probability zero may occur."""
    from scipy.stats import chisquare

    _, target_dir, draft_dir, reference = llama
    prompt, count, top_k = PROMPTS[0], 600, 8
    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = _filtered(reference(ids).logits[:, -1], top_k)[0]
        tokens = torch.nonzero(first).flatten()
        extended = torch.cat([ids.expand(len(tokens), -1), tokens[:, None]], dim=1)
        second = _filtered(reference(extended).logits[:, -1], top_k)
    exact = {(int(t1), t2): float(first[t1] * p)
             for t1, row in zip(tokens, second, strict=True)
             for t2, p in enumerate(row.tolist()) if p > 0}
    models = load_hf_models(str(target_dir), str(draft_dir))
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=2)] * count
    results = _decode(models, {"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                               "max_seqs_per_batch": 16}, [prompt] * count, params)
    observed = Counter(tuple(r.token_ids) for r in results)
    assert set(observed) <= set(exact)
    cells = sorted(exact, key=exact.__getitem__, reverse=True)
    kept = [cell for cell in cells if exact[cell] * count >= 5]
    assert len(kept) >= 5
    rest = [cell for cell in cells if exact[cell] * count < 5]
    seen = [observed[cell] for cell in kept] + [sum(observed[cell] for cell in rest)]
    expected = [exact[cell] * count for cell in kept] + [sum(exact[c] for c in rest) * count]
    assert chisquare(seen, [e * sum(seen) / sum(expected) for e in expected]).pvalue > 1e-3


def test_a_damaged_checkpoint_and_text_its_tokenizer_cannot_hold_are_one_line(
        llama: Family, tmp_path: Path) -> None:
    _, target_dir, _, _ = llama
    damaged = tmp_path / "damaged"
    shutil.copytree(target_dir, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    done = _run("generate", f"--model={damaged}", f"--draft_model={target_dir}",
                "--speculative_algorithm=MTP", "--num_speculative_tokens=3", "--prompt=a",
                "--max_tokens=2", "--temperature=0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"adaspec generate: error: --model={damaged}: cannot be "
                                  "loaded: ")
    done = _run("generate", f"--model={target_dir}", f"--draft_model={target_dir}",
                "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                "--prompt=ROM\u00c9O.", "--max_tokens=2", "--temperature=0")
    assert done.returncode == 2
    assert done.stderr == ("adaspec generate: error: --prompt=ROM\u00c9O.: holds characters the "
                           "checkpoint's tokenizer cannot encode (they would read as <unk>)\n")


def test_serve_refuses_a_port_in_use_before_its_checkpoint_loads(
        llama: Family, tmp_path: Path) -> None:
    """Before, the checkpoint loaded first: a large one took seconds to say the port was in
    use. A checkpoint that cannot load shows which came first."""
    _, target_dir, _, _ = llama
    damaged = tmp_path / "damaged"
    shutil.copytree(target_dir, damaged)
    (damaged / "model.safetensors").write_bytes(b"\0" * 16)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run("serve", f"--model={damaged}", f"--port={port}")
    assert (done.returncode, done.stderr) == (2, f"adaspec serve: error: --port={port}: cannot "
                                              f"listen on 127.0.0.1:{port}: Address already in "
                                              "use\n")


def test_a_character_the_vocabulary_lacks_is_refused_beside_a_spelled_unknown_token(
        llama: Family) -> None:
    from adaspec.models.hf import checkpoint_tokenizer, read_config

    _, target_dir, _, _ = llama
    tokenizer = checkpoint_tokenizer(str(target_dir), read_config(str(target_dir), "--model"))
    unknown = tokenizer.tokenizer.unk_token_id
    assert tokenizer.encode("<unk>").count(unknown) == 1  # spelled out: that token, kept
    with pytest.raises(InvalidRequest, match="holds characters the checkpoint's tokenizer "
                                             "cannot encode"):
        tokenizer.encode("\u00e9<unk>")  # before: read as two <unk> tokens


def _sentencepiece_tokenizer(unknown: bool, *, model_unknown: bool | None = None,
                             lacks: str = "", bos: bool = False, fold: bool = False,
                             byte_fallback: bool = False, lower_nfkc: bool = False) -> Any:
    """A tokenizer laid out as Llama 2's and Mistral's (a space before the text, spaces as
    \u2581, a decoder that strips the text's leading space), with the one merged word
    \u2581world. ``unknown``: transformers names <unk>; ``model_unknown``: the BPE model
    has it too (as ``unknown`` unless given); ``lacks``: characters left out of the
    vocabulary; ``bos``: <s> added before the text; ``fold``: case and accents folded;
    ``byte_fallback``: the 256 byte tokens <0x00>..<0xFF> spell what the vocabulary lacks;
    ``lower_nfkc``: lowercase, then NFKC (which may give capitals back: \u210d is H)."""
    import string

    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as Fast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    if byte_fallback:
        vocab |= {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    for char in ["\u2581", *(c for c in string.printable if not c.isspace())]:
        if char not in lacks:
            vocab.setdefault(char, len(vocab))
    merges = [("\u2581", "w"), ("\u2581w", "o"), ("\u2581wo", "r"), ("\u2581wor", "l"),
              ("\u2581worl", "d")]
    for first, second in merges:
        vocab[first + second] = len(vocab)
    model_unknown = unknown if model_unknown is None else model_unknown
    tokenizer = Fast(models.BPE(vocab, merges, unk_token="<unk>" if model_unknown else None,
                                byte_fallback=byte_fallback))
    folding = [normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()]
    folding = folding if fold else [normalizers.Lowercase(), normalizers.NFKC()] \
        if lower_nfkc else []
    tokenizer.normalizer = normalizers.Sequence([
        *folding, normalizers.Prepend("\u2581"),
        normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                           decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)])
    named = {"unk_token": "<unk>"} if unknown else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                                eos_token="</s>", **named)


def _with_special(tokenizer: Any, token: str) -> Any:
    tokenizer.add_special_tokens({"additional_special_tokens": [token]})
    return tokenizer


def _gpt2_style_tokenizer() -> Any:
    """Byte-level BPE whose one special token is its unknown token, its end-of-sequence
    token and a BOS it adds before the text (as GPT-2 checkpoints name <|endoftext|>)."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {"<|endoftext|>": 0}
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab.setdefault(char, len(vocab))
    tokenizer = Fast(models.BPE(vocab, [], unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    special = "<|endoftext|>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=special,
                                                bos_token=special, eos_token=special)


def test_a_completion_reads_after_its_prompt_so_a_stripped_leading_space_is_kept() -> None:
    """SentencePiece's decoder strips a text's leading space: a completion decoded alone
    would lose the space before its first word, and a stop string holding it would miss."""
    from adaspec.cli.generate import result_dict
    from adaspec.models.hf import HfTokenizer
    from adaspec.runtime.requests import RequestResult
    from adaspec.serve.text import CompletionText

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True))
    prompt = tokenizer.encode("Hello")
    world = tokenizer.tokenizer.convert_tokens_to_ids("\u2581world")
    whole = tokenizer.decode([*prompt, world, world, world])
    assert whole.endswith("Hello world world world")
    streamed = tokenizer.detokenizer(prompt)
    assert [streamed.feed([world]) for _ in range(3)] + [streamed.flush()] == \
        [" world"] * 3 + [""]
    result = RequestResult(request_id=0, token_ids=(world,) * 3, finish_reason="length",
                           rounds=1, verified=2, accepted=2)
    row = result_dict("Hello", prompt, result, tokenizer)
    assert row["prompt"] + row["text"] == "Hello world world world"
    stopped = CompletionText(tokenizer.detokenizer(prompt), [" world"])
    assert stopped.feed([world]) == ""
    assert stopped.stopped


def test_the_end_of_sequence_token_adds_no_text_to_the_completion() -> None:
    """As transformers' and vLLM's decoded output, a completion ends before its ``</s>``,
    streamed or whole, with a stop string or without; the token is still counted."""
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text
    from adaspec.serve.text import CompletionText

    fast = _sentencepiece_tokenizer(unknown=True)
    eos = fast.convert_tokens_to_ids("</s>")
    tokenizer = HfTokenizer(fast, eos_token_ids=(eos,))
    prompt = tokenizer.encode("Hello")
    world = fast.convert_tokens_to_ids("\u2581world")
    assert completion_text(tokenizer, prompt, [world, eos]) == " world"
    for stops in ([], ["zzz"]):
        streamed = CompletionText(tokenizer.detokenizer(prompt), stops)
        assert streamed.feed([world]) + streamed.feed([eos]) + streamed.finish() == " world"
        assert (streamed.text, streamed.num_tokens) == (" world", 2)


def test_text_a_model_reads_as_its_unknown_token_is_refused_though_transformers_names_none(
        ) -> None:
    """NFKC would read \u207f as n, which the spelled <unk> holds: the model's own unknown
    token is counted instead."""
    from adaspec.models.hf import HfTokenizer

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=False, model_unknown=True))
    with pytest.raises(InvalidRequest, match=r"cannot encode \(they would read as <unk>\)$"):
        tokenizer.encode("k\u207f")


@pytest.mark.parametrize(("settings", "text", "dropped"), [
    ({"unknown": False}, "\u00e9", "\u00e9"),
    ({"unknown": False}, "Hello \u00e9t\u00e9 \u65e5", "\u00e9"),
    # The <s> the tokenizer adds spells the characters dropped from the text.
    ({"unknown": False, "bos": True, "lacks": "<"}, "a<b", "<"),
    # transformers names an unknown token its BPE model does not have: that drops too.
    ({"unknown": True, "model_unknown": False}, "hello \u2603 world", "\u2603"),
    ({"unknown": False, "fold": True, "lacks": "<"}, "Caf\u00e9 <", "<"),
    # SentencePiece's space mark spelled in the text would read back as a space.
    ({"unknown": True}, "a\u2581b", "\u2581"),
])
def test_text_a_tokenizer_would_drop_is_refused(settings: dict[str, Any], text: str,
                                                dropped: str) -> None:
    from adaspec.models.hf import HfTokenizer

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(**settings))
    with pytest.raises(InvalidRequest) as info:
        tokenizer.encode(text)
    assert str(info.value) == (f"request field prompt={text}: holds characters the "
                               f"checkpoint's tokenizer cannot encode ({dropped!r} would be "
                               "dropped)")


@pytest.mark.parametrize(("tokenizer", "text"), [
    (lambda: _sentencepiece_tokenizer(unknown=False), "Hello world"),
    (lambda: _sentencepiece_tokenizer(unknown=False, bos=True), "Hello <s> world"),
    # Case and accents the tokenizer folds are no loss.
    (lambda: _sentencepiece_tokenizer(unknown=False, fold=True), "Hello Caf\u00e9"),
    # Its unknown token is also the BOS it adds: that one is no unknown character.
    (_gpt2_style_tokenizer, "hello \u2603"),
    # A normalizer that writes its own output otherwise (H to h) compares the text once.
    (lambda: _sentencepiece_tokenizer(unknown=False, lower_nfkc=True), "\u210dello"),
    # A special token the normalizer would fold is matched before it, as spelled.
    (lambda: _with_special(_sentencepiece_tokenizer(unknown=False, fold=True), "[INST]"),
     "[INST] hi"),
    (lambda: _sentencepiece_tokenizer(unknown=True, byte_fallback=True), "\u00e9t\u00e9 \u65e5"),
])
def test_text_a_tokenizer_holds_or_folds_is_encoded(tokenizer: Any, text: str) -> None:
    from adaspec.models.hf import HfTokenizer

    ids = HfTokenizer(tokenizer()).encode(text)
    assert ids


# --- what a checkpoint must be to load --------------------------------------------------------
def _copy(source: Path, folder: Path, change: Any = None) -> Path:
    """A copy of a checkpoint directory, its weights changed in place by ``change``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    if change is not None:
        weights = load_file(folder / "model.safetensors")
        change(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _edit_config(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | fields))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize(("flag", "name"), [
    ("--model", "config.json"), ("--model", "tokenizer.json"),
    ("--draft_model", "model.safetensors")])
def test_a_fifo_in_a_checkpoint_is_refused_in_one_line_not_waited_on(
        llama: Family, tmp_path: Path, flag: str, name: str) -> None:
    """Nothing in the directory is opened until every file in it is a regular one: reading a
    FIFO waits for a writer forever (the run would hang, then time out here)."""
    _, target_dir, draft_dir, _ = llama
    folder = _copy(target_dir if flag == "--model" else draft_dir, tmp_path / "fifo")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    dirs = {"--model": target_dir, "--draft_model": draft_dir} | {flag: folder}
    done = _run("generate", f"--model={dirs['--model']}",
                f"--draft_model={dirs['--draft_model']}", "--speculative_algorithm=MTP",
                "--num_speculative_tokens=3", "--prompt=a", "--max_tokens=2", "--temperature=0")
    assert done.returncode == 2
    assert done.stderr == (f"adaspec generate: error: {flag}={folder}: {name} is a FIFO, not "
                           "a regular file\n")


@pytest.mark.parametrize(("change", "words"), [
    (lambda w: w.pop("model.layers.1.mlp.down_proj.weight"),
     "model.safetensors lacks 1 weight the config needs: model.layers.1.mlp.down_proj.weight"),
    (lambda w: [w.pop(key) for key in list(w) if key.startswith("model.layers.1.")],
     "model.safetensors lacks 9 weights the config needs: model.layers.1.input_layernorm."
     "weight, model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight, ... "
     "(6 more)"),
    (lambda w: w.update({"model.layers.2.mlp.up_proj.weight": torch.ones(128, 64)}),
     "model.safetensors holds 1 weight the config has no place for: "
     "model.layers.2.mlp.up_proj.weight"),
    (lambda w: w.update({"model.layers.1.mlp.down_proj.weight": torch.ones(64, 100)}),
     "model.safetensors holds 1 weight of another shape than the config gives: "
     "model.layers.1.mlp.down_proj.weight [64, 100] (config: [64, 128])"),
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(torch.int32)}),
     "weight model.norm.weight is stored as I32 in model.safetensors; expected a floating "
     "dtype (F32, F16, BF16, ...) for a floating parameter"),
], ids=["missing", "missing-many", "unexpected", "reshaped", "integer"])
def test_weights_that_do_not_fit_the_config_are_refused_naming_them(
        llama: Family, tmp_path: Path, change: Any, words: str) -> None:
    """transformers would fill a missing or reshaped weight with random values (and drop one
    the config has no place for, and cast integers to floats), so the model would decode
    garbage without an error."""
    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "weights", change)
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(folder))
    assert str(info.value) == f"--model={folder}: {words}"


def test_weight_files_transformers_would_not_read_are_refused_naming_them(
        llama: Family, tmp_path: Path) -> None:
    """transformers reads model.safetensors alone, or the shards its index names: a second
    file without an index, or one the index leaves out, would be ignored without a word."""
    _, target_dir, _, reference = llama
    folder = _copy(target_dir, tmp_path / "unindexed")
    shutil.copy(folder / "model.safetensors", folder / "model-00002.safetensors")
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(folder), drafter=False)
    assert str(info.value) == (
        f"--model={folder}: holds the shards model-00002.safetensors but no "
        "model.safetensors.index.json; expected model.safetensors alone, or shards an index "
        "names")
    sharded = tmp_path / "sharded"
    reference.save_pretrained(sharded, max_shard_size="100KB")
    shards = sorted(path.name for path in sharded.glob("*.safetensors"))
    assert len(shards) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    # A file transformers never reads beside the shards (Mistral ships consolidated.*) loads.
    shutil.copy(sharded / shards[0], sharded / "consolidated.safetensors")
    load_hf_models(str(sharded), drafter=False)
    shutil.copy(sharded / shards[0], sharded / "model-00099-of-00099.safetensors")
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(sharded), drafter=False)
    assert str(info.value) == (
        f"--model={sharded}: model.safetensors.index.json does not name "
        "model-00099-of-00099.safetensors; expected every model-*.safetensors shard to be one "
        "it names (no other is read)")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    weight = sorted(index["weight_map"])[0]
    index["weight_map"][weight] = 2
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(sharded), drafter=False)
    assert str(info.value) == (
        f"--model={sharded}: model.safetensors.index.json weight_map[\"{weight}\"]=2; expected "
        "the file name of the shard that holds the weight")


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused_a_padded_one_is_not(
        llama: Family, tmp_path: Path) -> None:
    """A token id past vocab_size has no embedding: every prompt holding one would be refused
    as if the prompt were at fault. A model vocabulary larger than its tokenizer's (padded
    to a round size) is common and loads."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "vocab")
    _edit_config(folder, vocab_size=80)
    with pytest.raises(ConfigError) as info:
        command_tokenizer(load_config({"model": str(folder)}).launch)
    assert str(info.value) == (f"--model={folder}: its tokenizer holds {VOCAB} tokens, more "
                               "than config.json vocab_size=80; expected a tokenizer of at "
                               "most vocab_size tokens (the model's own)")
    _edit_config(folder, vocab_size=128)
    tokenizer, _ = command_tokenizer(load_config({"model": str(folder)}).launch)
    assert tokenizer.encode("ab") == [66, 67]


def test_a_special_token_added_past_the_vocabulary_loads_and_refuses_only_a_prompt_spelling_it(
        llama: Family, tmp_path: Path) -> None:
    """Qwen2's tokenizer class adds a pad token one past vocab_size, and transformers runs
    it: text reaches that id only by spelling the token. An ordinary token past the
    vocabulary is still refused at load."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "pad")
    added = transformers.AutoTokenizer.from_pretrained(folder)
    added.add_special_tokens({"pad_token": "<|pad|>"})
    added.save_pretrained(folder)
    tokenizer, _ = command_tokenizer(load_config({"model": str(folder)}).launch)
    assert tokenizer.encode("ab") == [66, 67]
    with pytest.raises(InvalidRequest) as info:
        tokenizer.encode("ab<|pad|>")
    assert str(info.value) == (f"request field prompt=ab<|pad|>: spells the tokenizer's "
                               f"token <|pad|> (id {VOCAB}), which the model's vocabulary of "
                               f"{VOCAB} tokens does not hold")
    added.add_tokens(["zz"])
    added.save_pretrained(folder)
    with pytest.raises(ConfigError, match=f"its tokenizer holds {VOCAB + 2} tokens, more than "
                                          f"config.json vocab_size={VOCAB}"):
        command_tokenizer(load_config({"model": str(folder)}).launch)


def test_a_kv_cache_the_device_cannot_hold_is_refused_in_one_line(
        llama: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV cache spans max_position_embeddings for every KV slot: a context of 10**12
    positions is refused before allocating (more bytes than the device has), and an
    allocation that fails anyway is the same one line, not an allocator's traceback."""
    from adaspec.models import layers

    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "context")
    _edit_config(folder, max_position_embeddings=10**12)
    done = _run("generate", f"--model={folder}", "--prompt=ab", "--max_tokens=2",
                "--temperature=0")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    # 2 layers, keys and values, 2 KV heads of 16 dims in float32, 2 * 16 + 1 KV slots
    needed = 2 * 2 * 33 * 2 * 10**12 * 16 * 4
    assert done.stderr.startswith(
        f"adaspec generate: error: --model={folder}: config.json max_position_embeddings="
        f"1000000000000 needs a KV cache of {needed} bytes for 33 KV slots, more than the ")
    assert done.stderr.endswith(" bytes of cpu memory; expected a context length (or a "
                                "--max_seqs_per_batch) whose KV cache fits the device\n")
    target = load_hf_models(str(folder), drafter=False).target
    monkeypatch.setattr(layers, "device_memory", lambda device: None)  # the allocator decides
    with pytest.raises(ConfigError) as info:
        target.allocate(1)
    assert str(info.value).startswith(
        f"--model={folder}: config.json max_position_embeddings=1000000000000 needs a KV "
        f"cache of {2 * 2 * 2 * 2 * 10**12 * 16 * 4} bytes for 2 KV slots, which cpu memory "
        "cannot hold: ")


def test_non_finite_weights_are_refused_naming_the_first(llama: Family,
                                                         tmp_path: Path) -> None:
    _, target_dir, draft_dir, _ = llama

    def poison(value: float) -> Any:
        return lambda w: w["model.layers.0.mlp.up_proj.weight"].__setitem__((3, 5), value)

    nan = _copy(target_dir, tmp_path / "nan", poison(float("nan")))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(nan), str(draft_dir))
    assert str(info.value) == (f"--model={nan}: weight model.layers.0.mlp.up_proj.weight "
                               "holds NaN values; expected finite weights")
    inf = _copy(draft_dir, tmp_path / "inf", poison(float("-inf")))
    with pytest.raises(ConfigError) as info:
        load_hf_models(str(target_dir), str(inf))
    assert str(info.value) == (f"--draft_model={inf}: weight model.layers.0.mlp.up_proj."
                               "weight holds infinite values; expected finite weights")


@pytest.mark.parametrize(("fields", "words"), [
    ({"hidden_size": "64"}, "Field 'hidden_size' expected int, got str"),
    ({"num_attention_heads": 3}, "The hidden size (64) is not a multiple of the number of "
                                 "attention heads (3)"),
], ids=["string", "heads"])
def test_a_config_transformers_refuses_is_blamed_on_config_json(
        llama: Family, tmp_path: Path, fields: dict[str, Any], words: str) -> None:
    """The config is validated before the tokenizer loads (which validates it too, and would
    take the blame), by the command's tokenizer and by the model loader alike."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "config")
    _edit_config(folder, **fields)
    for load in (lambda: command_tokenizer(load_config({"model": str(folder)}).launch),
                 lambda: load_hf_models(str(folder))):
        with pytest.raises(ConfigError) as info:
            load()
        assert str(info.value).startswith(f"--model={folder}: config.json cannot be loaded: ")
        assert words in str(info.value)


def test_a_tokenizer_config_that_is_no_object_is_named_so(llama: Family, tmp_path: Path
                                                         ) -> None:
    """Before, transformers' AttributeError: "'list' object has no attribute 'get'"."""
    from adaspec.models.hf import hf_tokenizer

    _, target_dir, _, _ = llama
    folder = _copy(target_dir, tmp_path / "tokenizer")
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as info:
        hf_tokenizer(str(folder))
    assert str(info.value) == f"--model={folder}: tokenizer_config.json is no JSON object"


def test_the_tokenizer_tells_the_checkpoints_end_of_sequence_tokens(
        llama: Family, tmp_path: Path) -> None:
    """config.json's eos_token_id and generation_config.json's together; none for a checkpoint
    without one and for the built-in models; an id outside the vocabulary is refused."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama

    def eos_of(folder: Path) -> tuple[int, ...]:
        tokenizer, _ = command_tokenizer(load_config({"model": str(folder)}).launch)
        return tokenizer.eos_token_ids

    assert eos_of(target_dir) == ()
    assert command_tokenizer(load_config({}).launch)[0].eos_token_ids == ()
    saved = _copy(target_dir, tmp_path / "eos")
    config = transformers.AutoConfig.from_pretrained(saved)
    config.eos_token_id = 6
    config.save_pretrained(saved)
    # generation_config.json, where it exists, is what transformers' generate stops at: the
    # copy's has no eos, so config.json's 6 stops nothing there either.
    assert (saved / "generation_config.json").is_file()
    assert eos_of(saved) == ()
    transformers.GenerationConfig.from_model_config(config).save_pretrained(saved)
    assert eos_of(saved) == (6,)
    (saved / "generation_config.json").unlink()
    assert eos_of(saved) == (6,)  # no such file: transformers derives it from config.json
    transformers.GenerationConfig(eos_token_id=[9, 6]).save_pretrained(saved)
    assert eos_of(saved) == (6, 9)
    transformers.GenerationConfig(eos_token_id=9).save_pretrained(saved)
    assert eos_of(saved) == (9,)
    transformers.GenerationConfig(eos_token_id=list(range(70, 87))).save_pretrained(saved)
    with pytest.raises(ConfigError) as info:
        eos_of(saved)
    assert str(info.value) == (f"--model={saved}: generation_config.json eos_token_id lists 17 "
                               "ids; expected at most 16 (a request stops at no more tokens)")
    (saved / "generation_config.json").unlink()
    _edit_config(saved, eos_token_id=[6, VOCAB])
    with pytest.raises(ConfigError) as info:
        eos_of(saved)
    assert str(info.value) == (f"--model={saved}: config.json eos_token_id {VOCAB} is outside "
                               f"the vocabulary of {VOCAB} tokens")
    (saved / "config.json").write_text((saved / "config.json").read_text().replace(
        '"eos_token_id"', '"rope_theta": NaN, "eos_token_id"'))
    with pytest.raises(ConfigError) as info:
        eos_of(saved)
    assert str(info.value) == (f"--model={saved}: config.json holds NaN; expected finite "
                               "numbers (strict JSON)")
    # A key twice: transformers would keep the last without a word.
    (saved / "config.json").write_text((saved / "config.json").read_text().replace(
        '"rope_theta": NaN, ', '"eos_token_id": 6, '))
    with pytest.raises(ConfigError) as info:
        eos_of(saved)
    assert str(info.value) == (f"--model={saved}: config.json gives the key \"eos_token_id\" "
                               "twice; expected each key once (transformers would keep the last "
                               "silently)")


def test_config_json_end_of_sequence_ids_are_checked_where_generation_config_overrides_them(
        llama: Family, tmp_path: Path) -> None:
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama
    saved = _copy(target_dir, tmp_path / "eos")
    transformers.GenerationConfig(eos_token_id=6).save_pretrained(saved)
    _edit_config(saved, eos_token_id=[6, -1])
    with pytest.raises(ConfigError) as info:
        command_tokenizer(load_config({"model": str(saved)}).launch)
    assert str(info.value) == (f"--model={saved}: config.json eos_token_id -1 is outside the "
                               f"vocabulary of {VOCAB} tokens")


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("repetition_penalty", 1.5, "unset or 1.0"),
    ("no_repeat_ngram_size", 3, "unset or 0"),
    # A decoder-only generate passes the prompt as its "encoder" input: applied too.
    ("encoder_repetition_penalty", 5.0, "unset or 1.0"),
    ("num_beams", 4, "unset or 1"),
    ("bad_words_ids", [[5]], "unset or []"),
    ("forced_eos_token_id", 6, "unset"),
    # They need generate's tokenizer: with it they change the output, without it they raise.
    ("stop_strings", ["p"], "unset or []"),
    ("token_healing", True, "unset or false"),
    # Shown as the file spells it: the string "1.5" is no number 1.5.
    ("repetition_penalty", "1.5", "unset or 1.0"),
])
def test_a_logits_processor_the_generation_config_turns_on_is_refused(
        llama: Family, tmp_path: Path, field: str, value: object, expected: str) -> None:
    """transformers' greedy generate applies it and adaspec does not: the outputs would
    differ without a word. Its neutral value loads."""
    from adaspec.models.launch import command_tokenizer

    _, target_dir, _, _ = llama
    saved = _copy(target_dir, tmp_path / "processor")
    launch = load_config({"model": str(saved)}).launch
    generation = json.loads((saved / "generation_config.json").read_text())
    (saved / "generation_config.json").write_text(json.dumps(generation | {field: value}))
    with pytest.raises(ConfigError) as info:
        command_tokenizer(launch)
    assert str(info.value) == (
        f"--model={saved}: generation_config.json {field}={json.dumps(value)}: transformers' "
        "generate applies it and adaspec does not, so their output would differ; expected "
        f"{expected} (edit the file to run without it)")
    neutral = {"repetition_penalty": 1.0, "num_beams": 1, "bad_words_ids": None}
    (saved / "generation_config.json").write_text(json.dumps(generation | neutral))
    command_tokenizer(launch)
    # Counts transformers compares as numbers: a float of the neutral value is neutral too.
    floats = {"num_beams": 1.0, "min_length": 0.0, "no_repeat_ngram_size": 0.0}
    (saved / "generation_config.json").write_text(json.dumps(generation | floats))
    command_tokenizer(launch)


def test_generate_stops_at_the_checkpoints_end_of_sequence_as_transformers_does(
        llama: Family, tmp_path: Path) -> None:
    """A token the greedy output reaches early becomes the checkpoint's eos: transformers'
    generate stops there, and so does adaspec generate (finish reason stop)."""
    _, target_dir, draft_dir, reference = llama
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer.encode(TEXTS[0])
    eos = _generate(reference, prompt, 24)[5]
    saved = _copy(target_dir, tmp_path / "eos")
    _edit_config(saved, eos_token_id=eos)
    transformers.GenerationConfig(eos_token_id=eos).save_pretrained(saved)
    stopping = transformers.AutoModelForCausalLM.from_pretrained(saved)
    expected = _generate(stopping, prompt, 24)
    assert expected[-1] == eos
    assert len(expected) < 24
    done = _run("generate", "--json", f"--model={saved}", f"--draft_model={draft_dir}",
                "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                f"--prompt={TEXTS[0]}", "--max_tokens=24", "--temperature=0")
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)["results"]
    assert (result["token_ids"], result["finish_reason"]) == (expected, "stop")
    # The end-of-sequence token ends the completion and adds none of its text.
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text
    assert result["text"] == completion_text(HfTokenizer(tokenizer), prompt, expected[:-1])
    assert result["text"] != completion_text(HfTokenizer(tokenizer), prompt, expected)


def test_the_models_end_of_sequence_ids_leave_room_for_a_requests_own() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, stop=tuple(range(15)))
    assert params.ending_at((20,)).stop == (*range(15), 20)
    assert params.ending_at((3,)).stop == tuple(range(15))
    with pytest.raises(InvalidRequest, match=r"^request field stop_token_ids=15 token ids: "
                                             r"expected at most 14: the model's 2 "):
        params.ending_at((20, 21), "stop_token_ids")


@pytest.mark.parametrize("completion", [
    ["<0x0D>", "<0x90>", "\u2581world"],  # an invalid group: each of its bytes reads U+FFFD
    ["<0xE4>", "<0xBD>", "<0xA0>", "<0xA0>"],  # a whole character, then a stray byte
    ["<0xE4>", "<0xBD>", "<0xA0>", "\u2581world", "<0x41>"],
])
def test_a_completion_of_byte_tokens_reads_the_same_however_its_tokens_come(
        completion: list[str]) -> None:
    """Byte-fallback tokens decode as one group, so a character sent early could be rewritten
    by the group's next byte: what a stream sends equals the whole decode after the prompt,
    token by token (as with stop strings) or all at once."""
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text
    from adaspec.serve.text import CompletionText

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True, byte_fallback=True))
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.tokenizer.convert_tokens_to_ids(completion)
    expected = tokenizer.decode([*prompt, *ids])[len(tokenizer.decode(prompt)):]
    assert completion_text(tokenizer, prompt, ids) == expected
    one_by_one = CompletionText(tokenizer.detokenizer(prompt), ["zzz"])
    assert "".join(one_by_one.feed([token]) for token in ids) + one_by_one.finish() == expected


@pytest.mark.parametrize(("prompt", "completion"), [
    ("\U0001f642\U0001f642", "\U0001f642"),  # the prompt ends in byte tokens, the completion
    # begins in them
    ("a \u2603\u2603", "\u2603 b"),
    ("x \U0001f642", "\U0001f642\n"),
])
def test_a_completion_after_a_prompt_ending_in_byte_tokens_reads_as_its_own_characters(
        prompt: str, completion: str) -> None:
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True, byte_fallback=True))
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.tokenizer.encode(completion, add_special_tokens=False)
    ids = ids[1:] if tokenizer.tokenizer.convert_ids_to_tokens(ids[:1]) == ["\u2581"] else ids
    assert completion_text(tokenizer, prompt_ids, ids) == completion


def test_a_stop_string_that_ends_on_a_byte_token_ends_the_count_there() -> None:
    """A run of byte tokens is held back until it ends, but a stop string inside it ends the
    completion at its own last token, and usage counts no token past it."""
    from adaspec.models.hf import HfTokenizer
    from adaspec.serve.text import CompletionText

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True, byte_fallback=True))
    prompt = tokenizer.encode("x")
    ids = tokenizer.tokenizer.convert_tokens_to_ids(
        ["<0xE2>", "<0x98>", "<0x83>", "<0x0A>", "<0x41>", "o"])  # \u2603, a newline, A, o
    for stops, text, count in [(["\n"], "\u2603", 4), (["\u2603"], "", 3), (["A"], "\u2603\n", 5)]:
        completion = CompletionText(tokenizer.detokenizer(prompt), stops)
        sent = "".join(completion.feed([token]) for token in ids) + completion.finish()
        assert (sent, completion.num_tokens, completion.stopped) == (text, count, True)


def test_a_completion_after_a_prompt_of_byte_tokens_only_keeps_its_leading_space() -> None:
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True, byte_fallback=True))
    prompt = tokenizer.tokenizer.convert_tokens_to_ids(["<0xC3>", "<0xBC>"])  # \u00fc as ids
    world = tokenizer.tokenizer.convert_tokens_to_ids(["\u2581world"])
    assert completion_text(tokenizer, prompt, world) == " world"


def _unigram_tokenizer() -> Any:
    """A Unigram tokenizer (SentencePiece's other model) whose decode cleans up the space
    before punctuation, as transformers does for models that are not BPE."""
    import string

    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, normalizers

    pieces = [("<unk>", 0.0), ("\u2581", -1.0), ("\u2581a", -1.0)]
    pieces += [(c, -2.0) for c in string.printable if not c.isspace()]
    tokenizer = Fast(models.Unigram(pieces, unk_id=0))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                 normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                                clean_up_tokenization_spaces=True)


def test_a_space_sent_before_punctuation_is_not_taken_back_by_a_clean_up() -> None:
    from adaspec.models.hf import HfTokenizer
    from adaspec.models.tokenizer import completion_text
    from adaspec.serve.text import CompletionText

    tokenizer = HfTokenizer(_unigram_tokenizer())
    prompt = tokenizer.encode("Hi")
    ids = tokenizer.tokenizer.convert_tokens_to_ids(["\u2581", ".", "\u2581a"])
    whole = completion_text(tokenizer, prompt, ids)
    assert whole == " . a"
    one_by_one = CompletionText(tokenizer.detokenizer(prompt), [])
    assert "".join(one_by_one.feed([token]) for token in ids) + one_by_one.finish() == whole
    stopped = CompletionText(tokenizer.detokenizer(prompt), ["."])
    assert (stopped.feed(ids), stopped.num_tokens, stopped.stopped) == (" ", 2, True)


class _DecodeSizes:
    """A checkpoint's tokenizer that records how many ids each decode reads: a spy on the
    real tokenizer, since the cost of a long completion is what the test is about."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids: list[int], **options: Any) -> str:
        self.sizes.append(len(ids))
        return str(self._tokenizer.decode(ids, **options))


def test_a_long_completion_is_decoded_a_window_at_a_time() -> None:
    """Each token of a 3000-token completion streamed against a stop string reads a few ids,
    not the whole completion again (which cost 40 s for 16k tokens)."""
    from adaspec.models.hf import HfDetokenizer, HfTokenizer
    from adaspec.serve.text import CompletionText

    tokenizer = HfTokenizer(_sentencepiece_tokenizer(unknown=True, byte_fallback=True))
    spy = _DecodeSizes(tokenizer.tokenizer)
    ids = tokenizer.tokenizer.encode("x \u2603 world" * 500, add_special_tokens=False)
    completion = CompletionText(HfDetokenizer(spy, tokenizer.encode("Hello")), ["zzz"])
    sent = "".join(completion.feed([token]) for token in ids) + completion.finish()
    assert len(ids) > 3000
    assert sent == tokenizer.decode(tokenizer.encode("Hello") + ids)[len("Hello"):]
    assert max(spy.sizes) <= 16
