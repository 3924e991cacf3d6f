"""The event bus: every event of the runtime passes through ``publish`` once, and reaches the
subscribers (the event log writer, the state trace, the policies' hooks) in the order they
subscribed.

Delivery is a plain loop of synchronous calls on the asyncio loop's thread: no tasks, no
``gather``, so the order in which subscribers see events, and therefore the event log, never
depends on scheduling. Waiting code uses ``next``, a loop future resolved by ``publish`` itself
(no polling). The bus stamps nothing: the publisher sets ``time`` from its ``Clock``.
"""

import asyncio
import functools
import inspect
import logging
import reprlib
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

from adaspec.runtime.events.types import EVENT_TYPES, Event

E = TypeVar("E", bound=Event)

LOG = logging.getLogger("adaspec.events")

Handler = Callable[[Event], object]
"""A subscriber: called with each published event; its return value is ignored."""

Match = str | type[Event] | Callable[[Event], bool]
"""What ``next`` waits for: an event ``kind``, an event class, or a predicate."""

_OBSERVER_BUGS = (Exception, asyncio.CancelledError, GeneratorExit)
"""What a handler's call may raise without reaching the publisher (see ``EventBus``)."""

_Waiter = tuple[Callable[[Event], bool], "asyncio.Future[Event]"]


