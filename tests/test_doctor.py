"""`patchkit doctor`: versions, hardware, the flash-attn import result and each patch's verdict, without patching."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from entrypoints import clean_env, patchkit_cli, run_loaded
from families import FAMILIES_FROM, served_here
from packaging.version import Version

import patchkit
from patchkit import gates
from patchkit.entry.doctor import doctor, exit_code, format_report

# the module itself: `patchkit.entry.doctor` is the function (patchkit.entry.doctor() returns the report data)
doctor_module = importlib.import_module("patchkit.entry.doctor")
# before 4.53 only LLaMA's patches apply: every other family's transformers gate fails, whatever the GPU
FAMILIES = Version(transformers.__version__) >= Version(FAMILIES_FROM)
GATED_OFF = "the transformers_version gate failed: no backend can help"


@pytest.fixture(autouse=True)
def reverted():
    yield
    patchkit.revert_patch()


def fake_flash_attn(root, version: str, extension_error: str = "") -> dict[str, str]:
    """A `flash_attn` package (with dist-info) whose CUDA extension imports, or fails with `extension_error`."""
    pkg = root / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    body = f"raise ImportError({extension_error!r})\n" if extension_error else "\n"
    (root / "flash_attn_2_cuda.py").write_text(body)
    info = root / f"flash_attn-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {version}\n")
    # in front of the caller's PYTHONPATH: the version matrix puts its transformers there, and the doctor must see it
    return clean_env(PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_doctor_text_report_names_everything_without_building_a_model():
    """A machine's report, fast: the doctor reads versions, metadata and gates and imports no family's modeling
    module (a check of that kind builds a model; dozens of families' imports cost seconds each). Which modules load
    is what keeps it fast, not a CPU-seconds bound (about 9 s here, its torch and transformers imports, and more on a
    busy machine: such a bound failed under load)."""
    proc, loaded = run_loaded("from patchkit.entry.cli import main\nsys.exit(main(['doctor']))")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" in loaded and "transformers" in loaded, loaded  # what was loaded was read
    modeling = [m for m in loaded if re.fullmatch(r"transformers\.models\.\w+\.modeling_\w+", m)]
    assert not modeling, modeling
    out = proc.stdout
    for text in ("python", torch.__version__, transformers.__version__, "flash-attn", "accelerate", "peft",
                 "compute capability", "bf16 on GPU", "flash-attn CUDA extension", "llama1", "llama2 (alias llama)"):
        assert text in out, text
    if not torch.cuda.is_available():
        assert "llama2 (alias llama): applies, backend sdpa" in out
        assert "torch_varlen gates failed (cuda_available" in out and "GPU                 none" in out
    # one line per patch, the shared reason once; the gates themselves only under --verbose
    section = out.split("patches (backend='auto')\n")[1].split("\nstartup hook")[0].splitlines()
    names = [p["name"] for p in patchkit.available_patches()]
    assert [line.split(":")[0].split(" (alias")[0].strip() for line in section[: len(names)]] == names
    assert len(section) == len(names) + 2 and section[-1].endswith("every gate of every patch, with its fix)")
    assert "FAILED" not in out and len(out.splitlines()) < 60, out


def test_doctor_verbose_lists_every_gate_of_every_patch(monkeypatch):
    data = simulated(monkeypatch, device_name="Tesla T4", compute_capability=(7, 5), bf16_supported=False)
    short, verbose = format_report(data), format_report(data, verbose=True)
    gate = "compute_capability: FAILED (required >= 8.0 (Ampere or newer); found 7.5)"
    assert gate not in short and verbose.count(gate) >= len(data["patches"])
    assert len(verbose.splitlines()) > len(short.splitlines()) + 5 * len(data["patches"])


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_doctor_json_matches_the_function_and_the_installed_packages():
    proc = patchkit_cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    here = doctor()
    for key in ("versions", "hardware", "flash_attn"):
        assert data[key] == here[key], key
    assert [p["name"] for p in data["patches"]] == [spec["name"] for spec in patchkit.available_patches()]
    assert [p["name"] for p in data["patches"]][:3] == ["llama1", "llama2", "mistral"]
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["transformers"] == transformers.__version__
    assert data["versions"]["cuda"] == torch.version.cuda
    for pkg in ("accelerate", "peft"):
        try:
            expected = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            expected = None
        assert data["versions"][pkg] == expected
    assert data["hardware"]["cuda_available"] == torch.cuda.is_available()


@pytest.mark.parametrize("name", ["llama1", "llama2"])
def test_doctor_backend_is_the_one_apply_patch_chooses(name):
    """The verdict is not a guess: apply_patch(backend='auto') picks the same backend, for the same reason."""
    verdict = next(p for p in doctor()["patches"] if p["name"] == name)
    assert patchkit.active_patches() == []  # doctor patched nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = patchkit.apply_patch(name)
    fell_back = any("runs on the exact sdpa backend" in str(w.message) for w in caught)
    assert fell_back == (handle.backend == "sdpa")
    assert verdict["applies"] and handle.backend == verdict["backend"]
    failed_gates = [g["name"] for g in verdict["gates"] if not g["passed"]]
    assert failed_gates == [g.name for g in handle.gates if not g.passed]


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_doctor_explains_an_undefined_symbol_import(tmp_path):
    error = "/env/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"
    proc = patchkit_cli("doctor", "--json", env=fake_flash_attn(tmp_path, "2.6.3", error))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    fa = data["flash_attn"]
    assert data["versions"]["flash-attn"] == "2.6.3"
    assert fa["installed"] is True and fa["cuda_extension_imports"] is False
    assert "undefined symbol: _ZN3c104cuda9SetDeviceEi" in fa["error"]
    assert "built against another torch/CUDA ABI" in fa["error"] and "reinstall a flash-attn wheel" in fa["error"]
    assert "does not import: ImportError: /env/flash_attn_2_cuda" in format_report(data)
    assert data["versions"]["transformers"] == transformers.__version__  # the subprocess saw this transformers
    for p in data["patches"]:  # the extension does not load: no patch may pick flash_attn
        if served_here(p["name"]):
            assert p["backend"] == "sdpa" and "flash_attn_installed" in p["why"]
        else:
            assert p["backend"] is None and p["why"] == GATED_OFF


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_doctor_judges_each_patch_by_its_own_flash_attn_minimum(tmp_path):
    """flash-attn 2.0.4 imports: llama1 (needs 2.0) passes the version gate, llama2 (needs 2.1) fails it."""
    proc = patchkit_cli("doctor", "--json", env=fake_flash_attn(tmp_path, "2.0.4"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["flash_attn"] == {"installed": True, "version": "2.0.4", "cuda_extension_imports": True, "error": None,
                                  "build": {}}
    gate = {p["name"]: {g["name"]: g["passed"] for g in p["gates"]} for p in data["patches"]}
    assert gate["llama1"]["flash_attn_installed"] and gate["llama2"]["flash_attn_installed"]
    assert gate["llama1"]["flash_attn_version"] is True
    assert gate["llama2"]["flash_attn_version"] is False


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_doctor_says_what_a_trimmed_flash_attn_build_lacks(tmp_path):
    """A flash-attn built by tools/build_flash_attn.py: doctor reads its build file and says what runs on sdpa."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        from flash_attn_sdist import build_info_source
    finally:
        sys.path.pop(0)
    env = fake_flash_attn(tmp_path, "2.8.3.post2")
    build = {"archs": ["90"], "head_dims": [64, 128], "head_dims_trimmed": [32, 96, 192, 256],
             "head_dim_buckets": [32, 64, 96, 128, 192, 256], "disabled": ["dropout", "uneven_k"]}
    (tmp_path / "flash_attn" / "_patchkit_build.py").write_text(build_info_source(build))
    proc = patchkit_cli("doctor", "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["flash_attn"]["build"] == build
    assert ("built by tools/build_flash_attn.py for sm_90: head-dim buckets 64,128 only, without dropout, uneven_k; "
            "a call it lacks runs on the sdpa backend") in format_report(data)


def simulated(monkeypatch, **changes) -> dict:
    base = gates.Environment(
        torch_version=torch.__version__, transformers_version=transformers.__version__, flash_attn_version="2.5.8",
        flash_attn_error=None, cuda_available=True, device_name="NVIDIA A100-SXM4-40GB", compute_capability=(8, 0),
        bf16_supported=True,
    )
    monkeypatch.setattr(gates, "probe_environment", lambda: dataclasses.replace(base, **changes))
    return doctor()


def test_doctor_on_a_simulated_ampere_gpu_picks_flash_attn(monkeypatch):
    data = simulated(monkeypatch)
    assert data["hardware"]["gpu"] == "NVIDIA A100-SXM4-40GB" and data["hardware"]["compute_capability"] == "8.0"
    verdicts = [(p["name"], p["applies"], p["backend"]) for p in data["patches"]]
    assert verdicts[:3] == [("llama1", True, "flash_attn"), ("llama2", True, "flash_attn"),
                            ("mistral", True, "flash_attn") if FAMILIES else ("mistral", False, None)]
    assert all((applies, backend) == ((True, "flash_attn") if served_here(name) else (False, None))
               for name, applies, backend in verdicts)
    assert all(p["why"] == GATED_OFF for p in data["patches"] if not served_here(p["name"]))
    assert "applies, backend flash_attn" in format_report(data)


def test_doctor_on_a_simulated_turing_gpu_falls_back_and_says_why(monkeypatch):
    data = simulated(monkeypatch, device_name="Tesla T4", compute_capability=(7, 5), bf16_supported=False)
    for p in data["patches"]:
        if served_here(p["name"]):
            assert p["backend"] == "sdpa" and "compute_capability" in p["why"]
        else:
            assert not p["applies"] and p["backend"] is None and p["why"] == GATED_OFF
    assert "compute_capability: FAILED (required >= 8.0 (Ampere or newer); found 7.5)" in format_report(data, True)
    assert "gates failed (compute_capability" in format_report(data)
    assert exit_code(data) == 0


def test_doctor_with_unsupported_transformers_says_no_patch_applies(monkeypatch):
    data = simulated(monkeypatch, transformers_version="4.30.0")
    assert all(not p["applies"] and p["backend"] is None for p in data["patches"])
    assert data["patches"][0]["why"] == "the transformers_version gate failed: no backend can help"
    assert "does NOT apply" in format_report(data)
    assert exit_code(data) == 1


def test_doctor_prints_a_failed_transformers_gate_once_per_patch(monkeypatch):
    data = simulated(monkeypatch, transformers_version="4.30.0")
    short, report = format_report(data), format_report(data, verbose=True)
    assert short.count("does NOT apply (transformers_version: found 4.30.0)") == len(data["patches"])
    names = [p["name"] for p in patchkit.available_patches()]
    section = report.split("patches (backend='auto')")[1]
    alternatives = "|".join(names)
    blocks = re.split(rf"\n  (?=(?:{alternatives})[ :])", section)[1:]  # one block per patch and its gates
    assert len(blocks) == len(names)
    for block in blocks:
        assert block.count("transformers_version: FAILED") == 1 and "found 4.30.0" in block, block


def test_doctor_reports_the_startup_hook(monkeypatch):
    monkeypatch.setenv("PATCHKIT_FLASH_ATTN", "1")
    data = doctor()
    hook = data["startup_hook"]
    assert hook["pth"] and hook["pth"].endswith("patchkit-startup.pth") and hook["module"] and hook["active"]
    assert hook["PATCHKIT_FLASH_ATTN"] == "1"
    report = format_report(data)
    assert f"  .pth file           {hook['pth']}" in report and "  PATCHKIT_FLASH_ATTN 1" in report


def test_doctor_module_attribute_lookup_is_what_tests_patch():
    assert doctor_module._gates is gates
