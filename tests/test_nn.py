"""VarlenSelfAttention against a float64 reference and torch.nn.MultiheadAttention: outputs, gradients, gates."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import flash_stand_in as stand_in
import pytest
import torch
import torch.nn.functional as F

import patchkit.nn as pnn
from patchkit import PatchGateError, PatchInputError
from patchkit import gates as pk_gates
from patchkit.backends.flash_attn import FlashAttnBackend
from patchkit.nn import VarlenSelfAttention

E, H, S, B = 32, 4, 12, 4
NO_GPU = pk_gates.Environment("2.13.0", "5.23.0", None, "not installed", False, None, None, False)
FLASH_OK = dataclasses.replace(
    NO_GPU, flash_attn_version="2.8.3", flash_attn_error=None, cuda_available=True, device_name="fake A100",
    compute_capability=(8, 0), bf16_supported=True,
)


def make_mask(kind: str, batch: int = B, seq: int = S) -> torch.Tensor | None:
    """None, or a (B, S) bool mask with True = real token; 'mixed' has a hole and an all-padding row."""
    if kind == "none":
        return None
    lengths = [seq, seq - 3, seq - 7, 2][:batch]
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for row, n in enumerate(lengths):
        left = kind == "left" or (kind == "mixed" and row % 2)
        if left:
            mask[row, seq - n :] = True
        else:
            mask[row, :n] = True
    if kind == "mixed":
        mask[0, 5] = False  # a hole inside a row
        mask[-1] = False  # a row that is all padding
    return mask


def reference(module: VarlenSelfAttention, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Dense attention in the module's own dtype with explicit masks: the textbook formula, zero at padding."""
    b, s, _ = x.shape
    h, hk, d = module.num_heads, module.num_kv_heads, module.head_dim
    real = torch.ones(b, s, dtype=torch.bool) if mask is None else mask
    qkv = module.in_proj(x)
    q = qkv[..., : h * d].view(b, s, h, d).transpose(1, 2)
    k, v = (t.reshape(b, s, hk, d).transpose(1, 2).repeat_interleave(h // hk, 1)
        for t in qkv[..., h * d :].chunk(2, -1))
    scores = q @ k.transpose(-1, -2) * module.softmax_scale
    allowed = real[:, None, None, :].expand(b, 1, s, s)
    if module.causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.nan_to_num(scores.masked_fill(~allowed, float("-inf")).softmax(-1), nan=0.0)
    out = module.out_proj((probs @ v).transpose(1, 2).reshape(b, s, h * d))
    return out * real[..., None]


def fwd_bwd(module, x, mask, weights):
    """Output, input gradient and parameter gradients for a fixed random linear loss."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = module(x, mask) if isinstance(module, VarlenSelfAttention) else module(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, E, generator=g, dtype=dtype), torch.randn(B, S, E, generator=g, dtype=dtype)


@pytest.mark.parametrize("kind", ["none", "right", "left", "mixed"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_reference(kind, kv_heads, causal):
    torch.manual_seed(0)
    module = VarlenSelfAttention(E, H, kv_heads, causal=causal, backend="sdpa")
    ref64 = copy.deepcopy(module).double()
    x, w = inputs()
    mask = make_mask(kind)
    out, gx, grads = fwd_bwd(module, x, mask, w)

    ref64.zero_grad(set_to_none=True)
    x64 = x.double().requires_grad_(True)
    want = reference(ref64, x64, mask)
    (want * w.double()).sum().backward()

    torch.testing.assert_close(out, want.float(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gx, x64.grad.float(), atol=2e-5, rtol=1e-4)
    for name, p in ref64.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.float(), atol=5e-5, rtol=1e-4, msg=name)
    if mask is not None:
        assert out[~mask].abs().max() == 0, "padding positions must be exactly zero"
        assert gx[~mask].abs().max() == 0, "padding tokens must get zero gradient"


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_multihead_attention(causal):
    """Same weights as nn.MultiheadAttention; right padding (every query sees a real key, so MHA has no NaN)."""
    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    module = VarlenSelfAttention.from_torch(mha, causal=causal, backend="sdpa")
    x, w = inputs(1)
    mask = make_mask("right")
    attn_mask = torch.ones(S, S, dtype=torch.bool).triu(1) if causal else None

    def mha_forward(inp):
        return mha(inp, inp, inp, key_padding_mask=~mask, attn_mask=attn_mask, need_weights=False)[0] * mask[..., None]

    out, gx, grads = fwd_bwd(module, x, mask, w)
    mha.zero_grad(set_to_none=True)
    x_ref = x.clone().requires_grad_(True)
    want = mha_forward(x_ref)
    (want * w).sum().backward()
    torch.testing.assert_close(out, want.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gx, x_ref.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grads["in_proj.weight"], mha.in_proj_weight.grad, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(grads["out_proj.weight"], mha.out_proj.weight.grad, atol=5e-5, rtol=1e-4)


def test_all_padding_row_is_zero_with_zero_gradient():
    torch.manual_seed(2)
    module = VarlenSelfAttention(E, H, 2, causal=True, backend="sdpa")
    x, w = inputs(2)
    mask = make_mask("mixed")
    out, gx, grads = fwd_bwd(module, x, mask, w)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert out[-1].abs().max() == 0 and gx[-1].abs().max() == 0
    # The other rows are unaffected by the all-padding row being in the batch.
    torch.testing.assert_close(out[:-1], module(x[:-1], mask[:-1]).detach())


def test_all_padding_batch_gives_zeros_and_backward_works():
    module = VarlenSelfAttention(E, H, backend="sdpa")
    x = torch.randn(2, S, E, requires_grad=True)
    out = module(x, torch.zeros(2, S, dtype=torch.bool))
    out.sum().backward()
    assert out.abs().max() == 0 and not torch.isnan(out).any()
    assert x.grad.abs().max() == 0 and module.in_proj.weight.grad.abs().max() == 0


def test_integer_mask_equals_bool_mask_and_float_mask_is_refused():
    module = VarlenSelfAttention(E, H, backend="sdpa")
    x, _ = inputs(3)
    mask = make_mask("left")
    torch.testing.assert_close(module(x, mask.long()), module(x, mask))
    with pytest.raises(PatchInputError, match="float mask"):
        module(x, mask.float())
    with pytest.raises(PatchInputError, match="shape"):
        module(x, mask[:, 1:])


def test_dropout_only_in_training():
    torch.manual_seed(4)
    module = VarlenSelfAttention(E, H, causal=True, dropout=0.5, backend="sdpa")
    x, _ = inputs(4)
    mask = make_mask("right")
    module.eval()
    with torch.no_grad():
        assert torch.equal(module(x, mask), module(x, mask))
        torch.testing.assert_close(module(x, mask), reference(module, x, mask), atol=2e-5, rtol=1e-4)
        module.train()
        a, b = module(x, mask), module(x, mask)
    assert not torch.allclose(a, b), "dropout must be active in training mode"
    assert a[~mask].abs().max() == 0


def test_sdpa_backend_has_no_warning(monkeypatch):
    monkeypatch.setattr(pk_gates, "probe_environment", lambda: NO_GPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = VarlenSelfAttention(E, H, backend="sdpa")
        module(inputs()[0], make_mask("right"))
    assert module.backend.name == "sdpa" and module.gates == []


def test_auto_falls_back_with_a_warning_naming_the_gate(monkeypatch):
    monkeypatch.setattr(pk_gates, "probe_environment", lambda: NO_GPU)
    with pytest.warns(RuntimeWarning, match=r"VarlenSelfAttention runs on the exact sdpa backend \(not "):
        module = VarlenSelfAttention(E, H)
    assert module.backend.name == "sdpa"
    assert {g.name for g in module.gates if not g.passed} >= {"flash_attn_installed", "cuda_available"}


@pytest.mark.parametrize("backend", ["auto", "flash_attn"])
def test_strict_raises_instead_of_falling_back(monkeypatch, backend):
    monkeypatch.setattr(pk_gates, "probe_environment", lambda: NO_GPU)
    with pytest.raises(PatchGateError, match="cuda_available: FAILED"):
        VarlenSelfAttention(E, H, backend=backend, strict=True)


def test_unknown_backend_and_bad_heads_are_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        VarlenSelfAttention(E, H, backend="triton")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        VarlenSelfAttention(E, H, 3, backend="sdpa")


class RecordingFlash:
    """A stand-in for the flash_attn package: patchkit's torch-native functions, recording input dtypes."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []

    def flash_attn_varlen_func(self, q, k, v, *args, **kwargs):
        self.dtypes.append(q.dtype)
        return stand_in.flash_attn_varlen_func(q, k, v, *args, **kwargs)


@pytest.fixture
def fake_flash(monkeypatch):
    """A machine where every flash gate passes; the 'flash' kernels are the torch-native ones on CPU."""
    recorder = RecordingFlash()
    real_make_backend = pnn.make_backend
    monkeypatch.setattr(pk_gates, "probe_environment", lambda: FLASH_OK)

    def make_backend(name: str):
        return FlashAttnBackend(recorder) if name == "flash_attn" else real_make_backend(name)

    monkeypatch.setattr(pnn, "make_backend", make_backend)
    return recorder


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fp32_inputs_run_exact_off_flash_with_one_warning_and_are_cast_under_autocast(fake_flash, monkeypatch,
                                                                                     kv_heads):
    """An fp32 module, no autocast: no half dtype keeps its numbers, so it runs on the exact backend (its fp32
    reference's numbers) with one warning; under autocast the kernel runs in autocast's dtype."""
    monkeypatch.setattr(pnn, "device_gate", lambda device: pk_gates.GateResult("input_device", True, "cuda", "cuda"))
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = VarlenSelfAttention(E, H, kv_heads, causal=True)
    assert module.backend.name == "flash_attn"
    x, _ = inputs(5)
    mask = make_mask("mixed")
    with pytest.warns(RuntimeWarning, match="no autocast and no half weights.*exact sdpa backend") as record:
        out = module(x, mask)
        module(x, mask)
    assert len([w for w in record if "exact sdpa" in str(w.message)]) == 1
    assert fake_flash.dtypes == [] and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(module, x, mask).detach(), atol=2e-5, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # its projection gives bf16 q/k/v
        module(x, mask)
    assert fake_flash.dtypes == [torch.bfloat16]


def test_fp32_inputs_are_refused_for_flash_in_strict_mode(fake_flash, monkeypatch):
    monkeypatch.setattr(pnn, "device_gate", lambda device: pk_gates.GateResult("input_device", True, "cuda", "cuda"))
    module = VarlenSelfAttention(E, H, strict=True)
    with pytest.raises(PatchGateError, match="dtype: FAILED"):
        module(inputs()[0])
    bf16 = VarlenSelfAttention(E, H, strict=True, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bf16(inputs(dtype=torch.bfloat16)[0])
    assert fake_flash.dtypes == [torch.bfloat16]


def test_flash_backend_with_cpu_inputs_falls_back_or_raises(fake_flash):
    module = VarlenSelfAttention(E, H, causal=True)
    x, _ = inputs(6)
    mask = make_mask("right")
    with pytest.warns(RuntimeWarning, match="input_device: FAILED"):
        out = module(x, mask)
    assert fake_flash.dtypes == []
    torch.testing.assert_close(out, reference(module, x, mask).detach(), atol=2e-5, rtol=1e-4)
    with pytest.raises(PatchGateError, match="input_device: FAILED"):
        VarlenSelfAttention(E, H, strict=True)(x, mask)


def test_head_dim_gate_falls_back(fake_flash):
    with pytest.warns(RuntimeWarning, match="head_dim: FAILED"):
        module = VarlenSelfAttention(2 * 512, 2)
    assert module.backend.name == "sdpa"


def test_gradient_flows_through_linear_loss_only_on_real_tokens():
    """Changing a padding token's input leaves every real output unchanged (padding is really removed)."""
    torch.manual_seed(7)
    module = VarlenSelfAttention(E, H, backend="sdpa")
    x, _ = inputs(7)
    mask = make_mask("left")
    changed = x.clone()
    changed[~mask] = 1e4
    torch.testing.assert_close(module(changed, mask), module(x, mask))
    assert F.mse_loss(module(x), module(x, mask)) > 0  # without the mask, padding is attended
