"""A real (non-editable) wheel carries every module of the source tree: an explicit package list drifts silently.
Its metadata requires ranges, never pins, reaching back to the oldest transformers the registry serves."""

from __future__ import annotations

import email.parser
import subprocess
import sys
import zipfile

import pytest
from entrypoints import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel `pip wheel` builds from the source tree, built once for this module."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(REPO)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = out.glob("patchkit-*.whl")
    return built


def test_the_wheel_holds_every_module_and_the_startup_hook(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "patchkit").rglob("*.py")}
    expected |= {"patchkit/patches/" + p.name for p in (REPO / "patches").glob("*.py")}
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}: add their packages to pyproject.toml [tool.setuptools]"
    assert {"_patchkit_startup.py", "patchkit-startup.pth"} <= names


def test_the_wheel_requires_ranges_from_the_oldest_supported_transformers(wheel):
    """A pin (or a floor above the oldest era) makes pip upgrade a user's old transformers or CUDA torch silently."""
    from patchkit import eras
    from patchkit.hooks.install import registry

    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(zf.read(name).decode())
    required = {r.name: r.specifier for r in map(Requirement, metadata.get_all("Requires-Dist")) if r.marker is None}
    floors = [Version(s.version) for spec in map(registry.resolve, registry.PATCH_MODULES) for s in spec.supported
              if s.operator == ">="]
    oldest = min(floors)
    assert oldest == min(Version(s.version) for era in eras.ERAS for s in SpecifierSet(era.transformers)
                         if s.operator == ">=")
    transformers = required["transformers"]
    assert {s.operator for s in transformers} == {">=", "<"}, transformers
    assert [Version(s.version) for s in transformers if s.operator == ">="] == [oldest], transformers
    torch = required["torch"]
    assert torch and all(s.operator in (">=", ">", "<", "!=") for s in torch), f"torch is pinned: {torch}"
