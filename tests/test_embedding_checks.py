"""What an embedding engine hands adaspec is checked where it is handed over, and refused in one
line naming it: weights and configs given to ``checkpoint_identity`` (which never lets two
different checkpoints share an identity), the value members of the models passed to
``Runtime(models=...)``, numbers of numpy types in ``SamplingParams``, and the text of a
model's own error reaching a request's error."""

import asyncio
import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from runtime_helpers import config, first_failure

from adaspec.config import SamplingParams
from adaspec.errors import ConfigError, ModelOutputError
from adaspec.models import ReferenceModels, checkpoint_identity, load_reference_models
from adaspec.runtime.engine import Runtime, RuntimeOptions


@pytest.fixture(scope="module")
def models() -> ReferenceModels:
    return load_reference_models()


# --- checkpoint_identity ---------------------------------------------------------------------

T = torch.arange(6, dtype=torch.float32)
IDENTITY = "db7f66bc428cd6387035008c06c8008c"  # the shipped small target's, as a parent


def test_the_encoding_of_plain_checkpoints_is_the_one_identities_always_had() -> None:
    # Pinned: identities recorded in model cards and saved cost tables must keep matching.
    weights = {"b": torch.arange(12, dtype=torch.float32).view(3, 4) / 7,
               "a": torch.tensor([1, 2, 3], dtype=torch.int64), "scalar": torch.tensor(0.5)}
    settings = {"hidden_size": 4, "window": 16, "name": "tiny", "eps": 1e-6}
    assert checkpoint_identity(settings, weights) == "e2635f2fe809d18af7184e36978f990a"
    assert checkpoint_identity({}, {}, parent=IDENTITY) == "64f93b0e1eb1a06fa6eec3fbfa60e2d0"


@pytest.mark.parametrize(("first", "second"), [
    # The parent and the first tensor name used to run together.
    (({}, {"ab": T}, "x"), ({}, {"b": T}, "xa")),
    (({}, {"ab": T}, ""), ({}, {"b": T}, "a")),
    (({}, {IDENTITY + "w": T}, ""), ({}, {"w": T}, IDENTITY)),
    (({}, {IDENTITY: T}, ""), ({}, {"": T}, IDENTITY)),
    # A key with a dot and the same key nested are different configs.
    (({"a.b": 1}, {"w": T}, ""), ({"a": {"b": 1}}, {"w": T}, "")),
])
def test_different_checkpoints_never_share_an_identity(first: tuple[Any, ...],
                                                        second: tuple[Any, ...]) -> None:
    assert checkpoint_identity(first[0], first[1], parent=first[2]) != \
        checkpoint_identity(second[0], second[1], parent=second[2])


def test_any_parent_string_is_taken_and_told_apart() -> None:
    parents = ["", IDENTITY, IDENTITY.upper(), "engine-target@v2", ":4:", "é"]
    assert len({checkpoint_identity({}, {"w": T}, parent=p) for p in parents}) == len(parents)


BYTES = torch.tensor(list(b"b:torch.uint8:(0,)"), dtype=torch.uint8)


