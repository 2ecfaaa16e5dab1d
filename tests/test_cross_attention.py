"""A decoder given `encoder_hidden_states` (GPT-2 built with `add_cross_attention`) steps aside as
`cross_attention`: the whole forward on the attention the model was loaded with, unpatched numbers, one warning.

Before, it stepped aside as `custom_mask_pattern` onto the family's eager attention (a row whose encoder positions
are all padding then differed from an sdpa-loaded model by 0.3, under a warning that said "exact"), and without
an `encoder_attention_mask` it crashed with an AttributeError on None.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models import labels_for, needs_mask_interface, padded_batch
from transformers import GPT2Config, GPT2LMHeadModel

import patchkit
from patchkit.errors import PatchInputError
from patchkit.hooks.name import attention_interface

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
ENCODER = 7


def decoder(attn: str) -> GPT2LMHeadModel:
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, add_cross_attention=True,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel._from_config(config, attn_implementation=attn)


def inputs(with_mask: bool = True) -> dict:
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    ids = ids.clamp(max=95)
    states = torch.randn(4, ENCODER, 32, generator=torch.Generator().manual_seed(4))
    out = dict(input_ids=ids, attention_mask=mask, encoder_hidden_states=states, labels=labels_for(ids, mask))
    if with_mask:
        encoder_mask = torch.ones(4, ENCODER, dtype=torch.long)
        encoder_mask[1, 3:] = 0
        encoder_mask[2] = 0  # a row whose encoder positions are all padding
        out["encoder_attention_mask"] = encoder_mask
    return out


def step(model: torch.nn.Module, batch: dict) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("with_mask", [True, False], ids=["encoder mask", "no encoder mask"])
@pytest.mark.parametrize("scope", ["instance", "class"])
def test_cross_attention_steps_aside_onto_the_loaded_attention_with_unpatched_numbers(attn, with_mask, scope):
    model, batch = decoder(attn), inputs(with_mask)
    want = step(model, batch)
    target = dict(model=model) if scope == "instance" else dict(name="gpt2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with patchkit.apply_patch(**target, backend="sdpa") as handle:
            got = step(model, batch)
            assert handle.stepped_aside == {"cross_attention": 1}
    assert_same(got, want)
    said = [str(w.message) for w in seen if "patchkit:" in str(w.message)]
    assert len(said) == 1 and "(cross_attention)" in said[0] and "encoder_hidden_states" in said[0]


def test_strict_refuses_cross_attention_by_name():
    model, batch = decoder("sdpa"), inputs()
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
        with pytest.raises(PatchInputError, match="strict=True.*encoder_hidden_states"):
            model(**batch)


@needs_mask_interface
@pytest.mark.parametrize("with_mask", [True, False], ids=["encoder mask", "no encoder mask"])
def test_under_the_name_alone_cross_attention_layers_step_aside_and_self_attention_stays_served(with_mask):
    """No patch wraps the forward: the cross-attention layers' encoder mask (transformers' bare bidirectional
    one, a tensor even where transformers would skip it) steps those layers aside onto transformers' attention, the
    one the model runs without patchkit (sdpa, its default; eager for a model named after it was loaded with eager:
    the two differ over a row whose encoder positions are all padding); the self-attention layers run patched. The
    numbers are that model's at every real position."""
    attention_interface.register(backend="sdpa")
    try:
        batch = inputs(with_mask)
        state = attention_interface.route_state()
        for loaded in ("sdpa", "eager"):
            plain, named = decoder(loaded).eval(), decoder("patchkit" if loaded == "sdpa" else "eager").eval()
            if loaded == "eager":
                named.set_attn_implementation("patchkit")
            calls, aside = state.calls, state.stepped_aside.get("cross_attention", 0)
            with torch.no_grad():
                want, got = plain(**batch), named(**batch)
            assert state.calls > calls and state.stepped_aside.get("cross_attention", 0) > aside
            real = batch["attention_mask"].bool()
            torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4, msg=loaded)
    finally:
        attention_interface.register(backend="auto", strict=False)
