"""A multimodal model's own masks for its language model, read back as the 2D padding mask they were made from.

Gemma 3's (and Gemma 4's) multimodal model builds its language model's masks itself, outside the patch: one 4D mask
per layer type (full, sliding), causal AND the 2D padding mask, OR a bidirectional block over each image's tokens
(`token_type_ids`). On a batch without images they are exactly causal, windowed and padded: each key a query sees
is real, and rebuilding every mask from those keys and comparing it entry for entry proves it is that and nothing
else; the forward then runs patched on the 2D mask. An image block is never a document of its own (the text after it
attends into it), so a mask where a query sees a later key steps aside, naming the image tokens.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from patchkit.forward.documents import allowed_keys
from patchkit.forward.inputs.arguments import given_cache, input_tokens, window_over_hole
from patchkit.forward.masks import cache_placement, fixed_slots
from patchkit.hooks.generation.slots_mask import causal_over_slots, layer_type_masks, same_mask, same_recurrent_masks

BIDIRECTIONAL = "bidirectional_image_tokens"


def padding_from_model_masks(module: Any, arguments: dict) -> Optional[torch.Tensor | str]:
    """(B, past + q_len) long, 1 = real: the 2D mask a dict of per-layer-type 4D masks over every key (no static
    cache) exactly is; `BIDIRECTIONAL` where some query sees a later key (an image's tokens, both ways); else None."""
    mask, cache, tokens = arguments.get("attention_mask"), given_cache(arguments), input_tokens(arguments)
    if not isinstance(mask, dict) or tokens is None or fixed_slots(cache):
        return None
    masks = layer_type_masks(module, mask)
    if masks is None:
        return None
    batch, q_len = tokens.shape[:2]
    past = cache_placement(cache, arguments.get("cache_position"))[0] if cache is not None else 0
    end = past + q_len
    given = {window: m for window, m in masks.items() if m is not None}
    if not given or any(not isinstance(m, torch.Tensor) or m.dim() != 4 or m.shape[:3] != (batch, 1, q_len)
                        or m.shape[-1] > end or (window is None and m.shape[-1] != end)
                        for window, m in given.items()):
        return None  # another shape: full layers' masks cover every key, sliding ones (a dynamic cache) the last
    queries = torch.arange(past, end, device=tokens.device)[:, None]
    keys = torch.zeros(batch, end, dtype=torch.bool, device=tokens.device)
    for m in given.values():  # a key is real where some query sees it; a query that sees a later key: an image's
        offset, seen = end - m.shape[-1], allowed_keys(m)
        if bool((seen & (torch.arange(offset, end, device=tokens.device)[None, :] > queries)).any()):
            return BIDIRECTIONAL
        keys[:, offset:] |= seen.any(dim=1)
    if len(given) < len(masks):  # a layer type whose mask sdpa skipped (causal, no padding): every key real
        keys[:] = True
    for window, m in given.items():
        if not same_mask(m, causal_over_slots(keys, past, q_len, m.shape[-1], window, end - m.shape[-1])):
            return None
    if not same_recurrent_masks(mask, keys, q_len):
        return None
    return keys.long()


def model_masks_cause(module: Any, arguments: dict) -> Optional[str]:
    """What a forward given a multimodal model's own masks steps aside for, or None where they are read back (the 2D
    mask now in `arguments`, in place): image tokens that see each other both ways, a sliding window over a padding
    hole, or any other pattern (custom_4d_mask)."""
    found = padding_from_model_masks(module, arguments)
    if found is None or isinstance(found, str):
        return found or "custom_4d_mask"
    if window_over_hole(module.config, found):
        return "window_over_padding_hole"
    arguments["attention_mask"] = found
    return None
