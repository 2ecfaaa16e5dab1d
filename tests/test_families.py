"""Every family patchkit serves, with its special feature biting, equals its own unpatched eager model."""

from __future__ import annotations

import copy

import pytest
import torch
from families import ATOL, FAMILIES, MOE, WINDOW, WINDOWED, any_model, family_model, packed_positions, set_attention
from models import VOCAB, assert_same, labels_for, needs_mask_interface, padded_batch, step

import patchkit
from patchkit import PatchTargetError
from patchkit.hooks.name import attention_interface

pytestmark = needs_mask_interface



@pytest.mark.parametrize("padding", ["right", "left", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_matches_eager(family, padding):
    model = family_model(family).train()
    ids, mask = padded_batch(padding)
    want = step(model, ids, mask)
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got = step(model, ids, mask)
        assert handle.check(model) == 2 and handle.layers_patched == 2
    assert_same(got, want, mask, atol=ATOL)


@pytest.mark.parametrize("padding", ["right", "left", "mixed"])
@pytest.mark.parametrize("family", sorted(MOE))
def test_a_mixture_of_experts_load_balancing_loss_and_router_logits_match_eager(family, padding):
    """With `output_router_logits` the loss adds each layer's load-balancing term, computed from router logits of
    shape (B * S, experts) against the 2D mask. The packed forward routes only real tokens, (nnz, experts): they come
    back repadded, zeros at padding, which the loss masks out (before, the aux loss raised a shape mismatch)."""
    model = family_model(family).train()
    ids, mask = padded_batch(padding)
    outputs = []

    def run() -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask),
                    output_router_logits=True)
        out.loss.backward()
        outputs.append(out)
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run()
    with patchkit.apply_patch(family, backend="sdpa", strict=True) as handle:
        got = run()
        assert handle.calls == 2 and not handle.stepped_aside
    assert_same(got, want, mask, atol=ATOL)
    plain, patched = outputs
    torch.testing.assert_close(patched.aux_loss, plain.aux_loss, atol=1e-6, rtol=1e-5)
    if getattr(plain, "router_logits", None) is None:  # Qwen3-VL-MoE's output has no such field in 5.0 and 5.1
        return
    real = mask.flatten().bool()
    assert len(patched.router_logits) == len(plain.router_logits) > 0  # a layer each (GLM-4.5V's first is dense)
    for ours, theirs in zip(patched.router_logits, plain.router_logits):
        assert ours.shape == theirs.shape == (mask.numel(), 4)
        torch.testing.assert_close(ours[real], theirs[real], atol=ATOL, rtol=1e-4)
        assert not ours[~real].any()  # padding never reached the router


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_greedy_generation_crossing_the_window_matches_eager(family):
    model = family_model(family, seed=1)
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=3 * WINDOW, do_sample=False, pad_token_id=0)
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got = model.generate(input_ids=ids, **kw)
        assert handle.calls == 2 * 3 * WINDOW  # prefill and 14 decode steps, 2 layers each
    assert torch.equal(got, want)


