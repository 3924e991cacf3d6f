"""``python -m adaspec`` runs the ``adaspec`` command."""

import sys

try:
    from adaspec.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules still load
    print("adaspec: interrupted", file=sys.stderr)
    sys.exit(130)

main()
