"""The event bus delivers each event to its handlers synchronously in subscription order, drops a
handler that raises (logged once) without the publisher or the other handlers noticing, and
resolves ``next`` futures from ``publish`` itself
(no polling, no sleeping); the virtual clock moves only when told to.
"""

from collections.abc import Callable

import pytest

from adaspec.policies.base import RoundFeedback
from adaspec.runtime.events.bus import EventBus
from adaspec.runtime.events.clock import Clock, MonotonicClock, VirtualClock
from adaspec.runtime.events.types import Event, RoundRetired, StageCompleted


def stage(round: int, name: str = "verify", time: float = 0.0) -> StageCompleted:
    return StageCompleted(time=time, round=round, slot=round % 2, stage=name)


def retired(round: int) -> RoundRetired:
    feedback = RoundFeedback(round=round, num_reqs=1, num_reqs_bucket=1, width=3, depth=3,
                             num_rows=4, verify_lengths=(3,), num_accepted=(1,))
    return RoundRetired(round=round, slot=round % 2, feedback=feedback)


def test_handlers_run_in_subscription_order_for_each_event() -> None:
    bus = EventBus()
    seen: list[tuple[str, float]] = []

    def handler(name: str) -> Callable[[Event], None]:
        return lambda event: seen.append((name, event.time))

    for name in ("log", "trace", "hooks"):
        bus.subscribe(handler(name))
    bus.publish(stage(0, time=1.0))
    bus.publish(stage(1, time=2.0))
    assert seen == [("log", 1.0), ("trace", 1.0), ("hooks", 1.0), ("log", 2.0), ("trace", 2.0),
                    ("hooks", 2.0)]


def test_a_handler_subscribed_first_runs_before_those_subscribed_earlier() -> None:
    bus = EventBus()
    seen: list[str] = []
    bus.subscribe(lambda event: seen.append("engine's"))
    bus.subscribe(lambda event: seen.append("log"), first=True)
    bus.publish(stage(0, time=1.0))
    assert seen == ["log", "engine's"]


def test_publish_without_subscribers_does_nothing() -> None:
    EventBus().publish(stage(0))


def test_unsubscribe_stops_delivery() -> None:
    bus = EventBus()
    seen: list[Event] = []
    bus.subscribe(seen.append)
    bus.publish(stage(0))
    bus.unsubscribe(seen.append)
    bus.publish(stage(1))
    assert seen == [stage(0)]


def test_a_handler_subscribed_during_publish_sees_the_next_event_only() -> None:
    bus = EventBus()
    late: list[Event] = []
    bus.subscribe(lambda event: bus.subscribe(late.append) if event.time == 0.0 else None)
    bus.publish(stage(0, time=0.0))
    bus.publish(stage(1, time=1.0))
    assert late == [stage(1, time=1.0)]