@pytest.mark.parametrize(("settings", "weights", "message"), [
    # {1: x} would hash as {"1": x}.
    ({1: 2}, {}, r"^checkpoint_identity\(config=\.\.\.\)=1: expected str keys \(JSON object "
                 r"keys\), got a key of type int, which would hash like the string \"1\"$"),
    ({"a": {2: 3}}, {}, r"^checkpoint_identity\(config=\.\.\.\)\['a'\]=2: expected str keys"),
    ({}, {1: T}, r"^checkpoint_identity\(weights=\.\.\.\)=1: expected tensor names that are "
                 r"str, got a key of type int$"),
    # A name with the separator could spell another name, its dtype, shape and bytes:
    # {"a": BYTES} would otherwise hash like {"a:torch.uint8:(18,)b": an empty tensor}.
    ({}, {"a:torch.uint8:(18,)b": torch.zeros(0, dtype=torch.uint8)},
     r"^checkpoint_identity\(weights=\.\.\.\)='a:torch\.uint8:\(18,\)b': expected tensor names "
     r"without ':'"),
    ({"a": np.int64(3)}, {}, r"^checkpoint_identity\(config=\.\.\.\)\['a'\]=numpy\.int64: "
                             r"expected a JSON value"),
])
def test_inputs_the_encoding_cannot_tell_apart_are_refused_in_one_line(
        settings: Any, weights: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        checkpoint_identity(settings, weights)
    assert "\n" not in str(raised.value)
    # The tensors the refused name could be confused with hash without trouble.
    assert len(checkpoint_identity({}, {"a": BYTES})) == 32


@pytest.mark.parametrize(("value", "found"), [
    (np.ones(3, dtype=np.float32), "numpy.ndarray"),
    ([1.0, 2.0], "list"),
    ({"b": T}, "dict"),  # nested weights: "a" -> "b" is no tensor named "a.b"
    (None, "NoneType"),
])
def test_a_weight_that_is_no_tensor_is_refused_naming_its_key_and_type(
        value: object, found: str) -> None:
    with pytest.raises(ConfigError) as raised:
        checkpoint_identity({}, {"embed.weight": T, "a": value})
    assert str(raised.value) == (f"checkpoint_identity(weights=...)['a']={found}: expected a "
                                 "torch.Tensor")


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated, not gone
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # nested tensors are a prototype
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])


@pytest.mark.parametrize(("tensor", "kind"), [
    (lambda: torch.ones(2, device="meta"), "meta tensor"),
    (lambda: torch.ones(2).to_sparse(), "sparse_coo tensor on cpu"),
    # Quantized tensors are strided: the refusal says what they are all the same.
    (_quantized, "quantized tensor on cpu"),
    (_nested, "nested tensor on cpu"),
])
def test_a_tensor_without_dense_values_is_refused_naming_its_key_and_kind(
        tensor: Callable[[], torch.Tensor], kind: str) -> None:
    with pytest.raises(ConfigError) as raised:
        checkpoint_identity({}, {"w": tensor()})
    assert str(raised.value) == (f"checkpoint_identity(weights=...)['w']={kind}: expected a "
                                 "dense (strided) tensor with values (not meta, sparse, "
                                 "quantized or nested)")


def test_conjugate_and_negative_views_hash_as_the_values_they_hold() -> None:
    # A view's bit is resolved, as a layout is: equal values, equal identities.
    z = torch.tensor([1 + 2j, 3 - 4j])
    assert checkpoint_identity({}, {"w": z.conj()}) == \
        checkpoint_identity({}, {"w": torch.tensor([1 - 2j, 3 + 4j])})
    assert checkpoint_identity({}, {"w": z.conj()}) != checkpoint_identity({}, {"w": z})
    y = torch.tensor([1.0, -2.0])
    negative = torch._neg_view(y)
    assert negative.is_neg()
    assert checkpoint_identity({}, {"w": negative}) == \
        checkpoint_identity({}, {"w": torch.tensor([-1.0, 2.0])})


def _deep(levels: int) -> dict[str, object]:
    config: dict[str, object] = {}
    inner = config
    for _ in range(levels):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    return config


