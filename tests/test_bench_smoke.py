"""Smoke test of benchmarks/bench.py: its smallest mode runs end to end and writes well-formed CSV rows and plots."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
COLUMNS = {"provider", "workload", "dtype", "x", "median", "min", "max", "unit", "device", "torch", "transformers",
           "patchkit", "timestamp"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    csv_path = out / "results.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--csv", str(csv_path), "--plots", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return csv_path, out, proc.stdout


def test_csv_rows_have_columns_and_positive_numbers(smoke_run: tuple[Path, Path, str]) -> None:
    csv_path, _, _ = smoke_run
    with csv_path.open() as f:
        reader = csv.DictReader(f)
        assert COLUMNS <= set(reader.fieldnames or [])
        rows = list(reader)
    measured = [r for r in rows if r["median"] != ""]
    assert measured, "no measured rows"
    for r in measured:
        lo, mid, hi = float(r["min"]), float(r["median"]), float(r["max"])
        assert 0 < lo <= mid <= hi, r
        assert r["unit"] in ("tokens/s", "MiB", "%"), r
    got = {(r["provider"], r["workload"]) for r in measured}
    for want in [("hf_eager", "train_padded"), ("hf_sdpa", "train_padded"), ("patchkit_sdpa", "train_padded"),
                 ("patchkit_sdpa", "train_packed_pos"), ("patchkit_sdpa", "train_packed_cu"),
                 ("floor_perdoc_sdpa", "train_packed_pos"), ("patchkit_sdpa", "long_peak_mem")]:
        assert want in got, f"missing {want}"
    skipped = [r for r in rows if r["median"] == ""]
    assert all(r["note"].startswith("skipped: ") for r in skipped), skipped


def test_plots_and_ratio_table(smoke_run: tuple[Path, Path, str]) -> None:
    _, out, stdout = smoke_run
    for name in ("throughput_vs_padding.png", "memory_vs_seqlen.png"):
        assert (out / name).stat().st_size > 1000
    assert "target (benchmarks/README.md, Targets)" in stdout
    assert "padding fraction" in stdout
    table = stdout.split("target (benchmarks/README.md, Targets)")[1]
    assert "not judged (smoke run; target is for the default run)" in table
    assert "PASS" not in table and "MISS" not in table  # a toy run cannot earn or miss a target
