"""``python -m adaspec`` runs the ``adaspec`` command."""

from adaspec.cli import main

main()
