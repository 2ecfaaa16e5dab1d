"""Build steps pyproject.toml cannot express: ship patchkit-startup.pth into site-packages, installed or editable.

The .pth line runs at every interpreter start and imports only `_patchkit_startup` (standard library only), which
makes PATCHKIT_FLASH_ATTN=1 and attn_implementation="patchkit" work without `import patchkit`. A file at a
wheel's root lands in site-packages: `build_py` puts it there for `pip install .`; for `pip install -e .`
setuptools builds the editable wheel from its own finder and .pth only (data files are not installed either), so
`editable_wheel` adds the file to the finished wheel, with its RECORD line, and pip installs and uninstalls it like
any other file. Everything else is in pyproject.toml.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "patchkit-startup.pth"  # sorts after setuptools' __editable__.*.pth, whose finder it may need
PTH_LINE = b"import _patchkit_startup; _patchkit_startup.install()\n"


class BuildPyWithPth(build_py):
    """`pip install .`: the .pth goes to the root of build_lib, hence of the wheel, hence of site-packages."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / PTH_NAME
            target.write_bytes(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH_NAME)]


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite `wheel` with one more root file, listed in RECORD with its sha256 and size."""
    with zipfile.ZipFile(wheel) as source:
        entries = [(info, source.read(info.filename)) for info in source.infolist()]
    if any(info.filename == name for info, _ in entries):
        return
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record_line = f"{name},sha256={digest},{len(data)}\n".encode()
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
        target.writestr(name, data)
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                content = content.rstrip(b"\n") + b"\n" + record_line
            target.writestr(info, content)
    tmp.replace(wheel)


class EditableWheelWithPth(editable_wheel):
    """`pip install -e .`: setuptools' editable wheel, plus the .pth at its root."""

    def run(self) -> None:
        super().run()
        wheels = sorted(Path(self.dist_dir).glob("*.editable-*.whl"), key=lambda p: p.stat().st_mtime)
        if not wheels:
            raise RuntimeError(f"no editable wheel found in {self.dist_dir} to add {PTH_NAME} to")
        add_to_wheel(wheels[-1], PTH_NAME, PTH_LINE)


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
