"""An attention forward that is not transformers' own (a user's subclass, or a script's patch of the class, as old
FastChat and xformers scripts do) runs as transformers runs it: on the padded batch and transformers' 4D mask. It
used to be handed one packed row of every row's real tokens (rows attended to each other, with no warning), or
patchkit's mask object, which it could not slice or add."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

import patchkit

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, pad_token_id=0, attn_implementation="sdpa")


def attend(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """A hand-written attention: causal by `is_causal` (right padding needs no mask), or by the 4D mask it is handed,
    sliced to its keys as pre-4.48 code did (`mask`)."""
    b, s, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
    if getattr(self, "reads_mask", False):
        mask = attention_mask[:, :, :, : k.shape[-2]]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return self.o_proj(o.transpose(1, 2).reshape(b, s, -1)), None


class MyAttention(modeling_llama.LlamaAttention):
    forward = attend


class MyLM(LlamaForCausalLM):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = MyAttention(config, i)


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 0, 0, 0, 0]])  # right padding
    mask = (ids != 0).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    ids, mask, labels = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), out.logits[mask.bool()].detach(), [p.grad for p in model.parameters()]


def assert_stepped_aside(model: torch.nn.Module, handle, want) -> None:
    """One patched step of `model` stepped aside as `own_attention_forward`, said, with the unpatched numbers."""
    with pytest.warns(RuntimeWarning, match="own_attention_forward"):
        got = step(model)
    assert_same(got, want)
    assert handle.stepped_aside == {"own_attention_forward": 1}


def assert_same(got, want) -> None:
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-5)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reads_mask", [False, True], ids=["is_causal", "sliced_mask"])
@pytest.mark.parametrize("way", ["class", "instance"])
def test_a_subclass_with_its_own_attention_forward_runs_as_unpatched(way, reads_mask):
    torch.manual_seed(0)
    reference = MyLM(CONFIG)
    for layer in reference.model.layers:
        layer.self_attn.reads_mask = reads_mask
    model = copy.deepcopy(reference)
    want = step(reference)
    handle = patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa")
    try:
        assert_stepped_aside(model, handle, want)
    finally:
        handle.revert()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_scripts_patch_of_the_attention_class_runs_as_unpatched(monkeypatch, when):
    """FastChat's and xformers' old recipes set `LlamaAttention.forward` themselves, before patchkit's class patch or
    after it (on a model that ran patched before, too: the walk is redone when a class's forward changes)."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(CONFIG)
    model = copy.deepcopy(reference)
    own = vars(modeling_llama.LlamaAttention)["forward"]
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", attend)
    want = step(reference)  # unpatched, with the script's attention
    if when == "after":
        monkeypatch.undo()
    handle = patchkit.apply_patch(backend="sdpa")
    try:
        if when == "after":
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                step(model)  # patched, no warning
            assert handle.calls > 0 and not handle.stepped_aside
            model.zero_grad()
            modeling_llama.LlamaAttention.forward = attend  # the patch's revert puts the script's back
        assert_stepped_aside(model, handle, want)
    finally:
        handle.revert()
        if when == "after":
            assert vars(modeling_llama.LlamaAttention)["forward"] is attend
            modeling_llama.LlamaAttention.forward = own


def test_a_scripts_patch_of_the_attention_class_after_an_instance_patch_runs_as_unpatched(monkeypatch):
    """The instance patch wraps each attention module's forward on the instance, and that wrapper held the class's
    forward of the time: a script's `LlamaAttention.forward = ...` set later was shadowed, and the patched model ran
    transformers' attention where the unpatched one ran the script's (loss 4.8747 for 4.8768, silently). The wrapper
    now runs what the class has, and the forward steps aside for it."""
    torch.manual_seed(0)
    reference = LlamaForCausalLM(CONFIG)
    model = copy.deepcopy(reference)
    handle = patchkit.apply_patch(model=model, backend="sdpa")
    try:
        step(model)
        model.zero_grad()
        assert handle.calls > 0 and not handle.stepped_aside
        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", attend)
        assert_stepped_aside(model, handle, step(reference))
        monkeypatch.undo()
        model.zero_grad()
        reference.zero_grad()
        calls = handle.calls
        assert_same(step(model), step(reference))
        assert handle.calls > calls  # patched again, with the class's own forward back
    finally:
        handle.revert()


def biased_attend(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """A copy of transformers' attention forward that adds an ALiBi-style bias to the mask before it calls the
    attention function `ALL_ATTENTION_FUNCTIONS` names (a remote-code model's)."""
    b, s, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
               for proj in (self.q_proj, self.k_proj, self.v_proj))
    q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
    bias = -torch.arange(s, dtype=q.dtype)[None, None, None, :] * 0.1
    attention = modeling_llama.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                     modeling_llama.eager_attention_forward)
    o, _ = attention(self, q, k, v, attention_mask + bias, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(o.reshape(b, s, -1)), None


def test_an_attention_that_adds_a_bias_to_the_mask_is_refused_naming_that_cause():
    """Such a copy dispatches as transformers' own does, so it runs patched, and its bias meets patchkit's key-padding
    mask. That is refused; the message named only patches changed mid-forward or a patchkit bug, and now names a
    model's own code reading the mask, and the way to run it."""

    class Biased(modeling_llama.LlamaAttention):
        forward = biased_attend

    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = Biased(CONFIG, i)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels)  # runs unpatched
    with patchkit.apply_patch(model=model, backend="sdpa"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(patchkit.PatchkitError, match="adds a bias to it.*attn_implementation='sdpa'"):
            model(input_ids=ids, attention_mask=mask, labels=labels)
