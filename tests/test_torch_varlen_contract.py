"""The torch_varlen backend through a double of torch's varlen_attn bound to its real signature (no GPU here)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from fakes import NO_FLASH_GPU_ENV, env, install_flash_double, install_torch_varlen_double
from models import clone, labels_for, padded_batch, tiny_model

import patchkit
from patchkit import PatchGateError, PatchInputError, gates
from patchkit.backends.torch_varlen import TorchVarlenBackend, kernel_window


def _varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature as an H100 printed it (no enable_gqa, seqused_k or block_table)."""


def _varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn signature (2.15's is the same): the kernel groups query heads itself."""


TORCH_2_11 = inspect.signature(_varlen_attn_2_11)
TORCH_2_13 = inspect.signature(_varlen_attn_2_13)  # fixed, so the case does not follow the installed torch


def within_bf16_error(ours: torch.Tensor, eager: torch.Tensor, truth: torch.Tensor, real: torch.Tensor) -> None:
    """flash-attn's own test rule: ours is no further from the fp32 truth than twice eager bf16's own error."""
    err = (ours.float() - truth)[real].abs().max()
    ref = (eager.float() - truth)[real].abs().max()
    assert err <= 2 * ref + 1e-3, (float(err), float(ref))


def test_auto_without_flash_attn_runs_torch_varlen_and_says_why(monkeypatch):
    install_torch_varlen_double(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"runs on the torch_varlen backend \(not flash_attn: flash_attn_installed"):
        handle = patchkit.apply_patch("llama2")
    assert handle.backend == "torch_varlen"
    report = handle.report()
    assert "flash_attn backend:" in report and "torch_varlen backend:" in report
    assert "torch_varlen_api: ok" in report and "flash_attn_installed: FAILED" in report


@pytest.mark.parametrize("torch_api", ["2.13", "2.11"])
@pytest.mark.parametrize("patch,kv_heads", [("llama2", 2), ("llama1", 4)])
def test_every_call_matches_the_kernel_contract(monkeypatch, patch, kv_heads, torch_api):
    fake = install_torch_varlen_double(monkeypatch, signature=TORCH_2_11 if torch_api == "2.11" else TORCH_2_13)
    model = tiny_model(kv_heads=kv_heads, dtype=torch.bfloat16)
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        truth = clone(model).float()(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch(patch, backend="torch_varlen", strict=True) as handle:
            ours = model(input_ids=ids, attention_mask=mask).logits
    assert handle.backend == "torch_varlen" and len(fake.calls) == model.config.num_hidden_layers
    lengths = [n for n in mask.sum(-1).tolist() if n]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for call in fake.calls:
        assert call["cu_q"] == call["cu_k"] == torch.tensor([0, *lengths]).cumsum(0).tolist()
        assert call["max_q"] == call["max_k"] == max(lengths)
        assert call["window"] == (-1, 0)  # causal, torch's spelling
        assert call["scale"] == pytest.approx(head_dim**-0.5)
        if torch_api == "2.13":  # the kernel groups query heads itself
            assert call["enable_gqa"] is (kv_heads != 4)
            assert call["shapes"] == [(sum(lengths), 4, head_dim)] + 2 * [(sum(lengths), kv_heads, head_dim)]
        else:  # no enable_gqa: K/V heads repeated over the real tokens only
            assert call["enable_gqa"] is None and call["shapes"] == 3 * [(sum(lengths), 4, head_dim)]
    within_bf16_error(ours, eager, truth, mask.bool())


def test_training_step_logits_and_gradients(monkeypatch):
    install_torch_varlen_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16).train()
    truth_model = clone(model).float()
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)

    def step(m):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach().float(), m.model.layers[0].self_attn.q_proj.weight.grad.float()

    truth, truth_grad = step(truth_model)
    eager, eager_grad = step(model)
    with patchkit.apply_patch("llama2", backend="torch_varlen", strict=True):
        ours, ours_grad = step(model)
    within_bf16_error(ours, eager, truth, mask.bool())
    assert (ours_grad - truth_grad).abs().max() <= 2 * (eager_grad - truth_grad).abs().max() + 1e-3


def test_generation_through_the_cache_is_the_exact_backend_token_for_token(monkeypatch):
    fake = install_torch_varlen_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch("llama2", backend="torch_varlen", strict=True):
        got = model.generate(input_ids=ids, **kw)
    assert torch.equal(got, want)
    # the prompt goes through the kernel; each decode step attends to the cache in place (no gathered copy of it)
    real = mask.sum(-1).tolist()
    assert len(fake.calls) == model.config.num_hidden_layers
    assert all(c["cu_q"] == c["cu_k"] == torch.tensor([0, *real]).cumsum(0).tolist() for c in fake.calls)


