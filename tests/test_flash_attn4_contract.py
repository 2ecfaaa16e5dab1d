"""The flash_attn_4 backend, driven through a recording double of flash-attn 4's `flash_attn.cute` (no GPU here)."""

from __future__ import annotations

import dataclasses
import warnings

import fakes
import pytest
import torch
from flash4_stand_in import RecordingFlash4, install_flash4_double
from models import cache_tensors, clone, padded_batch, step, tiny_model

import patchkit
from patchkit import PatchGateError, gates
from patchkit.backends import choice

H100, B200, A100 = (9, 0), (10, 0), (8, 0)


def test_training_step_through_the_kernel_equals_the_sdpa_backend(monkeypatch):
    """GQA, mixed padding, bf16, on an H100: every layer call reaches flash_attn_varlen_func with patchkit's
    cu_seqlens and host max lengths by keyword, causal, no window, no sink; logits and every gradient equal the sdpa
    backend's (the double computes with the same exact math), with no warning."""
    fake = install_flash4_double(monkeypatch, H100)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("mixed")
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
        want = step(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patchkit.apply_patch("llama2", strict=True) as handle:  # auto: flash_attn_4 first on sm90
            got = step(model, ids, mask)
    assert handle.backend == "flash_attn_4"
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    lengths = [n for n in mask.sum(-1).tolist() if n]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert len(fake.calls) == model.config.num_hidden_layers
    for call in fake.calls:
        assert call["layout"] == "varlen" and call["grad"] and call["dtype"] == torch.bfloat16
        assert call["cu_q"] == call["cu_k"] == torch.tensor([0, *lengths]).cumsum(0).tolist()
        assert call["max_q"] == call["max_k"] == max(lengths)
        assert call["causal"] is True and call["window_size"] == (None, None) and call["softcap"] == 0.0
        assert call["sink"] is None and call["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert call["shapes"] == [(sum(lengths), 4, head_dim), (sum(lengths), 2, head_dim), (sum(lengths), 2, head_dim)]


def test_window_and_softcap_reach_the_kernel_arguments(monkeypatch):
    """Gemma2 (a sliding window on layer 0, softcap 3.0 on both): the window as flash-attn 4's (left, 0), no window
    as (None, None), softcap as is; logits and gradients equal the sdpa backend's."""
    from families import WINDOW, family_model

    fake = install_flash4_double(monkeypatch, H100)
    model = family_model("gemma2", seed=1).to(torch.bfloat16).train()
    ids, mask = padded_batch("right", batch=3, seq=14)
    with patchkit.apply_patch("gemma2", backend="sdpa", strict=True):
        want = step(model, ids, mask)
    with patchkit.apply_patch("gemma2", backend="flash_attn_4", strict=True):
        got = step(model, ids, mask)
    assert [c["window_size"] for c in fake.calls] == [(WINDOW - 1, 0), (None, None)]
    assert all(c["softcap"] == 3.0 and c["causal"] is True for c in fake.calls)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def _gpt_oss():
    from census import tiny_lm

    from patches.table import serves_here

    if not serves_here():
        pytest.skip("the table serves GPT-OSS on transformers 5.x")
    model, why = tiny_lm("gpt_oss")
    if model is None:
        pytest.skip(why)
    return model.to(torch.bfloat16)


def test_gpt_oss_sinks_run_on_the_kernel(monkeypatch):
    """GPT-OSS's attention sinks (`s_aux`) reach the kernel as `learnable_sink` (each layer's own (H,) logits), no
    "sinks run on sdpa" warning; the loss, logits and every gradient (the sinks' own included) equal the sdpa
    backend's exact sink path."""
    fake = install_flash4_double(monkeypatch, H100)
    model = _gpt_oss()
    ids, mask = padded_batch("left", batch=3, seq=14)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
        want = step(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patchkit.apply_patch(model=model, backend="flash_attn_4", strict=True):
            got = step(model, ids, mask)
    layers = [layer.self_attn for layer in model.model.layers]
    assert len(fake.calls) == len(layers)
    for call, attn in zip(fake.calls, layers):
        assert torch.equal(call["sink"], attn.sinks.detach()) and call["grad"]
    assert {c["window_size"] for c in fake.calls} <= {(None, None), (model.config.sliding_window - 1, 0)}
    assert torch.equal(got[0][mask.bool()], want[0][mask.bool()])
    sink_grads = [n for n in want[1] if n.endswith("sinks")]
    assert sink_grads and all(got[1][n].abs().sum() > 0 for n in sink_grads)
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def test_ampere_has_no_backward_training_falls_back_with_one_warning_or_is_refused(monkeypatch):
    """flash-attn 4 (4.0.0b36) runs its forward on sm80 but has no backward there: inference runs on the kernel, a
    training step's layers run on the exact sdpa backend with one warning naming the cause and the fix (train with
    flash-attn 2), and strict mode refuses."""
    fake = install_flash4_double(monkeypatch, A100)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
        want = step(model, ids, mask)
    with patchkit.apply_patch("llama2", backend="flash_attn_4"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert len(fake.calls) == 2 and not any(c["grad"] for c in fake.calls)
        with pytest.warns(RuntimeWarning, match=r"no backward on sm80.*backend='flash_attn'") as record:
            got = step(model, ids, mask)
            step(model, ids, mask)
    assert sum("no backward" in str(w.message) for w in record) == 1 and len(fake.calls) == 2
    assert torch.equal(got[0], want[0])
    with patchkit.apply_patch("llama2", backend="flash_attn_4", strict=True):
        with pytest.raises(PatchGateError, match="no backward on sm80"):
            step(model, ids, mask)


@pytest.mark.parametrize("capability,head_dim,refused", [(B200, 160, "head_dim 160 is not supported on sm100"),
                                                         (H100, 160, None)])
def test_head_dims_by_architecture(capability, head_dim, refused):
    """sm100 runs head dims 8-128 and 256, sm90 8-256 (multiples of 8): what the GPU lacks is named per call."""
    from patchkit.backends.flash_attn_4 import FlashAttn4Backend

    backend = FlashAttn4Backend(RecordingFlash4(capability), capability)
    missing = backend.missing_feature((-1, -1), 0.0, 0.0, head_dim)
    assert (missing is None) if refused is None else refused in missing
    assert "head_dim 12 is not a multiple of 8" in backend.missing_feature((-1, -1), 0.0, 0.0, 12)
    sinks_bwd = FlashAttn4Backend(RecordingFlash4((12, 0)), (12, 0)).missing_feature((-1, -1), 0, 0, 64, True, True)
    assert "no backward for learnable sinks on sm120" in sinks_bwd


def test_dropout_is_refused_by_name(monkeypatch):
    """flash-attn 4 has no attention dropout: those layers run on sdpa with one warning, or strict refuses."""
    install_flash4_double(monkeypatch, H100)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16, attention_dropout=0.1).train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="flash_attn_4"):
        with pytest.warns(RuntimeWarning, match="attention dropout is not an argument of flash-attn-4"):
            model(input_ids=ids, attention_mask=mask)
    with patchkit.apply_patch("llama2", backend="flash_attn_4", strict=True):
        with pytest.raises(PatchGateError, match="attention dropout"):
            model(input_ids=ids, attention_mask=mask)


def test_decode_steps_on_the_padded_cache(monkeypatch):
    """generate(): the prefill runs the varlen kernel; an unpadded batch's decode steps run the kernel in its batch
    layout on the cache in place (no copy); a left-padded batch's run the exact SDPA on the cache in place (flash-attn
    4 has no cache_leftpad). The tokens equal the sdpa backend's."""
    fake = install_flash4_double(monkeypatch, H100)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    for attention_mask in (torch.ones_like(mask), mask):
        with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
            want = model.generate(input_ids=ids, attention_mask=attention_mask, **kw)
        fake.calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with patchkit.apply_patch("llama2", strict=True):
                out = model.generate(input_ids=ids, attention_mask=attention_mask, return_dict_in_generate=True,
                                     **kw)
        assert torch.equal(out.sequences, want)
        layers = model.config.num_hidden_layers
        assert [c["layout"] for c in fake.calls[:layers]] == ["varlen"] * layers
        decode = fake.calls[layers:]
        if attention_mask is mask:
            assert decode == []
            continue
        assert [c["layout"] for c in decode] == ["batch"] * 2 * layers
        assert decode[0]["shapes"][:2] == [(3, 1, 4, 16), (3, 17, 2, 16)] and decode[0]["causal"] is True
        assert [c["storage"] for c in decode[-layers:]] == [
            (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
            for k, v in cache_tensors(out.past_key_values)]


def test_auto_prefers_flash_attn_4_on_hopper_and_blackwell_only_where_installed():
    """backend="auto": flash_attn_4 first on sm90/sm100 when installed, after flash-attn 2 and torch_varlen on Ampere
    and sm120, and not a candidate (no warning about it) where it is not installed."""
    h100 = fakes.env(compute_capability=H100, flash_attn_4_version="4.0.0b36")
    assert choice.pick("auto", h100, "2.1", "cache").backend == "flash_attn_4"
    assert choice.pick("auto", dataclasses.replace(h100, compute_capability=B200), "2.1", "cache").backend == \
        "flash_attn_4"
    assert choice.candidates("auto", dataclasses.replace(h100, compute_capability=A100))[-1] == "flash_attn_4"
    assert choice.pick("auto", dataclasses.replace(h100, compute_capability=A100), "2.1", "cache").backend == \
        "flash_attn"
    plain = choice.pick("auto", fakes.env(compute_capability=H100), "2.1", "cache")
    assert plain.backend == "flash_attn" and plain.passed_over == []
    broken = dataclasses.replace(h100, flash_attn_4_error="import flash_attn.cute failed: ImportError: cutlass")
    picked = choice.pick("auto", broken, "2.1", "cache")
    assert picked.backend == "flash_attn" and [g.name for g in picked.passed_over] == ["flash_attn_4_installed"]
    assert "not flash_attn_4: flash_attn_4_installed: FAILED" in choice.fallback_message("patch 'llama2'", picked)


def test_named_backend_refusals_name_the_cause(monkeypatch):
    """backend="flash_attn_4" where it cannot run: strict names the failed gate and its fix; otherwise the exact
    sdpa backend with one warning."""
    monkeypatch.setattr(gates, "probe_environment", lambda: fakes.env(compute_capability=(7, 5)))
    with pytest.raises(PatchGateError) as err:
        patchkit.apply_patch("llama2", backend="flash_attn_4", strict=True)
    text = str(err.value)
    assert "flash_attn_4_installed: FAILED" in text and "pip install flash-attn-4" in text
    assert "compute_capability: FAILED" in text and "found 7.5" in text
    with pytest.warns(RuntimeWarning, match="not flash_attn_4: flash_attn_4_installed: FAILED"):
        with patchkit.apply_patch("llama2", backend="flash_attn_4") as handle:
            pass
    assert handle.backend == "sdpa"


def test_probe_finds_flash_attn_4_by_its_distribution(monkeypatch):
    """flash-attn 2 ships a flash_attn/cute folder too: only the flash-attn-4 distribution counts; a flash_attn.cute
    whose varlen function lacks an argument patchkit passes is named."""
    import importlib.metadata

    def version(name):
        if name == "flash-attn-4":
            return "4.0.0b36"
        raise importlib.metadata.PackageNotFoundError(name)

    assert gates.probe_flash_attn_4(False)[0] in (None, importlib.metadata.version("flash-attn-4")
                                                  if _installed() else None)
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert gates.probe_flash_attn_4(False) == ("4.0.0b36", None)
    fake = RecordingFlash4()
    monkeypatch.setitem(__import__("sys").modules, "flash_attn.cute", fake)
    assert gates.probe_flash_attn_4(True) == ("4.0.0b36", None)

    def old(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
            causal=False, window_size=(None, None), softcap=0.0):
        raise AssertionError("never called")

    monkeypatch.setattr(fake, "flash_attn_varlen_func", old)
    assert gates.probe_flash_attn_4(True)[1] == "flash_attn.cute.flash_attn_varlen_func lacks learnable_sink"


def _installed() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _installed(), reason="needs CUDA and flash-attn-4")
def test_gpu_stand_in_has_the_installed_signature_and_matches_fp32():
    """On a GPU with flash-attn-4 (its distribution: flash-attn 2's own flash_attn/cute folder is not it): the
    stand-in's signature is the installed one's, and a padded bf16 step on the flash_attn_4 backend is within 2x
    bf16 eager's own error against fp32."""
    import importlib
    import inspect

    cute = importlib.import_module("flash_attn.cute")
    assert list(inspect.signature(cute.flash_attn_varlen_func).parameters) == \
        list(inspect.signature(RecordingFlash4.flash_attn_varlen_func).parameters)[1:]
    model = tiny_model(hidden=512, heads=4, kv_heads=2).cuda()
    ids, mask = (t.cuda() for t in padded_batch("mixed"))
    with torch.no_grad():
        truth = model(input_ids=ids, attention_mask=mask).logits
        model16 = clone(model).to(torch.bfloat16)
        eager = model16(input_ids=ids, attention_mask=mask).logits.float()
        with patchkit.apply_patch("llama2", backend="flash_attn_4", strict=True):
            ours = model16(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (ours - truth)[real].abs().max() <= 2 * (eager - truth)[real].abs().max() + 1e-3
