"""A flash-attn built by tools/build_flash_attn.py without some head dims or features: patchkit reads what it lacks
(flash_attn/_patchkit_build.py) and sends those calls to the exact sdpa backend with one warning, or refuses them
in strict mode, before the kernel refuses them (or, for a trimmed head-dim bucket, crashes: seen on an H100)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from fakes import install_flash_double
from models import clone, padded_batch, tiny_model

import patchkit
from patchkit import PatchGateError
from patchkit.backends.flash_attn import build_lacks
from patchkit.gates import build_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from flash_attn_sdist import build_info_source  # noqa: E402

BUCKETS = [32, 64, 96, 128, 192, 256]
# What the H100 build of 2026-11-24 was: `--archs 90 --head-dims 64,128 --disable dropout,alibi,uneven_k`.
H100_BUILD = {"archs": ["90"], "head_dims": [64, 128], "head_dims_trimmed": [32, 96, 192, 256],
              "head_dim_buckets": BUCKETS, "disabled": ["dropout", "alibi", "uneven_k"]}


def install_build(fake, where: Path, config: dict) -> None:
    """The build file beside the (double's) flash_attn package, as the wheel carries it."""
    (where / "flash_attn").mkdir(exist_ok=True)
    (where / "flash_attn" / "_patchkit_build.py").write_text(build_info_source(config))
    fake.__file__ = str(where / "flash_attn" / "__init__.py")


def test_the_file_the_build_tool_writes_is_what_the_backend_reads(tmp_path):
    module = types.ModuleType("flash_attn")
    assert build_config(module) == {}  # no file: any other flash-attn, a full build, nothing lacking
    install_build(module, tmp_path, H100_BUILD)
    assert build_config(module) == H100_BUILD
    (tmp_path / "flash_attn" / "_patchkit_build.py").write_text("BUILD_CONFIG = {")
    assert build_config(module) == {}  # unreadable: taken as a full build; the kernel still refuses what it lacks


@pytest.mark.parametrize("head_dim, reason", [
    (16, "no kernels for head_dim 16 (bucket 32; built for head dims 64,128); rebuild with tools/build_flash_attn.py "
         "--head-dims 64,128,32"),
    (80, "no kernels for head_dim 80 (bucket 96"),
    (48, "without uneven head dims (--disable uneven_k): head_dim 48 is not a multiple of 32"),
    (64, None), (128, None), (None, None),
])
def test_head_dims_a_trimmed_build_lacks(head_dim, reason):
    got = build_lacks(H100_BUILD, (-1, -1), 0.0, 0.0, head_dim)
    assert got == reason if reason is None else reason in got


@pytest.mark.parametrize("need, feature", [
    (dict(dropout_p=0.1), "dropout"), (dict(softcap=30.0), "softcap"), (dict(window_size=(63, 0)), "local")])
def test_features_a_build_was_compiled_without(need, feature):
    args = {"window_size": (-1, -1), "softcap": 0.0, "dropout_p": 0.0, "head_dim": 64, **need}
    build = {**H100_BUILD, "disabled": [feature]}
    assert f"compiled without {feature} (--disable {feature})" in build_lacks(build, **args)
    assert build_lacks({**H100_BUILD, "disabled": []}, **args) is None
    assert build_lacks({}, **args) is None  # a full build lacks nothing


def test_a_trimmed_head_dim_never_reaches_the_kernel(monkeypatch, tmp_path):
    """head_dim 16 on the H100 build: sdpa with one warning naming the build and the fix; strict refuses."""
    fake = install_flash_double(monkeypatch)
    install_build(fake, tmp_path, H100_BUILD)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)  # hidden 64, 4 heads: head_dim 16
    ids, mask = padded_batch("right")
    with torch.no_grad():
        with patchkit.apply_patch("llama2", backend="sdpa"):
            exact = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2"):
            with pytest.warns(RuntimeWarning, match=r"no kernels for head_dim 16 \(bucket 32.*sdpa backend instead"):
                ours = model(input_ids=ids, attention_mask=mask).logits
        assert fake.calls == []
        assert torch.equal(ours, exact)
        with patchkit.apply_patch("llama2", strict=True):
            with pytest.raises(PatchGateError, match="flash_attn_build: .*--head-dims 64,128,32"):
                model(input_ids=ids, attention_mask=mask)


def test_a_kept_head_dim_runs_on_the_trimmed_build(monkeypatch, tmp_path):
    fake = install_flash_double(monkeypatch)
    install_build(fake, tmp_path, H100_BUILD)
    model = tiny_model(hidden=256, heads=4, kv_heads=2, dtype=torch.bfloat16)  # head_dim 64
    ids, mask = padded_batch("right")
    with torch.no_grad(), patchkit.apply_patch("llama2", strict=True):
        model(input_ids=ids, attention_mask=mask)
    assert len(fake.calls) == model.config.num_hidden_layers


def test_dropout_in_training_on_a_build_without_it_falls_back(monkeypatch, tmp_path):
    fake = install_flash_double(monkeypatch)
    install_build(fake, tmp_path, H100_BUILD)
    model = tiny_model(hidden=256, heads=4, kv_heads=2, dtype=torch.bfloat16, attention_dropout=0.1).train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2"):
        with pytest.warns(RuntimeWarning, match="compiled without dropout"):
            model(input_ids=ids, attention_mask=mask)
        assert fake.calls == []
        with torch.no_grad():
            clone(model).eval()(input_ids=ids, attention_mask=mask)  # no dropout in eval: the kernel serves it
        assert len(fake.calls) == model.config.num_hidden_layers


@pytest.mark.parametrize("archs, capability, runs", [
    (("90",), (9, 0), True), (("80",), (8, 6), True), (("80", "90"), (9, 0), True),
    (("90",), (8, 0), False), (("80",), (9, 0), False), (("86",), (8, 0), False),
])
def test_a_build_for_other_archs_is_passed_over_by_name(archs, capability, runs):
    """A wheel built for sm_90 copied to an A100 would fail at its first kernel ("no kernel image"): its gate says
    so, and backend='auto' takes the next backend with the reason."""
    from fakes import env

    from patchkit.backends.choice import fallback_message, pick

    choice = pick("auto", env(flash_attn_archs=archs, compute_capability=capability), "2.1", "kvpacked varlen")
    assert (choice.backend == "flash_attn") == runs
    if not runs:
        gate = choice.passed_over[0]
        assert gate.name == "flash_attn_build_arch" and choice.backend == "torch_varlen"
        assert f"sm_{capability[0]}{capability[1]}" in gate.found and "tools/build_flash_attn.py" in gate.fix
        assert "not flash_attn: flash_attn_build_arch: FAILED" in fallback_message("patch 'llama2'", choice)


def test_the_archs_are_read_from_the_installed_build(tmp_path, monkeypatch):
    """probe_environment reads the imported flash_attn's build file (a full build: no arch gate at all)."""
    from patchkit import gates

    module = types.ModuleType("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(gates, "probe_flash_attn", lambda: ("2.8.3.post2", None))
    assert gates.probe_environment().flash_attn_archs is None
    install_build(module, tmp_path, H100_BUILD)
    assert gates.probe_environment().flash_attn_archs == ("90",)
