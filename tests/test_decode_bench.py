"""Smoke test of benchmarks/decode.py: a toy-sized run generates the same tokens everywhere and writes its CSV."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # benchmark runs in their own processes: make test-heavy

ROOT = Path(__file__).resolve().parents[1]


def test_decode_benchmark_runs_and_writes_rows(tmp_path: Path) -> None:
    out = tmp_path / "decode.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--scale", "0.05", "--new-tokens", "3", "--reps", "1",
         "--kv-heads", "8", "2", "--csv", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["kv_heads"]) for r in rows] == [
        (p, kv) for kv in ("8", "2") for p in ("hf_eager", "hf_sdpa", "patchkit_sdpa")
    ]
    assert all(float(r["real_tokens_per_s"]) > 0 and float(r["median_s"]) > 0 for r in rows)
    assert "not judged" in proc.stdout and "MISS" not in proc.stdout