def test_a_raising_handler_is_dropped_and_logged_once_and_the_others_still_see_events(
        caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    before: list[Event] = []
    after: list[Event] = []
    calls: list[Event] = []

    def broken(event: Event) -> None:
        calls.append(event)
        raise OSError("disk full\nsecond line")

    bus.subscribe(before.append)
    bus.subscribe(broken)
    bus.subscribe(after.append)
    with caplog.at_level("ERROR", logger="adaspec.events"):
        bus.publish(stage(0))  # the publisher sees no error
        bus.publish(stage(1))
    assert before == after == [stage(0), stage(1)]
    assert calls == [stage(0)]  # never called again
    assert bus.dropped == (broken,)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["event subscriber test_a_raising_handler_is_dropped_and_logged_once_and"
                        "_the_others_still_see_events.<locals>.broken raised OSError: disk full "
                        "on a stage_completed event; it is unsubscribed and gets no further "
                        "events"]
    bus.unsubscribe(broken)  # already gone: no error


def test_a_handler_subscribed_twice_that_raises_is_dropped_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()

    def broken(event: Event) -> None:
        raise ValueError("bug")

    bus.subscribe(broken)
    bus.subscribe(broken)
    with caplog.at_level("ERROR", logger="adaspec.events"):
        bus.publish(stage(0))
        bus.publish(stage(1))
    assert len(caplog.records) == 1
    assert bus.dropped == (broken,)


def test_an_interrupt_in_a_handler_still_reaches_the_publisher() -> None:
    bus = EventBus()

    def interrupted(event: Event) -> None:
        raise KeyboardInterrupt

    bus.subscribe(interrupted)
    with pytest.raises(KeyboardInterrupt):
        bus.publish(stage(0))
    assert bus.dropped == ()


@pytest.mark.asyncio
async def test_a_raising_handler_does_not_keep_waiters_from_their_event() -> None:
    bus = EventBus()
    bus.subscribe(lambda event: 1 / 0)
    waiter = bus.next(StageCompleted)
    bus.publish(stage(3))
    assert (await waiter) == stage(3)


@pytest.mark.asyncio
async def test_next_resolves_on_the_first_matching_event_only() -> None:
    bus = EventBus()
    by_type = bus.next(RoundRetired)
    by_kind = bus.next("round_retired")
    by_predicate = bus.next(lambda event: isinstance(event, RoundRetired) and event.round == 1)
    bus.publish(stage(0))
    assert [by_type.done(), by_kind.done(), by_predicate.done()] == [False, False, False]
    bus.publish(retired(0))
    assert await by_type == retired(0)
    assert await by_kind == retired(0)
    assert not by_predicate.done()
    bus.publish(retired(1))
    assert await by_predicate == retired(1)


@pytest.mark.asyncio
async def test_next_registers_at_the_call_so_an_event_before_the_await_is_not_missed() -> None:
    bus = EventBus()
    bus.publish(retired(0))  # before the call: never returned
    waiting = bus.next(RoundRetired)
    bus.publish(retired(1))
    assert (await waiting).round == 1


@pytest.mark.asyncio
async def test_handlers_see_the_event_before_the_waiter_is_resolved() -> None:
    bus = EventBus()
    order: list[str] = []
    waiting = bus.next(RoundRetired)
    bus.subscribe(lambda event: order.append(f"handler saw resolved={waiting.done()}"))
    bus.publish(retired(0))
    assert order == ["handler saw resolved=False"]
    assert waiting.done()


@pytest.mark.asyncio
async def test_a_raising_predicate_fails_its_waiter_not_the_publisher() -> None:
    bus = EventBus()

    def broken(event: Event) -> bool:
        raise KeyError("round")

    waiting = bus.next(broken)
    other = bus.next(StageCompleted)
    bus.publish(stage(0))
    with pytest.raises(KeyError, match="round"):
        await waiting
    assert await other == stage(0)


@pytest.mark.asyncio
async def test_a_cancelled_waiter_is_forgotten() -> None:
    bus = EventBus()
    waiting = bus.next(StageCompleted)
    waiting.cancel()
    bus.publish(stage(0))
    assert waiting.cancelled()
    assert bus._waiters == []


def test_unsubscribing_a_handler_never_subscribed_names_it() -> None:
    bus = EventBus()
    seen: list[Event] = []

    def never(event: Event) -> None:
        """Not subscribed."""

    with pytest.raises(ValueError, match=r"^unsubscribe\(test_unsubscribing_a_handler_never_"
                                         r"subscribed_names_it\.<locals>\.never\): that handler "
                                         r"was not subscribed"):
        bus.unsubscribe(never)
    bus.subscribe(seen.append)
    bus.unsubscribe(seen.append)
    with pytest.raises(ValueError, match="was not subscribed"):  # twice: the caller's bug
        bus.unsubscribe(seen.append)


@pytest.mark.asyncio
@pytest.mark.parametrize(("match", "error", "message"), [
    (123, TypeError, r"^next\(123\): expected an event kind \(str\), an Event subclass or a "
                     r"predicate \(a callable\); got int$"),
    (int, TypeError, r"^next\(int\): expected an Event subclass, an event kind or a predicate"),
    ("no_such_kind", ValueError, r"^next\('no_such_kind'\): no event has that kind; expected "
                                 r"one of request_arrived, .*round_retired"),
])
async def test_next_refuses_what_no_event_could_ever_match_at_the_call(
        match: object, error: type[Exception], message: str) -> None:
    bus = EventBus()
    with pytest.raises(error, match=message):
        bus.next(match)  # type: ignore[call-overload]
    assert bus._waiters == []
    bus.publish(stage(0))  # nothing was registered that could fail a later publish


def test_publish_refuses_what_is_not_an_event_and_subscribe_a_non_bool_first() -> None:
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(seen.append)
    with pytest.raises(TypeError, match=r"^publish\('hello'\): expected an Event "
                                        r"\(adaspec\.runtime\.events\.types\); got str$"):
        bus.publish("hello")  # type: ignore[arg-type]
    assert seen == []
    with pytest.raises(TypeError, match=r"^subscribe\(first='no'\): expected True or False$"):
        bus.subscribe(seen.append, first="no")  # type: ignore[arg-type]


def test_the_virtual_clock_moves_only_when_advanced() -> None:
    clock: Clock = VirtualClock(start=10.0)
    assert clock.now() == clock.now() == 10.0
    assert isinstance(clock, VirtualClock)
    clock.advance(0.25)
    clock.advance(0.0)
    assert clock.now() == 10.25
    with pytest.raises(ValueError, match=r"only moves forward; got advance\(-1\)"):
        clock.advance(-1)
    assert clock.now() == 10.25


def test_the_monotonic_clock_never_goes_back() -> None:
    clock: Clock = MonotonicClock()
    readings = [clock.now() for _ in range(100)]
    assert readings == sorted(readings)


def test_a_dropped_handler_subscribed_again_is_dropped_again_and_a_non_callable_is_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    calls: list[Event] = []

    def broken(event: Event) -> None:
        calls.append(event)
        raise ValueError("bug")

    with caplog.at_level("ERROR", logger="adaspec.events"):
        bus.subscribe(broken)
        bus.publish(stage(0))
        bus.subscribe(broken)
        bus.publish(stage(1))
        bus.publish(stage(2))
    assert calls == [stage(0), stage(1)]
    assert len(caplog.records) == 2
    with pytest.raises(TypeError, match="must be callable, got 42"):
        bus.subscribe(42)  # type: ignore[arg-type]


def test_an_async_handler_is_refused_rather_than_left_unawaited() -> None:
    async def handler(event: Event) -> None:
        raise AssertionError("never runs: its coroutine would not be awaited")

    bus = EventBus()
    with pytest.raises(TypeError, match=r"^subscribe\(.*\.handler\): an async def handler would "
                                        r"only make coroutines nobody awaits"):
        bus.subscribe(handler)  # type: ignore[arg-type]
    bus.publish(stage(0))  # nothing subscribed, nothing to await


def test_a_dropped_handler_is_not_called_again_in_that_publish_and_a_fresh_subscription_stays(
        ) -> None:
    bus = EventBus()
    calls: list[Event] = []

    def broken(event: Event) -> None:
        calls.append(event)
        raise ValueError("bug")

    def resubscribe(event: Event) -> None:
        bus.subscribe(broken)

    bus.subscribe(broken)
    bus.subscribe(resubscribe)
    bus.subscribe(broken)  # its second subscription, still in this publish's snapshot
    bus.publish(stage(0))
    assert calls == [stage(0)]  # once, though subscribed twice
    bus.unsubscribe(resubscribe)
    bus.publish(stage(1))  # the fresh subscription survived: it runs (and is dropped) again
    assert calls == [stage(0), stage(1)]


class _Tap:
    """A subscriber that compares equal to every other one (as a dataclass with equal
    fields would), and raises when told to."""

    def __init__(self, raises: bool) -> None:
        self.raises, self.seen = raises, []  # type: list[Event]

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__

    def __call__(self, event: Event) -> None:
        self.seen.append(event)
        if self.raises:
            raise RuntimeError("tap bug")

    def method(self, event: Event) -> None:
        self.seen.append(event)


def test_a_subscriber_that_equals_one_that_raised_stays_subscribed() -> None:
    bus = EventBus()
    good, bad = _Tap(raises=False), _Tap(raises=True)
    bus.subscribe(good)
    bus.subscribe(bad)
    bus.publish(stage(0))
    bus.publish(stage(1))
    assert good.seen == [stage(0), stage(1)]
    assert bad.seen == [stage(0)]
    assert bus.dropped == (bad,)
    assert bus.dropped[0] is bad
    bus.unsubscribe(good)  # the very object: found, though ``bad`` also equals it
    bus.publish(stage(2))
    assert good.seen == [stage(0), stage(1)]
    with pytest.raises(ValueError, match="was not subscribed"):
        bus.unsubscribe(_Tap(raises=False))  # equal, but never subscribed
    bus.subscribe(good.method)  # a bound method: each ``good.method`` is a new object
    bus.publish(stage(3))
    bus.unsubscribe(good.method)
    bus.publish(stage(4))
    assert good.seen == [stage(0), stage(1), stage(3)]
    held: list[Event] = []
    bus.subscribe(held.__contains__)  # a method-wrapper: a new object at each lookup too
    bus.unsubscribe(held.__contains__)