@pytest.mark.parametrize(("settings", "message"), [
    ({"eps": float("nan")}, r"^checkpoint_identity\(config=\.\.\.\)\['eps'\]=nan: expected a "
                            r"JSON value: a finite number \(JSON has no NaN or infinity\)$"),
    ({"a": [1.0, float("-inf")]}, r"^checkpoint_identity\(config=\.\.\.\)\['a'\]\[1\]=-inf: "
                                  r"expected a JSON value: a finite number"),
    ({"a": np.float64("inf")}, r"^checkpoint_identity\(config=\.\.\.\)\['a'\]=inf: "),
    ({"a": 10**5000}, r"^checkpoint_identity\(config=\.\.\.\)\['a'\]=an int of 16610 bits: "
                      r"expected an int of at most \d+ decimal digits"),
    (_deep(5000), r"^checkpoint_identity\(config=\.\.\.\)\['a'\].*\.\.\..*\['a'\]=dict: "
                  r"expected a JSON value nested at most 100 levels deep$"),
])
def test_a_config_json_cannot_write_as_itself_is_refused_naming_the_key_path(
        settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        checkpoint_identity(settings, {})
    assert "\n" not in str(raised.value)
    assert len(str(raised.value)) < 400


def test_a_config_nested_as_deep_as_allowed_hashes() -> None:
    assert len(checkpoint_identity(_deep(100), {})) == 32


def test_a_parent_that_is_no_str_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint_identity\(parent=\.\.\.\)=NoneType: "
                                          r"expected a str"):
        checkpoint_identity({}, {"w": T}, parent=None)  # type: ignore[arg-type]


# --- the value members of Runtime(models=...) --------------------------------------------------

class Changed:
    """A model of the engine's that is the reference one with some members changed."""

    def __init__(self, model: object, **changed: object) -> None:
        self._model = model
        self._changed = changed

    def __getattr__(self, name: str) -> object:
        if name in self._changed:
            return self._changed[name]
        return getattr(self._model, name)


@pytest.mark.parametrize(("part", "member", "value", "expected"), [
    ("target", "identity", None, "expected a non-empty printable str"),
    ("target", "identity", "", "expected a non-empty printable str"),
    ("target", "identity", "a\nb", "expected a non-empty printable str"),
    ("target", "vocab_size", 0, "expected a positive int"),
    ("target", "vocab_size", -96, "expected a positive int"),
    ("target", "vocab_size", "96", "expected a positive int"),
    ("target", "vocab_size", 96.0, "expected a positive int"),
    ("target", "vocab_size", True, "expected a positive int"),
    # The event log writes it as JSON, which a numpy integer would break mid-run.
    ("target", "context_limit", np.int64(1024), "expected an int >= 2"),
    ("target", "context_limit", 1, "expected an int >= 2"),
    ("target", "hidden_size", 0, "expected a positive int"),
    ("target", "dtype", "float32", "expected a floating torch.dtype"),
    ("target", "dtype", torch.int64, "expected a floating torch.dtype"),
    ("mtp", "identity", 7, "expected a non-empty printable str"),
    ("dspark", "identity", b"id", "expected a non-empty printable str"),
])
def test_runtime_start_refuses_a_model_member_of_the_wrong_type_or_range(
        part: str, member: str, value: object, expected: str, models: ReferenceModels,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from adaspec.runtime import engine

    def no_stream(*args: object) -> None:
        raise AssertionError("a stream was opened before the models were checked")

    monkeypatch.setattr(engine, "open_stream", no_stream)
    algorithm = {"target": "MTP", "mtp": "MTP", "dspark": "DSpark"}[part]
    given = {"target": models.target, "mtp": models.mtp, "dspark": models.dspark}
    given[part] = Changed(given[part], **{member: value})
    runtime = Runtime(config(algorithm, 3, 2), models=SimpleNamespace(**given))
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    message = str(raised.value)
    assert message.startswith(f"Runtime(models=...).{part}.{member}={value!r}: {expected}")
    kind = type(value)
    assert message.endswith(
        f"; got type {kind.__module__}.{kind.__qualname__}".replace("builtins.", ""))
    assert "\n" not in message


def test_a_model_set_of_plain_engine_values_starts_and_decodes(models: ReferenceModels) -> None:
    target = Changed(models.target, identity="engine-target@v2")
    runtime = Runtime(config("MTP", 2, 2),
                      models=SimpleNamespace(target=target, mtp=models.mtp, dspark=None))

    async def run() -> int:
        await runtime.start()
        try:
            result = await runtime.submit(list(b"ROMEO."), SamplingParams(
                temperature=0.0, max_tokens=6)).result()
        finally:
            await runtime.stop()
        return len(result.token_ids)

    assert asyncio.run(run()) == 6


@pytest.mark.parametrize("hidden_size", [2**40, 2**63])  # the last past a 64-bit size
def test_a_hidden_size_whose_rows_cannot_be_allocated_is_refused_naming_it(
        models: ReferenceModels, hidden_size: int) -> None:
    target = Changed(models.target, hidden_size=hidden_size)
    message = _start_refusal(SimpleNamespace(target=target, mtp=models.mtp, dspark=None))
    assert message == (f"Runtime(models=...).target.hidden_size={hidden_size}: the hidden "
                       f"states of its 5 KV slot rows ({5 * hidden_size * 4} bytes) cannot be "
                       "allocated on cpu; "
                       "expected the width of the target's hidden states, or fewer sequences "
                       "per batch")


class AsyncVerify(Changed):
    """A target whose verify is a coroutine function: its coroutines are no TargetOutput."""

    async def verify(self, rows: Any) -> Any:
        return self._model.verify(rows)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["hidden_size", "None", "async"])
