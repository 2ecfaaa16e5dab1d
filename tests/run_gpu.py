"""`make gpu-test`: on a CUDA machine, get flash-attn where a wheel exists, run every `gpu` test, print one line.

Without CUDA it prints why and exits 0. flash-attn is installed only from a prebuilt wheel (never compiled: that
takes hours): `FLASH_ATTN_WHEEL=<path or URL>` names one, else pip is asked for a binary-only install, else the
wheel that flash-attn's own setup.py would download for this torch, CUDA and Python is tried. When none installs,
the line says so, the flash_attn tests skip with that reason, and the torch_varlen and sdpa tests still run.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
FLASH_ATTN_VERSION = os.environ.get("FLASH_ATTN_VERSION", "2.8.3")
RELEASES = "https://github.com/Dao-AILab/flash-attention/releases/download"


def flash_attn_version() -> Optional[str]:
    """The flash-attn whose CUDA extension imports in a fresh interpreter, else None."""
    code = "import flash_attn, flash_attn_2_cuda; print(flash_attn.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def release_wheel() -> str:
    """The wheel flash-attn's setup.py looks for on its GitHub release for this torch, CUDA and Python."""
    import torch

    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    cuda_major = (torch.version.cuda or "12").split(".")[0]
    abi = "TRUE" if torch._C._GLIBCXX_USE_CXX11_ABI else "FALSE"
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    name = f"flash_attn-{FLASH_ATTN_VERSION}+cu{cuda_major}torch{torch_mm}cxx11abi{abi}-{py}-{py}-linux_x86_64.whl"
    return f"{RELEASES}/v{FLASH_ATTN_VERSION}/{name}"


def pip_install(*args: str) -> tuple[bool, str]:
    """One pip install attempt (no compiling, no dependency changes, one retry: GPU machines are often offline);
    (installed, last line of its output)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--retries", "1",
           "--timeout", "15", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "timed out after 600 s"
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return proc.returncode == 0, tail[-1] if tail else ""


def named_wheel(given: str) -> str:
    """FLASH_ATTN_WHEEL as pip takes it: a wheel's path or URL, or a folder (tools/build_flash_attn.py's --out)
    holding one, the newest taken."""
    folder = Path(given)
    if not folder.is_dir():
        return given
    wheels = sorted(folder.glob("flash_attn-*.whl"), key=lambda w: w.stat().st_mtime)
    return str(wheels[-1]) if wheels else given


def get_flash_attn() -> str:
    """Install flash-attn from a wheel where one exists; say what happened in a few words."""
    found = flash_attn_version()
    if found:
        return f"flash-attn {found}"
    given = os.environ.get("FLASH_ATTN_WHEEL")
    tries = [("FLASH_ATTN_WHEEL", [named_wheel(given)])] if given else []
    tries += [("a PyPI wheel", ["--only-binary=:all:", f"flash-attn=={FLASH_ATTN_VERSION}"]),
              ("flash-attn's GitHub release", [release_wheel()])]
    reasons = []
    for source, args in tries:
        ok, why = pip_install(*args)
        found = flash_attn_version() if ok else None
        if found:
            return f"flash-attn {found} (installed from {source})"
        reasons.append(why or "installed, but its CUDA extension does not import")
    return f"flash-attn not installed (no wheel for this torch/CUDA/Python: {reasons[-1][:120]}); its tests skip"


class Tally:
    """A pytest plugin that counts outcomes (setup skips included)."""

    def __init__(self) -> None:
        self.counts = {"passed": 0, "failed": 0, "skipped": 0}

    def pytest_runtest_logreport(self, report: object) -> None:
        if report.when == "call" and report.outcome in self.counts:
            self.counts[report.outcome] += 1
        elif report.when == "setup" and report.outcome in ("skipped", "failed"):
            self.counts[report.outcome] += 1


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        print(f"gpu-test: skipped: no CUDA device here (torch {torch.__version__}, {build}); nothing to run. On a GPU "
              "machine put a CUDA torch into .venv first, e.g. .venv/bin/python -m pip install torch==2.13.0 "
              "--index-url https://download.pytorch.org/whl/cu128")
        return 0
    flash = get_flash_attn()
    import pytest

    tally = Tally()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", str(HERE)], plugins=[tally])
    c = tally.counts
    gpu = f"{torch.cuda.get_device_name()} (cc {'.'.join(map(str, torch.cuda.get_device_capability()))})"
    print(f"gpu-test: {c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed on {gpu}; torch "
          f"{torch.__version__}, {flash}; python {platform.python_version()}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
