"""Smoke test of benchmarks/static_decode.py: a toy-sized run (compiled with the eager backend, seconds) generates
HF sdpa's tokens with every provider and writes its CSV, and the compiled providers recompile nothing and break no
graph after the warm-up round (as their counter would show when they did)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # benchmark runs in their own processes: make test-heavy

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
    assert [r["provider"] for r in rows] == ["hf_eager", "hf_sdpa", "patchkit_sdpa", "patchkit_named_sdpa",
                                             "hf_sdpa_compiled", "patchkit_sdpa_compiled",
                                             "hf_sdpa_generate_compiled", "patchkit_sdpa_generate_compiled",
                                             "patchkit_named_sdpa_generate_compiled"]
    assert all(float(r["real_tokens_per_s"]) > 0 and float(r["same_tokens"]) == 1.0 for r in rows)
    compiled = [r for r in rows if r["provider"].endswith("_compiled")]
    assert [(r["recompiles"], r["graph_breaks"]) for r in compiled] == [("0", "0")] * 5
    hf = {r["provider"]: float(r["median_s"]) for r in rows if r["provider"].startswith("hf_")}
    for row in rows:  # each against HF sdpa run (eager or compiled) the way it is
        twin = "hf_sdpa" + row["provider"].partition("sdpa")[2]
        assert float(row["vs_hf_same"]) == pytest.approx(hf[twin] / float(row["median_s"]), abs=0.02), row["provider"]
    assert all(r["recompiles"] == r["graph_breaks"] == r["vs_hf_fa2"] == "" for r in rows if r not in compiled)
    assert "0 recompiles and 0 graph breaks after warm-up" in proc.stdout


def test_compile_counts_sees_a_recompile_and_a_graph_break() -> None:
    """The counter the benchmark reads moves on a new shape (a graph compiled) and on a graph break."""
    code = (
        "import json, sys, torch; sys.path.insert(0, 'benchmarks'); from static_decode import compile_counts\n"
        "f = torch.compile(lambda x: x.sin(), backend='eager', fullgraph=True)\n"
        "f(torch.ones(3)); a = compile_counts(); f(torch.ones(3)); b = compile_counts()\n"
        "f(torch.ones(4)); c = compile_counts()\n"
        "g = torch.compile(lambda x: (print(end=''), x.cos())[1], backend='eager'); g(torch.ones(2))\n"
        "print(json.dumps([a, b, c, compile_counts()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (g0, b0), (g1, b1), (g2, b2), (g3, b3) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (g1 - g0, b1 - b0) == (0, 0), "a call with seen shapes compiled or broke"
    assert (g2 - g1, b2 - b1) == (1, 0), "a new shape compiled no graph"
    assert b3 - b2 == 1, "a graph break was not counted"
