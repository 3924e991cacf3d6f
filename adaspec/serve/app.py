"""The HTTP routes of ``adaspec serve`` (aiohttp), on the event loop the runtime runs on.

    POST /v1/completions   OpenAI completions, streamed as server-sent events or whole
    GET  /v1/models        the one model served
    GET  /health           200 once ready; 503 while starting, draining or failed
    GET  /metrics          Prometheus text

A completion request is checked whole (every field, every prompt against the model) before
any of it is queued. A client that goes away cancels its requests: aiohttp cancels the
handler, and the handler cancels what it submitted.
"""

import asyncio
import contextlib
import json
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from adaspec.errors import InvalidRequest, UnsupportedRequest
from adaspec.models.tokenizer import Tokenizer
from adaspec.runtime.engine import Runtime, RuntimeStopped
from adaspec.runtime.requests import RequestFailed, RequestHandle
from adaspec.serve.metrics import CONTENT_TYPE, ServerMetrics
from adaspec.serve.protocol import (
    COMPLETION_FIELDS,
    MAX_BODY_BYTES,
    ApiError,
    CompletionJob,
    bad_field,
    parse_body,
    read_completion,
    refused,
)
from adaspec.serve.text import CompletionText

STARTING, READY, DRAINING, FAILED = "starting", "ready", "draining", "failed"
BODY_ENCODINGS = ("identity", "gzip", "deflate")
"""The request body encodings read; any other is refused (415), never read as plain."""
CLIENT_GONE = 499
"""The status logged for a request whose client went away before its answer (nginx's)."""
READ_TIMEOUT_S = 60.0
"""How long a connection may take to send a request's head and, apart, its body (8 MiB at
most): a client that stalls is cut off, and holds no connection the server needs."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class ServeSettings:
    model_name: str
    max_queued_requests: int
    temperature_rule: str | None
    """Why the launch needs every request's temperature; None: OpenAI's default applies."""
    read_timeout_s: float = READ_TIMEOUT_S


@dataclass(slots=True)
class Choice:
    """One prompt's completion while it runs, and its figures once it ends."""

    index: int
    handle: RequestHandle
    text: CompletionText
    prompt_tokens: int
    arrived: float
    first_token: float | None = None
    last_token: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    rounds: int = 0
    verified: int = 0
    accepted: int = 0

    def extension(self) -> dict[str, Any]:
        """adaspec's own figures of the completion (AL counts the residual or bonus)."""
        al = (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0
        return {"acceptance_length": round(al, 4), "drafted_accepted": self.accepted,
                "drafted_verified": self.verified, "rounds": self.rounds}


@dataclass(slots=True)
class Completion:
    """One HTTP completion request: its choices, and what its log line says."""

    id: str
    arrived: float
    stream: bool
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    status: int = 200
    error: str | None = None
    delivered: bool = False  # a stream's every chunk is out: only ``data: [DONE]`` is left
    user: str | None = None  # the request's ``user``, as the client named itself


class CompletionServer:
    """The routes' state: the runtime, the served model, counters and the drain."""

    def __init__(self, runtime: Runtime, tokenizer: Tokenizer, settings: ServeSettings,
                 log: Any = None) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = ServerMetrics(runtime)
        self.log = log or structlog.get_logger("adaspec.serve")
        self.state = STARTING
        self.failure = ""
        self.drained = asyncio.Event()  # set while no request is in flight
        self.drained.set()
        self.in_flight: set[RequestHandle] = set()  # submitted, not yet ended
        self.answering: set[asyncio.Task[Any]] = set()  # handlers of requests in flight
        self.cut = False  # set by ``cut_answers``
        self.created = int(time.time())
        # Prompts are encoded off the event loop, so a long one stalls no other stream; one
        # worker, because a Hugging Face tokenizer must not encode on two threads at once.
        self.encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaspec-encode")

    def close(self) -> None:
        """Let go of the encoding thread (an encoding under way runs to its end)."""
        self.encoder.shutdown(wait=False, cancel_futures=True)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    # --- plain routes --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"status": self.state}
        if self.failure:
            body["error"] = self.failure
        return web.json_response(body, status=200 if self.state == READY else 503)

    async def models(self, request: web.Request) -> web.Response:
        card: dict[str, Any] = {"id": self.settings.model_name, "object": "model",
                                "created": self.created, "owned_by": "adaspec"}
        if self.state in (READY, DRAINING):
            with contextlib.suppress(RuntimeStopped):  # stopped under the drain: unknown
                card["max_model_len"] = self.runtime.context_limit
        return web.json_response({"object": "list", "data": [card]})

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.text(), headers={"Content-Type": CONTENT_TYPE})

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal in OpenAI's error shape, aiohttp's own (404, 405, 413) included."""
        try:
            return await handler(request)
        except ApiError as error:
            return error_response(error)
        except web.HTTPRequestEntityTooLarge:
            return error_response(too_large())
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return error_response(ApiError(error.status, f"{request.method} {request.path}: "
                                           f"{error.reason}", kind="invalid_request_error"))
        except Exception as error:  # adaspec's bug: logged once with its traceback
            self.log.exception("handler_bug", path=request.path)
            return error_response(ApiError(500, f"internal error: {type(error).__name__}: "
                                           f"{error}", kind="server_error"))

    # --- completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        completion = Completion(id=f"cmpl-{uuid.uuid4().hex}", arrived=time.perf_counter(),
                                stream=False)
        try:
            return await self._complete(request, completion)
        except ApiError as error:
            completion.status, completion.error = error.status, error.message
            raise
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client gone away
            if not completion.delivered:
                completion.status, completion.error = CLIENT_GONE, self._why_cancelled(
                    completion)
            raise
        except Exception as error:  # adaspec's bug: answered 500 by the middleware
            completion.status = 500
            completion.error = f"{type(error).__name__}: {error}"
            raise
        finally:
            self.metrics.http_requests.labels(str(completion.status)).inc()
            self._log(completion)

    async def _complete(self, request: web.Request, completion: Completion
                        ) -> web.StreamResponse:
        self._check_open()
        raw = await self._body(request)
        self._check_open()  # a drain may have begun while the body came
        _check_no_query(request)
        job = read_completion(parse_body(raw), self.settings.model_name,
                              temperature_rule=self.settings.temperature_rule,
                              eos_token_ids=self.tokenizer.eos_token_ids)
        completion.stream, completion.user = job.stream, job.user
        self._check_stop_ids(job)
        prompts = [await self._prompt_ids(job, index) for index in range(len(job.prompts))]
        self._check_open()  # a drain may have begun while the prompts were encoded
        self._check_room(len(prompts))
        handles = self._submit(prompts, job)
        self.in_flight.update(handles)
        self.drained.clear()
        handler = asyncio.current_task()
        assert handler is not None
        self.answering.add(handler)
        self.metrics.waiting.inc(len(handles))
        completion.choices = [
            Choice(index=i, handle=h, prompt_tokens=len(ids), arrived=completion.arrived,
                   text=CompletionText(self.tokenizer.detokenizer(ids), job.stop_strings))
            for i, (h, ids) in enumerate(zip(handles, prompts, strict=True))]
        try:
            if job.stream:
                return await self._stream(request, job, completion)
            return await self._whole(job, completion)
        finally:
            for choice in completion.choices:
                if not choice.handle.done:  # the client went away, or a choice failed
                    choice.handle.cancel()
                    choice.finish_reason = choice.finish_reason or "cancelled"
            self.answering.discard(handler)
            self._ended(completion)

    def _why_cancelled(self, completion: Completion) -> str:
        if self.cut and completion.choices:
            return "cut off by the second signal while its answer waited for the client to read"
        if completion.choices or self.state == READY:
            return "the client went away"
        # Before its body came whole, a drain's close may have cut it off too.
        return "the connection closed before the request came whole"

    def _check_open(self) -> None:
        if self.state == READY:
            return
        if self.state == STARTING:
            raise ApiError(503, "the server is starting (loading models, preparing graphs, "
                           "calibrating); retry once GET /health answers 200",
                           kind="service_unavailable", retry_after=1)
        raise ApiError(503, f"the server is {self.state}; it takes no new requests",
                       kind="service_unavailable", retry_after=1)

    async def _body(self, request: web.Request) -> bytes:
        _check_transfer_coding(request)
        # Several header lines are one list of codings (RFC 9110), refused as one below.
        lines = request.headers.getall("Content-Encoding", ["identity"])
        encoding = ", ".join(line.strip() for line in lines).lower()
        if encoding not in BODY_ENCODINGS:
            raise ApiError(415, f"Content-Encoding={encoding}: expected one of "
                           f"{', '.join(BODY_ENCODINGS)}", kind="invalid_request_error")
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise too_large()
        try:
            async with asyncio.timeout(self.settings.read_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise ApiError(408, f"the request body did not come whole within "
                           f"{self.settings.read_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large() from None
        except (HttpProcessingError, RequestPayloadError) as error:  # a body cut short
            reason = " ".join(str(error).split()) or type(error).__name__
            raise ApiError(400, f"the request body cannot be read: {reason}") from None
        return decoded_body(raw, encoding)

    def _check_stop_ids(self, job: CompletionJob) -> None:
        try:
            vocab = self.runtime.vocab_size
        except RuntimeStopped as error:
            raise runtime_stopped(error) from None
        for field_name, token in job.stop_id_fields:
            if not 0 <= token < vocab:
                raise bad_field(field_name, token, f"expected token ids in 0..{vocab - 1}")

    async def _prompt_ids(self, job: CompletionJob, index: int) -> tuple[int, ...]:
        field_name = job.prompt_fields[index]
        prompt = job.prompts[index]
        try:
            ids = await self._encode(prompt) if isinstance(prompt, str) else prompt
        except InvalidRequest as error:  # text the tokenizer cannot hold
            raise bad_field(field_name, prompt, error.expected) from None
        try:
            return self.runtime.check(ids, job.params)
        except RuntimeStopped as error:
            raise runtime_stopped(error) from None
        except (InvalidRequest, UnsupportedRequest) as error:
            if error.field == "prompt":
                shown = prompt if isinstance(prompt, str) else error.value
                raise bad_field(field_name, shown, error.expected) from None
            if error.field.startswith("prompt["):  # one id of the prompt, by its index
                raise bad_field(field_name + error.field.removeprefix("prompt"), error.value,
                                error.expected) from None
            raise refused(error) from None

    async def _encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.encoder, self.tokenizer.encode, text)

    def _submit(self, prompts: list[tuple[int, ...]], job: CompletionJob
                ) -> list[RequestHandle]:
        """Every prompt's request, or none of them."""
        handles: list[RequestHandle] = []
        try:
            for ids in prompts:
                handles.append(self.runtime.submit(ids, job.params))
        except RuntimeStopped as error:  # a fault between the check and the submit
            for handle in handles:
                handle.cancel()
            raise runtime_stopped(error) from None
        return handles

    def _check_room(self, count: int) -> None:
        limit = self.settings.max_queued_requests
        if count > limit:
            raise bad_field("prompt", f"{count} prompts", f"expected at most {limit} (the "
                            "server's --max_queued_requests)")
        if len(self.in_flight) + count > limit:
            raise ApiError(429, f"the queue is full: {len(self.in_flight)} requests in flight, "
                           f"at most {limit} (--max_queued_requests); retry later",
                           kind="rate_limit_exceeded", code="queue_full", retry_after=1)

    async def _whole(self, job: CompletionJob, completion: Completion) -> web.Response:
        await asyncio.gather(*(self._run(choice, None) for choice in completion.choices))
        failed = next((c for c in completion.choices if c.error is not None), None)
        if failed is not None:
            raise ApiError(500, f"the request failed: {failed.error}", kind="server_error")
        body = self._chunk(completion, [
            {"index": c.index, "text": c.text.text, "logprobs": None,
             "finish_reason": c.finish_reason, "adaspec": c.extension()}
            for c in completion.choices])
        body["usage"] = usage(completion)
        return web.json_response(body, dumps=_dumps)

    async def _stream(self, request: web.Request, job: CompletionJob, completion: Completion
                      ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        pieces: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._run(c, pieces)) for c in completion.choices]
        try:
            await response.prepare(request)
            async for piece in _until_all_end(pieces, len(tasks)):
                await response.write(_event(self._chunk(completion, [piece])))
            failed = next((c for c in completion.choices if c.error is not None), None)
            if failed is not None:
                error = ApiError(500, f"the request failed: {failed.error}",
                                 kind="server_error")
                completion.error = error.message  # the status was sent already: 200
                await response.write(_event(error.body()))
            elif job.include_usage:
                final = self._chunk(completion, [])
                final["usage"] = usage(completion)
                await response.write(_event(final))
            # A client may close once it has read the whole completion (adaspec's bench does,
            # and so may others): that request was answered, not abandoned.
            completion.delivered = True
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:  # the client went away mid-stream: its requests are cancelled
            if not completion.delivered:
                completion.status = CLIENT_GONE
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return response

    async def _run(self, choice: Choice,
                   pieces: "asyncio.Queue[dict[str, Any] | None] | None") -> None:
        """Follow one request to its end; with ``pieces``, queue each text piece to stream
        (and ``None`` once the request has ended)."""
        try:
            await self._follow(choice, pieces)
        except RequestFailed as error:
            choice.error, choice.finish_reason = error.reason, "error"
        except Exception as error:  # adaspec's bug: the request ends, the server goes on
            choice.error, choice.finish_reason = f"{type(error).__name__}: {error}", "error"
            self.log.exception("completion_bug", request_id=choice.handle.request_id)
        finally:
            if pieces is not None:
                pieces.put_nowait(None)  # this choice has ended, whatever ended it

    async def _follow(self, choice: Choice,
                      pieces: "asyncio.Queue[dict[str, Any] | None] | None") -> None:
        async for chunk in choice.handle:
            now = time.perf_counter()
            if choice.first_token is None:
                choice.first_token = now
                self.metrics.waiting.dec()
                self.metrics.running.inc()
            choice.last_token = now
            text = choice.text.feed(chunk)
            if text and pieces is not None:
                pieces.put_nowait({"index": choice.index, "text": text, "logprobs": None,
                                   "finish_reason": None})
            if choice.text.stopped:
                choice.handle.cancel()
                break
        result = await choice.handle.result()
        choice.rounds, choice.verified = result.rounds, result.verified
        choice.accepted = result.accepted
        rest = choice.text.finish()  # its flush may complete a stop string
        choice.finish_reason = "stop" if choice.text.stopped else result.finish_reason
        if pieces is not None:
            pieces.put_nowait({"index": choice.index, "text": rest, "logprobs": None,
                               "finish_reason": choice.finish_reason,
                               "adaspec": choice.extension()})

    def _chunk(self, completion: Completion, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": completion.id, "object": "text_completion",
                "created": completion.created, "model": self.settings.model_name,
                "choices": choices}

    def cancel_all(self) -> None:
        """End every request in flight between rounds (a second signal while draining)."""
        for handle in list(self.in_flight):
            handle.cancel()

    def cut_answers(self) -> None:
        """Cancel the handlers of requests still in flight: after ``cancel_all``, those wait
        only for a client that does not read what they write (no write has a timeout)."""
        self.cut = True
        for handler in list(self.answering):
            handler.cancel()

    def _ended(self, completion: Completion) -> None:
        self.in_flight.difference_update(choice.handle for choice in completion.choices)
        if not self.in_flight:
            self.drained.set()
        for choice in completion.choices:
            if choice.first_token is None:
                self.metrics.waiting.dec()
            else:
                self.metrics.running.dec()
                self.metrics.ttft.observe(choice.first_token - choice.arrived)
                assert choice.last_token is not None
                if choice.text.num_tokens > 1:
                    self.metrics.tpot.observe((choice.last_token - choice.first_token)
                                              / (choice.text.num_tokens - 1))
                self.metrics.e2e.observe(choice.last_token - choice.arrived)
            self.metrics.finished.labels(choice.finish_reason or "cancelled").inc()

    def _log(self, completion: Completion) -> None:
        ended = time.perf_counter()
        choices = completion.choices
        for choice in choices:  # one whose follower was cancelled never read its result
            choice.rounds, choice.verified, choice.accepted = choice.handle.drafted()
        rounds = sum(c.rounds for c in choices)
        firsts = [c.first_token for c in choices if c.first_token is not None]
        self.log.info(
            "completion", id=completion.id, status=completion.status, stream=completion.stream,
            prompts=len(choices), prompt_tokens=sum(c.prompt_tokens for c in choices),
            completion_tokens=sum(c.text.num_tokens for c in choices),
            acceptance_length=round((sum(c.accepted for c in choices) + rounds) / rounds, 4)
            if rounds else None,
            drafted_accepted=sum(c.accepted for c in choices),
            drafted_verified=sum(c.verified for c in choices),
            ttft_s=round(min(firsts) - completion.arrived, 6) if firsts else None,
            e2e_s=round(ended - completion.arrived, 6),
            finish_reasons=[c.finish_reason for c in choices], user=completion.user,
            error=completion.error)


