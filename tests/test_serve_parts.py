"""The server's parts on their own: stop strings over a stream of byte tokens, the request
reader, and a server whose runtime has not started yet (on a real socket)."""

import asyncio
import contextlib
import gzip
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from gloo_job import PROCESS_LIMIT_S, REPO, peer_environment
from rank_launch import free_port

from adaspec.bench.load import (
    HttpTarget,
    LevelRun,
    LoadError,
    client_session,
    closed_loop,
    request_limit_s,
    served_model,
)
from adaspec.bench.url import report_text
from adaspec.config import SamplingParams, load_config
from adaspec.errors import AdaspecError, ConfigError
from adaspec.models.tokenizer import ByteTokenizer
from adaspec.runtime.engine import Runtime
from adaspec.runtime.events.types import RequestFinished
from adaspec.serve.app import DRAINING, READY, CompletionServer, ServeSettings, decoded_body
from adaspec.serve.protocol import MAX_BODY_BYTES, ApiError, parse_body, read_completion
from adaspec.serve.server import (
    Signals,
    _serve_until_drained,
    _start_unless_signalled,
    app_runner,
    json_logger,
    loop_errors,
)
from adaspec.serve.text import CompletionText


def _pieces(text: str, stops: list[str], sizes: list[int]) -> tuple[list[str], CompletionText]:
    """Feed ``text``'s UTF-8 bytes in chunks of ``sizes`` (cycled); the pieces sent."""
    tokens = list(text.encode("utf-8"))
    completion = CompletionText(ByteTokenizer().detokenizer(), stops)
    pieces, start, index = [], 0, 0
    while start < len(tokens) and not completion.stopped:
        size = sizes[index % len(sizes)]
        pieces.append(completion.feed(tokens[start:start + size]))
        start, index = start + size, index + 1
    pieces.append(completion.finish())
    return pieces, completion


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [7], [100]])
def test_the_text_stops_before_the_first_stop_string_however_the_tokens_come(
        sizes: list[int]) -> None:
    pieces, completion = _pieces("ab café, then the END and more END", ["END", "é,"], sizes)
    assert "".join(pieces) == completion.text == "ab caf"
    assert completion.stopped
    assert completion.num_tokens == len("ab café,".encode())  # through the stop's last byte


@pytest.mark.parametrize("sizes", [[1], [2], [5]])
def test_text_that_only_begins_a_stop_string_is_sent_once_it_cannot_be_one(
        sizes: list[int]) -> None:
    pieces, completion = _pieces("EN, ENDING? no: E", ["ENDS"], sizes)
    assert "".join(pieces) == "EN, ENDING? no: E"
    assert not completion.stopped
    for count in range(1, len(pieces)):  # never sends what may begin the stop string
        assert not "".join(pieces[:count]).endswith(("E", "EN", "END"))


def test_split_and_invalid_utf8_reads_as_one_decode_would() -> None:
    tokens = list("日本".encode()) + [0xFF, 0x41]
    completion = CompletionText(ByteTokenizer().detokenizer(), [])
    text = "".join(completion.feed([token]) for token in tokens) + completion.finish()
    assert text == bytes(tokens).decode("utf-8", "replace")
    assert completion.num_tokens == len(tokens)


def test_the_reader_keeps_openai_defaults_where_the_launch_allows_them() -> None:
    job = read_completion({"model": "m", "prompt": "hi"}, "m", temperature_rule=None)
    assert (job.params.temperature, job.params.max_tokens) == (1.0, 16)
    assert not job.stream
    job = read_completion({"model": "m", "prompt": [[1, 2], "x"], "stop": ["a", 7],
                           "stop_token_ids": [9], "top_k": -1, "temperature": 0.5},
                          "m", temperature_rule="adaptive verify")
    assert job.prompts == ((1, 2), "x")
    assert job.stop_strings == ("a",)
    assert job.params.stop == (7, 9)
    assert job.params.top_k == 0  # vLLM's -1: off
    # The limit counts distinct ids: a repeated one stops at nothing more.
    repeated = read_completion({"model": "m", "prompt": "hi", "stop_token_ids": [6] * 17},
                               "m", temperature_rule=None, eos_token_ids=(6,))
    assert repeated.params.stop == (6,)
    with pytest.raises(ApiError, match=r"^stop_token_ids=17 token ids: expected at most 16"):
        read_completion({"model": "m", "prompt": "hi", "stop_token_ids": list(range(17))},
                        "m", temperature_rule=None)
    # Ids given in ``stop`` alone are named by that field, the one the client sent.
    with pytest.raises(ApiError, match=r"^stop=17 token ids: expected at most 16") as info:
        read_completion({"model": "m", "prompt": "hi", "stop": list(range(17))},
                        "m", temperature_rule=None)
    assert info.value.param == "stop"
    with pytest.raises(ApiError, match=r"^user=u+\.\.\.: expected a string of at most 256"):
        read_completion({"model": "m", "prompt": "hi", "user": "u" * 257}, "m",
                        temperature_rule=None)


@pytest.mark.parametrize(("given", "shown"), [
    (5, "5"), (["m"], '["m"]'), ({"name": "m"}, '{"name": "m"}'), (True, "true")])
