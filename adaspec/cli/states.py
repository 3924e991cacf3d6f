"""``adaspec states``: the round state graph as a mermaid diagram."""

from collections.abc import Sequence

from adaspec.cli.flags import CommandFlags, Flag

STATES = CommandFlags(
    command="states",
    usage="[--diagram]",
    about="Prints the round state graph as a mermaid stateDiagram.",
    flags={"diagram": Flag(help="the same (the diagram is the only output there is)")})


def run(argv: Sequence[str]) -> int:
    if STATES.parse(argv).help:
        print(STATES.help())
        return 0
    from adaspec.runtime.states import mermaid

    print(mermaid())
    return 0