def _check_no_query(request: web.Request) -> None:
    """Completion parameters come in the JSON body only: one in the URL (``?stream=true``)
    would be ignored, so it is refused by name. Other query parameters (a gateway's
    ``api-version``) ask nothing of the completion and are left alone."""
    for name in request.query:
        if name in COMPLETION_FIELDS:
            raise ApiError(400, f"{name}: given in the URL's query; expected every completion "
                           "parameter in the JSON body", param=name)


async def _until_all_end(pieces: "asyncio.Queue[dict[str, Any] | None]", count: int
                         ) -> AsyncIterator[dict[str, Any]]:
    """The queued pieces until ``count`` ends (``None``) have come."""
    ended = 0
    while ended < count:
        piece = await pieces.get()
        if piece is None:
            ended += 1
        else:
            yield piece


def usage(completion: Completion) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completion.choices)
    generated = sum(c.text.num_tokens for c in completion.choices)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}


def runtime_stopped(error: RuntimeStopped) -> ApiError:
    """A request that met a runtime stopped by a fault (503: another server may take it)."""
    return ApiError(503, f"the runtime stopped: {error}", kind="service_unavailable",
                    retry_after=1)


def _check_transfer_coding(request: web.Request) -> None:
    """aiohttp reads a chunked body and passes over any coding listed before ``chunked``: a
    body sent as ``gzip, chunked`` would be read as if it were not compressed. A coding the
    server does not apply is a 501 (RFC 9112); a compressed body says so in Content-Encoding."""
    lines = request.headers.getall("Transfer-Encoding", [])
    codings = [coding.strip().lower() for line in lines for coding in line.split(",")]
    codings = [coding for coding in codings if coding]
    if codings and codings != ["chunked"]:
        raise ApiError(501, f"Transfer-Encoding={', '.join(codings)}: expected chunked alone "
                       "(a compressed body names its coding in Content-Encoding)",
                       kind="invalid_request_error")


