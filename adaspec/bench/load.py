"""A closed-loop load of completion requests against a target: an OpenAI-compatible server
over HTTP (``adaspec bench --url``), or a runtime in this process, driven the same way so the
two can be read side by side.

C clients each send a request, wait for its last token, and send the next, until the level's
requests are done. A request's time to first token (TTFT) runs from its send to its first
non-empty text, its time per output token (TPOT) over the tokens after the first, and its
end-to-end time to its last token; tokens/s is the level's tokens over its wall time.
"""

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from adaspec.config import SamplingParams
from adaspec.errors import AdaspecError, printable
from adaspec.models.tokenizer import ByteTokenizer
from adaspec.runtime.engine import Runtime


class LoadError(AdaspecError):
    """The target cannot be measured (unreachable, no such model, no usage reported)."""


@dataclass(frozen=True, slots=True)
class Timing:
    """One request as its client saw it."""

    tokens: int
    ttft_s: float
    e2e_s: float
    text: str

    @property
    def tpot_s(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


@dataclass(slots=True)
class LevelRun:
    """One concurrency level's requests: their timings in send order, and the failures."""

    concurrency: int
    seconds: float = 0.0
    timings: list[Timing | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def done(self) -> list[Timing]:
        return [t for t in self.timings if t is not None]

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.done)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        done = self.done
        return {
            "concurrency": self.concurrency, "requests": len(self.timings),
            "errors": len(self.errors), "first_errors": self.errors[:3],
            "tokens": self.tokens, "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ttft_ms": percentiles([t.ttft_s for t in done]),
            "tpot_ms": percentiles([t.tpot_s for t in done if t.tpot_s is not None]),
            "e2e_ms": percentiles([t.e2e_s for t in done]),
        }


def percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50, p90 and p99 in milliseconds (None without samples)."""
    if not seconds:
        return {"p50": None, "p90": None, "p99": None}
    if len(seconds) == 1:
        only = round(1000 * seconds[0], 3)
        return {"p50": only, "p90": only, "p99": only}
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {"p50": round(1000 * cuts[49], 3), "p90": round(1000 * cuts[89], 3),
            "p99": round(1000 * cuts[98], 3)}


MODELS_TIMEOUT_S = 30
"""The longest ``GET /v1/models`` may take: a server answers it at once."""

READ_TIMEOUT_S = 300
"""The longest a request may go without a byte from the server (its TTFT included) before it
counts as failed."""


def request_limit_s(max_tokens: int) -> float:
    """The longest a streamed request may take in all: the wait for a first byte, plus a
    second per token asked. A server that keeps the stream alive without ending it (pings
    forever) fails the request at this limit rather than holding the bench."""
    return float(READ_TIMEOUT_S + max_tokens)


def client_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT_S)


class Target(Protocol):
    async def complete(self, prompt: str, params: SamplingParams) -> Timing: ...


class RuntimeTarget:
    """A started runtime in this process, over the built-in models' byte tokens."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.tokenizer = ByteTokenizer()

    async def complete(self, prompt: str, params: SamplingParams) -> Timing:
        sent = time.perf_counter()
        handle = self.runtime.submit(self.tokenizer.encode(prompt), params)
        first = None
        async for _ in handle:
            first = first if first is not None else time.perf_counter()
        result = await handle.result()
        ended = time.perf_counter()
        return Timing(tokens=len(result.token_ids), ttft_s=(first or ended) - sent,
                      e2e_s=ended - sent, text=self.tokenizer.decode(result.token_ids))


def client_session(limit: int) -> aiohttp.ClientSession:
    """The session a load runs in: at most ``limit`` connections, and one connection per
    request, as other serving benchmarks open (a session each). On a connection kept alive,
    whatever a server sent after a whole completion would be read as the next request's
    answer, and what follows a completion need not be read to free the connection."""
    return aiohttp.ClientSession(timeout=client_timeout(), connector=aiohttp.TCPConnector(
        limit=limit, force_close=True))


class HttpTarget:
    """An OpenAI-compatible server's ``/v1/completions``, streamed, with the usage chunk
    (``stream_options.include_usage``) as the count of tokens; ``session`` is best a
    ``client_session``."""

    def __init__(self, url: str, model: str, session: aiohttp.ClientSession,
                 limit_s: Callable[[int], float] = request_limit_s) -> None:
        self.endpoint = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.session = session
        self.limit_s = limit_s  # a request's whole time, given its max_tokens

    def body(self, prompt: str, params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt,
                                "max_tokens": params.max_tokens,
                                "temperature": params.temperature or 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if params.top_k:
            body["top_k"] = params.top_k
        if params.top_p < 1.0:
            body["top_p"] = params.top_p
        if params.min_p:
            body["min_p"] = params.min_p
        return body

    async def complete(self, prompt: str, params: SamplingParams) -> Timing:
        limit = self.limit_s(params.max_tokens)
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await self._stream(prompt, params)
        except TimeoutError:
            if not deadline.expired():  # aiohttp's own: no byte for READ_TIMEOUT_S
                raise
            raise LoadError(f"the stream did not end within {limit:g} s ({READ_TIMEOUT_S} s "
                            "and 1 s per token asked)") from None
        except READ_FAULTS as error:
            raise read_fault(error) from None

    async def _stream(self, prompt: str, params: SamplingParams) -> Timing:
        sent = time.perf_counter()
        first, pieces, tokens = None, [], None
        async with self.session.post(self.endpoint, json=self.body(prompt, params)) as response:
            if response.status != 200:
                raise LoadError(f"HTTP {response.status}: {await _error_text(response)}")
            chosen = finished = done = False
            events = SseEvents()
            async for line in _ended(response.content):
                event = events.feed(line)
                if event is None:
                    continue
                if event is DONE:
                    done = True
                    break
                if event.get("error") is not None:
                    raise LoadError(f"error event: {printable(str(event['error']))}")
                chosen = chosen or bool(event.get("choices"))
                texts = _texts(event, finished)
                finished = finished or _finished(event)
                for text in texts:
                    first = first if first is not None else time.perf_counter()
                    pieces.append(text)
                if event.get("usage"):
                    tokens = _completion_tokens(event["usage"], params.max_tokens, tokens)
                if finished and tokens is not None:  # the usage chunk ends a finished choice
                    break
            ended = time.perf_counter()  # the completion is whole: what follows is no part
            if not (done or finished or chosen):
                _check_event_stream(response.content_type)
        _check_ending(done or finished, chosen, tokens, bool(pieces))
        assert tokens is not None
        return Timing(tokens=tokens, ttft_s=(first or ended) - sent, e2e_s=ended - sent,
                      text="".join(pieces))


GAVE_UP = ("abort", "aborted", "error", "cancelled", "canceled")
"""finish_reasons of a choice the server gave up (vLLM and SGLang say abort): no completion.
Any other ends one: OpenAI's stop and length, TGI's eos_token and stop_sequence."""


def _finished(event: dict[str, Any]) -> bool:
    """Whether a chunk ends its choice (a finish_reason): a stream may close after it, as
    some servers do, without ``data: [DONE]``. Null or empty (TGI's chunks before the last)
    ends nothing; a choice the server gave up fails."""
    choices = event.get("choices")
    reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)] \
        if isinstance(choices, list) else []
    for reason in reasons:
        if reason is not None and not isinstance(reason, str):
            raise LoadError(f"a choice's finish_reason is {printable(repr(reason)):.80}; "
                            "expected a string or null")
        if reason is not None and reason.lower() in GAVE_UP:
            raise LoadError(f"the server gave the choice up: finish_reason={reason!r}")
    return any(reasons)


