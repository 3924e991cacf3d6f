"""The event bus: every event of the runtime passes through ``publish`` once, and reaches the
subscribers (the event log writer, the state trace, the policies' hooks) in the order they
subscribed.

Delivery is a plain loop of synchronous calls on the asyncio loop's thread: no tasks, no
``gather``, so the order in which subscribers see events, and therefore the event log, never
depends on scheduling. Waiting code uses ``next``, a loop future resolved by ``publish`` itself
(no polling). The bus stamps nothing: the publisher sets ``time`` from its ``Clock``.
"""

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar, overload

from adaspec.runtime.events.types import Event

E = TypeVar("E", bound=Event)

Handler = Callable[[Event], object]
"""A subscriber: called with each published event; its return value is ignored."""

Match = str | type[Event] | Callable[[Event], bool]
"""What ``next`` waits for: an event ``kind``, an event class, or a predicate."""

_Waiter = tuple[Callable[[Event], bool], "asyncio.Future[Event]"]


class EventBus:
    """Synchronous, ordered fan-out of events to subscribers, plus awaitable waits.

    A handler that raises stops delivery of that event: the exception propagates out of
    ``publish`` to the publisher (the runtime fails the round through its one failure path),
    later handlers do not see the event and no waiter is resolved by it. A handler may publish
    in turn; that nested event is delivered in full before the outer one reaches later
    handlers. ``publish`` and ``next`` belong to the loop's thread (loop futures are not
    thread-safe).
    """

    __slots__ = ("_handlers", "_waiters")

    def __init__(self) -> None:
        # A tuple replaced on change: publish iterates a snapshot, so (un)subscribing from a
        # handler affects the next event only.
        self._handlers: tuple[Handler, ...] = ()
        self._waiters: list[_Waiter] = []

    @property
    def listening(self) -> bool:
        """Whether any handler or waiter would see an event; publishers may skip building
        events nobody receives (the hot path does)."""
        return bool(self._handlers or self._waiters)

    def subscribe(self, handler: Handler) -> None:
        """Deliver every later event to ``handler``, after the handlers subscribed before it."""
        self._handlers = (*self._handlers, handler)

    def unsubscribe(self, handler: Handler) -> None:
        """Stop delivering to ``handler`` (its first subscription, if subscribed twice)."""
        handlers = list(self._handlers)
        handlers.remove(handler)
        self._handlers = tuple(handlers)

    def publish(self, event: Event) -> None:
        """Hand ``event`` to every handler in subscription order, then resolve the waiters
        it matches (in the order they called ``next``)."""
        for handler in self._handlers:
            handler(event)
        if self._waiters:
            self._resolve(event)

    @overload
    def next(self, match: type[E]) -> "asyncio.Future[E]": ...

    @overload
    def next(self, match: str | Callable[[Event], bool]) -> "asyncio.Future[Event]": ...

    def next(self, match: Match) -> "asyncio.Future[Any]":
        """A future for the first event published after this call that matches.

        Registration happens now, not at ``await``: an event published between the call and
        the await is not missed, and one published before the call is never returned. A
        predicate that raises fails this future, not the publisher. Call it from the loop's
        thread; awaiting it is the only way the runtime waits for an event.
        """
        future: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiters.append((_predicate(match), future))
        return future

    def _resolve(self, event: Event) -> None:
        pending: list[_Waiter] = []
        for matches, future in self._waiters:
            if future.done():  # cancelled by its awaiting task: forget it
                continue
            try:
                hit = matches(event)
            except Exception as error:  # the waiter's bug belongs to the waiter
                future.set_exception(error)
                continue
            if hit:
                future.set_result(event)
            else:
                pending.append((matches, future))
        self._waiters = pending


def _predicate(match: Match) -> Callable[[Event], bool]:
    if isinstance(match, str):
        return lambda event: event.kind == match
    if isinstance(match, type):
        cls = match
        return lambda event: isinstance(event, cls)
    return match
