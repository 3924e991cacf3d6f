"""``adaspec replay``: re-run the policies of a recorded event log and report the first
decision they do not reproduce (``adaspec.runtime.events.replay`` does the work)."""

import json
from collections.abc import Sequence

from adaspec.cli import interrupts
from adaspec.cli.flags import CommandFlags, Flag, Positional
from adaspec.errors import AdaspecError
from adaspec.runtime.events.ranks import compare_ranks
from adaspec.runtime.events.replay import replay_file

REPLAY = CommandFlags(
    command="replay",
    usage="LOG [--across OTHER_LOG ...] [--json]",
    about="Re-runs the policies recorded in the event log LOG over its events and reports the "
          "first decision (draft depth d or verification budget G) they do not reproduce, and "
          "any decision that saw feedback newer than the lag allows (round n may use feedback "
          "of rounds <= n-2; n-1 for a run without schedule overlap, whose header records lag "
          "1). With --across, LOG and every OTHER_LOG are the event logs of one multi-rank "
          "run (one per rank), and their decisions are compared round by round.\n\nExit 0 "
          "when every decision matches, the lag holds and the ranks agree, 1 otherwise, 2 "
          "for an unreadable log.",
    flags={"json": Flag(help="print one JSON object instead of text"),
           "across": Flag(metavar="OTHER_LOG", repeat=True,
                          help="another rank's event log of the same run; repeat for each")},
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
        others = args.values("across")
        ranks = compare_ranks([args.positional, *others]) if others else None
    except AdaspecError as error:
        interrupts.say(f"adaspec replay: error: {error}")
        return 2
    if "json" in args:
        data = report.as_dict()
        if ranks is not None:
            data["ranks"] = ranks.as_dict()
        print(json.dumps(data, indent=2))
    else:
        print(report.format_text())
        if ranks is not None:
            print(ranks.format_text())
    return 0 if report.ok and (ranks is None or ranks.ok) else 1
