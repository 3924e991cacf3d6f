"""How a command stops at a signal: Ctrl-C (SIGINT) and SIGTERM alike.

The first signal cancels the command's main task where one runs (``run``), so its requests
end cancelled and its logs close whole, and raises ``KeyboardInterrupt`` anywhere else. It does
so for SIGTERM also when Ctrl-C is ignored (a job a script starts in the background). The first
signal says how the command stopped (``status``). A second one, while the first is still being
handled, ends the process at once with that status and the command's one line: a log then ends
where it was cut, which ``replay`` names.
"""

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it."""
TERMINATED = 143
"""The exit status of a command stopped by SIGTERM: 128 + SIGTERM."""


class _Stop:
    first: int | None = None  # the number of the first signal, once one came
    held = False  # inside ``held``: a signal is noted, raised as it ends
    main: "asyncio.Task[Any] | None" = None  # the task ``run`` runs, while it runs
    loop: asyncio.AbstractEventLoop | None = None
    command = "adaspec"
    saved_table: Callable[[], str | None] | None = None  # see ``tell_saved_table``


def install(command: str) -> None:
    """Take SIGINT and SIGTERM for ``command`` (the ``adaspec`` process only; a signal the
    process inherited ignored stays ignored)."""
    _Stop.command = command
    for number in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(number) != signal.SIG_IGN:  # Python's, or ``__main__``'s own
            signal.signal(number, _on_signal)
    sys.unraisablehook = _unraisable


def came() -> bool:
    """Whether a signal came (its interrupt may have been swallowed where it landed)."""
    return _Stop.first is not None


def _unraisable(unraisable: Any) -> None:
    """The interrupt of a signal that landed where Python cannot raise it (a finalizer such
    as an event loop's ``__del__``) is no error to print: the command says how it stopped."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _Stop.first is not None:
        return
    sys.__unraisablehook__(unraisable)


def status() -> int:
    """The exit status of a command a signal stopped, by the first signal that came."""
    return TERMINATED if _Stop.first == signal.SIGTERM else INTERRUPTED


def tell_saved_table(saved: Callable[[], str | None] | None) -> None:
    """The stopped line names the cost table file ``saved()`` returns (None: none, or not
    yet complete): a rerun with the same path would refuse to overwrite it. Each command
    starts with none."""
    _Stop.saved_table = saved


def stopped_line(command: str) -> str:
    line = f"{command}: {'terminated' if status() == TERMINATED else 'interrupted'}"
    path = None if _Stop.saved_table is None else _Stop.saved_table()
    return line if path is None else f"{line}; the cost table was saved whole to {path}"


def taken_by_adaspec(number: int) -> bool:
    return signal.getsignal(number) is _on_signal


def _on_signal(number: int, frame: Any) -> None:
    _end_at_a_second(number)
    _Stop.first = number
    if _Stop.held:  # raised here, it could land where it is swallowed
        return
    main, loop = _Stop.main, _Stop.loop
    if main is None or main.done() or loop is None:
        raise KeyboardInterrupt
    main.cancel()


def _wake() -> None:
    """The loop's callback for a signal ``run`` takes: nothing to do. Registering it sets the
    loop's wakeup descriptor, which wakes the loop's thread (where ``_on_signal`` runs) even
    when the signal reaches another thread while that one sleeps in the loop."""


def _end_at_a_second(number: int) -> None:
    if _Stop.first is not None:  # the first is still being handled: end now
        say(stopped_line(_Stop.command))
        os._exit(status())


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A signal taken by ``install`` inside is noted and raised as ``KeyboardInterrupt`` when
    it ends. For imports: one raised into torch's can be swallowed by its C++, which imports
    numpy on its own, and the command then runs on (or fails on a half-loaded numpy)."""
    _Stop.held = True
    try:
        yield
    finally:
        _Stop.held = False
    if _Stop.first is not None:
        raise KeyboardInterrupt


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` for a command's main coroutine: a signal taken by ``install`` cancels
    it and it then raises ``KeyboardInterrupt`` (without ``install``, Ctrl-C does as
    ``asyncio.run`` has it do)."""
    if _Stop.first is not None:  # a signal came and something swallowed its interrupt
        coroutine.close()
        raise KeyboardInterrupt
    runner = asyncio.Runner()

    async def main() -> T:
        loop = asyncio.get_running_loop()
        _Stop.main, _Stop.loop = asyncio.current_task(), loop
        taken = [number for number in (signal.SIGINT, signal.SIGTERM)
                 if signal.getsignal(number) is _on_signal]
        for number in taken:
            loop.add_signal_handler(number, _wake)
            # The handler itself runs between two bytecodes, not once the loop is free: a
            # second signal ends the command at once even during a long device work item.
            signal.signal(number, _on_signal)
        try:
            return await coroutine
        finally:  # ``serve`` may have taken them over meanwhile, and let them go
            for number in taken:
                loop.remove_signal_handler(number)
                signal.signal(number, _on_signal)

    try:
        result = runner.run(main())
    except asyncio.CancelledError:
        if _Stop.first is None:
            raise
    finally:
        _Stop.main = _Stop.loop = None
        with held():  # raised while the loop closes, it could land in a finalizer
            runner.close()
            coroutine.close()  # never awaited when a signal came first: no warning
    if _Stop.first is not None:  # stopped, or it ended as it was being stopped
        raise KeyboardInterrupt
    return result


def say(line: str) -> None:
    """One line on standard error, if there is one to take it."""
    if sys.stderr is not None:  # None: started with descriptor 2 closed
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # a full standard error: the exit status still says it
            pass
