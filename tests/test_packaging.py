"""A real (non-editable) wheel carries every module of the source tree: an explicit package list drifts silently."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from entrypoints import REPO


def test_the_wheel_holds_every_module_and_the_startup_hook(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(REPO)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("patchkit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "patchkit").rglob("*.py")}
    expected |= {"patchkit/patches/" + p.name for p in (REPO / "patches").glob("*.py")}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}: add their packages to pyproject.toml [tool.setuptools]"
    assert {"_patchkit_startup.py", "patchkit-startup.pth"} <= names