def test_a_sliding_window_reaches_the_kernel_and_softcap_falls_back_per_call(monkeypatch):
    from families import WINDOW, family_model

    fake = install_torch_varlen_double(monkeypatch)
    ids, mask = padded_batch("right")
    mistral = family_model("mistral").to(torch.bfloat16)
    with torch.no_grad():
        truth = clone(mistral).float()(input_ids=ids, attention_mask=mask).logits
        eager = mistral(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("mistral", backend="torch_varlen", strict=True):
            ours = mistral(input_ids=ids, attention_mask=mask).logits
    assert [c["window"] for c in fake.calls] == [(WINDOW - 1, 0)] * 2
    within_bf16_error(ours, eager, truth, mask.bool())
    fake.calls.clear()
    gemma2 = family_model("gemma2").to(torch.bfloat16)  # softcap on every layer: torch's kernel has none
    with torch.no_grad(), patchkit.apply_patch("gemma2", backend="torch_varlen"):
        with pytest.warns(RuntimeWarning, match="torch_varlen: softcap is not an argument.*sdpa backend instead"):
            gemma2(input_ids=ids, attention_mask=mask)
    assert fake.calls == []
    with patchkit.apply_patch("gemma2", backend="torch_varlen", strict=True):
        with pytest.raises(PatchGateError, match="softcap"):
            gemma2(input_ids=ids, attention_mask=mask)


def test_attention_dropout_in_training_falls_back_per_call(monkeypatch):
    fake = install_torch_varlen_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16, attention_dropout=0.1).train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="torch_varlen"):
        with pytest.warns(RuntimeWarning, match="attention dropout is fixed at 0"):
            model(input_ids=ids, attention_mask=mask)
        assert fake.calls == []
        model.eval()  # no dropout in eval: the kernel serves it
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert len(fake.calls) == model.config.num_hidden_layers
    with patchkit.apply_patch("llama2", backend="torch_varlen", strict=True):
        with pytest.raises(PatchGateError, match="dropout"):
            model.train()(input_ids=ids, attention_mask=mask)


