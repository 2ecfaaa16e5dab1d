"""The flash_attn backend, driven through a recording double of the flash_attn package."""

from __future__ import annotations

import warnings

import pytest
import torch
from fakes import install_flash_double
from families import served_tiny
from models import CACHE, cache_tensors, clone, decode_logits, needs_mask_interface, padded_batch, tiny_model

import patchkit
from patchkit import PatchGateError
from patchkit.hooks.install.model_walk import head_dim


@pytest.mark.parametrize("patch,kv_heads", [("llama2", 2), ("llama1", 4)])
def test_every_call_matches_the_kernel_contract(monkeypatch, patch, kv_heads):
    fake = install_flash_double(monkeypatch)
    model = tiny_model(kv_heads=kv_heads, dtype=torch.bfloat16)
    ids, mask = padded_batch("mixed")
    lengths = mask.sum(-1)
    ref32 = clone(model).float()
    with torch.no_grad():
        truth = ref32(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits.float()
        with patchkit.apply_patch(patch, strict=True) as handle:
            ours = model(input_ids=ids, attention_mask=mask).logits.float()
    assert handle.backend == "flash_attn"
    assert len(fake.calls) == model.config.num_hidden_layers
    nonzero = [n for n in lengths.tolist() if n]
    expected_cu = torch.tensor([0, *nonzero]).cumsum(0).tolist()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    total = sum(nonzero)
    for call in fake.calls:
        assert call["name"] == "varlen"
        assert call["dtype"] == torch.bfloat16
        assert call["cu_q"] == call["cu_k"] == expected_cu
        assert call["max_q"] == call["max_k"] == max(nonzero)
        assert call["causal"] is True and call["dropout_p"] == 0.0
        assert call["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert call["shapes"] == [(total, 4, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim)]
    real = mask.bool()
    assert (ours - truth)[real].abs().max() <= 2 * (eager - truth)[real].abs().max() + 1e-3


def test_decode_calls_use_cache_lengths(monkeypatch):
    """A decode step runs flash_attn_with_kvcache on the cache itself, row keys [cache_leftpad, cache_seqlens)."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("left", batch=3, seq=16)
    with patchkit.apply_patch("llama2", strict=True):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    decode = [c for c in fake.calls if c["name"] == "kvcache"]
    assert len(decode) == 2 * model.config.num_hidden_layers  # every step after the prefill
    assert all(c["name"] == "varlen" for c in fake.calls[: model.config.num_hidden_layers])  # prefill: varlen
    real = mask.sum(-1).tolist()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    first = decode[0]
    assert first["shapes"] == [(3, 1, 4, head_dim), (3, 17, 2, head_dim)]
    assert first["cache_seqlens"] == [17, 17, 17]
    assert first["cache_leftpad"] == [16 - n for n in real]
    assert first["causal"] is True and first["softmax_scale"] == pytest.approx(head_dim**-0.5)
    # the last step read the cache where it lies: no copy, no gather
    assert [c["storage"] for c in decode[-2:]] == [
        (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()) for k, v in cache_tensors(out.past_key_values)
    ]


def test_decode_per_step_logits_match_the_kernel_rule(monkeypatch):
    """Teacher-forced decode steps: the kvcache path's error against fp32 is within 2x bf16 eager's own."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16, seed=8)
    ids, mask = padded_batch("left", batch=4, seq=16)
    feed = torch.randint(3, 90, (4, 6), generator=torch.Generator().manual_seed(2))
    truth, _ = decode_logits(clone(model).float(), ids, mask, 6, feed)
    eager, _ = decode_logits(model, ids, mask, 6, feed)
    with patchkit.apply_patch("llama2", strict=True):
        ours, _ = decode_logits(model, ids, mask, 6, feed)
    assert sum(c["name"] == "kvcache" for c in fake.calls) == 6 * model.config.num_hidden_layers
    assert (ours.float() - truth).abs().max() <= 2 * (eager.float() - truth).abs().max() + 1e-3


def test_decode_on_a_flash_attn_without_cache_leftpad_gathers_with_one_warning_or_refuses(monkeypatch):
    """cache_leftpad came in flash-attn 2.6.1: before it a left-padded decode step gathers the cache (the varlen
    kernel, with the cache lengths), once warned, strict too (same kernel, exact: no fallback to refuse); an
    unpadded batch needs no leftpad (2.2)."""
    fake = install_flash_double(monkeypatch)
    fake.__version__ = "2.6.0"
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with patchkit.apply_patch("llama2"):
        with pytest.warns(RuntimeWarning, match=r"cache_leftpad needs flash-attn>=2.6.1 \(found 2.6.0\)") as record:
            model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert sum("cache_leftpad" in str(w.message) for w in record) == 1
    decode = [c for c in fake.calls if c["shapes"][0][0] == 3]  # one query token per row
    assert decode and all(c["name"] == "varlen" for c in decode)
    real = mask.sum(-1).tolist()
    assert decode[0]["cu_q"] == [0, 1, 2, 3]
    assert decode[0]["cu_k"] == torch.tensor([0, *[n + 1 for n in real]]).cumsum(0).tolist()
    assert decode[0]["max_q"] == 1 and decode[0]["max_k"] == max(real) + 1
    with patchkit.apply_patch("llama2"):
        want = model.generate(input_ids=ids, attention_mask=mask, **kw)
    with patchkit.apply_patch("llama2", strict=True):
        with pytest.warns(RuntimeWarning, match=r"cache_leftpad needs flash-attn>=2.6.1"):
            got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        assert torch.equal(got, want)
        fake.calls.clear()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(mask), **kw)  # no padding: no leftpad
    decode = [c for c in fake.calls if c["name"] == "kvcache"]
    assert len(decode) == 2 * model.config.num_hidden_layers and decode[0]["cache_leftpad"] is None


def test_decode_layouts_the_kernel_cannot_express_take_the_varlen_kernel(monkeypatch):
    """A right-padded prompt leaves a hole before the new tokens, and a step that needs gradients has no kvcache
    backward: both run the varlen kernel (exact), silently, since nothing is missing from the install."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model(kv_heads=2, dtype=torch.bfloat16)
    ids, mask = padded_batch("right", batch=3, seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad(), patchkit.apply_patch("llama2", strict=True):
            decode_logits(model, ids, mask, 2)
        assert [c["name"] for c in fake.calls] == ["varlen"] * 3 * model.config.num_hidden_layers
        fake.calls.clear()
        left, lmask = padded_batch("left", batch=3, seq=16)
        with patchkit.apply_patch("llama2", strict=True):
            out = model(input_ids=left, attention_mask=lmask, use_cache=True)
            nxt = torch.cat([lmask, torch.ones_like(lmask[:, :1])], 1)
            step = model(input_ids=left[:, :1], attention_mask=nxt, **{CACHE: out.past_key_values})
            step.logits.sum().backward()  # grad enabled, eval mode: the cache path declines
    assert [c["name"] for c in fake.calls] == ["varlen"] * 2 * model.config.num_hidden_layers


@needs_mask_interface
def test_decode_windows_and_softcap_reach_the_kvcache_kernel(monkeypatch):
    """Gemma2 (window on layer 0, softcap everywhere), left-padded, across the window."""
    from families import WINDOW, family_model

    fake = install_flash_double(monkeypatch)
    model = family_model("gemma2", seed=1).to(torch.bfloat16)
    ids, mask = padded_batch("left", batch=3, seq=14)
    feed = torch.randint(3, 90, (3, 2 * WINDOW), generator=torch.Generator().manual_seed(4))
    truth, _ = decode_logits(clone(model).float(), ids, mask, 2 * WINDOW, feed)
    eager, _ = decode_logits(model, ids, mask, 2 * WINDOW, feed)
    with patchkit.apply_patch("gemma2", strict=True):
        ours, _ = decode_logits(model, ids, mask, 2 * WINDOW, feed)
    decode = [c for c in fake.calls if c["name"] == "kvcache"]
    assert len(decode) == 2 * 2 * WINDOW
    assert [c.get("window_size") for c in decode[:2]] == [(WINDOW - 1, 0), None]
    assert all(c["softcap"] == 3.0 for c in decode)
    assert (ours.float() - truth).abs().max() <= 2 * (eager.float() - truth).abs().max() + 1e-3


def test_an_fp32_model_runs_exact_with_one_warning_or_is_refused_when_strict(monkeypatch):
    """fp32 weights, no autocast: casting q/k/v to bf16 for the kernel gave other numbers than unpatched (5.7e-4 in
    the logits) under a config that names bf16 too; they run on the exact sdpa backend, with one warning naming the
    fix, as unpatched computes them."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model()  # fp32 weights: q/k/v arrive in fp32
    model.config.torch_dtype = torch.bfloat16  # the checkpoint's dtype, not the compute's
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2"):
            with pytest.warns(RuntimeWarning, match="no autocast and no half weights.*exact sdpa") as record:
                got = model(input_ids=ids, attention_mask=mask).logits
                model(input_ids=ids, attention_mask=mask)
    assert sum("exact sdpa" in str(w.message) for w in record) == 1
    assert got.dtype == torch.float32 and not fake.calls
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    with patchkit.apply_patch("llama2", strict=True):
        with pytest.raises(PatchGateError, match="dtype: FAILED.*float32"):
            model(input_ids=ids, attention_mask=mask)


def test_autocast_dtype_is_the_compute_dtype(monkeypatch):
    fake = install_flash_double(monkeypatch)
    model = tiny_model()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2"), torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids, attention_mask=mask)
    assert fake.calls and all(c["dtype"] == torch.float16 for c in fake.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("patch", ["llama1", "llama2"])
def test_gpu_flash_attn_matches_eager_bf16(patch):
    pytest.importorskip("flash_attn")
    model = tiny_model(hidden=512, heads=4, kv_heads=4).cuda()  # head_dim 128: every trimmed build here keeps it
    ids, mask = (t.cuda() for t in padded_batch("mixed"))
    with torch.no_grad():
        truth = model(input_ids=ids, attention_mask=mask).logits
        model16 = clone(model).to(torch.bfloat16)
        eager = model16(input_ids=ids, attention_mask=mask).logits.float()
        with patchkit.apply_patch(patch, backend="flash_attn", strict=True):
            ours = model16(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (ours - truth)[real].abs().max() <= 2 * (eager - truth)[real].abs().max() + 1e-3


@needs_mask_interface
def test_windows_and_softcap_reach_the_kernel_or_fall_back_by_version(monkeypatch):
    """Gemma2 (window on layer 0, softcap everywhere): flash-attn >= 2.6 gets both; 2.2 has neither: sdpa + warning."""
    from families import WINDOW, family_model

    fake = install_flash_double(monkeypatch)
    model = family_model("gemma2").to(torch.bfloat16)
    ids, mask = padded_batch("right")
    truth_model = clone(model).float()
    with torch.no_grad():
        truth = truth_model(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits.float()
        with patchkit.apply_patch("gemma2", strict=True):
            ours = model(input_ids=ids, attention_mask=mask).logits.float()
    assert [c.get("window_size") for c in fake.calls] == [(WINDOW - 1, 0), None]
    assert [c.get("softcap") for c in fake.calls] == [3.0, 3.0]
    real = mask.bool()
    assert (ours - truth)[real].abs().max() <= 2 * (eager - truth)[real].abs().max() + 1e-3
    fake.calls.clear()
    fake.__version__ = "2.2.0"
    with torch.no_grad(), patchkit.apply_patch("gemma2"):
        with pytest.warns(RuntimeWarning, match=r"window_size needs flash-attn>=2.3.*sdpa backend instead"):
            model(input_ids=ids, attention_mask=mask)
    assert fake.calls == []
    with patchkit.apply_patch("gemma2", strict=True):
        with pytest.raises(PatchGateError, match="window_size needs flash-attn>=2.3"):
            model(input_ids=ids, attention_mask=mask)


def half_projections(model, dtype):
    """q/k/v_proj weights in `dtype`, their outputs cast back to fp32: fp32 q/k/v beside half projection weights."""
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.to(dtype)
            proj.register_forward_pre_hook(patchkit.shape_free(lambda m, args: (args[0].to(m.weight.dtype),)))
            proj.register_forward_hook(patchkit.shape_free(lambda m, args, out: out.float()))
    return model


@pytest.mark.parametrize("source", ["pre-quantization", "weights"])
def test_fp32_inputs_are_cast_to_the_pre_quantization_else_the_weight_dtype(monkeypatch, source):
    """Without autocast, fp32 q/k/v go to config._pre_quantization_dtype, else q_proj's dtype, not bf16 blindly."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model()
    if source == "pre-quantization":
        model.config._pre_quantization_dtype = torch.float16
    else:
        half_projections(model, torch.float16)
    ids, mask = padded_batch("right")
    with torch.no_grad(), patchkit.apply_patch("llama2"):
        with pytest.warns(RuntimeWarning, match=r"q/k/v are torch.float32.*casting to torch.float16"):
            got = model(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.float32
    assert len(fake.calls) == model.config.num_hidden_layers
    assert all(c["dtype"] == torch.float16 for c in fake.calls)


@pytest.mark.parametrize("patch", ["llama2", "llama1"])
def test_attention_dropout_reaches_the_kernel_in_training_only(monkeypatch, patch):
    """On a full flash_attn build, config.attention_dropout is every training call's dropout_p, and 0.0 in eval."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model(dtype=torch.bfloat16, attention_dropout=0.1).train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch(patch, strict=True):
        model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
        assert [c["dropout_p"] for c in fake.calls] == [0.1] * model.config.num_hidden_layers
        fake.calls.clear()
        with torch.no_grad():
            model.eval()(input_ids=ids, attention_mask=mask, use_cache=False)
    assert [c["dropout_p"] for c in fake.calls] == [0.0] * model.config.num_hidden_layers


@pytest.mark.parametrize("patch", ["llama2", "llama1"])
def test_an_all_padding_batch_calls_no_kernel_and_gives_zeros_and_zero_gradient(monkeypatch, patch):
    """nnz == 0 on a kernel backend: no total_q=0 call reaches flash-attn, attention is 0, backward runs, grad 0."""
    fake = install_flash_double(monkeypatch)
    model = tiny_model(dtype=torch.bfloat16).train()
    ids, mask = padded_batch("right", batch=2, seq=16)
    mask = torch.zeros_like(mask)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    attn_out = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(patchkit.shape_free(lambda m, args, out: attn_out.append(out[0])))
    with patchkit.apply_patch(patch, strict=True):
        logits = model(inputs_embeds=embeds, attention_mask=mask, use_cache=False).logits
        (logits.float() * mask[..., None]).sum().backward()  # a loss over real tokens: here none
    assert fake.calls == []
    assert len(attn_out) == model.config.num_hidden_layers and all(not o.any() for o in attn_out)
    assert logits.isfinite().all()
    assert embeds.grad is not None and torch.equal(embeds.grad, torch.zeros_like(embeds))


def test_multi_head_latent_attention_reaches_the_kernel_in_one_head_size(monkeypatch):
    """DeepSeek-V3's attention has no `head_dim` (queries and keys 12 wide here, values 8): the kernel backends
    raised AttributeError at its first call. Its calls take one head size, the values zero-padded (flash-attn 2
    takes no narrower values), with bf16 numbers as close to fp32 as transformers' own."""
    fake = install_flash_double(monkeypatch)
    model = served_tiny("deepseek_v3")
    config = model.config
    width = config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.v_head_dim < width
    assert head_dim(model) == width  # the apply-time gate's size too (config.head_dim is the rotary part alone)
    truth, model = clone(model).float().eval(), model.to(torch.bfloat16).eval()
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    ids = ids.clamp(max=config.vocab_size - 1)
    with torch.no_grad():
        want = truth(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits.float()
        tokens = model.generate(input_ids=ids[:, 4:], attention_mask=torch.ones_like(ids[:, 4:]), max_new_tokens=3,
                                do_sample=False, pad_token_id=0)
        with patchkit.apply_patch(model=model, strict=True) as handle:
            ours = model(input_ids=ids, attention_mask=mask).logits.float()
            got_tokens = model.generate(input_ids=ids[:, 4:], attention_mask=torch.ones_like(ids[:, 4:]),
                                        max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert handle.backend == "flash_attn" and fake.calls
    assert all(shape[-1] == width for call in fake.calls for shape in call["shapes"])
    real = mask.bool()
    assert (ours - want)[real].abs().max() <= 2 * (eager - want)[real].abs().max() + 1e-3
    assert torch.equal(got_tokens, tokens)


def test_per_layer_head_sizes_are_gated_layer_by_layer(monkeypatch):
    """Gemma 4's config holds head_dim per layer (512, 8, 512 here) and refuses a global read: an instance patch on
    a kernel backend raised transformers' AmbiguousGlobalPerLayerAttributeError before patching anything. Now each
    layer's calls are gated by their own size: the 8-wide layer on the kernel, the 512-wide ones on the exact
    backend with one warning naming head_dim; strict refuses them by name."""
    fake = install_flash_double(monkeypatch)
    model = served_tiny("gemma4_text")
    truth, model = clone(model).float(), model.to(torch.bfloat16)
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    with torch.no_grad():
        want = truth(input_ids=ids, attention_mask=mask).logits
        eager = model(input_ids=ids, attention_mask=mask).logits.float()
        with pytest.warns(RuntimeWarning, match=r"head_dim: FAILED .*found 512"):
            with patchkit.apply_patch(model=model) as handle:
                ours = model(input_ids=ids, attention_mask=mask).logits.float()
        assert handle.backend == "flash_attn"
        assert fake.calls and {shape[-1] for call in fake.calls for shape in call["shapes"]} == {8}
        with patchkit.apply_patch(model=model, strict=True):
            with pytest.raises(PatchGateError, match="head_dim"):
                model(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    assert (ours - want)[real].abs().max() <= 2 * (eager - want)[real].abs().max() + 1e-3
