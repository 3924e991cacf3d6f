"""``adaspec serve`` as a client meets it: a real server process on 127.0.0.1, the official
``openai`` client and raw HTTP, refusals, metrics, disconnects, a full queue and a drain."""

import asyncio
import gzip
import json
import re
import signal
import socket
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from gloo_job import PROCESS_LIMIT_S, REPO, peer_environment
from prometheus_client.parser import text_string_to_metric_families
from rank_launch import PROMPTS, free_port
from serve_process import MODEL, Served, start_server

ADAPTIVE = ["--speculative_algorithm=DSpark", "--num_speculative_tokens=5",
            "--enable_adaptive_target_verify=true", "--max_seqs_per_batch=4"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def adaptive_flags(dspark5_batch4_costs: str) -> list[str]:
    return [*ADAPTIVE, f"--adaptive_target_verify_cost_table={dspark5_batch4_costs}"]


@pytest.fixture(scope="module")
def server(adaptive_flags: list[str]) -> Iterator[Served]:
    served = start_server(*adaptive_flags)
    try:
        yield served
    finally:
        assert served.stop() == 0, served.other
    assert served.events("stopped")


@pytest.fixture(scope="module")
def reference(adaptive_flags: list[str]) -> list[str]:
    """What ``adaspec generate`` prints for the held-out prompts, greedy, on the same launch."""
    done = subprocess.run(
        [sys.executable, "-m", "adaspec", "generate", "--json", f"--max_tokens={MAX_TOKENS}",
         "--temperature=0", *adaptive_flags, *(f"--prompt={p}" for p in PROMPTS)],
        capture_output=True, text=True, env=peer_environment(), cwd=REPO,
        timeout=PROCESS_LIMIT_S, check=False)
    assert done.returncode == 0, done.stderr
    return [row["text"] for row in json.loads(done.stdout)["results"]]


def metrics(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = served.request("GET", "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples}


# --- the official client ----------------------------------------------------------------------
async def _through_openai(url: str) -> tuple[list[Any], list[str], list[Any]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def streamed(prompt: str, temperature: float) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                                 max_tokens=MAX_TOKENS, temperature=temperature)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    def whole(prompt: str, temperature: float) -> Any:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=temperature)

    # Greedy and random requests side by side, so they share batches.
    results = await asyncio.gather(
        *(whole(p, 0.0) for p in PROMPTS), *(streamed(p, 0.0) for p in PROMPTS),
        *(whole(p, 0.8) for p in PROMPTS), *(streamed(p, 0.8) for p in PROMPTS))
    await client.close()
    count = len(PROMPTS)
    return list(results[:count]), list(results[count:2 * count]), list(results[2 * count:])


def test_the_openai_client_gets_the_text_generate_gives_streamed_or_not(
        server: Served, reference: list[str]) -> None:
    whole, streamed, sampled = asyncio.run(_through_openai(server.url))
    assert [r.choices[0].text for r in whole] == reference
    assert streamed == reference
    for response in whole:
        assert response.usage.completion_tokens == MAX_TOKENS
        assert response.choices[0].finish_reason == "length"
        extra = response.choices[0].model_extra["adaspec"]
        assert extra["rounds"] >= 1
        assert 0 <= extra["drafted_accepted"] <= extra["drafted_verified"]
        assert extra["acceptance_length"] == pytest.approx(
            (extra["drafted_accepted"] + extra["rounds"]) / extra["rounds"], abs=1e-4)
    for result in sampled:  # random requests end as asked too
        text = result if isinstance(result, str) else result.choices[0].text
        assert len(text.encode("utf-8", "surrogatepass")) >= 1


def test_a_batch_of_prompts_answers_one_choice_per_prompt_in_order(
        server: Served, reference: list[str]) -> None:
    status, body = server.post({"model": MODEL, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                "temperature": 0})
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == list(range(len(PROMPTS)))
    assert [c["text"] for c in body["choices"]] == reference
    assert body["usage"]["completion_tokens"] == MAX_TOKENS * len(PROMPTS)
    token_ids = list(PROMPTS[0].encode("utf-8"))  # the same prompt as token ids
    status, body = server.post({"model": MODEL, "prompt": token_ids, "max_tokens": MAX_TOKENS,
                                "temperature": 0})
    assert status == 200
    assert body["choices"][0]["text"] == reference[0]


def test_a_stop_string_cuts_the_text_before_it_streamed_or_not(
        server: Served, reference: list[str]) -> None:
    text = reference[0]
    stop = text[10:13]
    expected = text[:text.index(stop)]
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
               "temperature": 0, "stop": [stop, "never appears"]}
    status, body = server.post(request)
    assert status == 200, body
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    # Its tokens are counted through the one that completed the stop string.
    assert body["usage"]["completion_tokens"] == len((expected + stop).encode("utf-8"))
    status, _, raw = server.request("POST", "/v1/completions", {**request, "stream": True})
    assert status == 200
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n\n")
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert raw.decode().endswith("data: [DONE]\n\n")


# --- refusals -------------------------------------------------------------------------------
def _base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, **fields}


