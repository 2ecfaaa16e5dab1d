"""Falcon, served by config: its rotary configs (Falcon-7B's multi-query, Falcon-40B/180B's grouped "new decoder
architecture", plain multi-head) run patched and exact; an ALiBi config (Falcon-RW) runs on transformers' attention,
which adds the bias to the mask, warned and counted every way in, and apply_patch(model=...) refuses it by its gate."""

from __future__ import annotations

import copy

import pytest
import torch
from families import serves_model_type
from models import VOCAB, assert_same, decode_logits, padded_batch, step

import patchkit
from patchkit import PatchGateError, PatchInputError

pytestmark = pytest.mark.skipif(not serves_model_type("falcon"),
                                reason="Falcon calls transformers' attention interface from 5.25")

VARIANTS = {
    "multi_query": dict(multi_query=True, parallel_attn=True),  # Falcon-7B
    "new_decoder_architecture": dict(new_decoder_architecture=True, num_kv_heads=2),  # Falcon-40B / 180B
    "falcon2": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),  # Falcon2-11B
    "multi_head": dict(multi_query=False, parallel_attn=False, bias=True),
}
ALIBI = dict(alibi=True, multi_query=False, parallel_attn=False, bias=True)  # Falcon-RW


def falcon(seed: int = 0, attn: str = "sdpa", **kw) -> torch.nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          attention_dropout=0.0, hidden_dropout=0.0, **kw)
    torch.manual_seed(seed)
    return FalconForCausalLM._from_config(config, attn_implementation=attn).train()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rotary_falcon_runs_patched_and_exact(variant):
    """A padded training step (logits and every gradient) and a cached decode, class and instance patch."""
    model = falcon(**VARIANTS[variant])
    ids, mask = padded_batch("left", batch=3, seq=16)
    want, want_decode = step(model, ids, mask), decode_logits(model.eval(), ids, mask, steps=3)[0]
    model.train()
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        assert_same(step(model, ids, mask), want, mask)
        torch.testing.assert_close(decode_logits(model.eval(), ids, mask, steps=3)[0], want_decode, atol=2e-5,
                                   rtol=1e-4)
    assert handle.calls > 0 and handle.stepped_aside == {}
    with patchkit.apply_patch("falcon", backend="sdpa") as handle:
        built = falcon(**VARIANTS[variant])
        assert_same(step(built, ids, mask), want, mask)
    assert handle.calls > 0 and handle.stepped_aside == {}


def test_an_alibi_falcon_steps_aside_under_the_class_patch():
    """transformers adds ALiBi to the attention mask (in bfloat16): the forward runs as unpatched, with the cause;
    strict refuses it."""
    model = falcon(**ALIBI)
    ids, mask = padded_batch("left", batch=3, seq=16)
    want = step(model, ids, mask)
    with pytest.warns(RuntimeWarning, match=r"ALiBi.*\(alibi\)"):
        with patchkit.apply_patch("falcon", backend="sdpa") as handle:
            built = falcon(**ALIBI)
            assert_same(step(built, ids, mask), want, mask)
    assert handle.stepped_aside == {"alibi": 1}
    with patchkit.apply_patch("falcon", backend="sdpa", strict=True):
        built = falcon(**ALIBI)
        with pytest.raises(PatchInputError, match="uses ALiBi"):
            built(input_ids=ids, attention_mask=mask)


def test_apply_patch_on_an_alibi_falcon_patches_nothing_and_says_why():
    model = falcon(**ALIBI)
    forward = model.forward
    with pytest.raises(PatchGateError, match=r"alibi=True: ALiBi.*Nothing was patched"):
        patchkit.apply_patch(model=model, backend="sdpa")
    assert model.forward == forward and "forward" not in vars(model.transformer)


def test_an_alibi_falcon_under_the_registered_name_alone_steps_aside():
    """attn_implementation="patchkit": the eager attention of the family, on transformers' mask with ALiBi in it."""
    model = falcon(attn="eager", **ALIBI)
    ids, mask = padded_batch("left", batch=3, seq=16)
    want = step(model, ids, mask)
    named = copy.deepcopy(model)
    named.set_attn_implementation("patchkit")
    with pytest.warns(RuntimeWarning, match=r"\(alibi\)"):
        assert_same(step(named, ids, mask), want, mask)
