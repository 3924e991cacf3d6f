"""``python -m adaspec`` runs the ``adaspec`` command."""

import signal
import sys


def _early(number: int, frame: object) -> None:
    """SIGTERM until the command takes it (``interrupts.install``): as Ctrl-C, one line."""
    raise KeyboardInterrupt(number)


if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    signal.signal(signal.SIGTERM, _early)
try:
    from adaspec.cli import main
except KeyboardInterrupt as stopped:  # a signal while the command's modules still load
    terminated = stopped.args == (signal.SIGTERM,)
    try:
        print(f"adaspec: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    except (OSError, AttributeError):  # no standard error to take it: the status says it
        pass
    sys.exit(143 if terminated else 130)

main()
