"""``python -m adaspec`` runs the ``adaspec`` command."""

import os
import signal
import sys

_first: list[int] = []  # the signal that came while the command line loads, if one did


def _early(number: int, frame: object) -> None:
    """Ctrl-C and SIGTERM until the command takes them (``interrupts.install``): the first
    stops the load, a second ends the process at once with the first one's status."""
    if _first:
        os._exit(_status())
    _first.append(number)
    raise KeyboardInterrupt(number)


def _status() -> int:
    return 143 if _first == [signal.SIGTERM] else 130


for _number in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(_number) != signal.SIG_IGN:  # an inherited ignore stays
        signal.signal(_number, _early)
try:
    from adaspec.cli import main
except KeyboardInterrupt:  # a signal while the command's modules still load
    try:
        print(f"adaspec: {'terminated' if _status() == 143 else 'interrupted'}",
              file=sys.stderr, flush=True)
    except (OSError, AttributeError):  # no standard error to take it: the status says it
        pass
    # Not sys.exit: Python would end a run whose import a Ctrl-C stopped by SIGINT.
    os._exit(_status())

main()