REFUSED = [  # (body, status, param named)
    (_base(logprobs=2), 400, "logprobs"),
    (_base(seed=7), 400, "seed"),
    (_base(logit_bias={"65": 5}), 400, "logit_bias"),
    (_base(presence_penalty=0.5), 400, "presence_penalty"),
    (_base(frequency_penalty=1), 400, "frequency_penalty"),
    (_base(response_format={"type": "json_object"}), 400, "response_format"),
    (_base(n=2), 400, "n"),
    (_base(best_of=3), 400, "best_of"),
    (_base(echo=True), 400, "echo"),
    (_base(suffix="!"), 400, "suffix"),
    (_base(tools=[]), 400, "tools"),
    (_base(model=None), 400, "model"),
    (_base(model="gpt-4"), 404, "model"),
    (_base(prompt=None), 400, "prompt"),
    (_base(prompt=""), 400, "prompt"),
    (_base(prompt=[]), 400, "prompt"),
    (_base(prompt=[65, 300]), 400, "prompt[1]"),  # the id out of the vocabulary, by its index
    (_base(prompt=[[65], [66, -3]]), 400, "prompt[1][1]"),
    (_base(prompt=[[65, 66, 999]]), 400, "prompt[0][2]"),  # one prompt, still an array's item
    (_base(prompt=[[65, 66, 3.5]]), 400, "prompt[0][2]"),
    (_base(prompt=["ok", 5]), 400, "prompt[1]"),
    (_base(prompt=["ok", "x" * 1100]), 400, "prompt[1]"),
    (_base(prompt="\ud800"), 400, "prompt"),
    (_base(max_tokens=0), 400, "max_tokens"),
    (_base(max_tokens=2000), 400, "max_tokens"),
    (_base(max_tokens=1.5), 400, "max_tokens"),
    (_base(temperature=-1), 400, "temperature"),
    (_base(temperature="hot"), 400, "temperature"),
    (_base(temperature=None), 400, "temperature"),  # required with adaptive verify
    (_base(temperature=0.7, top_p=0), 400, "top_p"),
    (_base(temperature=0.7, top_k=1.5), 400, "top_k"),
    (_base(temperature=0.7, min_p=2), 400, "min_p"),
    # Integers past float's range: a range check refuses them, not an OverflowError (500).
    (_base(temperature=10**400), 400, "temperature"),
    (_base(temperature=0.7, top_p=10**400), 400, "top_p"),
    (_base(temperature=0.7, min_p=-10**400), 400, "min_p"),
    (_base(temperature=0.7, top_k=10**400), 400, "top_k"),
    (_base(top_p=10**400), 400, "top_p"),
    (_base(top_k=5), 400, "top_k"),  # a filter on a greedy request would do nothing
    (_base(stop=5), 400, "stop"),
    (_base(stop=[""]), 400, "stop"),
    (_base(stop=[1000]), 400, "stop"),
    (_base(stop_token_ids=["a"]), 400, "stop_token_ids"),
    (_base(stop_token_ids=[999]), 400, "stop_token_ids"),  # named as given, not as "stop"
    (_base(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (_base(max_tokens={}), 400, "max_tokens"),
    (_base(stream="yes"), 400, "stream"),
    (_base(stream_options={"include_usage": True}), 400, "stream_options"),
    (_base(stream=True, stream_options={"x": 1}), 400, "stream_options"),
    (_base(user=5), 400, "user"),
]


@pytest.mark.parametrize(("body", "status", "param"), REFUSED,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(REFUSED)])
def test_every_unsupported_or_wrong_field_is_refused_naming_it(
        server: Served, body: dict[str, Any], status: int, param: str) -> None:
    got, answer = server.post(body)
    assert got == status, answer
    error = answer["error"]
    assert error["param"] == param
    assert error["message"].startswith(param)
    assert "\n" not in error["message"]


MALFORMED = [
    (b'{"model": "builtin:target", "prompt": "a"', "not valid JSON"),
    (b'[1, 2]', "JSON array"),
    (b'{"model": "builtin:target", "prompt": "a", "max_tokens": NaN}', "NaN"),
    (b'{"prompt": "a", "prompt": "b"}', "given twice"),
    (b'\xff\xfe{}', "not UTF-8"),
    (b'[' * 100_000 + b']' * 100_000, "nests too deeply"),
    (b'', "not valid JSON"),
]


@pytest.mark.parametrize(("raw", "words"), MALFORMED)
def test_a_malformed_body_is_a_400_saying_what_is_wrong(
        server: Served, raw: bytes, words: str) -> None:
    status, _, body = server.request("POST", "/v1/completions", raw)
    assert status == 400
    assert words in json.loads(body)["error"]["message"]


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"model": "builtin:target", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
     "max_tokens"),
    (b'{"model": "builtin:target", "prompt": [1, -' + b"9" * 5000 + b"]}", "prompt"),
])
def test_an_integer_of_thousands_of_digits_is_a_400_naming_its_field(
        server: Served, raw: bytes, param: str) -> None:
    """Before, the message held Python's own words, cut short, and no param."""
    status, _, body = server.request("POST", "/v1/completions", raw)
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, param)
    assert error["message"].startswith(param)
    assert error["message"].endswith(": an integer of 5000 digits; expected at most 4300")