@pytest.mark.parametrize("unpad", ["model", "attention"])
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_generate_on_either_padding_in_either_unpad_mode_equals_unpatched(family, padding, unpad):
    """generate() of every family on a left- and a right-padded batch, unpadding at the model or in each attention
    layer: the same tokens as unpatched (on transformers 5.24, before patchkit read its cache under the new name,
    the left-padded one crashed and the right-padded one under unpad='attention' gave other tokens silently). A
    right-padded prefill is said and counted (its short rows' next tokens are read at padding)."""
    model = any_model(family)
    ids, mask = padded_batch(padding, batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch("llama2" if family == "llama" else family, backend="sdpa", unpad=unpad) as handle:
        if padding == "right":
            with pytest.warns(RuntimeWarning, match="right-padded prompt"):
                got = model.generate(input_ids=ids, **kw)
            assert handle.stepped_aside["right_padded_generation"] == 1
        else:
            got = model.generate(input_ids=ids, **kw)
            assert handle.stepped_aside == {} and handle.calls == 2 * 4
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_documents_run_separately(family):
    model = family_model(family, seed=2)
    g = torch.Generator().manual_seed(3)
    lengths = [9, 4, 7]
    docs = [torch.randint(3, VOCAB, (1, n), generator=g) for n in lengths]
    with torch.no_grad():
        want = torch.cat([model(input_ids=d).logits for d in docs], 1)
        packed = torch.cat(docs, 1)
        positions = packed_positions(family, torch.cat([torch.arange(n) for n in lengths])[None])
        with patchkit.apply_patch(family, backend="sdpa"):
            got = model(input_ids=packed, position_ids=positions).logits
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_registered_name_and_instance_patch_match_eager(family):
    model = family_model(family, seed=4)
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    named = copy.deepcopy(model)
    set_attention(named, patchkit.ATTENTION_NAME)
    patchkit.register_attention(backend="sdpa")
    try:
        with torch.no_grad():
            by_name = named(input_ids=ids, attention_mask=mask).logits
    finally:
        patchkit.register_attention(backend="auto")
    handle = patchkit.apply_patch(model=model, backend="sdpa")  # the family picked by model_type
    assert handle.name == family and handle.check(model) == 2
    with torch.no_grad():
        by_instance = model(input_ids=ids, attention_mask=mask).logits
    handle.revert()
    real = mask.bool()
    torch.testing.assert_close(by_name[real], want[real], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(by_instance[real], want[real], atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("use_cache", [None, False])
def test_a_padding_hole_under_a_sliding_window_steps_aside_unless_the_window_cannot_bite(use_cache):
    """transformers counts padding columns inside the window, varlen kernels real tokens: a window shorter than the
    mask steps aside (exact); one as long as the mask changes nothing and runs patched (per layer: a packed row's
    length is no padded row's)."""
    model = family_model("mistral")
    ids, mask = padded_batch("right")
    mask[0, 3:6] = 0  # padding between real tokens
    for window, aside in ((WINDOW, 1), (24, 0)):
        model.config.sliding_window = window
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, use_cache=use_cache).logits
            with patchkit.apply_patch("mistral", backend="sdpa") as handle:
                got = model(input_ids=ids, attention_mask=mask, use_cache=use_cache).logits
                assert handle.stepped_aside.get("window_over_padding_hole", 0) == aside
                assert handle.calls == 2 * (1 - aside)
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)


def test_families_do_not_patch_each_other_and_unknown_types_are_refused():
    llama_handle = patchkit.apply_patch("llama2", backend="sdpa")
    mistral_handle = patchkit.apply_patch("mistral", backend="sdpa")  # different classes: both can be active
    assert {h.name for h in patchkit.active_patches()} == {"llama2", "mistral"}
    model = family_model("qwen2")
    with pytest.raises(PatchTargetError, match="has no MistralAttention layers: patch 'mistral' serves"):
        mistral_handle.check(model)
    llama_handle.revert()
    mistral_handle.revert()
    bert = torch.nn.Module()
    bert.config = type("C", (), {"model_type": "bert", "num_attention_heads": 2})()
    with pytest.raises(PatchTargetError, match="no patch for model_type 'bert'.*mistral"):
        patchkit.apply_patch(model=bert, backend="sdpa")


@pytest.mark.parametrize("family", ["llama"] + FAMILIES)
def test_values_at_padding_under_the_registered_name_alone_step_aside_exactly(family):
    """Under attn_implementation="patchkit" alone no patch wraps the model's forward, so its mask function reads the
    causal LM's call instead: labels at padding (`labels = input_ids`), generate()'s right-padded prefill and a
    window over the padding hole its decode steps leave all need values varlen kernels never compute. Those forwards
    step aside (counted), with eager's loss, gradients, tokens and scores; they silently differed before (a 2e-2
    loss gap, other greedy tokens in 7 of 13 families)."""
    model = any_model(family).train()
    named = set_attention(copy.deepcopy(model), patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("right", batch=3, seq=14)
    patchkit.register_attention(backend="sdpa")
    try:
        state = attention_interface.route_state()
        want = step(model, ids, mask, labels=ids)
        got = step(named, ids, mask, labels=ids)
        assert state.stepped_aside == {"labels_from_padding": 2} and state.calls == 0
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
        want_gen, got_gen = model.eval().generate(ids, **kw), named.eval().generate(ids, **kw)
        windowed = family in WINDOWED
        assert state.stepped_aside["right_padded_generation"] == 2  # the prefill's 2 layers
        assert state.stepped_aside.get("window_over_padding_hole", 0) == (10 if windowed else 0)
        assert state.calls == (0 if windowed else 10)  # 5 decode steps with no window, 2 layers each
    finally:
        patchkit.register_attention(backend="auto")
    assert_same(got, want, mask, atol=ATOL)
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=1e-4)  # padding positions too: the loss reads them
    assert torch.equal(got_gen.sequences, want_gen.sequences)
    torch.testing.assert_close(torch.stack(got_gen.scores), torch.stack(want_gen.scores), atol=ATOL, rtol=1e-4)
