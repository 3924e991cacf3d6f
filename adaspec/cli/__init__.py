"""The ``adaspec`` command: ``main`` dispatches to one module per subcommand
(``adaspec.cli.<command>``, each with its ``run(argv) -> status``), which all parse their flags
with ``adaspec.cli.flags``. Nothing below the command line imports this package."""

from adaspec.cli.interrupts import INTERRUPTED
from adaspec.cli.main import COMMANDS, USAGE, main, run, run_to_stdout

__all__ = ["COMMANDS", "INTERRUPTED", "USAGE", "main", "run", "run_to_stdout"]