def test_a_target_whose_prewarmed_verify_breaks_the_protocol_is_refused_at_start(
        models: ReferenceModels, kind: str) -> None:
    """The start runs every verify shape once: what it returns is checked there, so the
    model is refused before a request is taken, not at its first request."""
    hidden = models.target.hidden_size
    target: object = {
        "hidden_size": Changed(models.target, hidden_size=hidden + 1),
        "None": Changed(models.target, verify=lambda rows: None),
        "async": AsyncVerify(models.target)}[kind]
    runtime = Runtime(config("MTP", 2, 2),
                      models=SimpleNamespace(target=target, mtp=models.mtp, dspark=None))
    with pytest.raises(ModelOutputError) as raised:
        asyncio.run(runtime.start())
    assert re.fullmatch({
        "hidden_size": rf"target\.verify \(prewarmed at start\) returned hidden of shape "
                       rf"\[(\d+), {hidden}\]: expected \[\1, {hidden + 1}\] "
                       r"\(\[G, hidden_size\]\)",
        "None": r"target\.verify \(prewarmed at start\) returned a value of type NoneType: "
                r"expected a TargetOutput \(logits, hidden\)",
        "async": r"target\.verify \(prewarmed at start\) returned a value of type coroutine: "
                 r"expected a TargetOutput \(logits, hidden\)"}[kind], str(raised.value))


# --- a model's own error text ------------------------------------------------------------------

class FailingVerify(Changed):
    """A target whose verify fails, once the runtime has started (and prepared its shapes),
    with the kind of report a device error gives: an escape sequence, several lines."""

    active = False

    def verify(self, rows: Any) -> Any:
        if self.active:
            raise RuntimeError("\x1b[2Jdevice lost\r\nsecond line of the report")
        return self._model.verify(rows)  # type: ignore[attr-defined]


def test_a_models_error_text_reaches_the_request_error_on_one_line_escaped(
        models: ReferenceModels) -> None:
    target = FailingVerify(models.target)
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert message.isprintable()
    assert "\\x1b[2Jdevice lost" in message


# --- numpy numbers in SamplingParams -------------------------------------------------------------

def test_numpy_sampling_values_decode_and_are_logged_as_plain_numbers(
        models: ReferenceModels, tmp_path: Path) -> None:
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(20),
                            top_p=np.float64(0.9), min_p=np.float16(0.0),
                            max_tokens=np.int32(5), stop=(np.int64(255),))
    log = tmp_path / "events.jsonl"
    runtime = Runtime(config("MTP", 2, 2), models=models,
                      options=RuntimeOptions(seed=3, event_log=str(log)))

    async def run() -> int:
        await runtime.start()
        try:
            result = await runtime.submit(list(b"ROMEO."), params).result()
        finally:
            await runtime.stop()
        return len(result.token_ids)

    assert asyncio.run(run()) >= 1
    arrived = [event for event in map(json.loads, log.read_text().splitlines())
               if event.get("kind") == "request_arrived"]
    assert len(arrived) == 1
    assert arrived[0]["sampling"] == {"temperature": 0.5, "top_k": 20, "top_p": 0.9,
                                      "min_p": 0.0, "max_tokens": 5, "stop": [255]}



