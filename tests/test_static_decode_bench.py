"""Smoke test of benchmarks/static_decode.py: a toy-sized run (compiled with the eager backend, seconds) generates
HF sdpa's tokens with every provider and writes its CSV."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_static_decode_benchmark_runs_and_writes_rows(tmp_path: Path) -> None:
    out = tmp_path / "static_decode.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "static_decode.py"), "--scale", "0.05", "--new-tokens", "2",
         "--reps", "1", "--compile-backend", "eager", "--csv", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["provider"] for r in rows] == ["hf_eager", "hf_sdpa", "patchkit_sdpa", "hf_sdpa_compiled",
                                             "patchkit_sdpa_compiled"]
    assert all(float(r["real_tokens_per_s"]) > 0 and float(r["same_tokens"]) == 1.0 for r in rows)