@pytest.mark.parametrize(("query", "param"), [("stream=true", "stream"),
                                               ("api-version=1&max_tokens=1&n=2", "max_tokens"),
                                               ("seed=3", "seed")])
def test_a_completion_parameter_in_the_url_query_is_refused_naming_it(
        server: Served, query: str, param: str) -> None:
    """It would be ignored: the body alone holds a completion's parameters. Others (a
    gateway's api-version) ask nothing of the completion and pass."""
    status, _, body = server.request("POST", f"/v1/completions?{query}", _base())
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, param)
    assert error["message"] == (f"{param}: given in the URL's query; expected every completion "
                                "parameter in the JSON body")
    status, _, body = server.request("POST", "/v1/completions?api-version=2024-02-01&%0a=1",
                                     _base())
    assert status == 200, body


def test_a_key_with_a_newline_is_named_on_one_line(server: Served) -> None:
    status, body = server.post(b'{"model": "builtin:target", "prompt": "a", "fo\\no": 1}')
    assert status == 400
    assert body["error"]["message"].startswith("fo\\no: unknown parameter")
    assert "\n" not in body["error"]["message"]


def test_a_body_that_does_not_match_its_content_encoding_is_a_400(server: Served) -> None:
    status, _, body = server.request("POST", "/v1/completions", _base(),
                                     headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert "the request body cannot be read" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("encoding", ["foo", "br", "zstd"])
def test_a_content_encoding_the_server_does_not_read_is_a_415(server: Served,
                                                              encoding: str) -> None:
    """Well-formed encodings the server has no decoder for too (br, zstd): the same JSON
    refusal, never aiohttp's plain-text answer."""
    status, _, body = server.request("POST", "/v1/completions", _base(),
                                     headers={"Content-Encoding": encoding})
    assert status == 415
    assert json.loads(body)["error"]["message"] == (
        f"Content-Encoding={encoding}: expected one of identity, gzip, deflate")


def test_compressed_bodies_are_read_and_a_bomb_or_a_cut_stream_is_refused(
        server: Served) -> None:
    plain = json.dumps(_base()).encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    bodies = {"gzip": gzip.compress(plain), "deflate": zlib.compress(plain)}
    bodies["deflate-raw"] = raw_deflate.compress(plain) + raw_deflate.flush()
    for name, data in bodies.items():
        status, _, body = server.request("POST", "/v1/completions", data,
                                         headers={"Content-Encoding": name.split("-")[0]})
        assert status == 200, (name, body)
    bomb = gzip.compress(b" " * (64 << 20))  # 64 MiB of spaces: about 64 KiB compressed
    status, _, body = server.request("POST", "/v1/completions", bomb,
                                     headers={"Content-Encoding": "gzip"})
    assert status == 413
    for lines in (["gzip", "gzip"], ["gzip", "identity"]):  # one list over header lines
        status, _, body = server.request_lines(
            "/v1/completions", gzip.compress(gzip.compress(plain)),
            [("Content-Encoding", line) for line in lines])
        assert status == 415
        assert json.loads(body)["error"]["message"].startswith(
            f"Content-Encoding={', '.join(lines)}: expected one of")
    cut = gzip.compress(plain)[:-12]
    status, _, body = server.request("POST", "/v1/completions", cut,
                                     headers={"Content-Encoding": "gzip"})
    assert status == 400
    assert json.loads(body)["error"]["message"].startswith(
        "the request body cannot be read: it is not gzip data")


def test_malformed_http_is_answered_without_a_traceback_in_the_log(server: Served) -> None:
    before = len(server.events("http_error"))
    with socket.create_connection(("127.0.0.1", server.port), timeout=PROCESS_LIMIT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.")
    server.wait_for("http_error", before + 1)
    assert not any("Traceback" in line for line in server.other)


def test_a_stop_string_the_last_flush_completes_ends_the_text_as_stop(server: Served) -> None:
    request = _base(prompt="\u00ff\u00ff\u00ff\u20ac\u20ac\u20ac", max_tokens=1)
    status, body = server.post(request)  # one byte that begins a character: U+FFFD at the end
    assert (status, body["choices"][0]["text"]) == (200, "\ufffd")
    status, body = server.post({**request, "stop": "\ufffd"})
    assert status == 200
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("", "stop")


def test_an_oversized_body_is_a_413_and_wrong_routes_answer_in_the_error_shape(
        server: Served) -> None:
    status, _, body = server.request("POST", "/v1/completions", b"x" * (9 * 2**20))
    assert status == 413
    assert "larger than" in json.loads(body)["error"]["message"]
    for method, path, code in (("GET", "/v1/completions", 405), ("POST", "/v1/chat", 404),
                               ("POST", "/health", 405)):
        status, _, body = server.request(method, path)
        assert status == code
        assert path in json.loads(body)["error"]["message"]


def test_models_and_health_describe_the_served_model(server: Served) -> None:
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200
    card = json.loads(body)["data"]
    assert [(c["id"], c["max_model_len"]) for c in card] == [(MODEL, 1024)]
    status, _, body = server.request("GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ready"})


# --- metrics --------------------------------------------------------------------------------
def _counter(table: dict[Any, float], name: str, **labels: str) -> float:
    return table.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_agree_with_what_the_requests_were_told(server: Served) -> None:
    before = metrics(server)
    answers = [server.post(_base(prompt=p, max_tokens=12, temperature=t))[1]
               for p in PROMPTS for t in (0, 0.9)]
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        return _counter(after, name, **labels) - _counter(before, name, **labels)

    choices = [a["choices"][0] for a in answers]
    assert delta("adaspec_tokens_generated_total") == sum(
        a["usage"]["completion_tokens"] for a in answers)
    assert delta("adaspec_drafted_accepted_total") == sum(
        c["adaspec"]["drafted_accepted"] for c in choices)
    assert delta("adaspec_drafted_verified_total") == sum(
        c["adaspec"]["drafted_verified"] for c in choices)
    assert delta("adaspec_requests_finished_total") == len(answers)
    assert delta("adaspec_http_requests_total", status="200") == len(answers)
    assert delta("adaspec_completions_finished_total", reason="length") == len(answers)
    assert delta("adaspec_time_to_first_token_seconds_count") == len(answers)
    by_rows = sum(v for (name, _), v in after.items() if name == "adaspec_rounds_by_rows_total")
    by_depth = sum(v for (name, _), v in after.items()
                   if name == "adaspec_rounds_by_depth_total")
    assert by_rows == by_depth == _counter(after, "adaspec_rounds_retired_total")
    for position in range(1, 6):  # every position: accepted at most what was verified
        assert 0 <= _counter(after, "adaspec_position_accepted_total",
                             position=str(position)) <= _counter(
            after, "adaspec_position_verified_total", position=str(position))
    assert _counter(after, "adaspec_requests_running") == 0
    assert _counter(after, "adaspec_requests_waiting") == 0
    logged = {line["id"] for line in server.events("completion")}
    assert all(a["id"] in logged for a in answers)


# --- load, disconnects, a full queue, a drain -----------------------------------------------------
def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


async def _load(url: str, count: int, concurrency: int, first: int) -> list[int]:
    """``count`` requests, ``concurrency`` at a time, every other one sampled: statuses."""
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(index: int) -> int:
            body = _base(prompt=PROMPTS[index % len(PROMPTS)][:40], max_tokens=8,
                         temperature=0.8 if index % 2 else 0, stream=index % 3 == 0)
            async with limit, session.post(f"{url}/v1/completions", json=body) as response:
                await response.read()
                return response.status
        return list(await asyncio.gather(*(one(first + i) for i in range(count))))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_500_mixed_requests_at_concurrency_32_end_without_error_in_flat_memory(
        server: Served) -> None:
    warm = asyncio.run(_load(server.url, 100, 32, 0))
    rss = _rss_kib(server.process.pid)
    rest = asyncio.run(_load(server.url, 400, 32, 100))
    grown = _rss_kib(server.process.pid) - rss
    assert warm + rest == [200] * 500
    assert grown < 32 * 1024, f"the server grew {grown} KiB over 400 requests"


@pytest.fixture
def small_server() -> Iterator[Served]:
    """One request decodes at a time (two KV slots) and one may be in flight."""
    served = start_server("--max_seqs_per_batch=1", "--max_queued_requests=1",
                          "--speculative_algorithm=MTP", "--num_speculative_tokens=3")
    try:
        yield served
    finally:
        assert served.stop() == 0, served.other


def _open_stream(served: Served, max_tokens: int, events: int = 1) -> socket.socket:
    """A streamed request whose first ``events`` events have come; the socket is left
    open."""
    body = json.dumps(_base(prompt="Once upon a time", max_tokens=max_tokens, stream=True))
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=PROCESS_LIMIT_S)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    seen = b""
    while seen.count(b"data: {") < events:
        seen += sock.recv(4096)
    return sock


