"""Patched vs unpatched eager LLaMA: logits and gradients on padded batches, MHA and GQA, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
import transformers
from families import served_tiny
from models import clone, labels_for, padded_batch, tiny_model
from packaging.version import Version

import patchkit
from patchkit.forward.masks import VarlenMask


def run(model, ids, mask, train: bool = True):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask) if train else None)
    if train:
        out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("patch,kv_heads", [("llama2", 4), ("llama2", 2), ("llama2", 1), ("llama1", 4)])
@pytest.mark.parametrize("kind", ["right", "left", "mixed"])
def test_fp32_logits_and_grads_match_eager(patch, kv_heads, kind):
    ref = tiny_model(kv_heads=kv_heads)
    ids, mask = padded_batch(kind)
    want_logits, want_grads = run(ref, ids, mask)
    with patchkit.apply_patch(patch, backend="sdpa") as handle:
        got_logits, got_grads = run(ref, ids, mask)
        assert handle.layers_patched == ref.config.num_hidden_layers
    real = mask.bool()
    torch.testing.assert_close(got_logits[real], want_logits[real], atol=2e-5, rtol=1e-4)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=2e-5, rtol=1e-3, msg=name)


def test_all_padding_row_is_zero_not_nan():
    model = tiny_model()
    ids, mask = padded_batch("mixed")
    with patchkit.apply_patch("llama2", backend="sdpa"):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits, grads = run(model, ids, mask)
    assert torch.isfinite(hidden).all() and torch.isfinite(logits).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    # The all-padding row attends to nothing: its attention output is zero, so its hidden state is a
    # function of its own embeddings only, exactly as if attention were removed for it.
    layer = model.model.layers[0]
    with patchkit.apply_patch("llama2", backend="sdpa"):
        attn_out, _ = layer.self_attn(
            layer.input_layernorm(model.model.embed_tokens(ids)),
            position_embeddings=model.model.rotary_emb(model.model.embed_tokens(ids), torch.arange(24)[None]),
            attention_mask=VarlenMask.for_forward(mask),  # what the patched model hands its layers
        )
    assert attn_out[-1].abs().max() == 0


def test_all_padding_batch_does_not_crash():
    model = tiny_model()
    ids = torch.randint(3, 90, (2, 8))
    mask = torch.zeros(2, 8, dtype=torch.long)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    assert handle.calls == model.config.num_hidden_layers


@pytest.mark.parametrize("patch", ["llama2", "llama1", "all"])
def test_all_padding_batch_gives_every_parameter_a_zero_gradient_as_unpatched(patch):
    """Labels all -100 on a batch that is all padding: unpatched, every parameter gets a gradient of zeros, which
    DDP expects and AdamW's weight decay reads (None skips the decay). Patched must give the same, not None."""
    model = tiny_model().train()
    ids, mask = torch.randint(3, 90, (2, 8)), torch.zeros(2, 8, dtype=torch.long)

    def step() -> dict:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits * mask[..., None]).sum().backward()  # a summed loss over real tokens: none here
        return {n: p.grad for n, p in model.named_parameters()}

    want = step()
    with patchkit.apply_patch(patch, backend="sdpa") as handle:
        got = step()
        assert handle.calls == model.config.num_hidden_layers
    assert all(g is not None for g in want.values())
    for name, grad in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], grad, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_an_all_padding_batch_gives_a_mixture_of_experts_the_unpatched_gradients(family):
    """As above on a mixture of experts: unpatched, the padding tokens reach the router and its experts, whose
    weights get zero gradients (not None, which DDP would take for unused parameters); patched, the same."""
    model = served_tiny(family).train()
    ids, mask = torch.randint(3, model.config.vocab_size, (2, 8)), torch.zeros(2, 8, dtype=torch.long)

    def step() -> dict:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits * mask[..., None]).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want = step()
    with patchkit.apply_patch(backend="sdpa"):
        got = step()
    assert any(".experts." in name for name in want)
    assert {n for n, g in got.items() if g is None} == {n for n, g in want.items() if g is None}
    for name, grad in want.items():
        if grad is not None:
            torch.testing.assert_close(got[name], grad, msg=name)


def test_an_empty_sequence_fails_as_unpatched():
    """N = 0 with a (B, 0) mask: transformers' own error (its reshape of no tokens), not one from patchkit's
    metadata ("step must be nonzero")."""
    model = tiny_model()
    ids, mask = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(Exception) as unpatched:  # noqa: B017 - its class differs by era (RuntimeError, IndexError)
        model(input_ids=ids, attention_mask=mask)
    with patchkit.apply_patch(backend="sdpa"), pytest.raises(Exception) as patched:  # noqa: B017
        model(input_ids=ids, attention_mask=mask)
    if Version(transformers.__version__) >= Version("5"):  # 4.5x's own mask raises first unpatched (IndexError)
        assert (type(patched.value), str(patched.value)) == (type(unpatched.value), str(unpatched.value))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_bf16_error_at_most_twice_eager_error(kv_heads):
    ref32 = tiny_model(kv_heads=kv_heads)
    ids, mask = padded_batch("mixed")
    real = mask.bool()
    truth, _ = run(ref32, ids, mask, train=False)
    model16 = clone(ref32).to(torch.bfloat16)
    eager16, _ = run(model16, ids, mask, train=False)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        ours16, _ = run(model16, ids, mask, train=False)
    eager_err = (eager16.float() - truth)[real].abs().max().item()
    ours_err = (ours16.float() - truth)[real].abs().max().item()
    assert ours_err <= 2 * eager_err + 1e-3, (ours_err, eager_err)


def test_unpadded_batch_without_mask_matches_eager():
    model = tiny_model(kv_heads=2)
    ids = torch.randint(3, 90, (3, 16))
    want, want_g = run(model, ids, torch.ones_like(ids))
    with patchkit.apply_patch("llama2", backend="sdpa"):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    torch.testing.assert_close(out.logits, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(model.lm_head.weight.grad, want_g["lm_head.weight"], atol=2e-5, rtol=1e-3)


def test_gradient_checkpointing_keeps_working():
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    model.train()
    model.config.attention_dropout = 0.0
    want, want_g = run(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got, got_g = run(model, ids, mask)
        assert handle.layers_patched == 2
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=2e-5, rtol=1e-3, msg=name)
