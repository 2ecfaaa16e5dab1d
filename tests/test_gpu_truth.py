"""`make gpu-truth` gets one shot on a lent GPU: every command it will run there must be accepted here first."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_truth  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side of the GPU run")


def test_every_benchmark_command_of_the_gpu_run_is_accepted_by_its_script(tmp_path):
    """Each benchmark part's GPU command line, run here, parses and ends with the script's no-CUDA line: a renamed
    flag or a script without `--device cuda` fails here, not in the device minutes."""
    benchmarks = [p for p in gpu_truth.parts(tmp_path) if "pytest" not in p.cmd]
    assert len(benchmarks) >= 6
    procs = [(p, subprocess.Popen(p.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for p in benchmarks]
    for part, proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{part.name}: exit {proc.returncode}\n{out[-1500:]}"
        assert "no CUDA device here" in out, f"{part.name}: ran without saying there is no GPU\n{out[-1500:]}"
        assert "--device" in part.cmd and "cuda" in part.cmd


def test_a_rehearsal_runs_a_gpu_tests_part_and_writes_the_summary_and_archive(tmp_path):
    """The dry run of the flash_attn test part: its `gpu` tests are collected and skip here, the summary says
    what ran and what was left out, and the archive holds the part's JUnit report."""
    out = tmp_path / "out"
    code = gpu_truth.main(["--dry-run", "--only", "flash_attn", "--out", str(out), "--wheels", str(tmp_path / "x")])
    assert code == 0
    summary = (out / "summary.md").read_text()
    assert "rehearsal on CPU" in summary
    row = next(ln for ln in summary.splitlines() if ln.startswith("| gpu tests, flash_attn"))
    assert "| ok |" in row and "skipped" in row and "passed" not in row, row
    assert int(row.split(" skipped")[0].split()[-1]) >= 10, row
    assert summary.count("left out (--only)") == len(gpu_truth.parts(tmp_path)) - 1
    with tarfile.open(out / "truth.tar.gz") as tar:
        assert "gpu-truth/tests_flash.xml" in tar.getnames()