def _read_to_the_end(sock: socket.socket) -> bytes:
    """What a stream sends until its end (or the connection's); the socket is closed."""
    received = b""
    while not received.endswith(b"data: [DONE]\n\n") and b"0\r\n\r\n" not in received:
        piece = sock.recv(65536)
        if not piece:
            break
        received += piece
    sock.close()
    return received


def test_a_client_gone_mid_stream_cancels_its_request_and_frees_its_kv_slot(
        small_server: Served) -> None:
    for number in range(1, 4):  # more than the two KV slots: a leaked one would hang the next
        # Three events: the prefill's token and at least two rounds' tokens.
        _open_stream(small_server, 900, events=3).close()
        small_server.wait_for("completion", number)
    gone = small_server.events("completion")
    assert [line["status"] for line in gone] == [499] * 3
    assert all(line["finish_reasons"] == ["cancelled"] for line in gone)
    # The rounds that ran are reported, though the result was never read.
    assert all(line["drafted_verified"] > 0 for line in gone)
    assert all(line["acceptance_length"] is not None for line in gone)
    status, body = small_server.post(_base(max_tokens=5))
    assert status == 200
    assert body["usage"]["completion_tokens"] == 5
    table = metrics(small_server)
    assert _counter(table, "adaspec_completions_finished_total", reason="cancelled") == 3
    assert _counter(table, "adaspec_tokens_generated_total") < 3 * 900


