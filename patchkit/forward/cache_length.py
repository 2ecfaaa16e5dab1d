"""How many tokens a KV cache holds, read from a layer that holds keys: a hybrid's layer 0 may be recurrent.

From transformers 5.25, `Cache.get_seq_length()` (layer 0 by default) no longer looks past a linear-attention
layer to the first attention layer: it reads that layer's own token count, which RecurrentGemma's recurrent blocks
never advance (always 0). transformers' masks read the attention layers (`get_mask_sizes(q_len, layer_idx)`), and so
does patchkit: the first layer that is neither recurrent nor a KV-sharing placeholder, as `get_seq_length` did
before 5.25 and `masking_utils.find_first_full_attention_index` does.
"""

from __future__ import annotations

from typing import Any, Optional


def keys_layer(cache: Any) -> int:
    """The index of `cache`'s first layer that holds keys (0 where the cache cannot say: a tuple, a 4.x cache)."""
    try:
        linear, dummy = list(getattr(cache, "is_linear", ())), list(getattr(cache, "is_dummy", ()))
    except Exception:  # noqa: BLE001 - a cache whose flags cannot be read before its first update
        return 0
    if not linear or not any(linear):
        return 0
    dummy = dummy or [False] * len(linear)
    return next((i for i, (lin, dum) in enumerate(zip(linear, dummy)) if not lin and not dum), 0)


def past_length(cache: Any) -> Optional[Any]:
    """The tokens `cache` held before this forward (`get_seq_length`, of its first layer that holds keys); None for a
    cache that cannot say (no `get_seq_length`: a legacy tuple, a caller's own object)."""
    if getattr(cache, "get_seq_length", None) is None:
        return None
    index = keys_layer(cache)
    return cache.get_seq_length(index) if index else cache.get_seq_length()


def query_offset(cache: Any) -> Any:
    """The position of this forward's first query (`get_query_offset`, 5.x: an MTP cache's runs ahead; else the
    length), read at the first layer that holds keys."""
    offset = getattr(cache, "get_query_offset", None)
    if offset is None:
        return past_length(cache)
    index = keys_layer(cache)
    return offset(index) if index else offset()