class EventBus:
    """Synchronous, ordered fan-out of events to subscribers, plus awaitable waits.

    A handler whose call raises an ``Exception`` is a broken observer, not a broken round: it
    is unsubscribed (every subscription of it) and its failure logged once, as an error on the
    ``adaspec.events`` logger naming the handler and the event; the other handlers and the
    waiters still get the event, and the publisher never sees the error. So is one raising
    ``CancelledError`` or ``GeneratorExit``: a plain call cannot be cancelled by the loop,
    so either is the handler's own bug. An interrupt (``KeyboardInterrupt``, ``SystemExit``)
    still propagates to the publisher. A handler may publish in
    turn; that nested event is delivered in full before the outer one reaches later handlers.
    ``publish`` and ``next`` belong to the loop's thread (loop futures are not thread-safe).
    """

    __slots__ = ("_dropped", "_handlers", "_waiters")

    def __init__(self) -> None:
        # A tuple replaced on change: publish iterates a snapshot, so (un)subscribing from a
        # handler affects the next event only.
        self._handlers: tuple[Handler, ...] = ()
        self._waiters: list[_Waiter] = []
        self._dropped: list[Handler] = []  # unsubscribed after raising: see the class doc

    @property
    def listening(self) -> bool:
        """Whether any handler or waiter would see an event; publishers may skip building
        events nobody receives (the hot path does)."""
        return bool(self._handlers or self._waiters)

    def subscribe(self, handler: Handler, *, first: bool = False) -> None:
        """Deliver every later event to ``handler``, after the handlers subscribed before it,
        or with ``first`` before them: a record of the events (the event log) sees each one
        before a handler can react to it with another (a cancel, a submit), so it records
        them in the order they happened. A handler dropped after raising may subscribe
        again, and is dropped again if it raises again."""
        if not callable(handler):
            raise TypeError(f"an event subscriber must be callable, got {_shown(handler)}")
        if is_async_callable(handler):
            raise TypeError(f"subscribe({_name(handler)}): an async def handler would only "
                            "make coroutines nobody awaits; expected a plain function (it may "
                            "start a task of its own)")
        if not isinstance(first, bool):
            raise TypeError(f"subscribe(first={_shown(first)}): expected True or False")
        self._dropped = [h for h in self._dropped if not _same(h, handler)]
        self._handlers = (handler, *self._handlers) if first else (*self._handlers, handler)

    def unsubscribe(self, handler: Handler) -> None:
        """Stop delivering to ``handler`` (its first subscription, if subscribed twice); a
        handler the bus dropped after it raised is already unsubscribed. A handler that was
        never subscribed (or is already unsubscribed) raises ``ValueError``: unsubscribing
        it twice, or another object than the one subscribed, is the caller's bug."""
        handlers = list(self._handlers)
        index = next((i for i, h in enumerate(handlers) if _same(h, handler)), None)
        if index is None:
            if _held(self._dropped, handler):
                return
            raise ValueError(f"unsubscribe({_name(handler)}): that handler was not subscribed "
                             "(unsubscribe the same object that was passed to subscribe)")
        del handlers[index]
        self._handlers = tuple(handlers)

    @property
    def dropped(self) -> tuple[Handler, ...]:
        """The handlers unsubscribed because they raised, in the order they did."""
        return tuple(self._dropped)

    def publish(self, event: Event) -> None:
        """Hand ``event`` to every handler in subscription order, then resolve the waiters
        it matches (in the order they called ``next``). ``event`` must be an ``Event``."""
        if not isinstance(event, Event):
            raise TypeError(f"publish({_shown(event)}): expected an Event "
                            f"(adaspec.runtime.events.types); got {type(event).__name__}")
        dropped: list[Handler] | None = None  # in this publish: not called again for it
        for handler in self._handlers:
            if dropped is not None and _held(dropped, handler):
                continue
            try:
                handler(event)
            except _OBSERVER_BUGS as error:  # the observer's bug, not the round's
                dropped = [*(dropped or ()), handler]
                self._drop(handler, event, error)
        if self._waiters:
            self._resolve(event)

    def _drop(self, handler: Handler, event: Event, error: BaseException) -> None:
        if _held(self._dropped, handler):  # subscribed twice: already dropped and logged
            return
        self._handlers = tuple(h for h in self._handlers if not _same(h, handler))
        self._dropped.append(handler)
        name = _name(handler)
        try:
            text = str(error)
        except Exception:  # an exception whose own message is broken: its type says enough
            text = ""
        message = text.splitlines()[0] if text else ""
        LOG.error("event subscriber %s raised %s: %s on a %s event; it is unsubscribed and "
                  "gets no further events", name, type(error).__name__, message, event.kind)

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

        ``match`` is an event ``kind`` named in ``EVENT_TYPES``, an ``Event`` subclass, or a
        predicate called with each event; anything else (an unknown kind, which no event
        would ever match) raises ``TypeError`` or ``ValueError`` now.
        """
        predicate = _predicate(match)
        future: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
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
        if match not in EVENT_TYPES:
            raise ValueError(f"next({_shown(match)}): no event has that kind; expected one of "
                             + ", ".join(EVENT_TYPES))
        return lambda event: event.kind == match
    if isinstance(match, type):
        if not issubclass(match, Event):
            raise TypeError(f"next({_name(match)}): expected an Event subclass, an event kind "
                            "or a predicate; no event is an instance of that class")
        cls = match
        return lambda event: isinstance(event, cls)
    if not callable(match):
        raise TypeError(f"next({_shown(match)}): expected an event kind (str), an Event "
                        f"subclass or a predicate (a callable); got {type(match).__name__}")
    return match


def _same(one: Handler, other: Handler) -> bool:
    """The same subscriber: the same object, or the same method of the same object (each
    ``obj.method`` is a new bound method, and so is each ``a_list.append``). Never ``==``,
    which a handler may define so that another one compares equal to it."""
    if one is other:
        return True
    if isinstance(one, types.MethodType) and isinstance(other, types.MethodType):
        return one.__func__ is other.__func__ and one.__self__ is other.__self__
    for kind in (types.BuiltinMethodType, types.MethodWrapperType):  # ``a_list.append``
        if isinstance(one, kind) and isinstance(other, kind):
            owner = one.__self__
            return owner is not None and owner is other.__self__ and one.__name__ == other.__name__
    return False


def _held(handlers: Sequence[Handler], handler: Handler) -> bool:
    return any(_same(h, handler) for h in handlers)


def _name(handler: object) -> str:
    """A callable as its qualified name (its repr when it has none), on one line."""
    name = getattr(handler, "__qualname__", None)
    return name if isinstance(name, str) and name.isprintable() else _shown(handler)


def _shown(value: object) -> str:
    """``repr(value)``, short and on one line (repr escapes control characters)."""
    return reprlib.repr(value)


def is_async_callable(value: object) -> bool:
    """Whether calling ``value`` only makes a coroutine (an ``async def`` function, a partial
    of one, or an object whose ``__call__`` is one): a plain caller would never await it."""
    while isinstance(value, functools.partial):  # what a partial calls is what counts
        value = value.func
    return inspect.iscoroutinefunction(value) or \
        inspect.iscoroutinefunction(type(value).__call__)
