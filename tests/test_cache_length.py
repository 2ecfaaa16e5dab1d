"""A hybrid's cache length is read from a layer that holds keys (transformers 5.25: layer 0 may be recurrent)."""

from __future__ import annotations

import pytest
import torch
from fakes import install_transformers_flash_attention_2
from families import served_tiny
from models import CACHE, dynamic_cache, padded_batch

import patchkit
from patchkit.forward.cache_length import keys_layer, past_length

# Hybrids whose cache begins with a recurrent layer (RecurrentGemma's blocks: recurrent, recurrent, attention; the
# Qwen3.5 and Qwen3-Next tiny configs: linear attention first), and a plain one.
FAMILIES = ["recurrent_gemma", "qwen3_next", "qwen3_5_text", "lfm2", "llama"]


class Flags:
    """A cache's layer flags alone, as transformers 5.x's `Cache` exposes them."""

    def __init__(self, is_linear: list, is_dummy: list) -> None:
        self.is_linear, self.is_dummy = is_linear, is_dummy


def test_the_first_layer_that_holds_keys_is_read():
    assert keys_layer(Flags([True, True, False, False], [False] * 4)) == 2
    assert keys_layer(Flags([True, False, False], [False, True, False])) == 2  # KV sharing's placeholder skipped
    assert keys_layer(Flags([False, True], [False, False])) == 0
    assert keys_layer(Flags([True, True], [False, False])) == 0  # all recurrent (Mamba): the cache's own reading
    assert keys_layer((torch.zeros(1), torch.zeros(1))) == 0  # a legacy tuple cache


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hybrid_caches_past_is_its_prompt(family):
    """After a prefill of 7 tokens the cache holds 7, whatever its layer 0 counts (RecurrentGemma's recurrent layer
    reads 0 on transformers 5.25, where `get_seq_length()` no longer skips it)."""
    model = served_tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    cache = dynamic_cache(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{CACHE: cache})
    assert int(past_length(cache)) == 7


def test_recurrent_gemma_on_flash_attention_2_decodes_into_a_static_cache_patched(monkeypatch):
    """transformers 5.25's RecurrentGemma cache said 0 tokens at every step: patchkit cut generate()'s 2D mask of a
    static cache to the new token's column and stepped aside for `short_mask` on every decode step. Now the steps
    run patched, with the unpatched tokens."""
    install_transformers_flash_attention_2(monkeypatch)
    model = served_tiny("recurrent_gemma")
    model.config._attn_implementation = "flash_attention_2"  # its 2D masks, made ahead by generate()
    left, mask = padded_batch("left", batch=3)

    def tokens() -> torch.Tensor:
        return model.generate(input_ids=left, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              cache_implementation="static")

    want = tokens()
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = tokens()
        assert handle.calls > 0 and not handle.stepped_aside, handle.report()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
