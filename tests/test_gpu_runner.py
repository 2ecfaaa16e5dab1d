"""`make gpu-test`'s runner as a machine without CUDA meets it: one line saying why, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).with_name("run_gpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the runner runs the GPU tests instead")
def test_without_cuda_the_runner_says_why_and_exits_zero():
    proc = subprocess.run([sys.executable, str(RUNNER)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-test: skipped: no CUDA device here (torch ")


def test_the_flash_attn_wheel_it_looks_for_matches_this_torch_and_python():
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run_gpu
    finally:
        sys.path.remove(str(RUNNER.parent))
    url = run_gpu.release_wheel()
    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert url.startswith(f"{run_gpu.RELEASES}/v{run_gpu.FLASH_ATTN_VERSION}/flash_attn-")
    assert f"torch{torch_mm}cxx11abi" in url and url.endswith(f"-{py}-{py}-linux_x86_64.whl")
