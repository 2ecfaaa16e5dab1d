"""Every gate: passing, failing with fallback and a warning that names it, and failing in strict mode."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from fakes import env, install_flash_double
from models import padded_batch, tiny_model

import patchkit
from patchkit import PatchGateError, gates

FAILING = {
    "flash_attn_installed": dict(flash_attn_version=None, flash_attn_error="not installed (No module named x)"),
    "flash_attn_version": dict(flash_attn_version="2.0.9"),
    "cuda_available": dict(cuda_available=False, device_name=None, compute_capability=None),
    "compute_capability": dict(compute_capability=(7, 5), device_name="Tesla T4"),
}


FLASH_ONLY = ("flash_attn_installed", "flash_attn_version")  # torch's own varlen kernel does not need these


@pytest.mark.parametrize("gate", sorted(FAILING))
def test_failing_gate_falls_back_with_a_warning_naming_it(monkeypatch, gate):
    """A flash-attn gate alone: auto takes torch's varlen kernel; no GPU kernel at all: the exact sdpa backend."""
    if gate in FLASH_ONLY:  # the backend imports torch's varlen module when it is made
        pytest.importorskip("torch.nn.attention.varlen", reason=f"torch {torch.__version__} has no varlen_attn")
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**FAILING[gate]))
    fallback = "torch_varlen" if gate in FLASH_ONLY else "exact sdpa"
    with pytest.warns(RuntimeWarning, match=rf"runs on the {fallback} backend \(not flash_attn: {gate}: FAILED"):
        handle = patchkit.apply_patch("llama2")
    assert handle.backend == ("torch_varlen" if gate in FLASH_ONLY else "sdpa")
    assert any(g.name == gate and not g.passed for g in handle.gates)
    assert f"{gate}: FAILED" in handle.report()


@pytest.mark.parametrize("gate", sorted(FAILING))
def test_failing_gate_in_strict_mode_raises_and_patches_nothing(monkeypatch, gate):
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**FAILING[gate]))
    mod = sys.modules["transformers.models.llama.modeling_llama"]
    before = mod.LlamaAttention.__dict__["forward"]
    refusal = f"(?s)Nothing was patched.*\\n  simplest: backend='sdpa'.*\\n  - flash_attn: {gate}: FAILED.*Fix: "
    with pytest.raises(PatchGateError, match=refusal):
        patchkit.apply_patch("llama2", backend="flash_attn", strict=True)
    assert mod.LlamaAttention.__dict__["forward"] is before
    assert patchkit.active_patches() == []


def test_all_gates_passing_selects_flash_attn(monkeypatch):
    install_flash_double(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = patchkit.apply_patch("llama2", strict=True)
    assert handle.backend == "flash_attn"
    assert all(g.passed for g in handle.gates)


def test_flash_attn_version_compared_as_versions_not_strings(monkeypatch):
    """'2.10.0' < '2.1' as strings (FastChat's bug); as versions it passes."""
    monkeypatch.setattr(gates, "probe_environment", lambda: env(flash_attn_version="2.10.0"))
    assert gates.flash_attn_version_gate(gates.probe_environment(), "2.1", "cache").passed
    assert not gates.flash_attn_version_gate(env(flash_attn_version="2.0.4"), "2.1", "cache").passed
    # llama1 only needs the varlen API of 2.0
    assert gates.flash_attn_version_gate(env(flash_attn_version="2.0.4"), "2.0", "varlen").passed


def test_transformers_outside_range_always_raises_naming_the_range(monkeypatch):
    monkeypatch.setattr(gates, "probe_environment", lambda: env(transformers_version="4.30.2"))
    with pytest.raises(PatchGateError, match=r"transformers<6,>=4.31.*found 4.30.2"):
        patchkit.apply_patch("llama2", backend="sdpa")  # no backend can help: not even non-strict falls back


def test_undefined_symbol_import_error_is_explained(monkeypatch):
    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "flash_attn_2_cuda":
                raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
            return None

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(__version__="2.6.3"))
    monkeypatch.delitem(sys.modules, "flash_attn_2_cuda", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    version, error = gates.probe_flash_attn()
    assert version == "2.6.3"
    assert "undefined symbol" in error and "ABI" in error and "reinstall" in error
    gate = gates.flash_attn_installed_gate(env(flash_attn_version=version, flash_attn_error=error))
    assert not gate.passed and "reinstall" in gate.found


def test_head_dim_gate_falls_back_per_model_or_raises(monkeypatch):
    install_flash_double(monkeypatch)
    model = tiny_model(hidden=1152, heads=4, kv_heads=4, layers=1)  # head_dim 288 > 256
    with pytest.raises(PatchGateError, match=r"head_dim: FAILED \(required head_dim <= 256; found 288\)"):
        patchkit.apply_patch("llama2", model=model, strict=True)
    with pytest.warns(RuntimeWarning, match="head_dim: FAILED"):
        handle = patchkit.apply_patch("llama2", model=model)
    assert handle.backend == "sdpa"


def test_head_dim_gate_at_run_time_for_a_class_patch(monkeypatch):
    fake = install_flash_double(monkeypatch)
    model = tiny_model(hidden=1152, heads=4, kv_heads=4, layers=1).to(torch.bfloat16)
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", strict=True):
        with pytest.raises(PatchGateError, match="head_dim"):
            model(input_ids=ids, attention_mask=mask)
    with patchkit.apply_patch("llama2"), pytest.warns(RuntimeWarning, match="use the sdpa backend instead"):
        model(input_ids=ids, attention_mask=mask)
    assert fake.calls == []


def test_llama1_refuses_gqa_config_clearly():
    model = tiny_model(kv_heads=2)
    with pytest.raises(PatchGateError, match="grouped-query attention; use apply_patch\\('llama2'\\)"):
        patchkit.apply_patch("llama1", model=model, backend="sdpa")
    assert patchkit.active_patches() == []
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama1", backend="sdpa"):  # class patch: refused when the GQA model runs
        with pytest.raises(PatchGateError, match="4 query heads and 2 key/value heads"):
            model(input_ids=ids, attention_mask=mask)


def test_the_strict_error_lists_one_failed_gate_per_line_the_simplest_fix_first(monkeypatch):
    no_gpu = {**FAILING["cuda_available"], **FAILING["flash_attn_installed"]}
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**no_gpu))
    with pytest.raises(PatchGateError) as exc:
        patchkit.apply_patch(backend="auto", strict=True)
    lines = str(exc.value).splitlines()
    failed = [line for line in lines if line.startswith("  - ")]
    assert lines[0].startswith("Patch 'all', backend 'auto': ") and lines[0].endswith("Nothing was patched.")
    assert lines[1].startswith("  simplest: backend='sdpa'") and len(lines) == 2 + len(failed) >= 4
    assert "flash_attn_installed: FAILED" in failed[0] and "pip install" in failed[0]  # a pip install before hardware
    assert any("cuda_available: FAILED" in line for line in failed[2:]) and "mistral" not in str(exc.value)
    assert all(len(line) <= 300 for line in lines), max(map(len, lines))