def test_a_full_queue_answers_429_with_retry_after(small_server: Served) -> None:
    sock = _open_stream(small_server, 600)
    status, headers, body = small_server.request("POST", "/v1/completions",
                                                 _base(max_tokens=2))
    assert status == 429
    assert headers["retry-after"] == "1"
    assert "--max_queued_requests" in json.loads(body)["error"]["message"]
    sock.close()


def test_a_client_stalled_mid_body_does_not_hold_the_drain(small_server: Served) -> None:
    with socket.create_connection(("127.0.0.1", small_server.port),
                                  timeout=PROCESS_LIMIT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"\r\n{\"mod")
        small_server.process.send_signal(signal.SIGTERM)
        assert small_server.process.wait(timeout=PROCESS_LIMIT_S) == 0
    small_server.wait_for("stopped", 1)


def test_sigterm_lets_the_stream_in_flight_end_refuses_new_requests_and_exits_0(
        small_server: Served) -> None:
    sock = _open_stream(small_server, 300)
    small_server.process.send_signal(signal.SIGTERM)
    small_server.wait_for("draining", 1)
    status, headers, body = small_server.request("POST", "/v1/completions", _base())
    assert status == 503
    assert "retry-after" in headers
    status, _, body = small_server.request("GET", "/health")
    assert (status, json.loads(body)["status"]) == (503, "draining")
    assert b"data: [DONE]" in _read_to_the_end(sock)
    assert small_server.process.wait(timeout=PROCESS_LIMIT_S) == 0
    finished = small_server.events("completion")
    assert finished[-1]["completion_tokens"] == 300
    assert finished[-1]["status"] == 200


