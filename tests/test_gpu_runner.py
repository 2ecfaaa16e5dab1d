"""`make gpu-test`'s runner as a machine without CUDA meets it: one line saying why, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).with_name("run_gpu.py")


@pytest.mark.heavy  # starts Python processes: make test-heavy
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


def test_flash_attn_wheel_may_name_the_build_tools_output_folder(tmp_path):
    """`FLASH_ATTN_WHEEL=fa_build make gpu-test`: the newest wheel tools/build_flash_attn.py left there."""
    import os

    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run_gpu
    finally:
        sys.path.remove(str(RUNNER.parent))
    old, new = tmp_path / "flash_attn-2.8.3-old.whl", tmp_path / "flash_attn-2.8.3.post2+pk.sm90-cp312.whl"
    old.write_text(""), new.write_text("")
    os.utime(old, (1, 1))
    assert run_gpu.named_wheel(str(tmp_path)) == str(new)
    assert run_gpu.named_wheel(str(new)) == str(new)
    assert run_gpu.named_wheel("https://example.org/flash_attn.whl") == "https://example.org/flash_attn.whl"