def test_a_model_that_is_no_string_is_a_400_not_a_missing_model(given: object,
                                                                  shown: str) -> None:
    """Before, 404 model_not_found, with the value as Python writes it."""
    with pytest.raises(ApiError) as info:
        read_completion({"model": given, "prompt": "hi"}, "m", temperature_rule=None)
    assert (info.value.status, info.value.param, info.value.code, info.value.message) == (
        400, "model", None, f"model={shown}: expected a string, the served model's name ('m')")
    with pytest.raises(ApiError) as info:
        read_completion({"model": "n", "prompt": "hi"}, "m", temperature_rule=None)
    assert (info.value.status, info.value.code) == (404, "model_not_found")


def test_the_servers_signals_go_back_to_the_handlers_they_had() -> None:
    """Before, they went back to the system's default: a SIGTERM while rank 0 stopped after
    a lost rank killed it (-15) with no line."""

    def command_handler(number: int, frame: object) -> None:  # the command's own
        raise AssertionError("not called here")

    async def take_and_give_back() -> object:
        loop = asyncio.get_running_loop()
        signals = Signals(json_logger(io.StringIO()))
        signals.install(loop)
        assert signal.getsignal(signal.SIGTERM) is not command_handler
        signals.remove(loop)
        return signal.getsignal(signal.SIGTERM)

    before = signal.signal(signal.SIGTERM, command_handler)
    try:
        assert asyncio.run(take_and_give_back()) is command_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_gzip_body_of_several_members_reads_as_gzip_d_reads_it() -> None:
    first, second = b'{"model": "m", ', b'"prompt": "hi"}'
    assert decoded_body(gzip.compress(first) + gzip.compress(second), "gzip") == first + second
    with pytest.raises(ApiError, match=r"\(data follows the compressed stream\)$"):
        decoded_body(gzip.compress(first) + b"junk", "gzip")
    with pytest.raises(ApiError, match=r"\(more than 64 gzip members\)$"):  # loop-holding
        decoded_body(gzip.compress(first) + gzip.compress(b" ", mtime=0) * 90000, "gzip")
    with pytest.raises(ApiError) as info:  # members that inflate past the limit together
        decoded_body(gzip.compress(b" " * (MAX_BODY_BYTES // 2 + 1)) * 2, "gzip")
    assert info.value.status == 413


def test_the_neutral_values_openai_clients_send_are_accepted_and_others_named() -> None:
    neutral = {"model": "m", "prompt": "hi", "response_format": {"type": "text"},
               "logit_bias": {"65": 0}}
    assert read_completion(neutral, "m", temperature_rule=None).params.temperature == 1.0
    for name, value in (("response_format", {"type": "json_object"}),
                        ("logit_bias", {"65": 0, "66": -2})):
        with pytest.raises(ApiError) as info:
            read_completion(neutral | {name: value}, "m", temperature_rule=None)
        assert (info.value.status, info.value.param) == (400, name)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n", "1", "n=1: one completion per prompt is supported; expected 1, not a JSON string"),
    ("echo", "false", "echo=false: echoing the prompt is not supported; expected false, not a "
                      "JSON string"),
    ("stream", "false", "stream=false: expected true or false, not a JSON string"),
    ("stream_options", {"include_usage": "true"},
     "stream_options.include_usage=true: expected true or false, not a JSON string"),
    # A string that reads as no neutral value is not told apart from one.
    ("suffix", "", "suffix='': suffixes (insertion) are not supported; expected null"),
    ("stream", "yes", "stream=yes: expected true or false"),
    ("presence_penalty", "0.0", "presence_penalty=0.0: non-neutral penalties are not "
                                "supported (the verifier samples the plain target "
                                "distribution); expected null or 0, not a JSON string"),
    # An integer field's 1.0 is no 1, as max_tokens=8.0 is no 8.
    ("n", 1.0, "n=1.0: one completion per prompt is supported; expected 1"),
    ("min_tokens", 0.0, "min_tokens=0.0: minimum-length stops are not supported; expected "
                        "null or 0"),
    ("top_logprobs", 0.0, "top_logprobs=0.0: logprobs are not supported; expected null or 0"),
    ("max_tokens", "1", "max_tokens=1: expected an integer, not a JSON string"),
    # vLLM's -1 for off is read too, so the range says so; a bias shows as JSON spells it.
    ("top_k", -2, "top_k=-2: expected an integer in 0..2147483647 (0 or -1: off)"),
    ("logit_bias", {"5": 1}, 'logit_bias={"5": 1}: token bias is not supported; expected {} '
                             "or a bias of 0 on each token id (a string of digits)"),
])
def test_a_neutral_value_of_another_json_kind_is_refused_naming_the_kind(
        field: str, value: object, message: str) -> None:
    stream = {"stream": True} if field == "stream_options" else {}
    with pytest.raises(ApiError) as info:
        read_completion({"model": "m", "prompt": "hi", **stream, field: value}, "m",
                        temperature_rule=None)
    assert str(info.value) == message


@pytest.mark.parametrize(("raw", "param", "message"), [
    # 1e-400 reads as 0.0: a temperature of it would decode greedily, unasked.
    (b'{"temperature": 1e-400}', "temperature", "temperature: 1e-400 is a nonzero number "
     "below the smallest double; expected 0 or a number a double can hold"),
    (b'{"logit_bias": {"7": 1e400}}', "logit_bias", "logit_bias.7: 1e400 is beyond a double; "
     "expected a finite number"),
    (b'{"stop_token_ids": [3, -2.5E-999]}', "stop_token_ids", "stop_token_ids[1]: -2.5E-999 "
     "is a nonzero number below the smallest double; expected 0 or a number a double can hold"),
])
def test_a_number_no_double_holds_is_refused_naming_where_it_stands(
        raw: bytes, param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


def test_a_number_no_double_holds_deep_in_the_body_is_named_in_a_short_line() -> None:
    with pytest.raises(ApiError) as info:
        parse_body(b'{"x": ' + b"[" * 900 + b"1e400" + b"]" * 900 + b"}")
    assert info.value.message.startswith("x[0][0]"), info.value.message
    assert info.value.message.endswith("]: 1e400 is beyond a double; expected a finite number")
    assert len(info.value.message) < 200


ID_ARRAY = ("expected a token id (an integer): an array that starts with a number is one "
            "prompt's token ids")


@pytest.mark.parametrize(("prompt", "message"), [
    ([65, 66.0], f"prompt[1]=66.0: {ID_ARRAY}"),
    ([65, "B"], f"prompt[1]=B: {ID_ARRAY}"),
    ([65.0, 66], f"prompt[0]=65.0: {ID_ARRAY}"),
    (["A", 66], "prompt[1]=66: expected a non-empty string or a non-empty array of token ids"),
    ([[65], [66, True]], "prompt[1][1]=true: expected a token id (an integer)"),
])
def test_an_item_of_a_prompt_array_is_named_by_what_the_array_holds(
        prompt: list[object], message: str) -> None:
    with pytest.raises(ApiError) as info:
        read_completion({"model": "m", "prompt": prompt}, "m", temperature_rule=None)
    assert (info.value.status, info.value.message) == (400, message)


def test_json_constants_and_scalars_are_no_request() -> None:
    for raw, words in ((b"Infinity", "not JSON"), (b"1", "JSON number"), (b"null", "null")):
        with pytest.raises(ApiError, match=words) as info:
            parse_body(raw)
        assert info.value.status == 400


@pytest.mark.asyncio
async def test_a_server_still_starting_says_so_and_refuses_completions() -> None:
    runtime = Runtime(load_config({}))  # never started
    server = CompletionServer(runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None))
    async with TestClient(TestServer(server.app())) as client:
        health = await client.get("/health")
        assert (health.status, await health.json()) == (503, {"status": "starting"})
        refused = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert refused.status == 503
        assert refused.headers["Retry-After"] == "1"
        assert "starting" in (await refused.json())["error"]["message"]
        scraped = await client.get("/metrics")  # nothing counted yet, but it answers
        assert scraped.status == 200
        assert "adaspec_http_requests_total" in await scraped.text()


@pytest.mark.asyncio
async def test_a_client_that_closes_after_the_whole_completion_is_counted_answered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client may close once the finish and usage chunks are in (adaspec's bench does): the
    request was answered, so it counts as 200, not as a client gone away (499). The write of
    ``data: [DONE]`` fails as it does on a closed connection: an injected fault."""
    written = web.StreamResponse.write

    async def closed_before_done(self: web.StreamResponse, data: bytes) -> None:
        if data == b"data: [DONE]\n\n":
            raise ConnectionResetError("Cannot write to closing transport")
        await written(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closed_before_done)
    runtime = Runtime(load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                                   "max_seqs_per_batch": 2}))
    await runtime.start()
    server = CompletionServer(runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None))
    server.state = READY
    try:
        async with TestClient(TestServer(server.app())) as client:
            answer = await client.post("/v1/completions", json={
                "model": "m", "prompt": "Once", "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}})
            body = await answer.text()
            assert '"completion_tokens": 6' in body.replace('":', '": ')
            assert "[DONE]" not in body
            scraped = await (await client.get("/metrics")).text()
    finally:
        await runtime.stop()
    counted = {line.split()[0]: float(line.split()[1]) for line in scraped.splitlines()
               if line.startswith("adaspec_http_requests_total{")}
    assert counted == {'adaspec_http_requests_total{status="200"}': 1.0}


class _HeldTokenizer(ByteTokenizer):
    """An injected slow encoding: the prompt ``held`` encodes only once ``release`` is set,
    or after 10 s (when the encoding ran on the event loop, nothing else could set it)."""

    def __init__(self) -> None:
        self.began, self.release = threading.Event(), threading.Event()
        self.released = False

    def encode(self, text: str) -> list[int]:
        if text == "held":
            self.began.set()
            self.released = self.release.wait(timeout=10)
        return super().encode(text)


@pytest.mark.asyncio
async def test_a_prompt_being_encoded_stalls_no_other_request() -> None:
    runtime = Runtime(load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                                   "max_seqs_per_batch": 2}))
    await runtime.start()
    tokenizer = _HeldTokenizer()
    server = CompletionServer(runtime, tokenizer, ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None))
    server.state = READY
    try:
        async with TestClient(TestServer(server.app())) as client:
            held = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": "m", "prompt": "held", "max_tokens": 2}))
            assert await asyncio.to_thread(tokenizer.began.wait, 10)
            other = await client.post("/v1/completions", json={"model": "m", "prompt": [65],
                                                               "max_tokens": 2})
            assert other.status == 200
            tokenizer.release.set()
            assert (await held).status == 200
    finally:
        server.close()
        await runtime.stop()
    assert tokenizer.released, "the other request was answered only after the encoding"


@pytest_asyncio.fixture
async def mtp_runtime() -> AsyncIterator[Runtime]:
    runtime = Runtime(load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                                   "max_seqs_per_batch": 2}))
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


class SignalledAsItStarts(Runtime):  # the fault: the signal comes as the start ends
    def __init__(self, drain: asyncio.Event, fails: bool) -> None:
        super().__init__(load_config({"speculative_algorithm": "MTP",
                                      "num_speculative_tokens": 3}))
        self.drain, self.fails = drain, fails

    async def start(self) -> None:
        await super().start()
        self.drain.set()
        if self.fails:  # as a start's collective fails once the signalled peer rank left
            raise AdaspecError("collective tp_all_reduce over ranks [0, 1] failed; rank 1 "
                               "stopped")


@pytest.mark.asyncio
@pytest.mark.parametrize("fails", [False, True], ids=["ended", "failed"])
async def test_a_signal_that_comes_as_the_start_ends_still_abandons_it(fails: bool) -> None:
    """The signal's line has said the start is abandoned. Before, the ended start won: the
    server said it was ready, then drained; or it failed with the start's error, exit 2."""
    signals = Signals(json_logger(io.StringIO()))
    runtime = SignalledAsItStarts(signals.drain, fails)
    try:
        assert await _start_unless_signalled(runtime, signals) is False
    finally:
        await runtime.stop()
    assert (signals.starting, signals.started) == (False, False)


@pytest.mark.asyncio
async def test_a_signal_after_a_failed_start_does_not_say_it_abandons_the_start() -> None:
    """Round 34: the start failed, then the signal (handled while the server closed) said
    the start was abandoned, above the start's error."""
    logged = io.StringIO()
    signals = Signals(json_logger(logged))
    runtime = Runtime(load_config({"speculative_algorithm": "MTP", "num_speculative_tokens": 3,
                                   "max_seqs_per_batch": 65536}))  # refused at the start
    try:
        with pytest.raises(ConfigError, match="--max_seqs_per_batch=65536"):
            await _start_unless_signalled(runtime, signals)
    finally:
        await runtime.stop()
    signals._received(signal.SIGTERM)
    assert signals.drain.is_set()
    assert logged.getvalue() == ""


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


@pytest.mark.asyncio
async def test_a_body_that_stalls_is_a_408_and_the_requests_user_is_logged(
        mtp_runtime: Runtime) -> None:
    """The read timeout is set short here (0.2 s), as a stalled client meets the 60 s one."""
    logged = io.StringIO()
    server = CompletionServer(mtp_runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None, read_timeout_s=0.2),
        json_logger(logged))
    server.state = READY
    async with TestClient(TestServer(server.app())) as client:
        answer = await client.post("/v1/completions", json={
            "model": "m", "prompt": "hi", "max_tokens": 2, "user": "alice"})
        assert answer.status == 200

        async def stalled() -> AsyncIterator[bytes]:
            yield b'{"model": "m", '
            await asyncio.Event().wait()  # the rest never comes

        answer = await client.post("/v1/completions", data=stalled(),
                                   headers={"Content-Type": "application/json"})
        assert answer.status == 408
        assert (await answer.json())["error"]["message"] == \
            "the request body did not come whole within 0.2 s"
    server.close()
    lines = [line for line in _lines(logged) if line["event"] == "completion"]
    assert [(line["status"], line["user"]) for line in lines] == [(200, "alice"), (408, None)]


@pytest.mark.asyncio
async def test_a_connection_that_never_sends_a_whole_request_head_is_closed() -> None:
    runtime = Runtime(load_config({}))  # never started: no request gets that far
    server = CompletionServer(runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None, read_timeout_s=0.2))
    runner = app_runner(server)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no blank line
        # Closed by the server: the read ends, with nothing answered (a limit bounds the
        # test should the server keep it open, as aiohttp's own setting would for an hour).
        assert await asyncio.wait_for(reader.read(), PROCESS_LIMIT_S) == b""
        writer.close()
    finally:
        await runner.cleanup()
        server.close()


