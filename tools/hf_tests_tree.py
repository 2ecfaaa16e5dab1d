"""Assemble a tree of transformers' own tests for tools/hf_modeling_tests.py: the sdist's files, a mirror's, stubs."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable, Optional

try:
    import tomllib
except ImportError:  # Python < 3.11: pytest.ini then gets no markers or filters from the sdist's pyproject.toml
    tomllib = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parent.parent
FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "granite", "starcoder2", "olmo2",
    "smollm3", "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "phi", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
)

# ---------------------------------------------------------------------------------------------------- the tree

STUB_DISTRIBUTED = '''"""Stub written by patchkit's tools/hf_modeling_tests.py: transformers'
distributed_testing_utils is in neither the sdist nor the mirror. Every helper skips the test that calls it
(tensor-parallel, expert-parallel, FSDP mixins)."""

import unittest


def _skip(*args, **kwargs):
    raise unittest.SkipTest("distributed_testing_utils is a stub in this assembled tests tree")


def run_distributed(*args, **kwargs):
    return lambda fn: _skip


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _skip
'''

CONFTEST = '''"""Minimal root conftest written by patchkit's tools/hf_modeling_tests.py (transformers' own registers an
xdist-only hook, pytest_configure_node, and fails without pytest-xdist). It keeps what matters for modeling tests."""

import os
import warnings

warnings.simplefilter(action="ignore", category=FutureWarning)


def pytest_configure(config):
    for name in ("slow", "is_pipeline_test", "is_staging_test", "accelerate_tests", "not_device_test",
                 "torch_compile_test", "torch_export_test", "training_ci", "tensor_parallel_ci", "fsdp_ci"):
        config.addinivalue_line("markers", f"{name}: transformers test marker")
    os.environ["DISABLE_SAFETENSORS_CONVERSION"] = "true"


def pytest_addoption(parser):
    from transformers.testing_utils import pytest_addoption_shared

    pytest_addoption_shared(parser)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 5:
        session.exitstatus = 0


try:
    import torch
    from transformers.utils import enable_tf32

    if hasattr(torch.backends.cudnn, "allow_tf32"):
        torch.backends.cudnn.allow_tf32 = False
    enable_tf32(False)
except ImportError:
    pass
'''


def git_tar(repo: Path, rev: str, paths: list[str]) -> tarfile.TarFile:
    """`git archive` of `paths` (pathspecs) at `rev` of a checkout or bare mirror, as an open tar."""
    done = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev, "--", *paths],
                          capture_output=True)
    if done.returncode:
        raise SystemExit(f"git archive of {repo}@{rev} failed: {done.stderr.decode(errors='replace').strip()}")
    return tarfile.open(fileobj=io.BytesIO(done.stdout))


def present(repo: Path, rev: str, families: tuple[str, ...]) -> tuple[str, ...]:
    """The families whose `tests/models/<family>` the mirror has at `rev`; each other one is said and left out (a
    family newer than the mirror), so that the rest of the tree is still prepared."""
    found = []
    for family in families:
        known = subprocess.run(["git", "-C", str(repo), "cat-file", "-e", f"{rev}:tests/models/{family}"],
                               capture_output=True).returncode == 0
        if known:
            found.append(family)
        else:
            print(f"{family}: not prepared: the mirror has no tests/models/{family} at {rev}", file=sys.stderr)
    return tuple(found)


def extract(tar: tarfile.TarFile, dest: Path, strip: str = "", keep: Optional[Callable[[str], bool]] = None,
            ) -> list[str]:
    """Extract regular files (under `strip`, which is removed from their names) that `keep(name)` accepts."""
    written = []
    for member in tar.getmembers():
        if not member.isfile() or not member.name.startswith(strip):
            continue
        name = member.name[len(strip):]
        if keep is not None and not keep(name):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = tar.extractfile(member)
        assert source is not None
        target.write_bytes(source.read())
        written.append(name)
    return written


def installed_transformers(python: str) -> tuple[str, str]:
    """(version, package directory) of transformers in `python`'s environment."""
    code = "import transformers, os; print(transformers.__version__); print(os.path.dirname(transformers.__file__))"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.split("\n")
    return out[0].strip(), out[1].strip()


