"""Requests as the runtime's host side sees them, and the handle an engine streams from."""

import asyncio
import numbers
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from adaspec.config.requests import SamplingParams
from adaspec.errors import AdaspecError, InvalidRequest
from adaspec.models.protocols import TargetModel

PROMPT_EXPECTED = ("expected the prompt's token ids in order: a list or tuple of ints, bytes, "
                   "or a 1-d integer array")


def prompt_ids(prompt: object, field: str = "prompt") -> tuple[int, ...]:
    """The token ids of a prompt given as a sequence of integers (a list, a tuple, bytes) or
    a 1-d integer numpy array or torch tensor; anything else (a set or a dict, whose order is
    no prompt's, a generator, a string, a float) is refused naming ``field``."""
    if hasattr(prompt, "ndim") and hasattr(prompt, "dtype") and hasattr(prompt, "tolist"):
        kind = str(prompt.dtype)
        if prompt.ndim != 1 or not ("int" in kind and "complex" not in kind):
            raise InvalidRequest(field, f"{type(prompt).__name__} of {prompt.ndim} dimensions "
                                 f"and dtype {kind}", PROMPT_EXPECTED)
        device = getattr(getattr(prompt, "device", None), "type", "cpu")
        if device == "meta":  # shapes without values: nothing to read
            raise InvalidRequest(field, f"{type(prompt).__name__} on the meta device",
                                 f"{PROMPT_EXPECTED} holding values")
        prompt = prompt.tolist()
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise InvalidRequest(field, type(prompt).__name__, PROMPT_EXPECTED)
    ids = []
    for index, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise InvalidRequest(f"{field}[{index}]", repr(token), f"{PROMPT_EXPECTED} (got an "
                                 f"item of type {type(token).__name__})")
        ids.append(int(token))
    return tuple(ids)


def check_prompt(target: TargetModel, prompt: tuple[int, ...], field: str = "prompt") -> None:
    """Refuse, naming ``field`` (and the id's index in it), a prompt the target cannot decode:
    1 .. context_limit - 1 tokens (the first generated token needs a position), ids in the
    vocabulary. ``prompt`` is what ``prompt_ids`` made of it."""
    limit = target.context_limit - 1
    if not 1 <= len(prompt) <= limit:
        raise InvalidRequest(field, f"{len(prompt)} tokens",
                             f"expected 1..{limit} tokens (context limit "
                             f"{target.context_limit}, and the first generated token "
                             "needs a position)")
    vocab = target.vocab_size
    bad = next((index for index, token in enumerate(prompt) if not 0 <= token < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{field}[{bad}]", prompt[bad],
                             f"expected a token id in 0..{vocab - 1}")


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


@dataclass(slots=True)
class Request:
    """One request's host-side bookkeeping.

    Tokens are appended as rounds retire; a consumer iterating the handle reads them from
    ``tokens`` and waits on ``_wakeup``, a loop future that exists only while it waits, so
    delivering a round costs a list extend when nobody is iterating.
    """

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    kv_slot: int = -1
    tokens: list[int] = field(default_factory=list)
    running: bool = True
    finish_reason: str | None = None
    error: BaseException | None = None
    last_round: int = -1  # newest submitted round that includes this request
    rounds: int = 0
    verified: int = 0
    accepted: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    _wakeup: "asyncio.Future[None] | None" = None
    length: int = field(init=False)  # prompt and tokens: the context the host knows of
    # The length once the request has committed all it may (max_tokens or the context limit):
    # set when it is admitted. A request one token short of it, with a round in flight that
    # includes it, ends in that round (every live entry commits a token a round), so no
    # later round includes it: ``ending``.
    end_length: int = -1
    ending: bool = False

    def __post_init__(self) -> None:
        self.length = len(self.prompt) + len(self.tokens)

    def emit(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        self.length += len(token_ids)
        if self._wakeup is not None:
            self._wake()

    def take_round(self, verified: int, accepted: int, token_ids: list[int]) -> bool:
        """Count one retired round of this request and emit its tokens; True when the
        request is then one token short of its end (``ending``)."""
        self.rounds += 1
        self.verified += verified
        self.accepted += accepted
        self.tokens += token_ids
        self.length += len(token_ids)
        if self._wakeup is not None:
            self._wake()
        return self.length + 1 >= self.end_length

    def finish(self, reason: str) -> None:
        self.running = False
        self.finish_reason = reason
        self.done.set()
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.running = False
        self.error = error
        self.done.set()
        self._wake()

    def _wake(self) -> None:
        waiter, self._wakeup = self._wakeup, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_beyond(self, count: int) -> None:
        """Return once more than ``count`` tokens exist or the request has ended."""
        while len(self.tokens) <= count and self.running:
            if self._wakeup is None or self._wakeup.done():  # shared by every consumer
                self._wakeup = asyncio.get_running_loop().create_future()
            # Shielded: a consumer cancelled while it waits leaves the others waiting.
            await asyncio.shield(self._wakeup)

    def result(self) -> RequestResult:
        assert self.finish_reason is not None
        return RequestResult(request_id=self.id, token_ids=tuple(self.tokens),
                             finish_reason=self.finish_reason, rounds=self.rounds,
                             verified=self.verified, accepted=self.accepted)


class RequestHandle:
    """What ``Runtime.submit`` returns: iterate it for token chunks as rounds retire, or await
    ``result()``; ``cancel()`` ends the request between rounds."""

    def __init__(self, request: Request, cancel: Callable[[Request], None],
                 on_loop: Callable[[str], None] = lambda call: None) -> None:
        self._request = request
        self._cancel = cancel
        # Refuses a wait from another loop than the runtime's: nothing would wake it there,
        # and the request's asyncio objects would be bound to that loop.
        self._on_loop = on_loop

    @property
    def request_id(self) -> int:
        return self._request.id

    def __aiter__(self) -> AsyncIterator[list[int]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[list[int]]:
        """Each chunk is the tokens committed since the previous one (a round's worth, or
        more when the consumer was slow); a failed request raises its error at the end."""
        self._on_loop("iterating a RequestHandle")
        request, seen = self._request, 0
        while True:
            await request.wait_beyond(seen)
            if len(request.tokens) > seen:
                chunk, seen = request.tokens[seen:], len(request.tokens)
                yield chunk
            elif request.error is not None:
                raise request.error
            elif not request.running:
                return

    @property
    def done(self) -> bool:
        """Whether the request has ended (finished, cancelled or failed)."""
        return not self._request.running

    def cancel(self) -> None:
        """End the request before its next round; tokens of rounds already in flight are
        dropped and its KV slot is freed once they retire."""
        self._cancel(self._request)

    def drafted(self) -> tuple[int, int, int]:
        """Rounds taken part in, drafted tokens verified and accepted so far: a consumer that
        stops before ``result()`` (a client gone) still reports the rounds that ran."""
        request = self._request
        return request.rounds, request.verified, request.accepted

    async def result(self) -> RequestResult:
        self._on_loop("RequestHandle.result()")
        await self._request.done.wait()
        if self._request.error is not None:
            raise self._request.error
        return self._request.result()
