"""Each layer attends within the window of the mask transformers built for it, as eager and sdpa do: not within the
`sliding_window` its attention module was built with, where the two differ after the model was built (a config
changed, a layer moved or pruned). patchkit used to take the module's: up to 3.2 off in logits, with no warning."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import patchkit

WINDOW = 5
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, initializer_range=0.25, sliding_window=WINDOW,
              attn_implementation="sdpa")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def compare(model: torch.nn.Module, change) -> None:
    """`change` applied to the model and to a patched copy: the same logits at real tokens, the same loss and
    gradients of a training step (labels as the README says), nothing stepped aside."""
    change(model)
    patched = copy.deepcopy(model)
    handle = patchkit.apply_patch(model=patched, backend="sdpa")
    try:
        ids, mask = batch()
        labels = ids.masked_fill((mask == 0) | (mask.cumsum(-1) == 1), -100)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want, got = (m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
                         for m in (model, patched))
        real = mask.bool()
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-5)
        want.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        for (name, a), b in zip(model.named_parameters(), patched.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
        assert handle.calls > 0 and not handle.stepped_aside
    finally:
        handle.revert()


def test_a_window_changed_in_the_config_after_build_is_the_one_attended_within():
    """Gemma 3: `config.sliding_window` 5 -> 3 after the model is built. transformers builds the sliding layers' mask
    from the config (3); each attention module still passes the 5 it was built with."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, num_hidden_layers=2, head_dim=8,
                                               layer_types=["sliding_attention", "full_attention"]))

    def narrower(m: torch.nn.Module) -> None:
        m.config.sliding_window = 3

    compare(model, narrower)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_a_layer_moved_where_transformers_builds_another_mask_attends_as_that_mask_says(family):
    """A sliding layer's attention copied into a full-attention layer (Qwen2), or a layer pruned so that a sliding
    module sits where `layer_types` says full (Gemma 2): transformers attends fully there, by the mask it builds."""
    torch.manual_seed(0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True,
                                             layer_types=["sliding_attention", "full_attention"]))

        def surgery(m: torch.nn.Module) -> None:
            m.model.layers[1].self_attn = copy.deepcopy(m.model.layers[0].self_attn)
    else:
        model = Gemma2ForCausalLM(Gemma2Config(**{**COMMON, "attn_implementation": "eager"}, num_hidden_layers=4,
                                               head_dim=8))  # Gemma 2's default

        def surgery(m: torch.nn.Module) -> None:  # layer 1 dropped; layer_types left as they were
            layers = [layer for i, layer in enumerate(m.model.layers) if i != 1]
            for i, layer in enumerate(layers):
                layer.self_attn.layer_idx = i
            m.model.layers = torch.nn.ModuleList(layers)
            m.config.num_hidden_layers = len(layers)

    compare(model, surgery)