def decoded_body(raw: bytes, encoding: str) -> bytes:
    """The body as sent before its Content-Encoding: the server decodes it itself (aiohttp's
    own decoding is off), so an encoding it does not read is a 415 and a body inflating past
    the size limit is a 413 before it is held whole. A gzip body may hold several members
    (RFC 1952), read one after the other as ``gzip -d`` reads them."""
    if encoding == "identity":
        return raw
    # gzip has its own header; deflate is zlib-wrapped, or raw as some clients send it.
    attempts = (16 + zlib.MAX_WBITS,) if encoding == "gzip" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)
    reason = ""
    for wbits in attempts:
        try:
            return _inflated(raw, wbits, members=encoding == "gzip")
        except _Unreadable as error:
            reason = str(error)
    raise ApiError(400, f"the request body cannot be read: it is not {encoding} data "
                   f"({reason})")


MAX_GZIP_MEMBERS = 64
"""The most members a gzip body may hold (a client sends one; thousands of tiny ones would
hold the event loop)."""


class _Unreadable(Exception):
    """The body is not data of the encoding tried (the reason)."""


def _inflated(raw: bytes, wbits: int, *, members: bool) -> bytes:
    pieces: list[bytes] = []  # joined once: adding to one string would copy it per member
    size, rest, first = 0, raw, True
    while True:
        inflater = zlib.decompressobj(wbits)
        try:  # at most one byte past the limit: never more than that is held
            piece = inflater.decompress(rest, MAX_BODY_BYTES + 1 - size)
        except zlib.error as error:
            raise _Unreadable(str(error) if first else
                              "data follows the compressed stream") from None
        pieces.append(piece)
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise too_large()
        if not inflater.eof:
            raise _Unreadable("the compressed data ends early")
        rest, first = inflater.unused_data, False
        if not rest:
            return b"".join(pieces)
        if not members:
            raise _Unreadable("data follows the compressed stream")
        if len(pieces) == MAX_GZIP_MEMBERS:  # each member costs a copy of what follows it
            raise _Unreadable(f"more than {MAX_GZIP_MEMBERS} gzip members")


def too_large() -> ApiError:
    return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                    kind="invalid_request_error")


def error_response(error: ApiError) -> web.Response:
    headers = {} if error.retry_after is None else {"Retry-After": str(error.retry_after)}
    return web.json_response(error.body(), status=error.status, headers=headers)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _event(value: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(value).encode("utf-8") + b"\n\n"