def _check_event_stream(content_type: str) -> None:
    """Name an answer that carried no event because it is no event stream (a server that
    answers a stream request with one JSON completion), rather than calling it cut short."""
    if content_type != "text/event-stream":
        raise LoadError(f"the server answered the stream request with Content-Type "
                        f"{printable(content_type)[:60] or '(none)'}, not an event stream "
                        "(text/event-stream); it must support stream: true")


def _check_ending(done: bool, chosen: bool, tokens: int | None, texts: bool) -> None:
    """Refuse a stream that is no whole completion: one cut before ``data: [DONE]`` and
    before any finish_reason, one that answered with no choice at all, one without the
    usage chunk that counts it, one that chunk counts as no token, or one
    without text that it counts as several (a server that dropped the text would measure
    as the fastest there is)."""
    if not done:
        raise LoadError("the stream ended without data: [DONE] or a finish_reason; it may "
                        "have been cut short")
    if not chosen:
        raise LoadError("the stream carried no completion choice, only other events")
    if tokens is None:
        raise LoadError("the stream ended without a usage chunk; the server must support "
                        "stream_options.include_usage")
    if tokens == 0:  # a request asks for at least one token: an ended one decoded it
        raise LoadError("the usage chunk counts completion_tokens=0 for a stream that "
                        f"carried {'text' if texts else 'a finished choice'}; expected at "
                        "least 1")
    if tokens > 1 and not texts:  # one token without text: an end-of-sequence token
        raise LoadError(f"the usage chunk counts completion_tokens={tokens} for a stream "
                        "that carried no text; a completion without text cannot be measured")