def test_from_torch_2_15_a_call_with_sdpas_flash_off_steps_aside_and_the_rest_reach_the_kernel(monkeypatch):
    """torch 2.15's varlen_attn runs only on the SDPA backends `sdpa_kernel` leaves on ("No viable backend" under
    MATH, where 2.13 ignored it): under such a context patchkit steps aside with the reason, exactly, per call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fake = install_torch_varlen_double(monkeypatch, follows_sdpa_kernel=True)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        truth = clone(model).float()(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), sdpa_kernel(SDPBackend.MATH):
            want = model(input_ids=ids, attention_mask=mask).logits  # what the fallback is: the exact backend
        with patchkit.apply_patch("llama2", backend="torch_varlen") as handle:
            with sdpa_kernel(SDPBackend.MATH):
                with pytest.warns(RuntimeWarning, match=r"SDPA's FlashAttention backend is off here.*sdpa backend"):
                    got = model(input_ids=ids, attention_mask=mask).logits
                assert fake.calls == []
            kernel = model(input_ids=ids, attention_mask=mask).logits  # the context closed: the kernel again
    assert len(fake.calls) == model.config.num_hidden_layers and handle.backend == "torch_varlen"
    real = mask.bool()
    assert torch.equal(got[real], want[real])
    within_bf16_error(kernel, eager, truth, real)
    with patchkit.apply_patch("llama2", backend="torch_varlen", strict=True), sdpa_kernel(SDPBackend.MATH):
        with pytest.raises(PatchGateError, match="SDPA's FlashAttention backend is off"):
            model(input_ids=ids, attention_mask=mask)


def test_which_torch_follows_sdpa_kernel_and_its_real_refusal():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from patchkit.backends.torch_varlen import OBEYS_SDPA_KERNEL, obeys_sdpa_kernel

    assert [obeys_sdpa_kernel(v) for v in ("2.13.0+cpu", "2.14.1+cu130", "2.15.0+cu132", "2.16.0a0+git12")] == [
        False, False, True, True]
    if not OBEYS_SDPA_KERNEL:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn ignores sdpa_kernel (or is not there)")
    from torch.nn.attention import varlen

    q, cu = torch.zeros(4, 2, 8, dtype=torch.bfloat16), torch.tensor([0, 4], dtype=torch.int32)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError, match="No viable backend for varlen_attn"):
        varlen.varlen_attn(q, q, q, cu, cu, 4, 4, window_size=(-1, 0))  # the rule the double keeps, on this torch


def test_the_backend_refuses_what_its_kernel_cannot_honour():
    """Called directly (not through backend_for), softcap or dropout raise: never dropped silently."""
    backend = TorchVarlenBackend(fn=lambda *a, **k: pytest.fail("the kernel must not run"))
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 2, 8, dtype=torch.bfloat16)
    meta = patchkit.forward.masks.build_metadata(None, 1, 4, 4, q.device)
    for extra in (dict(softcap=3.0), dict(dropout_p=0.1)):
        opts = {"dropout_p": 0.0, "softmax_scale": 0.3, "causal": True, **extra}
        with pytest.raises(PatchInputError):
            backend.varlen(q, kv[:, 0], kv[:, 1], meta, **opts)


def test_kernel_window_is_torchs_spelling_of_flash_attns():
    assert kernel_window(True, (-1, -1)) == (-1, 0)
    assert kernel_window(True, (4, -1)) == (4, 0) == kernel_window(True, (4, 3))  # causal forces right = 0
    assert kernel_window(False, (-1, -1)) == (-1, -1)
    assert kernel_window(False, (2, 3)) == (2, 3)


def test_gates_torch_version_cuda_capability_api_and_head_dim(monkeypatch):
    cases = {
        "torch_version": dict(torch_version="2.9.1"),
        "cuda_available": dict(cuda_available=False, device_name=None, compute_capability=None),
        "compute_capability": dict(compute_capability=(7, 5)),
        "torch_varlen_api": dict(torch_varlen_error="varlen_attn(...) is not the signature patchkit calls"),
    }
    for gate, changes in cases.items():
        monkeypatch.setattr(gates, "probe_environment", lambda c=changes: env(**{**vars(NO_FLASH_GPU_ENV), **c}))
        with pytest.raises(PatchGateError, match=rf"(?s)Nothing was patched\.\n.*\n  - torch_varlen: {gate}: FAILED"):
            patchkit.apply_patch("llama2", backend="torch_varlen", strict=True)
        with pytest.warns(RuntimeWarning, match=rf"sdpa backend \(not torch_varlen: {gate}: FAILED"):
            assert patchkit.apply_patch("llama2", backend="torch_varlen").backend == "sdpa"
        patchkit.revert_patch()
    assert gates.torch_version_gate(env(torch_version="2.10.0a0+git1234")).passed  # a 2.10 pre-release has it
    model = tiny_model(hidden=144, heads=4, kv_heads=4, layers=1)  # head_dim 36: not a multiple of 8
    install_torch_varlen_double(monkeypatch)
    with pytest.raises(PatchGateError, match=r"head_dim: FAILED \(required head_dim <= 256 and a multiple of 8"):
        patchkit.apply_patch("llama2", model=model, backend="torch_varlen", strict=True)


def test_the_api_gate_reads_the_installed_signature(monkeypatch):
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason=f"torch {torch.__version__} has no varlen_attn")

    assert gates.probe_torch_varlen(cuda=False) is None  # torch 2.13's varlen_attn, as installed here

    def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("never called")

    monkeypatch.setattr(varlen, "varlen_attn", older)
    assert "is not the signature patchkit calls" in gates.probe_torch_varlen(cuda=False)


def test_strict_auto_takes_torch_varlen_but_strict_flash_attn_refuses(monkeypatch):
    install_torch_varlen_double(monkeypatch)
    with pytest.warns(RuntimeWarning, match="runs on the torch_varlen backend"):
        assert patchkit.apply_patch("llama2", strict=True).backend == "torch_varlen"
    patchkit.revert_patch()
    with pytest.raises(PatchGateError, match="flash_attn: flash_attn_installed: FAILED"):
        patchkit.apply_patch("llama2", backend="flash_attn", strict=True)


def test_auto_prefers_flash_attn_when_both_pass(monkeypatch):
    install_flash_double(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = patchkit.apply_patch("llama2", strict=True)
    assert handle.backend == "flash_attn"
    assert {g.backend for g in handle.gates} == {"", "flash_attn", "torch_varlen"}
