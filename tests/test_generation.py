"""KV-cache paths: greedy generation, decode steps and chunked prefill match the unpatched model."""

from __future__ import annotations

import pytest
import torch
from models import padded_batch, static_decode, tiny_model
from transformers import DynamicCache

import patchkit
from patchkit import PatchInputError


def greedy(model, ids, mask, n=32):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_greedy_generate_left_padded_matches_eager(kv_heads):
    model = tiny_model(kv_heads=kv_heads, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=16)
    want = greedy(model, ids, mask)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = greedy(model, ids, mask)
        assert handle.calls >= 32 * model.config.num_hidden_layers
    assert torch.equal(got, want)


def test_chunked_prefill_with_cache_matches_single_pass():
    model = tiny_model(kv_heads=2, seed=4)
    ids, mask = padded_batch("left", batch=3, seq=20)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            single = model(input_ids=ids, attention_mask=mask).logits
            cache = DynamicCache()
            chunks = []
            position = mask.long().cumsum(-1) - 1
            position.masked_fill_(mask == 0, 1)
            for start, stop in [(0, 7), (7, 8), (8, 15), (15, 20)]:  # prefill, a decode step, more chunks
                out = model(
                    input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache,
                    position_ids=position[:, start:stop], use_cache=True,
                )
                chunks.append(out.logits)
            chunked = torch.cat(chunks, dim=1)
    real = mask.bool()
    torch.testing.assert_close(single[real], want[real], atol=2e-5, rtol=1e-4)
    # the single pass above used arange positions; compare chunked against the same positions run at once
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        once = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    eager_once = model(input_ids=ids, attention_mask=mask, position_ids=position).logits.detach()
    torch.testing.assert_close(chunked[real], once[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunked[real], eager_once[real], atol=2e-5, rtol=1e-4)


def test_mask_with_past_columns_prepended_twice_is_refused():
    """FastChat's LLaMA-2 bug: a mask of [batch, 2*past + q_len] must raise, not gather wrong keys."""
    model = tiny_model(seed=5)
    ids, mask = padded_batch("left", batch=2, seq=14)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        step = torch.randint(3, 90, (2, 1))
        bad = torch.cat([torch.ones(2, 14, dtype=torch.long), mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        with pytest.raises(PatchInputError, match=r"attention_mask has shape \(2, 29\).*15 keys"):
            model(input_ids=step, attention_mask=bad, past_key_values=out.past_key_values)


def test_llama1_refuses_a_past_but_runs_an_empty_cache():
    model = tiny_model(seed=6)
    ids, mask = padded_batch("right", batch=2, seq=14)
    with torch.no_grad(), patchkit.apply_patch("llama1", backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)  # an empty cache is a prefill: it runs
        assert out.past_key_values.get_seq_length() == 14
        nxt = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        with pytest.raises(PatchInputError, match="llama1' is for training and prefill only.*llama2"):
            model(input_ids=ids[:, :1], attention_mask=nxt, past_key_values=out.past_key_values)


def test_static_cache_generation_equals_unpatched():
    """generate(cache_implementation="static"): the same tokens as unpatched (patched where generate()'s 4D mask is
    read back as its 2D mask, tests/test_static_cache.py; else stepped aside), and the default dynamic cache still
    runs patched after."""
    model = tiny_model(seed=7)
    ids, mask = padded_batch("left", batch=2, seq=14)
    want = greedy(model, ids, mask, n=3)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    static = model.generate(input_ids=ids, cache_implementation="static", **kw)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        assert torch.equal(model.generate(input_ids=ids, cache_implementation="static", **kw), static)
        assert torch.equal(greedy(model, ids, mask, n=3), want)


@pytest.mark.parametrize("full_mask", [True, False], ids=["full-length mask", "short mask"])
def test_a_static_cache_decode_loop_with_the_first_row_padded_equals_unpatched(full_mask):
    """A decode loop of one's own into a StaticCache (no cache_position: the cache's count of filled slots places
    each step). transformers 4.56-5.x count them as the first row's nonzero keys, and the packed prefill left zeros
    at padding slots: the count came up short and the steps were wrong (up to 0.26, no error). 4.48's StaticCache
    has no `is_compileable`: patchkit took it for a growing cache and refused it, blaming activation checkpointing."""
    model = tiny_model(kv_heads=2, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=14)
    ids, mask = ids.flip(0), mask.flip(0)  # the first row padded
    want = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
