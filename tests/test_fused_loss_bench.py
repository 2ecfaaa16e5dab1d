"""benchmarks/fused_loss.py at a toy size: the three ways of the head and loss compute the same loss per dtype."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # benchmark runs in their own processes: make test-heavy

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lora", [0, 8], ids=["the head trained", "lora on a frozen head"])
def test_every_way_computes_the_same_loss_and_a_fused_one_holds_less(tmp_path: Path, lora: int) -> None:
    out = tmp_path / "fused_loss.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fused_loss.py"), "--vocabs", "4096", "--rows", "512", "--hidden",
         "64", "--reps", "1", "--lora", str(lora), "--csv", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = {(r["dtype"], r["way"]): r for r in csv.DictReader(f)}
    fused = ("held",) if lora else ("held", "recomputed")  # a frozen head's gradients are always written forward
    assert len(rows) == 2 * (1 + len(fused)) and all(int(r["lora"]) == lora for r in rows.values()), rows
    for dtype in ("float32", "bfloat16"):
        unfused = rows[dtype, "unfused"]
        for way in fused:
            assert float(rows[dtype, way]["loss"]) == pytest.approx(float(unfused["loss"]), abs=1e-4), (dtype, way)
        # the unfused logits (512 x 4096, float32 copies of them and their gradient) are the largest tensors here
        assert float(rows[dtype, fused[-1]]["peak_mib"]) < float(unfused["peak_mib"]), dtype
