"""The ``specdec`` command's entry point.

Importing the CLI imports PyTorch and transformers (seconds); Ctrl-C during that time is
a clean exit like Ctrl-C at any other moment (``specdec: interrupted``, status 130), not
a traceback. This module imports nothing heavy itself.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Import the CLI and run it; returns its exit status (130 after Ctrl-C)."""
    try:
        from specdec.cli import main as cli_main
    except KeyboardInterrupt:
        print("\nspecdec: interrupted", file=sys.stderr)
        return 130  # as specdec.cli.EXIT_INTERRUPTED, which cannot be imported yet
    return cli_main()  # which handles Ctrl-C from here on


if __name__ == "__main__":
    sys.exit(main())
