"""The ``specdec`` command's entry point.

Importing the CLI imports PyTorch and transformers (seconds); Ctrl-C during that time is
a clean exit like Ctrl-C at any other moment (``specdec: interrupted``, status 130), not
a traceback. This module imports nothing heavy itself.
"""

from __future__ import annotations

import sys

from specdec.interrupt import watched


def main() -> int:
    """Import the CLI and run it; returns its exit status (130 after Ctrl-C).
    ``specdec --version`` answers without importing it (PyTorch: seconds)."""
    if sys.argv[1:] == ["--version"]:
        from specdec import __version__

        print(f"specdec {__version__}")
        return 0

    def load():
        from specdec.cli import main as cli_main

        return cli_main

    cli_main, code = watched(load)
    if code is not None:
        return code
    return cli_main()  # which handles Ctrl-C from here on


if __name__ == "__main__":
    sys.exit(main())