# --- members that raise, num_kv_slots after allocate ---------------------------------------------

class RaisingIdentity(Changed):
    """A model whose identity property fails when read."""

    @property
    def identity(self) -> str:
        raise RuntimeError("checkpoint hash not computed\nsecond line")


@pytest.mark.parametrize("part", ["target", "mtp"])
def test_a_model_member_that_raises_is_refused_naming_it_and_the_error(
        part: str, models: ReferenceModels, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaspec.runtime import engine

    def no_stream(*args: object) -> None:
        raise AssertionError("a stream was opened before the models were checked")

    monkeypatch.setattr(engine, "open_stream", no_stream)
    given: dict[str, Any] = {"target": models.target, "mtp": models.mtp, "dspark": None}
    given[part] = RaisingIdentity(given[part])
    runtime = Runtime(config("MTP", 2, 2), models=SimpleNamespace(**given))
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    assert str(raised.value) == (f"Runtime(models=...).{part}.identity: reading it raised "
                                 "RuntimeError: checkpoint hash not computed\\nsecond line; "
                                 "expected a member that can be read")


class Flaky(Changed):
    """A model whose value members hold only on their first read: later reads raise (its
    vocab_size) or change (its identity, its context limit)."""

    def __init__(self, model: object) -> None:
        super().__init__(model)
        self.reads: dict[str, int] = {}

    def _read(self, name: str) -> int:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.reads[name]

    @property
    def vocab_size(self) -> int:
        if self._read("vocab_size") > 1:
            raise RuntimeError("vocab_size read twice")
        return self._model.vocab_size  # type: ignore[attr-defined, no-any-return]

    @property
    def identity(self) -> str:
        return f"engine-target@v{self._read('identity')}"

    @property
    def context_limit(self) -> int:
        return 1024 if self._read("context_limit") == 1 else 3


def test_a_runtime_runs_on_the_model_values_it_checked_reading_each_once(
        models: ReferenceModels, tmp_path: Path) -> None:
    target = Flaky(models.target)
    log = tmp_path / "run.jsonl"
    runtime = Runtime(config("MTP", 2, 2), options=RuntimeOptions(event_log=str(log)),
                      models=SimpleNamespace(target=target, mtp=models.mtp, dspark=None))

    async def run() -> list[int]:
        await runtime.start()
        try:
            handle = runtime.submit(list(b"ROMEO."), SamplingParams(temperature=0.0,
                                                                    max_tokens=6))
            return (await handle.result()).token_ids
        finally:
            await runtime.stop()

    assert len(asyncio.run(run())) == 6
    assert target.reads == {"vocab_size": 1, "identity": 1, "context_limit": 1}
    header = json.loads(log.read_text().splitlines()[0])
    assert (header["models"]["target"], header["context_limit"]) == ("engine-target@v1", 1024)


def _start_refusal(given: SimpleNamespace, batch: int = 2) -> str:
    runtime = Runtime(config("MTP", 2, batch), models=given)
    with pytest.raises(ConfigError) as raised:
        asyncio.run(runtime.start())
    message = str(raised.value)
    assert "\n" not in message
    return message


SLOTS_4 = ("expected 4 after allocate(4): 4 + 1 KV slots, 0 .. 3 for requests and 4 the "
           "scratch KV slot")


@pytest.mark.parametrize(("num_kv_slots", "tail"), [
    # One short: the scratch KV slot, that padding writes, would be a request's slot.
    (3, " (with fewer, the scratch KV slot would be a request's); allocate left it unchanged"),
    (5, "; allocate left it unchanged"),
    (10**6, "; allocate left it unchanged"),
    ("many", "; got type str"),
    (4.0, "; got type float"),
])
def test_a_target_num_kv_slots_other_than_allocate_asked_for_is_refused(
        num_kv_slots: object, tail: str, models: ReferenceModels) -> None:
    target = Changed(models.target, num_kv_slots=num_kv_slots)
    message = _start_refusal(SimpleNamespace(target=target, mtp=models.mtp, dspark=None))
    assert message == f"Runtime(models=...).target.num_kv_slots={num_kv_slots!r}: {SLOTS_4}{tail}"


def test_an_allocate_that_does_nothing_is_refused() -> None:
    fresh = load_reference_models()  # never allocated: num_kv_slots is 0
    target = Changed(fresh.target, allocate=lambda num_kv_slots: None)
    message = _start_refusal(SimpleNamespace(target=target, mtp=fresh.mtp, dspark=None))
    assert message == (f"Runtime(models=...).target.num_kv_slots=0: {SLOTS_4} (with fewer, the "
                       "scratch KV slot would be a request's); allocate left it unchanged")


def test_a_drafter_that_tells_another_num_kv_slots_is_refused(models: ReferenceModels) -> None:
    drafter = Changed(models.mtp, num_kv_slots=2)
    message = _start_refusal(SimpleNamespace(target=models.target, mtp=drafter, dspark=None))
    assert message == (f"Runtime(models=...).mtp.num_kv_slots=2: {SLOTS_4} (with fewer, the "
                       "scratch KV slot would be a request's); allocate left it unchanged")


# --- outputs of the wrong shape -------------------------------------------------------------------

class Rewired(Changed):
    """A model whose ``method`` output goes through ``change`` once the runtime has started
    (so the shapes the start prepares are the model's own)."""

    def __init__(self, model: object, method: str, change: Callable[[Any], Any]) -> None:
        super().__init__(model)
        self._method = method
        self._change = change
        self.active = False

    def __getattr__(self, name: str) -> object:
        real = getattr(self._model, name)
        if name != self._method:
            return real

        def call(*args: Any) -> Any:
            out = real(*args)
            return self._change(out) if self.active else out

        return call


def _failure(given: SimpleNamespace, algorithm: str, rewired: "Rewired | FailingVerify"
             ) -> str:
    """The one-line reason the first request fails for, once ``rewired`` is switched on."""
    runtime = Runtime(config(algorithm, 3, 2), models=given)

    def switch_on() -> None:
        rewired.active = True

    return first_failure(runtime, 6, switch_on)


@pytest.mark.parametrize("lengths", [torch.int32, torch.int8])
def test_outputs_the_protocol_allows_decode_as_the_models_own(models: ReferenceModels,
                                                               lengths: torch.dtype) -> None:
    # A prefill padded past the longest prompt with lengths of any integer dtype (int8 cannot
    # hold the context limit of 1024, which the runtime compares them with), int32 draft ids
    # and drafter logits over another vocabulary (never read) are all the protocol's: they
    # decode as before.
    target = Rewired(models.target, "prefill", lambda out: type(out)(
        last=out.last, lengths=out.lengths.to(lengths),
        hidden=torch.nn.functional.pad(out.hidden, (0, 0, 0, 3))))
    drafter = Rewired(models.mtp, "step", lambda out: type(out)(
        hidden=out.hidden, token_ids=out.token_ids.to(torch.int32), probs=out.probs,
        logits=out.logits[:, :7]))
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    async def run(given: SimpleNamespace, rewired: list[Rewired]) -> tuple[int, ...]:
        runtime = Runtime(config("MTP", 3, 2), models=given)
        await runtime.start()
        for model in rewired:
            model.active = True
        try:
            return tuple((await runtime.submit(list(b"ROMEO."), greedy).result()).token_ids)
        finally:
            await runtime.stop()

    own = asyncio.run(run(SimpleNamespace(target=models.target, mtp=models.mtp, dspark=None),
                          []))
    assert asyncio.run(run(SimpleNamespace(target=target, mtp=drafter, dspark=None),
                           [target, drafter])) == own


@pytest.mark.parametrize(("change", "field", "got", "wanted"), [
    (lambda out: type(out)(last=out.last, hidden=out.hidden.double(), lengths=out.lengths),
     "hidden", "of dtype torch.float64",
     r"\[1, 6, \d+\] \(\[B, T, hidden_size\], T at least the longest prompt\) in "
     r"torch\.float32 \(the target's dtype\)"),
    (lambda out: type(out)(last=out.last, hidden=out.hidden, lengths=out.lengths.to("meta")),
     "lengths", "on meta", r"\[1\] \(\[B\]\) of an integer dtype on cpu"),
], ids=["hidden", "lengths"])
def test_prefill_hidden_in_another_dtype_or_lengths_elsewhere_fail_the_prefill_naming_them(
        models: ReferenceModels, change: Any, field: str, got: str, wanted: str) -> None:
    """A drafter reads the prompt's hidden states beside the verify rows' (so in their dtype),
    and the runtime compares the lengths on its device."""
    target = Rewired(models.target, "prefill", change)
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert re.search(rf"prefill failed: ModelOutputError: target\.prefill returned {field} "
                     rf"{got}: expected {wanted}$", message), message


def test_verify_logits_of_the_wrong_shape_fail_the_round_naming_both_shapes(
        models: ReferenceModels) -> None:
    target = Rewired(models.target, "verify", lambda out: type(out)(
        logits=out.logits[:, :10], hidden=out.hidden))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    vocab = models.target.vocab_size
    assert re.search(r"round \d+ failed in verify: ModelOutputError: target\.verify returned "
                     rf"logits of shape \[(\d+), 10\]: expected \[\1, {vocab}\] "
                     r"\(\[G, vocab_size\]\)$", message), message


def test_verify_hidden_in_another_dtype_fails_the_round_naming_both(
        models: ReferenceModels) -> None:
    """The hidden states of verified rows are stored beside the target's own: another dtype
    would fail later inside commit with torch's message; it fails at verify, named."""
    target = Rewired(models.target, "verify", lambda out: type(out)(
        logits=out.logits, hidden=out.hidden.double()))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert re.search(r"failed in verify: ModelOutputError: target\.verify returned hidden of "
                     r"dtype torch\.float64: expected \[\d+, \d+\] \(\[G, hidden_size\]\) in "
                     r"torch\.float32 \(the target's dtype\)$", message), message


@pytest.mark.parametrize(("change", "got", "wanted"), [
    (lambda logits: logits > 0, "of dtype torch.bool", " of a floating dtype"),
    (lambda logits: logits.to(torch.complex64), "of dtype torch.complex64",
     " of a floating dtype"),
    (lambda logits: logits.to("meta"), "on meta", " on cpu"),
])
def test_verify_logits_of_no_floating_dtype_or_on_another_device_fail_the_round_naming_them(
        models: ReferenceModels, change: Any, got: str, wanted: str) -> None:
    """The sampler would fail on them with torch's message, blamed on the sample stage."""
    target = Rewired(models.target, "verify", lambda out: type(out)(
        logits=change(out.logits), hidden=out.hidden))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert re.search(rf"failed in verify: ModelOutputError: target\.verify returned logits "
                     rf"{got}: expected \[\d+, \d+\] \(\[G, vocab_size\]\){wanted}$",
                     message), message


def test_verify_returning_no_target_output_fails_the_round_naming_its_type(
        models: ReferenceModels) -> None:
    target = Rewired(models.target, "verify", lambda out: (out.logits, out.hidden))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert message.endswith("failed in verify: ModelOutputError: target.verify returned a "
                            "value of type tuple: expected a TargetOutput (logits, hidden)"), \
        message


@pytest.mark.parametrize(("algorithm", "method", "message"), [
    ("MTP", "step", "mtp.step returned a value of type tuple: expected an MtpStep (hidden, "
     "token_ids, probs)"),
    ("DSpark", "draft", "dspark.draft returned a value of type tuple: expected a DSparkBlock "
     "(token_ids, confidences)"),
])
def test_a_drafter_returning_a_tuple_fails_the_round_naming_its_type(
        models: ReferenceModels, algorithm: str, method: str, message: str) -> None:
    name = algorithm.lower()
    drafter = Rewired(getattr(models, name), method, lambda out: tuple(
        getattr(out, field.name) for field in dataclasses.fields(out)))
    given = SimpleNamespace(**{"target": models.target, "mtp": None, "dspark": None,
                               name: drafter})
    failure = _failure(given, algorithm, drafter)
    assert failure.endswith(f"ModelOutputError: {message}"), failure


def test_prefill_returning_no_prefill_output_fails_the_prefill_naming_its_type(
        models: ReferenceModels) -> None:
    target = Rewired(models.target, "prefill", lambda out: {
        "last": out.last, "hidden": out.hidden, "lengths": out.lengths})
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert message.endswith("prefill failed: ModelOutputError: target.prefill returned a value "
                            "of type dict: expected a PrefillOutput (last, hidden, lengths)"), \
        message


def test_verify_with_too_few_rows_fails_the_round(models: ReferenceModels) -> None:
    target = Rewired(models.target, "verify", lambda out: type(out)(
        logits=out.logits[:1], hidden=out.hidden[:1]))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    assert re.search(r"target\.verify returned logits of shape \[1, \d+\]: expected "
                     r"\[\d+, \d+\] \(\[G, vocab_size\]\)$", message), message


def test_prefill_hidden_of_the_wrong_shape_fails_the_prefill(models: ReferenceModels) -> None:
    target = Rewired(models.target, "prefill", lambda out: type(out)(
        last=out.last, hidden=out.hidden[:, :1], lengths=out.lengths))
    message = _failure(SimpleNamespace(target=target, mtp=models.mtp, dspark=None), "MTP",
                       target)
    hidden = models.target.hidden_size
    assert message.endswith(f"prefill failed: ModelOutputError: target.prefill returned hidden "
                            f"of shape [1, 1, {hidden}]: expected [1, 6, {hidden}] ([B, T, "
                            "hidden_size], T at least the longest prompt) in torch.float32 "
                            "(the target's dtype)"), message


def test_mtp_draft_tokens_of_the_wrong_shape_fail_the_round(models: ReferenceModels) -> None:
    drafter = Rewired(models.mtp, "step", lambda out: type(out)(
        hidden=out.hidden, token_ids=out.token_ids[:, None], probs=out.probs,
        logits=out.logits))
    message = _failure(SimpleNamespace(target=models.target, mtp=drafter, dspark=None), "MTP",
                       drafter)
    assert re.search(r"failed in draft: ModelOutputError: mtp\.step returned token_ids of shape "
                     r"\[(\d+), 1\]: expected \[\1\] \(\[N\]\) of an integer dtype$", message), \
        message


def test_a_dspark_block_of_the_wrong_width_fails_the_round(models: ReferenceModels) -> None:
    drafter = Rewired(models.dspark, "draft", lambda out: type(out)(
        token_ids=out.token_ids, confidences=out.confidences[:, :1], logits=out.logits))
    message = _failure(SimpleNamespace(target=models.target, mtp=None, dspark=drafter),
                       "DSpark", drafter)
    assert re.search(r"failed in draft: ModelOutputError: dspark\.draft returned confidences of "
                     r"shape \[(\d+), 1\]: expected \[\1, 3\] \(\[N, width\]\)$", message), message