READ_FAULTS = (HttpProcessingError, aiohttp.ClientPayloadError, aiohttp.RedirectClientError,
               aiohttp.ClientResponseError)
"""What aiohttp raises for an answer it cannot take: as LoadErrors the request fails, on one
line (aiohttp's messages run over several)."""


def read_fault(error: BaseException) -> LoadError:
    """The one-line LoadError for a READ_FAULTS error."""
    if isinstance(error, aiohttp.TooManyRedirects):
        return LoadError("the server redirected too many times")
    if isinstance(error, aiohttp.InvalidUrlRedirectClientError):
        return LoadError(f"the server redirected to {printable(str(error))[:120]}, which is "
                         "no valid URL")
    if isinstance(error, aiohttp.RedirectClientError):
        return LoadError(f"the server redirected to {printable(str(error))[:120]}, no http or "
                         "https URL")
    # A body aiohttp cannot parse (a line past its 512 KiB limit, a broken chunked or
    # compressed encoding), or a status line or headers it cannot read, which it says as a
    # 400 of its own (the bench raises for no status): never the server's.
    assert isinstance(error, Exception)
    return LoadError(f"the response cannot be read: {_http_fault(error)}")


def _http_fault(error: Exception) -> str:
    """aiohttp's message for a fault in a body, on one line and cut short (it may quote the
    line that was too long); a ClientPayloadError carries the parser's fault as its cause."""
    fault = error.__cause__ if isinstance(error.__cause__, HttpProcessingError) else error
    text = fault.message if isinstance(fault, HttpProcessingError | aiohttp.ClientResponseError) \
        else str(fault)
    text = " ".join(str(text).split()) or type(fault).__name__
    return printable(text if len(text) <= 120 else text[:117] + "...")


def _texts(event: dict[str, Any], finished: bool) -> list[str]:
    """The non-empty texts of a completion chunk's choices. The bench asks for one
    completion of one prompt: a second choice, or a choice of another index than 0, is
    another completion, whose text and tokens are no part of the one measured; so is text
    after the choice's finish_reason (``finished``: an earlier chunk gave one)."""
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise LoadError(f"a stream event's choices are not a list of objects: {choices!r:.80}")
    if len(choices) > 1:
        raise LoadError(f"a stream event carries {len(choices)} choices; the bench asks for "
                        "one completion")
    for choice in choices:
        if choice.get("index", 0) != 0 or isinstance(choice.get("index"), bool):
            raise LoadError(f"a stream event's choice has index="
                            f"{printable(repr(choice['index'])):.40}; the bench asks for one "
                            "completion, of index 0")
    texts = [c.get("text") for c in choices]
    if not all(isinstance(t, str) for t in texts):
        raise LoadError("a stream event's choice has no text string")
    if finished and any(texts):
        raise LoadError("a stream event carries text after the choice's finish_reason; "
                        "expected none")
    return [t for t in texts if t]


def _completion_tokens(usage: object, max_tokens: int, earlier: int | None) -> int:
    """The usage chunk's count, which no honest server puts past the request's max_tokens
    (one that does would inflate every rate the bench reports); ``earlier`` is an earlier
    usage chunk's count (None: this is the first), since a second one would override it."""
    if earlier is not None:
        raise LoadError("the stream carried two usage chunks; expected one")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise LoadError(f"the usage chunk holds no completion_tokens count: {usage!r:.80}")
    if tokens > max_tokens:
        digits = str(tokens)
        shown = digits if len(digits) <= 20 else f"{digits[:12]}... ({len(digits)} digits)"
        raise LoadError(f"the usage chunk counts completion_tokens={shown} for a "
                        f"request of max_tokens={max_tokens}")
    return tokens


DONE: dict[str, Any] = {}
"""What ``_sse_data`` returns for ``data: [DONE]``, the end of an OpenAI stream."""