def test_an_os_error_the_loop_meets_on_its_own_is_one_json_line() -> None:
    """The fault is injected as asyncio reports it when ``accept`` runs out of descriptors;
    any other loop error keeps asyncio's own report."""
    logged = io.StringIO()
    loop = asyncio.new_event_loop()
    try:
        handle = loop_errors(json_logger(logged))
        handle(loop, {"message": "socket.accept() out of system resource\nsocket: <...>",
                      "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    (line,) = _lines(logged)
    assert (line["event"], line["message"], line["error"]) == (
        "loop_error", "socket.accept() out of system resource",
        "OSError: [Errno 24] Too many open files")


@pytest.mark.asyncio
async def test_the_model_card_keeps_its_context_limit_while_draining(
        mtp_runtime: Runtime) -> None:
    server = CompletionServer(mtp_runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None))
    async with TestClient(TestServer(server.app())) as client:
        for state in (READY, DRAINING):
            server.state = state
            card = (await (await client.get("/v1/models")).json())["data"][0]
            assert card["max_model_len"] == mtp_runtime.context_limit
    server.close()


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaspec", "serve", *flags],
                          capture_output=True, text=True, env=peer_environment(), cwd=REPO,
                          timeout=PROCESS_LIMIT_S, check=False)


@pytest.mark.parametrize(("flags", "words"), [
    (["--max_queued_requests=0"], "--max_queued_requests=0: expected an integer in 1..65536"),
    (["--served_model_name= "], "--served_model_name=' ': expected a printable name"),
    (["--seed=-1"], "--seed=-1: expected an integer in 0.."),
    (["--port=0"], "--port=0"),
    (["--model=/models/llama"], "--model="),
    (["--max_queued=3"], "did you mean --max_queued_requests"),
    (["--host=256.1.1.1"], "--host=256.1.1.1: cannot"),
])
def test_bad_serve_flags_get_one_line_before_anything_listens(
        flags: list[str], words: str) -> None:
    done = _serve(*flags)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr


def test_a_port_in_use_is_named_before_any_model_loads() -> None:
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = _serve(f"--port={port}")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert lines == [f"adaspec serve: error: --port={port}: cannot listen on 127.0.0.1:{port}: "
                     "Address already in use"], done.stderr


# --- bench --url against a server that lies (a fake server is the point of these tests) ----
def _lying_app(models: object, usage: object) -> web.Application:
    async def listed(_: web.Request) -> web.Response:
        return web.json_response(models)

    async def completion(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for event in ({"choices": [{"text": "hi"}]}, {"choices": [], "usage": usage}):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", listed)
    app.router.add_post("/v1/completions", completion)
    return app


@pytest.mark.asyncio
@pytest.mark.parametrize(("models", "usage", "words"), [
    ({"data": [{"id": 5}]}, {"completion_tokens": 1}, "no list of models with string ids"),
    ({"data": "m"}, {"completion_tokens": 1}, "no list of models with string ids"),
    ({"data": [{"id": "m"}]}, {"completion_tokens": 1e30}, "no completion_tokens count"),
    ({"data": [{"id": "m"}]}, {"completion_tokens": 10**30},
     "completion_tokens=100000000000... (31 digits) for a request of max_tokens=4"),
])
async def test_bench_url_refuses_what_no_honest_server_reports(
        models: object, usage: object, words: str) -> None:
    async with TestServer(_lying_app(models, usage), host="127.0.0.1") as fake, \
            aiohttp.ClientSession() as session:
        url = str(fake.make_url("/"))

        async def bench_one() -> None:
            model = await served_model(url, session)
            await HttpTarget(url, model, session).complete(
                "x", SamplingParams(temperature=0, max_tokens=4))

        with pytest.raises(LoadError, match=re.escape(words)):
            await bench_one()


@pytest.mark.asyncio
async def test_bench_url_counts_json_nested_past_the_parser_as_a_failure() -> None:
    """An event or model list nested deeper than Python's parser follows is a server's fault:
    a failed request, or one line, never a RecursionError."""
    deep = b"[" * 100_000 + b"]" * 100_000
    async with TestServer(_broken_stream_app(b"data: " + deep + b"\n\n", {}),
                          host="127.0.0.1") as fake, aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == ["request 0: a stream event is nested too deeply to read: "
                          + repr(deep[:40])]

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=deep, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as session:
        with pytest.raises(LoadError, match="^GET /v1/models answered JSON nested too deeply "
                                            "to read$"):
            await served_model(str(fake.make_url("/")), session)


def _broken_stream_app(body: bytes, headers: dict[str, str]) -> web.Application:
    async def completion(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        await response.write(body)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    return app


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "headers", "words"), [
    (b"data: " + b"x" * (600 * 2**10) + b"\n\n", {}, "Got more than 524288 bytes"),
    (b"data: not gzip\n\n", {"Content-Encoding": "gzip"}, "Can not decode content-encoding: gzip"),
])
async def test_bench_url_counts_a_stream_aiohttp_cannot_parse_as_a_failed_request(
        body: bytes, headers: dict[str, str], words: str) -> None:
    async with TestServer(_broken_stream_app(body, headers), host="127.0.0.1") as fake, \
            aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.timings == [None]
    [error] = run.errors
    assert error.startswith("request 0: the response cannot be read: "), error
    assert words in error, error
    assert "\n" not in error, error
    assert len(error) < 200, error


