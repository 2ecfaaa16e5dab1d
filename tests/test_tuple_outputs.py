"""return_dict=False: a tuple's elements sit by position, so a patched forward returns the same elements in the same
places as unpatched (the training cache transformers keeps there, router logits per token of the padded batch)."""

from __future__ import annotations

import importlib

import pytest
import torch
from families import FAMILIES, MOE, any_model
from models import padded_batch

import patchkit


def describe(out: tuple) -> list[str]:
    return [type(x).__name__ + (str(tuple(x.shape)) if isinstance(x, torch.Tensor) else "") for x in out]


def patch_name(family: str) -> str:
    return "llama2" if family == "llama" else family


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_a_training_step_returning_a_tuple_keeps_every_element_in_place(family):
    """In training transformers keeps a DynamicCache when the config's use_cache is on; patchkit kept none, so the
    tuple lost that element and every later one moved (`loss, logits, past = out` raised; a mixture of experts'
    out[3] was its router logits). The tuple now has the same elements, equal at real tokens. Gemma2 and Gemma3 make
    no cache in training before transformers 5.0: there the patched tuple has none either (it had one)."""
    model = any_model(family, "sdpa").train()
    ids, mask = padded_batch("right")
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), return_dict=False,
              **({"output_router_logits": True} if family in MOE else {}))
    want = model(**kw)
    with patchkit.apply_patch(patch_name(family), backend="sdpa") as handle:
        got = model(**kw)
        assert handle.calls == model.config.get_text_config().num_hidden_layers and handle.stepped_aside == {}
    assert describe(got) == describe(want)
    real = mask.bool()
    for ours, theirs in zip(got, want):
        if isinstance(theirs, torch.Tensor) and theirs.dim() == 3:  # the logits: zeros at padding under the patch
            torch.testing.assert_close(ours[real], theirs[real], atol=3e-5, rtol=1e-4)
        elif isinstance(theirs, torch.Tensor):
            torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=1e-4)
    for ours, theirs in zip(got, want):
        if hasattr(theirs, "get_seq_length"):
            assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("family", sorted(MOE))
def test_a_moe_base_model_tuple_gives_router_logits_per_padded_token(family):
    """Router logits in a tuple come back (batch x length, experts), as named outputs do, so transformers' own
    load-balancing loss reads them against the 2D mask and equals unpatched."""
    model = any_model(family, "sdpa").eval()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    ids, mask = padded_batch("right")
    kw = dict(input_ids=ids, attention_mask=mask, return_dict=False, output_router_logits=True, use_cache=False)
    with torch.no_grad():
        want = base(**kw)
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            got = base(**kw)
            assert handle.calls == model.config.get_text_config().num_hidden_layers
    assert describe(got[-1]) == describe(want[-1]) and len(got) == len(want)
    real = mask.bool().flatten()
    for ours, theirs in zip(got[-1], want[-1]):
        torch.testing.assert_close(ours[real], theirs[real], atol=3e-5, rtol=1e-4)
    text = model.config.get_text_config()
    loss = importlib.import_module(type(base).__module__).load_balancing_loss_func
    experts = getattr(text, "num_local_experts", getattr(text, "num_experts", None))
    torch.testing.assert_close(loss(got[-1], experts, text.num_experts_per_tok, mask),
                               loss(want[-1], experts, text.num_experts_per_tok, mask), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("way", ["class", "instance"])
def test_a_sequence_classifiers_training_tuple_keeps_its_cache_in_place(way):
    """A sequence classifier in training, return_dict=False, the config's use_cache on: transformers' tuple is
    (loss, logits, cache, hidden states). The head asks its base model for a dict, so the base model could not tell a
    place was held: the patched tuple lost the cache (`loss, logits, cache, hidden = out` raised), as the causal LM's
    did until its wrapper passed use_cache on. The task head's wrapper passes it on too."""
    from models import tiny_config
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_config(num_labels=3)).train()
    ids, mask = padded_batch("right")
    kw = dict(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 1]), return_dict=False,
              output_hidden_states=True)
    want = model(**kw)
    with patchkit.apply_patch("llama2", backend="sdpa", model=model if way == "instance" else None):
        got = model(**kw)
    assert describe(got)[:3] == describe(want)[:3] and len(got) == len(want) == 4
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert got[2].get_seq_length() == want[2].get_seq_length() == ids.shape[1]