async def _ended(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A body's lines, then a blank one: an event the body ends without its blank line is
    read too."""
    async for line in content:
        yield line
    yield b"\n"


class SseEvents:
    """Server-sent events from a body's lines, as the event-stream format reads them: an
    event's ``data:`` lines joined by newlines, dispatched at the blank line that ends it;
    comments (keep-alive pings) and other fields skipped, a byte-order mark before the first
    line dropped. An event typed ``error`` fails the request; one of another type than
    ``message`` is no completion chunk (a client listening for messages never sees it)."""

    def __init__(self) -> None:
        self.kind = b""
        self.data: list[bytes] = []
        self.first = True
        self.cut = False  # the last line read had no line end: the body ended inside it

    def feed(self, line: bytes) -> dict[str, Any] | None:
        """The JSON object of the event ``line`` ends, ``DONE`` for the stream's end, None
        while an event is still being read or carries no data."""
        if self.first:
            line, self.first = line.removeprefix(b"\xef\xbb\xbf"), False
        ended = line.rstrip(b"\r\n")
        if ended:
            self.cut, line = ended == line, ended
            name, _, value = line.partition(b":")
            if name == b"data":
                self.data.append(value[1:] if value.startswith(b" ") else value)
            elif name == b"event":
                self.kind = value[1:] if value.startswith(b" ") else value
            return None
        kind, data = self.kind, b"\n".join(self.data).strip()
        self.kind, self.data = b"", []
        if kind == b"error":
            raise LoadError(f"an error event: {printable(data[:120].decode('utf-8', 'replace'))}")
        if kind not in (b"", b"message"):
            return None
        return _sse_data(data, self.cut) if data else None


def _sse_data(data: bytes, cut: bool = False) -> dict[str, Any]:
    """One event's data: ``DONE`` for the stream's end, else its JSON object; ``cut``: the
    body ended inside the event's last line, which explains data that is no JSON."""
    if data == b"[DONE]":
        return DONE
    try:
        event = json.loads(data)
    except ValueError as error:
        if "int_max_str_digits" in str(error):  # JSON still, past what Python reads
            raise LoadError(f"a stream event holds a number too long to read: {data[:80]!r}"
                            ) from None
        if cut:
            raise LoadError(f"the stream ended in the middle of an event: {data[-80:]!r}"
                            ) from None
        raise LoadError(f"a stream event is not JSON: {data[:80]!r}") from None
    except RecursionError:  # nesting deeper than the parser follows: no event of a server
        raise LoadError(f"a stream event is nested too deeply to read: {data[:40]!r}") from None
    if not isinstance(event, dict):  # no completion chunk is anything but an object
        raise LoadError(f"a stream event is not a JSON object: {data[:80]!r}")
    return event


ERROR_BODY_LIMIT = 64 * 1024
"""Bytes of an error answer's body read: an endless one must not fill the bench's memory."""


async def _error_text(response: aiohttp.ClientResponse) -> str:
    """OpenAI's error message, or the start of whatever else the body holds, on one line."""
    body = bytearray()
    while len(body) < ERROR_BODY_LIMIT:
        chunk = await response.content.read(ERROR_BODY_LIMIT - len(body))
        if not chunk:
            break
        body += chunk
    raw = body.decode("utf-8", errors="replace")
    try:
        text = str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        text = " ".join(raw.split())[:120] + " (not an OpenAI error body)"
    return printable(text)


async def closed_loop(target: Target, requests: Sequence[tuple[str, SamplingParams]],
                      concurrency: int) -> LevelRun:
    """``concurrency`` clients over the requests, in order; a failed request is counted and
    its client goes on."""
    run = LevelRun(concurrency=concurrency, timings=[None] * len(requests))
    queue = list(enumerate(requests))

    async def client() -> None:
        while queue:
            index, (prompt, params) = queue.pop(0)
            try:
                run.timings[index] = await target.complete(prompt, params)
            except (LoadError, aiohttp.ClientError, AdaspecError) as error:
                run.errors.append(f"request {index}: {error}")
            except TimeoutError:
                run.errors.append(f"request {index}: no byte from the server for "
                                  f"{READ_TIMEOUT_S} s")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    run.seconds = time.perf_counter() - started
    return run


async def served_model(url: str, session: aiohttp.ClientSession) -> str:
    """The one model a server lists at ``/v1/models``."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models",
                               timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
                               ) as response:
            if response.status != 200:
                raise LoadError(f"GET /v1/models answered HTTP {response.status}")
            data = await response.json(content_type=None)
    except READ_FAULTS as error:
        raise LoadError(f"GET /v1/models: {read_fault(error)}") from None
    except aiohttp.ClientError as error:
        raise LoadError(f"cannot reach {url}: {error}") from None
    except TimeoutError:
        raise LoadError(f"GET /v1/models got no answer within {MODELS_TIMEOUT_S} s") from None
    except ValueError:
        raise LoadError("GET /v1/models did not answer JSON") from None
    except RecursionError:
        raise LoadError("GET /v1/models answered JSON nested too deeply to read") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise LoadError(f"GET /v1/models answered no list of models with string ids: "
                        f"{data!r:.80}")
    names: list[str] = [m["id"] for m in models]
    if len(names) != 1:
        listed = printable(", ".join(names))
        raise LoadError(f"the server lists {len(names)} models ({listed}); name one with "
                        "--served_model_name")
    return names[0]