def _events(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode())
                    + b"\n\n" for e in events)


CHUNK = {"choices": [{"index": 0, "text": "hi"}]}
LONG = b'{"choices": [], "usage": {"completion_tokens": ' + b"1" * 5000 + b"}}"
"""JSON still, with a number of more digits than Python reads."""
USAGE = {"choices": [], "usage": {"completion_tokens": 4}}


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "words"), [
    (_events(CHUNK, b"5", USAGE, b"[DONE]"), "a stream event is not a JSON object: b'5'"),
    (_events(CHUNK, b'"x"', USAGE, b"[DONE]"), "a stream event is not a JSON object: b'\"x\"'"),
    (_events(USAGE, b"[DONE]"), "the stream carried no completion choice, only other events"),
    (_events(CHUNK, USAGE), "the stream ended without data: [DONE] or a finish_reason; it "
                            "may have been cut short"),
    (_events(CHUNK, b"[DONE]", USAGE), "the stream ended without a usage chunk; the server "
                                       "must support stream_options.include_usage"),
    (_events({"choices": [{}]}, USAGE, b"[DONE]"), "a stream event's choice has no text string"),
    (_events(CHUNK, {"choices": [], "usage": {"completion_tokens": 0}}, b"[DONE]"),
     "the usage chunk counts completion_tokens=0 for a stream that carried text; expected "
     "at least 1"),
    (_events({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
             {"choices": [], "usage": {"completion_tokens": 0}}, b"[DONE]"),
     "the usage chunk counts completion_tokens=0 for a stream that carried a finished choice; "
     "expected at least 1"),
    (_events(CHUNK, USAGE, USAGE, b"[DONE]"), "the stream carried two usage chunks; expected one"),
    (_events(CHUNK, {"choices": [], "usage": {"completion_tokens": int("1" * 400)}},
             b"[DONE]"), "the usage chunk counts completion_tokens=111111111111... (400 digits) "
                         "for a request of max_tokens=4"),
    # A choice the server gave up (vLLM and SGLang say abort) is no completion.
    (_events(CHUNK, {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}, USAGE,
             b"[DONE]"), "the server gave the choice up: finish_reason='abort'"),
    (_events(CHUNK, {"choices": [{"index": 0, "text": "", "finish_reason": "Canceled"}]},
             USAGE, b"[DONE]"), "the server gave the choice up: finish_reason='Canceled'"),
    (_events(CHUNK, {"choices": [{"index": 0, "text": "", "finish_reason": 5}]}, USAGE,
             b"[DONE]"), "a choice's finish_reason is 5; expected a string or null"),
    (b"event: error\ndata: {\"message\": \"server exploded\"}\n\n" + _events(CHUNK, USAGE,
                                                                               b"[DONE]"),
     'an error event: {"message": "server exploded"}'),
    pytest.param(b"data: " + LONG + b"\n\n", f"a stream event holds a number too long to "
                 f"read: {LONG[:80]!r}", id="a-number-past-the-digit-limit"),
    # A stream without text that counts several tokens dropped its text; text after the
    # choice's finish_reason is no part of it.
    (_events({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, USAGE,
             b"[DONE]"), "the usage chunk counts completion_tokens=4 for a stream that "
                         "carried no text; a completion without text cannot be measured"),
    (_events({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}, CHUNK, USAGE,
             b"[DONE]"), "a stream event carries text after the choice's finish_reason; "
                         "expected none"),
    # The bench asks for one completion: another choice is no part of it.
    (_events({"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}, USAGE,
             b"[DONE]"), "a stream event carries 2 choices; the bench asks for one completion"),
    (_events({"choices": [{"index": 7, "text": "z", "finish_reason": "stop"}]}, USAGE,
             b"[DONE]"),
     "a stream event's choice has index=7; the bench asks for one completion, of index 0"),
    (_events({"choices": [{"index": "0", "text": "z"}]}, USAGE, b"[DONE]"),
     "a stream event's choice has index='0'; the bench asks for one completion, of index 0"),
    # A body that ends inside an event's line was cut there: its data is no JSON for that.
    (_events(CHUNK) + b'data: {"choices": [{"ind',
     "the stream ended in the middle of an event: b'{\"choices\": [{\"ind'"),
])
async def test_bench_url_counts_a_stream_that_is_no_whole_completion_as_a_failure(
        body: bytes, words: str) -> None:
    async with TestServer(_broken_stream_app(body, {}), host="127.0.0.1") as fake, \
            aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.timings == [None]
    assert run.errors == [f"request 0: {words}"]


@pytest.mark.asyncio
@pytest.mark.parametrize("content_type", ["application/json", ""])
async def test_bench_url_names_an_answer_that_is_no_event_stream(content_type: str) -> None:
    """A server that answers a stream request with one whole JSON completion does not
    stream: that is what the failure says, not that the stream was cut short."""
    body = json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                       "usage": {"completion_tokens": 1}}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    async with TestServer(_broken_stream_app(body, headers), host="127.0.0.1") as fake, \
            aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    shown = content_type or "application/octet-stream"
    assert run.errors == [f"request 0: the server answered the stream request with "
                          f"Content-Type {shown}, not an event stream (text/event-stream); "
                          "it must support stream: true"]


@pytest.mark.asyncio
@pytest.mark.parametrize("body", [
    # A finish_reason ends the choice: some servers close the stream there, with no [DONE].
    _events(CHUNK, {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
                    "usage": {"completion_tokens": 4}}),
    # Whatever follows [DONE] is no part of the completion.
    _events(CHUNK, USAGE, b"[DONE]", b"5", {"error": "late"}),
    # An error field that is null reports no error.
    _events({**CHUNK, "error": None}, USAGE, b"[DONE]"),
    # One event's data over several lines is joined (the event-stream format), comments and
    # other fields are skipped, and lines may end in CRLF.
    b'data: {"choices":\r\ndata: [{"index": 0, "text": "hi"}]}\r\n: ping\r\nid: 3\r\n\r\n'
    + _events(USAGE, b"[DONE]"),
    # TGI: an empty finish_reason before the last chunk, its own reason and the usage in it.
    _events({"choices": [{"index": 0, "text": "hi", "finish_reason": ""}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "eos_token"}],
             "usage": {"completion_tokens": 4}}, b"[DONE]"),
    # One token without text: the model ended at once (its end-of-sequence token).
    _events({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
            {"choices": [], "usage": {"completion_tokens": 1}}, b"[DONE]"),
    # A last event the body ends without its blank line is read.
    _events(CHUNK, USAGE) + b"data: [DONE]",
    # A byte-order mark may open the stream; an event of another type than message (a
    # server's own ping or progress) is no chunk of the completion.
    b"\xef\xbb\xbf" + _events(CHUNK) + b"event: progress\ndata: {\"done\": 0.5}\n\n"
    + b"event: message\n" + _events(USAGE, b"[DONE]"),
])
async def test_bench_url_takes_a_whole_completion_however_it_ends(body: bytes) -> None:
    async with TestServer(_broken_stream_app(body, {}), host="127.0.0.1") as fake, \
            aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == []
    assert [t.tokens for t in run.done] == [1 if b'"completion_tokens": 1}' in body else 4]


WHOLE = [_events(CHUNK, USAGE, b"[DONE]"),
         # A stream may end at a finish_reason without [DONE]: its usage chunk ends it then.
         _events(CHUNK, {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
                 USAGE)]
"""Whole completions, ended both ways a server may end one."""


@pytest.mark.asyncio
@pytest.mark.parametrize("body", WHOLE, ids=["done", "finish-and-usage"])
async def test_bench_url_stops_the_clock_at_the_end_whatever_the_server_does_next(
        body: bytes) -> None:
    """A server holding the connection open after a whole completion (a fake, the point of
    the test) neither fails the request nor adds the wait to its time: the connection is
    closed there."""

    async def completion(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(body)
        await asyncio.Event().wait()  # never set: the connection stays open
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == []
    [timing] = run.done
    assert (timing.tokens, timing.text) == (4, "hi")
    assert timing.e2e_s < 0.3


@pytest.mark.asyncio
@pytest.mark.parametrize("body", WHOLE, ids=["done", "finish-and-usage"])
async def test_bench_url_takes_a_whole_completion_whose_server_then_cuts_the_body(
        body: bytes) -> None:
    """A server (a fake on a raw socket, the point of the test) that closes the connection
    after a whole completion but before the chunked body's last chunk cuts nothing of it."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n")
        await writer.drain()
        writer.close()  # no terminating 0-length chunk

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, aiohttp.ClientSession() as session:
        target = HttpTarget(f"http://127.0.0.1:{port}", "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == []
    assert [(t.tokens, t.text) for t in run.done] == [(4, "hi")]


@contextlib.asynccontextmanager
async def _raw_server(talk: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                     Awaitable[None]]) -> AsyncIterator[str]:
    """A server on a raw socket (a fake: what it sends is the point of its test) and its URL.
    ``talk`` answers each request once its head is read; every connection has ended when the
    block does."""
    handlers: list[asyncio.Task[None]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await reader.readuntil(b"\r\n\r\n")
            await talk(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    await asyncio.gather(*handlers, return_exceptions=True)


@pytest.mark.asyncio
@pytest.mark.parametrize(("answer", "words"), [
    (b"HTTP/1.1 302 Found\r\nLocation: /v1/completions\r\nContent-Length: 0\r\n\r\n",
     "the server redirected too many times"),
    (b"HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\nContent-Length: 0\r\n\r\n",
     "the server redirected to file:///etc/passwd, no http or https URL"),
    # aiohttp says these as a 400 of its own; the server sent no 400.
    (b"hello, no status line\r\n\r\n", "the response cannot be read: Bad status line"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
     "the response cannot be read: Got more than 8190 bytes"),
])
async def test_bench_url_names_an_answer_aiohttp_cannot_take_for_what_it_is(
        answer: bytes, words: str) -> None:
    """A server answering with raw bytes (a fake, the point of the test)."""
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()

    async with _raw_server(reply) as url, client_session(1) as session:
        run = await closed_loop(HttpTarget(url, "m", session),
                                [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    [error] = run.errors
    assert error.startswith(f"request 0: {words}"), error
    assert "\n" not in error, error
    assert len(error) < 200, error


@pytest.mark.asyncio
async def test_bench_url_names_a_models_answer_aiohttp_cannot_take_for_what_it_is() -> None:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello, no status line\r\n\r\n")
        await writer.drain()

    async with _raw_server(reply) as url, client_session(1) as session:
        with pytest.raises(LoadError, match=r"^GET /v1/models: the response cannot be read: "
                                            r"Bad status line"):
            await served_model(url, session)


def _whole_response(text: str) -> bytes:
    body = _events({"choices": [{"index": 0, "text": text}]}, USAGE, b"[DONE]")
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


@pytest.mark.asyncio
async def test_bench_url_never_takes_what_a_server_sent_unasked_as_the_next_answer() -> None:
    """A server (a fake on a raw socket, the point of the test) that sends a second, unasked
    answer once its first was read: the next request's answer is the one sent for it."""
    first_read, unasked_sent = asyncio.Event(), asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_whole_response("hi"))
        await first_read.wait()
        if not unasked_sent.is_set():
            writer.write(_whole_response("unasked"))
            await writer.drain()
            unasked_sent.set()
        await reader.read()  # until the client closes

    async with _raw_server(answer) as url, client_session(1) as session:
        target = HttpTarget(url, "m", session)
        params = SamplingParams(temperature=0, max_tokens=4)
        first = await target.complete("x", params)
        first_read.set()
        await unasked_sent.wait()
        for _ in range(5):  # no wait in time: loop turns, for the bytes to reach the client
            await asyncio.sleep(0)
        second = await target.complete("x", params)
    assert (first.text, second.text) == ("hi", "hi")


@pytest.mark.asyncio
async def test_bench_url_reads_only_the_start_of_an_endless_error_body() -> None:
    """A server answering 500 with a body that never ends (a fake, the point of the test)
    fails the request with the body's start, read to a bound, not to memory's end."""
    async def completion(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=500)
        await response.prepare(request)
        while True:
            await response.write(b"x" * 2**20)

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == ["request 0: HTTP 500: " + "x" * 120 + " (not an OpenAI error body)"]


@pytest.mark.asyncio
async def test_bench_url_fails_a_stream_kept_alive_past_its_limit() -> None:
    """A server pinging for ever (a fake, the point of the test) fails the request at its
    whole-time limit, here shortened, instead of holding the bench."""
    async def completion(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(_events(CHUNK))
        while True:
            await response.write(b": ping\n\n")
            await asyncio.sleep(0)

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as session:
        target = HttpTarget(str(fake.make_url("/")), "m", session, limit_s=lambda _: 0.2)
        run = await closed_loop(target, [("x", SamplingParams(temperature=0, max_tokens=4))], 1)
    assert run.errors == ["request 0: the stream did not end within 0.2 s (300 s and 1 s per "
                          "token asked)"]
    assert request_limit_s(4) == 304.0


def test_a_servers_model_name_and_errors_cannot_draw_on_the_terminal() -> None:
    run = LevelRun(concurrency=1, timings=[None], errors=["request 0: bad\x1b[2J\nline"])
    text = report_text("http://127.0.0.1:1", "m\x1b[31m\nbench of FAKE", [run], "4 tokens")
    assert text.splitlines()[0] == "bench of http://127.0.0.1:1 (model m\\x1b[31m\\nbench of " \
                                   "FAKE): 4 tokens"
    assert text.splitlines()[-1] == "     failed: request 0: bad\\x1b[2J\\nline"
    assert "\x1b" not in text


@pytest.mark.asyncio
async def test_a_second_signal_cuts_an_answer_its_client_never_reads(
        mtp_runtime: Runtime) -> None:
    """A streaming client that never reads holds its handler in a write once the socket's
    buffers fill (kept small here on both sides, with a long model name in every chunk). The
    drain waits for it; the second signal ends it after the grace."""
    logged = io.StringIO()
    log = json_logger(logged)
    server = CompletionServer(mtp_runtime, ByteTokenizer(), ServeSettings(
        model_name="m" * 4000, max_queued_requests=4, temperature_rule=None), log)
    server.state = READY
    finished = asyncio.Event()
    mtp_runtime.subscribe(lambda event: isinstance(event, RequestFinished) and finished.set())
    runner = app_runner(server)
    await runner.setup()
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted ones inherit it
    listening.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listening).start()
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    client.connect(listening.getsockname())
    body = json.dumps({"model": "m" * 4000, "prompt": "Once", "max_tokens": 120,
                       "stream": True}).encode()
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        await asyncio.wait_for(finished.wait(), PROCESS_LIMIT_S)  # all its output is queued
        signals = Signals(log)
        signals.drain.set()
        signals.now.set()
        await asyncio.wait_for(_serve_until_drained(mtp_runtime, server, signals, log),
                               PROCESS_LIMIT_S)
    finally:
        client.close()
        await runner.cleanup()
        server.close()
    events = [line["event"] for line in _lines(logged)]
    assert events == ["draining", "cancelling", "cutting", "completion"]
    (line,) = [line for line in _lines(logged) if line["event"] == "completion"]
    assert (line["status"], line["error"]) == (
        499, "cut off by the second signal while its answer waited for the client to read")


@pytest.mark.asyncio
@pytest.mark.parametrize(("codings", "status"), [
    ("gzip, chunked", 501), ("foo, chunked", 501), ("deflate,chunked", 501),
    ("Chunked", 200), ("chunked", 200)])
async def test_a_transfer_coding_the_server_does_not_apply_is_a_501(
        mtp_runtime: Runtime, codings: str, status: int) -> None:
    server = CompletionServer(mtp_runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None))
    server.state = READY
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    async with TestServer(server.app()) as served:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Transfer-Encoding: " + codings.encode() + b"\r\n\r\n"
                     + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), PROCESS_LIMIT_S)
        writer.close()
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.split()[1] == str(status).encode()
    if status == 501:
        assert json.loads(text)["error"]["message"] == (
            f"Transfer-Encoding={codings.replace(',c', ', c')}: expected chunked alone (a "
            "compressed body names its coding in Content-Encoding)")
    server.close()


class _FullStderr(io.StringIO):
    """Injected fault: a standard error whose every write fails, as a full disk's does."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


@pytest.mark.asyncio
async def test_a_log_its_stream_cannot_take_drops_lines_not_answers(
        mtp_runtime: Runtime) -> None:
    server = CompletionServer(mtp_runtime, ByteTokenizer(), ServeSettings(
        model_name="m", max_queued_requests=4, temperature_rule=None),
        json_logger(_FullStderr()))
    server.state = READY
    server.log.info("listening")  # what ended the server before anything was served
    async with TestClient(TestServer(server.app())) as client:
        answer = await client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                            "max_tokens": 2})
        assert answer.status == 200
        assert (await client.post("/v1/completions", json={})).status == 400
    server.close()
