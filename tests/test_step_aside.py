"""Where the varlen path cannot serve a forward exactly, transformers' own attention runs it: the same numbers as
unpatched, one warning per cause naming it and the fix, a count in the report; strict mode refuses instead."""

from __future__ import annotations

import warnings

import pytest
import torch
from families import family_model
from models import padded_batch, tiny_model

import patchkit
from patchkit import PatchInputError


def model_of(family: str, attn: str = "eager") -> torch.nn.Module:
    model = tiny_model(kv_heads=2) if family == "llama" else family_model(family)
    model.set_attn_implementation(attn)
    return model


def patch(family: str, way: str, model: torch.nn.Module, **kw):
    return patchkit.apply_patch(family, backend="sdpa", **kw) if way == "class" else patchkit.apply_patch(
        model=model, backend="sdpa", **kw)


def aside_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if "transformers' own attention (exact" in str(w.message)]


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("where", ["call", "config"])
def test_output_attentions_steps_aside_with_the_weights(family, way, where):
    """From the call or from the config: the weights come back equal to unpatched, never an empty tuple."""
    model = model_of(family)
    ids, mask = padded_batch("mixed")
    kw = {"output_attentions": True} if where == "call" else {}
    if where == "config":
        model.config.output_attentions = True
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, **kw)
        handle = patch(family, way, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(input_ids=ids, attention_mask=mask, **kw)
            model(input_ids=ids, attention_mask=mask, **kw)
    assert handle.stepped_aside == {"output_attentions": 2} and handle.calls == 0
    (message,) = aside_messages(caught)
    assert "output_attentions=True" in message and "leave output_attentions off" in message
    handle.revert()
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.logits, want.logits)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_callers_4d_mask_steps_aside_exactly(family):
    """A custom pattern (here: each row also hides key 2 from every query after it)."""
    model = model_of(family)
    ids, mask = padded_batch("right")
    causal = torch.ones(24, 24).tril().bool()
    custom = causal[None, None] & mask.bool()[:, None, None, :]
    custom[..., 3:, 2] = False
    additive = torch.zeros(custom.shape).masked_fill(~custom, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=additive).logits
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=additive).logits
            assert handle.stepped_aside == {"custom_4d_mask": 1}
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real])


def test_strict_refuses_output_attentions_naming_the_cause():
    model = model_of("mistral")
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("mistral", backend="sdpa", strict=True):
        with pytest.raises(PatchInputError, match="strict=True.*output_attentions=True.*leave output_attentions off"):
            model(input_ids=ids, attention_mask=mask, output_attentions=True)