SMALL_FILES = (
    # ``adaspec serve`` with writes past 2 KiB to any file failing with EFBIG (not a signal).
    "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048)); "
    "sys.argv = ['adaspec', 'serve', *sys.argv[1:]]; runpy.run_module('adaspec', "
    "run_name='__main__')")


@pytest.mark.parametrize(("flag", "what"), [("--event_log", "event log"),
                                            ("--trace", "state trace")])
def test_an_output_that_fills_is_named_by_its_flag_when_the_server_stops(
        tmp_path: Path, flag: str, what: str) -> None:
    path = tmp_path / "out.jsonl"
    served = start_server("--speculative_algorithm=MTP", "--num_speculative_tokens=3",
                          f"{flag}={path}", program=("-c", SMALL_FILES))
    try:
        status, _ = served.post(_base(max_tokens=48))
        assert status == 200  # the output ends, never the requests
    finally:
        code = served.stop()
    assert code == 2
    assert served.other[-1] == (
        f"adaspec serve: error: {flag}={path}: cannot write the {what} (File too large); "
        "what it holds is incomplete, the run went on without it")


# --- several ranks --------------------------------------------------------------------------
async def _concurrently(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                answer: dict[str, Any] = await response.json()
                assert response.status == 200, answer
                return answer
        return list(await asyncio.gather(*(one(body) for body in bodies)))


def _two_ranks(*flags: str) -> list[str]:
    """The launch line of a two-rank MTP launch with ``flags``, on a fresh rendezvous."""
    return ["--nnodes=2", "--speculative_algorithm=MTP", "--num_speculative_tokens=3",
            f"--master_node_addr=127.0.0.1:{free_port()}", *flags]


def _start_follower(common: list[str]) -> subprocess.Popen[str]:
    """Rank 1 of a two-rank ``adaspec serve`` launch; its stderr is kept."""
    return subprocess.Popen([sys.executable, "-m", "adaspec", "serve", *common,
                             "--node_rank=1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=peer_environment(), cwd=REPO)


def _end(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.communicate()


def test_rank_0_serves_http_while_the_other_dp_shard_decodes_its_share(
        reference: list[str]) -> None:
    common = _two_ranks("--dp_size=2")
    follower = _start_follower(common)
    try:
        front = start_server(*common, "--node_rank=0")
        answers = asyncio.run(_concurrently(front.url, [
            _base(prompt=p, max_tokens=MAX_TOKENS) for p in PROMPTS]))
        assert [a["choices"][0]["text"] for a in answers] == reference
        table = metrics(front)
        assert _counter(table, "adaspec_requests_finished_total") == len(PROMPTS)
        assert front.stop() == 0, front.other
        _, errors = follower.communicate(timeout=PROCESS_LIMIT_S)
        assert follower.returncode == 0, errors
    finally:
        _end(follower)
    lines = [json.loads(line) for line in errors.splitlines()]
    assert [(line["event"], line["rank"]) for line in (lines[0], lines[-1])] == [
        ("starting", 1), ("stopped", 1)], errors


@pytest.mark.parametrize("follower_ends", ["by SIGTERM", "killed"])
def test_a_signal_to_every_rank_drains_the_stream_in_flight_through_the_follower(
        follower_ends: str) -> None:
    """A launcher (torchrun) signals every rank at once: the follower keeps decoding until
    rank 0 has drained, so the stream in flight ends whole and both ranks exit 0. A follower
    lost while rank 0 drains fails the stream, and rank 0 exits non-zero saying so."""
    common = _two_ranks("--collective_timeout_s=30")
    follower = _start_follower(common)
    try:
        front = start_server(*common, "--node_rank=0")
        sock = _open_stream(front, 300)
        if follower_ends == "killed":
            front.process.send_signal(signal.SIGTERM)
            front.wait_for("draining", 1)
            follower.kill()
        else:
            follower.send_signal(signal.SIGTERM)
            front.process.send_signal(signal.SIGTERM)
        received = _read_to_the_end(sock)
        code = front.process.wait(timeout=PROCESS_LIMIT_S)  # signalled once: it ends itself
        front.ended.wait(PROCESS_LIMIT_S)
        _, errors = follower.communicate(timeout=PROCESS_LIMIT_S)
    finally:
        _end(follower)
    finished = front.events("completion")
    if follower_ends == "killed":
        assert code == 2, front.other
        assert finished[-1]["completion_tokens"] < 300, finished[-1]
        assert b'"error"' in received
        assert front.other[-1].startswith("adaspec serve: error: the runtime faulted while "
                                          "draining or stopping: "), front.other
        # Met in a collective of its own, or in a round's (which ends the ranks' lockstep).
        assert re.search(r"draining or stopping: .*collective \w+ over ranks \[0,1\] "
                         r"failed: ", front.other[-1]), front.other
        return
    assert b"data: [DONE]" in received
    assert (code, follower.returncode) == (0, 0), (front.other, errors)
    assert (finished[-1]["status"], finished[-1]["completion_tokens"]) == (200, 300)
    draining = [json.loads(line) for line in errors.splitlines() if '"draining"' in line]
    assert [(line["rank"], line["signal"]) for line in draining] == [(1, "SIGTERM")], errors


def test_a_second_signal_ends_a_follower_at_once_with_its_line() -> None:
    """Before, the first signal gave the follower's signals back to their default action:
    the second killed it (-15) with nothing said. The follower's start may end after rank
    0's: signalled before its ``ready`` line, it abandons its start instead of draining."""
    common = _two_ranks()
    follower = _start_follower(common)
    try:
        front = start_server(*common, "--node_rank=0")
        try:
            _wait_for_line(follower, "ready")
            follower.send_signal(signal.SIGTERM)
            _wait_for_line(follower, "draining")
            follower.send_signal(signal.SIGTERM)
            _, errors = follower.communicate(timeout=PROCESS_LIMIT_S)
        finally:
            front.kill()
    finally:
        _end(follower)
    last = json.loads(errors.splitlines()[-1])
    assert (follower.returncode, last["event"], last["rank"], last["signal"]) == (
        143, "stopped", 1, "SIGTERM"), errors
    assert last["reason"] == "a second signal ends this rank at once"


def test_a_follower_signalled_while_its_start_waits_for_rank_0_says_it_stopped() -> None:
    """Before, its log ended at ``stopping``: nothing said the rank had stopped."""
    follower = _start_follower(_two_ranks("--collective_timeout_s=60"))  # rank 0 never comes
    errors = _signalled_at(follower, "starting", signal.SIGTERM)
    lines = [json.loads(line) for line in errors.splitlines()]
    assert [line["event"] for line in lines[-2:]] == ["stopping", "stopped"], errors
    assert {line["rank"] for line in lines} == {1}, errors
    assert follower.returncode == 0, errors


def test_a_signal_during_the_start_abandons_it_and_exits_0_as_a_drain() -> None:
    """The exit status of a server stopped as asked, started or not; its log says which."""
    server = _slow_starting_server()
    errors = _signalled_at(server, "listening", signal.SIGTERM)  # as the start begins
    events = [json.loads(line)["event"] for line in errors.splitlines()]
    assert events[-2:] == ["stopping", "stopped"], errors
    assert "ready" not in events, errors
    assert server.returncode == 0, errors


def test_a_second_signal_during_an_abandoned_start_ends_the_server_at_once() -> None:
    """Before, the second signal was noted for a drain that never came: the server went on
    unwinding its start for seconds and exited 0."""
    server = _slow_starting_server()
    # Two of a kind pending at once would be taken as one; these two are two, in some order.
    errors = _signalled_at(server, "listening", signal.SIGINT, signal.SIGTERM)
    lines = [json.loads(line) for line in errors.splitlines()]
    assert [line["event"] for line in lines[-2:]] == ["stopping", "stopped"], errors
    assert {lines[-2]["signal"], lines[-1]["signal"]} == {"SIGINT", "SIGTERM"}
    assert lines[-2]["reason"] == "signalled during the start, which is abandoned"
    assert lines[-1]["reason"] == "a second signal ends the server at once"
    assert server.returncode == 128 + signal.Signals[lines[-2]["signal"]]  # the first's


def _slow_starting_server() -> subprocess.Popen[str]:
    """``adaspec serve`` with a start long enough to be signalled during it; stderr kept."""
    return subprocess.Popen([sys.executable, "-m", "adaspec", "serve", f"--port={free_port()}",
                             "--max_seqs_per_batch=64"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=peer_environment(), cwd=REPO)


def _signalled_at(server: subprocess.Popen[str], event: str, *numbers: signal.Signals) -> str:
    """The rest of the server's log once ``numbers`` were sent at its ``event`` line."""
    try:
        _wait_for_line(server, event)
        for number in numbers:
            server.send_signal(number)
        return server.communicate(timeout=PROCESS_LIMIT_S)[1]
    finally:
        _end(server)


def _wait_for_line(server: subprocess.Popen[str], event: str) -> None:
    """Read the server's log up to its first ``event`` line."""
    assert server.stderr is not None
    for line in iter(server.stderr.readline, ""):  # "" once it ended
        if f'"event": "{event}"' in line:
            return
    raise AssertionError(f"the server ended before its {event!r} line")


# --- adaspec bench --url -----------------------------------------------------------------------
def _bench(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaspec", "bench", *flags],
                          capture_output=True, text=True, env=peer_environment(), cwd=REPO,
                          timeout=PROCESS_LIMIT_S, check=False)


def test_bench_url_reports_latency_percentiles_and_tokens_per_level(server: Served) -> None:
    done = _bench(f"--url={server.url}/v1", "--concurrency=1,3", "--requests=3",
                  "--max_tokens=8", "--temperature=0,0.8", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["model"], report["url"]) == (MODEL, server.url)
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert (level["requests"], level["errors"], level["tokens"]) == (3, 0, 24)
        assert level["tokens_per_second"] > 0
        for figure in ("ttft_ms", "tpot_ms", "e2e_ms"):
            cuts = level[figure]
            assert 0 < cuts["p50"] <= cuts["p90"] <= cuts["p99"]
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    table = _bench(f"--url={server.url}", "--concurrency=2", "--requests=2", "--max_tokens=4")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[2].split()[:3] == ["2", "2", "0"]


def test_bench_url_counts_refused_requests_as_failures_and_exits_1(server: Served) -> None:
    done = _bench(f"--url={server.url}", "--concurrency=1", "--requests=1",
                  "--max_tokens=1000")
    assert done.returncode == 1
    assert "failed: request 0: HTTP 400: max_tokens=1000" in done.stdout


@pytest.mark.parametrize(("flags", "words"), [
    (["--url=http://127.0.0.1:9", "--widths=3"], "--widths=3: configures the runtime"),
    # A plot configures no runtime: refused for what it is, a plot of arms a server has not.
    (["--url=http://127.0.0.1:9", "--plot=u.png"],
     "--plot=u.png: plots the tokens/s and per-position acceptance of the arms this bench "
     "would run; with --url there are no arms, and a server reports no acceptance: expected "
     "no --plot (--json gives the figures)\n"),
    (["--url=http://127.0.0.1:9", "--passes=3"],
     "--passes=3: repeats every arm this bench would run; with --url each level is one "
     "closed loop against the server: expected no --passes\n"),
    (["--url=http://127.0.0.1:9", "--speculative_algorithm=MTP"],
     "--speculative_algorithm=MTP: a launch flag"),
    (["--url=ftp://x"], "--url=ftp://x: expected a server's base URL"),
    (["--url=http://127.0.0.1:99999"], "expected a port in 1..65535"),
    (["--url=http://127.0.0.1:0"], "--url=http://127.0.0.1:0: expected a port in 1..65535"),
    (["--url=http://[::1"], "--url=http://[::1: expected a server's base URL"),
    (["--url=http://127.0.0.1:9/v1/completions/"],
     "--url=http://127.0.0.1:9/v1/completions/: expected a server's base URL "
     "(http://127.0.0.1:9 or http://127.0.0.1:9/v1), not an endpoint's path (/v1/completions)\n"),
    (["--served_model_name=m"], "--served_model_name=m: names a server's model"),
    ([f"--url=http://127.0.0.1:{free_port()}"], "cannot reach"),
])
def test_bench_url_refuses_what_does_not_apply_in_one_line(flags: list[str], words: str) -> None:
    done = _bench(*flags)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr


def test_bench_url_under_torchrun_is_refused_naming_the_variable() -> None:
    """Before, every rank ran the whole load and printed a report of its own."""
    environment = {**peer_environment(), "RANK": "1", "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-m", "adaspec", "bench",
                           f"--url=http://127.0.0.1:{free_port()}", "--requests=1"],
                          capture_output=True, text=True, env=environment, cwd=REPO,
                          timeout=PROCESS_LIMIT_S, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("adaspec bench: error: RANK=1: set by a launcher such as torchrun; "
                           "bench --url is one client process (each rank would send its own "
                           "load and print its own report): run it once, without the "
                           "launcher\n")