def testing_utils_shim(tests_dir: Path, mirror: Path, rev: str, python: str) -> str:
    """conftest lines that give the installed transformers.testing_utils the constants the mirror's testers import
    from it and it lacks (the mirror is a later snapshot than some releases: 2026-08's causal_lm_tester.py imports
    `_TEXT_MODEL_TESTER_DEFAULTS`, which 5.24.0 does not define). Only literal constants of the mirror's
    testing_utils are copied; a missing function is left to fail the import, as it would."""
    wanted: set[str] = set()
    for path in tests_dir.glob("tests/**/*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        wanted |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.module == "transformers.testing_utils" for alias in node.names}
    code = ("import sys, transformers.testing_utils as t; "
            "print(*[n for n in sys.argv[1:] if not hasattr(t, n)])")
    missing = subprocess.run([python, "-c", code, *sorted(wanted)], check=True, capture_output=True,
                             text=True).stdout.split()
    if not missing:
        return ""
    source = subprocess.run(["git", "-C", str(mirror), "show", f"{rev}:src/transformers/testing_utils.py"],
                            check=True, capture_output=True, text=True).stdout
    values = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in missing:
                try:
                    values[name] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    if not values:
        return ""
    lines = ["", "", "# constants the mirror's testers import from transformers.testing_utils, which the installed",
             "# version lacks: copied from the mirror's src/transformers/testing_utils.py by tools/hf_tests_tree.py",
             "import transformers.testing_utils as _testing_utils", ""]
    lines += [f"_testing_utils.{name} = {value!r}" for name, value in sorted(values.items())]
    return "\n".join(lines) + "\n"


def pytest_ini(pyproject: Optional[bytes]) -> str:
    """pytest.ini with the sdist pyproject's markers and warning filters (and nothing that needs a plugin)."""
    options: dict[str, Any] = {}
    if pyproject and tomllib is not None:
        options = tomllib.loads(pyproject.decode()).get("tool", {}).get("pytest", {}).get("ini_options", {})
    lines = ["[pytest]", "doctest_optionflags = NUMBER NORMALIZE_WHITESPACE ELLIPSIS"]
    for key in ("markers", "filterwarnings"):
        if options.get(key):
            lines.append(f"{key} =")
            lines += [f"    {value}" for value in options[key]]
    return "\n".join(lines) + "\n"


def prepare(tests_dir: Path, mirror: Path, rev: str, sdist: Optional[Path], python: str,
            families: tuple[str, ...] = FAMILIES) -> None:
    """Assemble the tests tree: mirror files first, the installed version's sdist tests/*.py over them, then stubs.

    `families` names the `tests/models/<family>` folders taken from the mirror (default: the patch-module families).
    """
    version, package = installed_transformers(python)
    tests_dir.mkdir(parents=True, exist_ok=True)
    if sdist is None:
        download = tests_dir / "_sdist"
        download.mkdir(exist_ok=True)
        subprocess.run([python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"transformers=={version}", "-d", str(download)], check=True)
        sdist = next(download.glob(f"transformers-{version}.tar.gz"))
    provenance: dict[str, str] = {}
    # two archives: an exclude pathspec wins over the include of tests/models/<family> in the same call
    for specs in (["tests", ":(exclude)tests/models", "utils/test_module", "utils/fetch_hub_objects_for_ci.py"],
                  ["tests/models/__init__.py", *(f"tests/models/{f}" for f in present(mirror, rev, families))]):
        with git_tar(mirror, rev, specs) as tar:
            for name in extract(tar, tests_dir):
                provenance[name] = f"mirror {mirror}@{rev}"
    pyproject = None
    with tarfile.open(sdist) as tar:
        root = tar.getmembers()[0].name.split("/")[0] + "/"
        member = tar.getmember(root + "pyproject.toml")
        handle = tar.extractfile(member)
        pyproject = handle.read() if handle else None
        top_level = re.compile(r"^tests/[^/]+\.py$")
        for name in extract(tar, tests_dir, strip=root, keep=lambda n: bool(top_level.match(n))):
            provenance[name] = f"sdist {sdist.name}"
    generated = {
        "conftest.py": CONFTEST + testing_utils_shim(tests_dir, mirror, rev, python),
        "pytest.ini": pytest_ini(pyproject),
    }
    if not (tests_dir / "tests/distributed_testing_utils.py").exists():
        generated["tests/distributed_testing_utils.py"] = STUB_DISTRIBUTED
    for name, text in generated.items():
        (tests_dir / name).write_text(text)
        provenance[name] = "generated by tools/hf_modeling_tests.py (stub)"
    link = tests_dir / "src/transformers"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(package)
    provenance["src/transformers"] = f"link to the installed package {package}"
    (tests_dir / "PROVENANCE.json").write_text(json.dumps(
        {"transformers": version, "sdist": str(sdist), "mirror": f"{mirror}@{rev}", "files": provenance},
        indent=1, sort_keys=True))
    missing = [m for m in ("parameterized", "httpx", "requests") if subprocess.run(
        [python, "-c", f"import {m}"], capture_output=True).returncode]
    print(f"assembled {len(provenance)} files for transformers {version} in {tests_dir}")
    if missing:
        print(f"the test files import {', '.join(missing)}: {python} -m pip install {' '.join(missing)}")


# ---------------------------------------------------------------------------------------------------- the probe

