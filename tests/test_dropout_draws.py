"""Dropout under patchkit draws its masks over real tokens only: a seeded training step's numbers differ from the
unpatched step's, and one warning says so; with every dropout at 0 they are the same and nothing is said."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import labels_for, padded_batch, tiny_model

import patchkit
from patchkit.hooks.attention import dropout_draws

DRAWS = "dropout or a router's noise is on .* draws its random numbers over the real tokens only"


def seeded_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    return model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss


@pytest.mark.parametrize("where", ["a dropout module (LoRA's)", "attention_dropout"])
def test_dropout_on_a_padded_batch_is_said_once(where, monkeypatch):
    monkeypatch.setattr(dropout_draws, "_said", [False])
    model = tiny_model(kv_heads=2).train()
    if where == "attention_dropout":
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
    else:  # a dropout before a projection, as LoRA puts one before each adapter
        mlp = model.model.layers[0].mlp
        mlp.down_proj = torch.nn.Sequential(torch.nn.Dropout(0.05), mlp.down_proj)
    ids, mask = padded_batch("right")
    want = seeded_loss(model, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with pytest.warns(RuntimeWarning, match=DRAWS):
            got = seeded_loss(model, ids, mask)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            seeded_loss(model, ids, mask)  # once
    assert not torch.allclose(got, want, atol=1e-6)  # other masks, as said


def test_no_dropout_gives_the_same_numbers_and_says_nothing(monkeypatch):
    monkeypatch.setattr(dropout_draws, "_said", [False])
    model = tiny_model(kv_heads=2).train()
    mlp = model.model.layers[0].mlp
    mlp.down_proj = torch.nn.Sequential(torch.nn.Dropout(0.0), mlp.down_proj)
    ids, mask = padded_batch("right")
    want = seeded_loss(model, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa"), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = seeded_loss(model, ids, mask)
        model.eval()  # a dropout module out of training drops nothing either
        mlp.down_proj[0].p = 0.1
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "phimoe"])
def test_a_routers_training_noise_is_said_as_dropout_is(family, monkeypatch):
    """Mixtral's router jitter and PhiMoE's Gumbel sampling of experts (on in training by default) draw over the
    tokens they are handed: other draws patched, said once; in eval mode the numbers are the same."""
    from census import tiny_lm

    monkeypatch.setattr(dropout_draws, "_said", [False])
    model, _ = tiny_lm(family)
    if family == "mixtral":
        model.config.router_jitter_noise = 0.01
        model = type(model)(model.config)  # its blocks read the jitter when built
    model = model.float().train()
    ids, mask = padded_batch("right")
    ids = ids % model.config.vocab_size
    want = seeded_loss(model, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with pytest.warns(RuntimeWarning, match=DRAWS):
            got = seeded_loss(model, ids, mask)
        model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            evaluated = seeded_loss(model, ids, mask)
    if family == "mixtral":  # other draws, as said (PhiMoE's tiny router picks alike here whatever it draws)
        assert not torch.allclose(got, want, atol=1e-7)
    model.train(False)
    torch.testing.assert_close(evaluated, seeded_loss(model, ids, mask), atol=2e-5, rtol=1e-5)
