"""`python -m patchkit COMMAND ...`: the `patchkit` command where the console script is not on PATH."""

from __future__ import annotations

import sys

from patchkit.entry.cli import main

if __name__ == "__main__":
    sys.exit(main())
