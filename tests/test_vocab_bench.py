"""benchmarks/vocab.py at a toy size: every provider's step trains on the same labels to the same loss per layout."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # benchmark runs in their own processes: make test-heavy

ROOT = Path(__file__).resolve().parents[1]


def test_every_provider_reaches_the_same_loss_in_every_layout(tmp_path: Path) -> None:
    """The completion-only layout labels each row's second half alone: its loss differs from the right-padded one's,
    and patchkit (logits, loss alone) equals HF sdpa's in both (the speed ratios compare the same training)."""
    out = tmp_path / "vocab.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vocab.py"), "--vocabs", "512", "--layouts", "right", "completion",
         "--providers", "patchkit", "patchkit_loss", "hf_sdpa", "--reps", "1", "--no-memory", "--scale", "0.1",
         "--csv", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with out.open() as f:
        rows = list(csv.DictReader(f))
    loss = {(r["layout"], r["provider"]): float(r["loss"]) for r in rows}
    assert len(loss) == 6, rows
    for layout in ("right", "completion"):
        for provider in ("patchkit", "patchkit_loss"):
            assert loss[layout, provider] == pytest.approx(loss[layout, "hf_sdpa"], abs=2e-5), (layout, provider)
    assert abs(loss["completion", "hf_sdpa"] - loss["right", "hf_sdpa"]) > 1e-3
    assert "| 512 | completion |" in proc.stdout
