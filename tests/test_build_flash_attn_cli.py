"""tools/build_flash_attn.py as a command, on CPU: the dry run's plan, one-line errors and the status file.

Builds started in the background are followed through the status file; with a CPU torch a real build fails in
preflight, before any compiler runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flash_sdist import TOOL, bfa, expected_kernels, fake_sdist_fixture, fas, sdist_fixture  # noqa: F401 (fixtures)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_plan(sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(sdist), "--out", str(out), "--archs", "9.0", "--head-dims", "64,128",
            "--disable", "dropout", "--jobs", "2", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "kernels: kept 24 of 72" in r.stdout
    assert "head dims kept: [64, 128]  trimmed: [32, 96, 192, 256]" in r.stdout
    for name in expected_kernels((64, 128)):
        assert f"csrc/flash_attn/src/{name}" in r.stdout
    assert "hdim96" not in r.stdout
    assert "FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS=2" in r.stdout and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in r.stdout
    assert "pip wheel --no-deps --no-build-isolation" in r.stdout
    assert not list(out.glob("*.whl")) and not (out / bfa.CONFIG_FILE).exists()
    status = json.loads((out / bfa.STATUS_FILE).read_text())
    assert status["state"] == "done" and status["wheel"] is None and status["config"]["dry_run"] is True
    assert "patchkit tools/build_flash_attn.py" in (out / "work" / fas.DIFF_FILE).read_text()


def test_cli_errors_are_one_line(fake_sdist: Path, tmp_path: Path) -> None:
    r = cli("--sdist", str(fake_sdist), "--out", str(tmp_path / "o"), "--archs", "75", "--dry-run")
    assert r.returncode == 1 and "compute capability 75" in r.stderr and "Traceback" not in r.stderr
    r = cli("--sdist", str(tmp_path / "nope.tar.gz"), "--out", str(tmp_path / "o"), "--archs", "90", "--dry-run")
    assert r.returncode == 1 and "no such file" in r.stderr


def test_status_round_trips(tmp_path: Path, capsys) -> None:
    assert bfa.show_status(tmp_path) == 2
    config = {"archs": ["90"], "head_dims": [64, 128], "disabled": ["dropout"]}
    bfa.write_status(tmp_path, state="running", started="t0", finished=None, wheel=None, log="l", config=config,
                     pid=os.getpid(), error=None)
    written = bfa.read_status(tmp_path)
    assert written == {"state": "running", "started": "t0", "finished": None, "wheel": None, "log": "l",
                       "config": config, "pid": os.getpid(), "error": None}
    capsys.readouterr()
    assert bfa.show_status(tmp_path) == 0
    assert json.loads(capsys.readouterr().out) == written
    bfa.write_status(tmp_path, state="done", finished="t1", wheel="w.whl")
    assert bfa.read_status(tmp_path) == {**written, "state": "done", "finished": "t1", "wheel": "w.whl"}
    r = cli("--status", str(tmp_path))
    assert r.returncode == 0 and json.loads(r.stdout)["wheel"] == "w.whl"


def test_status_of_a_vanished_build_is_failed(tmp_path: Path, capsys) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    bfa.write_status(tmp_path, state="running", pid=proc.pid)
    assert bfa.show_status(tmp_path) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "failed" and "ended without recording" in shown["error"]


def wait_for_end(out: Path, seconds: float = 120) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = bfa.read_status(out) or {}
        if status.get("state") in ("done", "failed"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"build still running after {seconds}s: {bfa.read_status(out)}")


def test_background_dry_run(fake_sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(fake_sdist), "--out", str(out), "--archs", "90", "--head-dims", "64", "--dry-run",
            "--background")
    assert r.returncode == 0, r.stderr
    assert "started in the background" in r.stdout
    status = wait_for_end(out)
    assert status["state"] == "done", status
    assert status["config"]["head_dims"] == [64] and status["config"]["kernels_kept"] == 12
    assert "kernels: kept 12 of 72" in Path(status["log"]).read_text()


def _cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


@pytest.mark.skipif(_cuda_torch(), reason="a CUDA torch: this machine might really start compiling")
def test_background_build_with_a_cpu_torch_fails_in_preflight(fake_sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(fake_sdist), "--out", str(out), "--archs", "90", "--head-dims", "64", "--background")
    assert r.returncode == 0, r.stderr
    status = wait_for_end(out, 300)
    assert status["state"] == "failed" and "preflight failed" in status["error"], status
    assert "is a CPU build" in status["error"]
    assert "preflight failed" in Path(status["log"]).read_text()
    assert not (out / bfa.CONFIG_FILE).exists()
