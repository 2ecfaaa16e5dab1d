"""A multimodal model's own masks for its language model, read back as the 2D padding mask they were made from.

Gemma 3's multimodal model builds its language model's masks itself, outside the patch: one 4D mask per layer type
(full, sliding), causal AND the 2D padding mask, OR a bidirectional block over each image's tokens
(`token_type_ids`). Each query's reach (the last key it sees) and the real keys are read off them; rebuilding every
mask from those and comparing it entry for entry, in every real query's row, proves it is that and nothing else
(what a padding query sees is its own output's, padding either way). The forward then runs patched on
the 2D mask, its image blocks (queries that see later keys of their own block) served by a pass of their own
(`forward/metadata.py`). A pattern that is no set of blocks, or blocks behind a past, steps aside, naming the image
tokens. PaliGemma's one 4D mask (or two, PaliGemma 2's) is read the same way, its image and prompt prefix one block;
its non-causal Gemma layers attend as that mask says (`ForwardPlan.mask_decides`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from patchkit.forward.documents import allowed_keys
from patchkit.forward.inputs.arguments import given_cache, input_tokens, transformers_made, window_over_hole
from patchkit.forward.masks import cache_placement, fixed_slots
from patchkit.forward.metadata import BlockQueries, block_queries
from patchkit.hooks.generation.slots_mask import (
    causal_over_slots,
    layer_type_masks,
    same_mask,
    same_recurrent_masks,
    static_layers,
)

BIDIRECTIONAL = "bidirectional_image_tokens"


def padding_from_model_masks(module: Any, arguments: dict) -> Optional[tuple[torch.Tensor, Any] | str]:
    """((B, past + q_len) long, 1 = real; the block queries or None): the 2D mask and image blocks a 4D mask, or a
    dict of them per layer type, over every key (no static cache) exactly are; `BIDIRECTIONAL` where some query sees a
    later key in a pattern that is no set of blocks on a forward without a past; else None."""
    mask, cache, tokens = arguments.get("attention_mask"), given_cache(arguments), input_tokens(arguments)
    if not transformers_made(mask) or tokens is None:
        return None
    masks = layer_type_masks(module, mask)
    if masks is None:
        return None
    batch, q_len = tokens.shape[:2]
    past = cache_placement(cache, arguments.get("cache_position"))[0] if cache is not None else 0
    end = past + q_len
    masks = filled_slots(masks, cache, past, end)
    if masks is None:
        return None
    given = {window: m for window, m in masks.items() if m is not None}
    if not given or any(not isinstance(m, torch.Tensor) or m.dim() != 4 or m.shape[:3] != (batch, 1, q_len)
                        or m.shape[-1] > end or (window is None and m.shape[-1] != end)
                        for window, m in given.items()):
        return None  # another shape: full layers' masks cover every key, sliding ones (a dynamic cache) the last
    queries = torch.arange(past, end, device=tokens.device)
    keys = torch.zeros(batch, end, dtype=torch.bool, device=tokens.device)
    reaches = {}  # by window: the last key each query sees (its own position where it sees none later)
    for window, m in given.items():  # a key is real where some query sees it
        offset, seen = end - m.shape[-1], allowed_keys(m)
        columns = torch.arange(offset, end, device=tokens.device)
        reaches[window] = torch.maximum(torch.where(seen, columns, -1).amax(-1), queries)
        keys[:, offset:] |= seen.any(dim=1)
    if len(given) < len(masks):  # a layer type whose mask sdpa skipped (causal, no padding): every key real
        keys[:] = True
    real = keys[:, past:]  # a real query's own key is real; what a padding query sees is its output's, padding
    reaches = {window: torch.where(real, reach, queries) for window, reach in reaches.items()}
    blocks = image_blocks(reaches, queries, keys, set(masks), past)
    if isinstance(blocks, str):
        return blocks
    for window, m in given.items():
        served = blocks is not None and (not blocks.sliding_only or window is not None)
        if not same_rows(m, causal_over_slots(keys, past, q_len, m.shape[-1], window, end - m.shape[-1],
                                              reaches[window] if served else None), real):
            if not (served and window is not None and same_rows(m, causal_over_slots(
                    keys, past, q_len, m.shape[-1], window, end - m.shape[-1], reaches[window],
                    block_members(reaches[window], queries, keys)), real)):
                return None
            blocks.windowed = False  # PaliGemma 2's: its prompt block sees all of itself, however long
    if not same_recurrent_masks(mask, keys, q_len):
        return None
    return keys.long(), blocks


def filled_slots(masks: dict, cache: Any, past: int, end: int) -> Optional[dict]:
    """`masks` over the keys a dynamic cache (or none) returns; a static cache's prefill's (generate() with
    `cache_implementation="static"`) over its slots, cut to the filled ones, which are that: every later column is an
    unfilled slot that no query sees. None for any other static cache's forward (a decode step's single query sees
    no later key: its masks are read as padding, `slots_mask`)."""
    if not fixed_slots(cache):
        return masks
    if past or static_layers(cache) is None:
        return None
    cut = {}
    for window, m in masks.items():
        if isinstance(m, torch.Tensor) and m.dim() == 4 and m.shape[-1] > end:
            if bool(allowed_keys(m[..., end:]).any()):
                return None
            m = m[..., :end]
        cut[window] = m
    return cut


def image_blocks(reaches: dict, queries: torch.Tensor, keys: torch.Tensor, kinds: set,
                 past: int) -> Optional[BlockQueries | str]:
    """The image blocks the masks' reaches (by window) say, for every layer type (Gemma 3's) or the sliding ones
    alone (Gemma 4's: its full layers stay causal); None where no query sees a later key; `BIDIRECTIONAL` where
    they are no blocks patchkit serves (behind a past, layer types that disagree)."""
    later = {window for window, reach in reaches.items() if bool((reach > queries).any())}
    if not later:
        return None
    first = reaches[next(iter(later))]
    if past or any(not torch.equal(reaches[window], first) for window in later):
        return BIDIRECTIONAL
    sliding_only = later != kinds
    if sliding_only and (None in later or None not in kinds):
        return BIDIRECTIONAL  # blocks on full layers but not on sliding ones: no family's
    blocks = block_queries(first, keys)
    if blocks is None:
        return BIDIRECTIONAL
    blocks.sliding_only = sliding_only
    return blocks


def same_rows(mask: torch.Tensor, expected: torch.Tensor, rows: torch.Tensor) -> bool:
    """`mask` (B, 1, q_len, K) is `expected` in the query rows `rows` (B, q_len) marks (`same_mask`)."""
    return same_mask(mask[:, 0][rows], expected[:, 0][rows])


def block_members(reach: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, q_len) the queries of a block: the real ones that see a later key, and the token after each run of them
    (the block's last)."""
    later = (reach > queries) & keys[:, -reach.shape[-1]:]
    return later | torch.nn.functional.pad(later, (1, 0))[:, :-1]


def model_masks_cause(module: Any, arguments: dict) -> tuple[Optional[str], Optional[BlockQueries]]:
    """(what a forward given a multimodal model's own masks steps aside for, None), or (None, its image blocks or
    None) where they are read back (the 2D mask now in `arguments`, in place): image tokens that see each other both
    ways in no pattern of blocks, a sliding window over a padding hole, or any other pattern (custom_4d_mask)."""
    found = padding_from_model_masks(module, arguments)
    if found is None or isinstance(found, str):  # a caller's one 4D mask is no multimodal model's: named as given
        return found if isinstance(arguments.get("attention_mask"), dict) and found else "custom_4d_mask", None
    keys, blocks = found
    if window_over_hole(module.config, keys):
        return "window_over_padding_hole", None
    arguments["attention_mask"] = keys
    return None, blocks
