"""The Quickstart demo runs as a user runs it and reports a match against eager."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_demo_trains_and_generates_like_eager():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "generated tokens identical to eager: True" in proc.stdout
    assert "demo OK" in proc.stdout
    assert "attention layers through the patch: 4" in proc.stdout
