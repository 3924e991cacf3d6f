"""Requests as the runtime's host side sees them, and the handle an engine streams from."""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError


class RequestFailed(AdaspecError):
    """A request ended because a round it was in failed; ``reason`` says where and why."""

    def __init__(self, request_id: int, reason: str) -> None:
        super().__init__(request_id, reason)
        self.request_id = request_id
        self.reason = reason

    def __str__(self) -> str:
        return f"request {self.request_id} failed: {self.reason}"


@dataclass(frozen=True, slots=True)
class RequestResult:
    """A finished request. Acceptance length (AL) counts the residual or bonus token:
    ``mean_acceptance_length = (accepted + rounds) / rounds``."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str  # stop | length | cancelled
    rounds: int  # decode rounds the request took part in
    verified: int  # drafted tokens the target verified
    accepted: int  # drafted tokens accepted

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


_END = object()


@dataclass(slots=True)
class Request:
    """One request's host-side bookkeeping."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    kv_slot: int = -1
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    last_round: int = -1  # newest submitted round that includes this request
    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    chunks: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.finish_reason is None and self.error is None

    def emit(self, token_ids: list[int]) -> None:
        if token_ids:
            self.tokens.extend(token_ids)
            self.chunks.put_nowait(token_ids)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.chunks.put_nowait(_END)
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.chunks.put_nowait(error)
        self.done.set()

    def result(self) -> RequestResult:
        assert self.finish_reason is not None
        return RequestResult(request_id=self.id, token_ids=tuple(self.tokens),
                             finish_reason=self.finish_reason, rounds=self.rounds,
                             verified=self.verified, accepted=self.accepted)


class RequestHandle:
    """What ``Runtime.submit`` returns: iterate it for token chunks as rounds retire, or await
    ``result()``; ``cancel()`` ends the request between rounds."""

    def __init__(self, request: Request, cancel: Callable[[int], None]) -> None:
        self._request = request
        self._cancel = cancel

    @property
    def request_id(self) -> int:
        return self._request.id

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[list[int]]:
        while True:
            item = await self._request.chunks.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, list)
            yield item

    def cancel(self) -> None:
        """End the request before its next round; tokens of rounds already in flight are
        dropped and its KV slot is freed once they retire."""
        self._cancel(self._request.id)

    async def result(self) -> RequestResult:
        await self._request.done.wait()
        if self._request.error is not None:
            raise self._request.error
        return self._request.result()
