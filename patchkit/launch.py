"""`python -m patchkit.launch`, the launcher's public name (torchrun, accelerate): the launcher is `entry/launch.py`."""

from __future__ import annotations

import sys

from patchkit.entry.launch import main

if __name__ == "__main__":
    sys.exit(main())
