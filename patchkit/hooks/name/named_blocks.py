"""The image blocks a mask function asks for under the registered name, read from transformers' block ids.

A multimodal model under `attn_implementation="patchkit"` builds its language model's masks through patchkit's mask
function, with transformers' block ids ORed into the causal mask (`block_sequence_ids`: Gemma 3's images,
PaliGemma's prompt). Their blocks are read from the ids and the real tokens (`forward/metadata.id_blocks`), served
by the block pass as in a patched forward (`hooks/decide/model_masks.py` reads the same blocks off 4D masks).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from patchkit.forward.inputs.mask_functions import block_pattern
from patchkit.forward.metadata import BlockQueries, id_blocks


def named_blocks(function: Any, kwargs: dict) -> Optional[BlockQueries] | bool | str:
    """The blocks of a mask function that ORs transformers' block ids into its causal mask (`block_pattern`: a
    multimodal model's images, PaliGemma's prompt), in this call's real tokens: their block queries; False where it
    has none (a mask without blocks); the cause it steps aside for where they are no blocks patchkit serves (in
    pieces, or behind a past); None for any other mask function."""
    pattern = block_pattern(function)
    if pattern is None:
        return None
    ids, windowed = pattern
    mask, q_length, kv_length = kwargs.get("attention_mask"), kwargs.get("q_length"), kwargs.get("kv_length")
    keys = ids.shape[-1] if kv_length is None else int(kv_length) + int(kwargs.get("kv_offset") or 0)
    padded = isinstance(mask, torch.Tensor) and mask.dim() == 2
    seen = min(keys, mask.shape[-1]) if padded else keys  # a static cache's unfilled slots: no token
    real = mask[:, :seen].bool() if padded else torch.ones_like(ids[:, :seen], dtype=torch.bool)
    found = id_blocks(ids[:, :seen], real, from_row_start=windowed is False)
    if found is None:
        return False
    if found is False:
        return "custom_mask_pattern"
    if q_length is None or not int(q_length) == seen == keys:
        return "bidirectional_image_tokens"  # a block behind a past (a prefill in chunks), or before unfilled slots
    found.windowed = windowed is not False
    return found
