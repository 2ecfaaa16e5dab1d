"""`patchkit verify`: the table of patched vs eager differences, its tolerances, and its exit code."""

from __future__ import annotations

import json

import pytest
from entrypoints import patchkit_cli
from models import tiny_model

import patchkit
from patchkit.backends import SdpaBackend
from patchkit.entry.verify import FP32_RTOL, HALF_FACTOR, verify
from patchkit.gates import probe_environment

FLASH_USABLE = probe_environment().flash_attn_error is None and probe_environment().cuda_available
CHECKS = ["right padding: logits", "right padding: gradients", "left padding: logits", "left padding: gradients",
          "mixed padding: logits", "mixed padding: gradients"]
GENERATION = ["cached decode: logits", "greedy 12 tokens: mismatches"]

@pytest.fixture(autouse=True)
def reverted():
    yield
    patchkit.revert_patch()


def break_causal(monkeypatch) -> None:
    """A bug of the kind verify exists to catch: the kernel ignores causality (as with a wrong causal alignment)."""
    original = SdpaBackend.varlen
    broken = staticmethod(lambda *a, _f=original, **k: _f(*a, **{**k, "causal": False}))
    monkeypatch.setattr(SdpaBackend, "varlen", broken)


def test_fp32_llama2_passes_with_real_differences():
    result = verify("llama2", "fp32", backend="sdpa")
    assert [c.name for c in result.checks] == CHECKS + GENERATION
    assert result.passed and result.backend == "sdpa"
    for check in result.checks[:-1]:
        assert check.tol >= FP32_RTOL * 1e-3 and check.diff < 1e-5, check
    assert result.checks[-1].diff == 0 and result.checks[-1].tol == 0  # greedy tokens identical
    assert patchkit.active_patches() == []  # verify reverts what it applied


def test_llama1_has_no_generation_checks():
    result = verify("llama1", "fp32", backend="sdpa")
    assert [c.name for c in result.checks] == CHECKS and result.passed


def test_bf16_tolerance_is_relative_to_the_eager_bf16_error():
    result = verify("llama2", "bf16", backend="sdpa")
    assert result.passed, result.table()
    for check in result.checks[:-1]:
        eager_error = float(check.detail.split()[-1])
        assert eager_error > 0  # bf16 eager really differs from the fp32 reference
        assert check.tol >= HALF_FACTOR * eager_error and check.diff > 0


def test_a_broken_kernel_fails_verify(monkeypatch):
    break_causal(monkeypatch)
    result = verify("llama2", "fp32", backend="sdpa")
    assert not result.passed
    failed = {c.name for c in result.checks if not c.passed}
    assert {"right padding: logits", "left padding: gradients", "cached decode: logits"} <= failed
    assert "FAIL" in result.table() and "=> FAIL" in result.table()


def test_a_broken_kernel_fails_in_bf16_too(monkeypatch):
    break_causal(monkeypatch)
    result = verify("llama2", "bf16", backend="sdpa")
    assert not result.passed and not result.checks[0].passed


def test_refuses_to_run_while_a_class_patch_is_active():
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    with pytest.raises(patchkit.PatchkitError, match="revert_patch"):
        verify()
    assert handle.active  # the user's patch is left alone


def test_llama1_refuses_a_gqa_checkpoint(tmp_path):
    tiny_model(kv_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_config: FAILED.*grouped-query"):
        verify("llama1", model_path=str(tmp_path))


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_cli_verify_prints_the_table_and_exits_zero():
    proc = patchkit_cli("verify", "--backend", "sdpa")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in CHECKS + GENERATION:
        assert name in proc.stdout
    assert "patch 'llama2', backend 'sdpa', dtype fp32" in proc.stdout and "=> PASS (8/8)" in proc.stdout


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_cli_verify_local_checkpoint_json(tmp_path):
    tiny_model(kv_heads=4, seed=7).save_pretrained(tmp_path / "ckpt")
    proc = patchkit_cli("verify", "--patch", "llama1", "--model", str(tmp_path / "ckpt"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["model"] == str(tmp_path / "ckpt") and data["patch"] == "llama1" and data["passed"] is True
    assert [c["name"] for c in data["checks"]] == CHECKS
    if not FLASH_USABLE:  # auto fell back: the warning reaches the user
        assert "warning: patchkit: patch 'llama1' runs on the exact sdpa backend" in proc.stderr


def test_cli_verify_exits_one_when_a_tolerance_is_exceeded(monkeypatch, capsys):
    """The CLI's exit code, from its `main` (the console script's `sys.exit(main())`; the table and JSON runs above
    start it as a user does)."""
    from patchkit.entry.cli import main

    break_causal(monkeypatch)
    assert main(["verify", "--backend", "sdpa", "--patch", "llama1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "=> FAIL" in out


@pytest.mark.skipif(FLASH_USABLE, reason="flash-attn usable here")
def test_cli_verify_strict_flash_attn_is_a_clear_error_not_a_table(capsys):
    from patchkit.entry.cli import main

    assert main(["verify", "--backend", "flash_attn", "--strict"]) == 2
    captured = capsys.readouterr()
    assert "PatchGateError" in captured.err and "flash_attn_installed: FAILED" in captured.err
    assert "=> PASS" not in captured.out


def test_cli_verify_rejects_a_bad_dtype(capsys):
    from patchkit.entry.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["verify", "--dtype", "fp8"])
    assert exc.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype='fp8' is not valid; allowed values: fp32, bf16, fp16"):
        verify(dtype="fp8")


def test_verify_takes_a_checkpoints_own_family_and_refuses_what_it_cannot_run_by_name(tmp_path, capsys):
    """`--model` alone verifies the checkpoint's family (a family served from data too: GPT-OSS's); `--patch all`
    and a family without its checkpoint are refused with the fix (the first exited 2 naming no such patch, and no
    family served from data could be verified)."""
    from census import tiny_lm

    from patchkit.entry.cli import main

    model, why = tiny_lm("gpt_oss")
    assert model is not None, why
    model.save_pretrained(tmp_path / "ckpt")
    result = verify(None, "fp32", model_path=str(tmp_path / "ckpt"), backend="sdpa")
    assert result.passed and result.patch == "gpt_oss", result.table()
    assert main(["verify", "--patch", "all"]) == 2
    assert "verify checks one family" in capsys.readouterr().err
    assert main(["verify", "--patch", "qwen3"]) == 2
    assert "give --model PATH" in capsys.readouterr().err
