"""``adaspec replay``: re-run the policies of a recorded event log and report the first
decision they do not reproduce (``adaspec.runtime.events.replay`` does the work)."""

import json
import sys
from collections.abc import Sequence

from adaspec.cli.flags import CommandFlags, Flag, Positional
from adaspec.errors import AdaspecError
from adaspec.runtime.events.replay import replay_file

REPLAY = CommandFlags(
    command="replay",
    usage="LOG [--json]",
    about="Re-runs the policies recorded in the event log LOG over its events and reports the "
          "first decision (draft depth d or verification budget G) they do not reproduce, and "
          "any decision that saw feedback newer than the lag allows (round n may use feedback "
          "of rounds <= n-2; n-1 for a run without schedule overlap, whose header records lag "
          "1).\n\nExit 0 when every decision matches and the lag holds, 1 "
          "otherwise, 2 for an unreadable log.",
    flags={"json": Flag(help="print one JSON object instead of text")},
    positional=Positional(metavar="LOG", what="event log path"))

USAGE = REPLAY.help()


def run(argv: Sequence[str]) -> int:
    """``adaspec replay LOG [--json]``; returns the exit status."""
    try:
        args = REPLAY.parse(argv)
        if args.help:
            print(USAGE)
            return 0
        assert args.positional is not None  # REPLAY declares it
        report = replay_file(args.positional)
    except AdaspecError as error:
        print(f"adaspec replay: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if "json" in args else report.format_text())
    return 0 if report.ok else 1
