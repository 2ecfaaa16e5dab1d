"""generate()'s 4D mask for a static cache, read back as the 2D key-padding mask it was made from, when it is one;
and a caller's 2D mask over every slot, cut to the filled ones.

With a compileable cache, transformers' `prepare_inputs_for_generation` builds the mask before the model runs
(`create_masks_for_generate`, with the model's own eager or sdpa mask function, outside the patch): a
(B, 1, q_len, max_cache_len) tensor that is causal over the cache's slots (query i of this forward sits at slot
past + i) AND the 2D padding mask padded with zeros over the unfilled slots. Its last query row holds that 2D mask's
first past + q_len columns; rebuilding the 4D mask from them and comparing it exactly (every entry, additive masks
only 0 or the dtype's minimum) proves it is that and nothing else. Only a StaticCache of full-attention layers
on a config without a sliding window qualifies, where the varlen path already places queries in the slots
(`VarlenMask`, `cache_placement`); anything else keeps stepping aside.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from patchkit.forward.documents import allowed_keys
from patchkit.forward.liveness import is_compiling
from patchkit.forward.masks import cache_placement, fixed_slots
from patchkit.hooks.step_aside import documents_in_4d_mask, input_tokens, sliding_window, take_documents


def full_static_cache(cache: Any) -> Optional[int]:
    """A StaticCache whose every layer is a full-attention StaticLayer: its slot count, else None."""
    try:
        from transformers.cache_utils import StaticCache, StaticLayer
    except ImportError:  # before 4.56 (no cache layers): not served
        return None
    layers = getattr(cache, "layers", None)
    if type(cache) is not StaticCache or not layers or any(type(layer) is not StaticLayer for layer in layers):
        return None
    slots = {layer.max_cache_len for layer in layers}
    return slots.pop() if len(slots) == 1 else None


def causal_over_slots(keys: torch.Tensor, past: int, q_len: int, slots: int) -> torch.Tensor:
    """(B, 1, q_len, slots) booleans: query i (at slot past + i) sees slot j <= past + i where `keys` (B, past + q_len)
    is real; no unfilled slot."""
    idx = torch.arange(slots, device=keys.device)
    causal = idx[None, :] <= torch.arange(past, past + q_len, device=keys.device)[:, None]
    padding = torch.nn.functional.pad(keys, (0, slots - keys.shape[-1]))
    return (causal[None] & padding[:, None, :])[:, None]


def same_mask(mask: torch.Tensor, expected: torch.Tensor) -> bool:
    """`mask` (boolean, or additive: 0 and the dtype's minimum only) is exactly `expected`; one host sync."""
    if mask.dtype == torch.bool:
        return torch.equal(mask, expected)
    if not mask.is_floating_point():
        return False
    blocked = torch.tensor(torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device)
    return torch.equal(mask, torch.where(expected, torch.zeros_like(blocked), blocked))


def padding_from_slots_mask(module: Any, arguments: dict) -> Optional[tuple[torch.Tensor, int]]:
    """(the 2D mask (B, past + q_len), 1 = real, that generate()'s 4D mask for this static cache exactly is, past), or
    None."""
    mask, cache = arguments.get("attention_mask"), arguments.get("past_key_values")
    if isinstance(mask, dict):  # generate()'s masks per layer type: served only when every layer attends fully
        mask = mask.get("full_attention") if set(mask) == {"full_attention"} else None
    slots = full_static_cache(cache)
    if slots is None or sliding_window(module.config) is not None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != slots:
        return None
    tokens = input_tokens(arguments)
    batch, _, q_len, _ = mask.shape
    if tokens is None or tuple(tokens.shape[:2]) != (batch, q_len):
        return None
    past, _ = cache_placement(cache, arguments.get("cache_position"))
    if past + q_len > slots:
        return None
    keys = allowed_keys(mask[:, :, -1:, : past + q_len])[:, 0]  # the last query sees every real column before it
    return (keys.long(), past) if same_mask(mask, causal_over_slots(keys, past, q_len, slots)) else None


def served_cause(module: Any, arguments: dict, extra: dict, cause: Optional[str]) -> Optional[str]:
    """`forward_cause`'s verdict once the masks patchkit serves are put in the form its path reads (in place): a 4D
    one (`served_4d_cause`), or a 2D mask over a static cache's every slot on a windowed model (`cut_slots_mask`)."""
    if cause == "custom_4d_mask":
        return served_4d_cause(module, arguments, extra)
    if cause is None:
        cut_slots_mask(module, arguments)
    return cause


def cut_slots_mask(module: Any, arguments: dict) -> None:
    """A 2D mask over a static cache's every slot, on a model with a sliding window: its first past + q_len columns.

    Causal attention never sees a column past its query, so the unfilled tail is never read, unpatched either; a
    sliding layer's rolling buffer is placed by the shorter mask, and full layers by either (`keys_in_use`).
    """
    mask, tokens = arguments.get("attention_mask"), input_tokens(arguments)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or mask.shape[-1] <= tokens.shape[1]:
        return
    cache = arguments.get("past_key_values")
    if not fixed_slots(cache) or sliding_window(module.config) is None or is_compiling():
        return
    past, _ = cache_placement(cache, arguments.get("cache_position"))
    if mask.shape[-1] > past + tokens.shape[1]:
        arguments["attention_mask"] = mask[:, : past + tokens.shape[1]]


def served_4d_cause(module: Any, arguments: dict, extra: dict) -> Optional[str]:
    """What a forward given a 4D mask steps aside for, or None where the mask is one the varlen path serves exactly:
    packed documents (now `cu_seq_lens`), or a static cache's causal-and-padding mask (now the 2D mask), both in
    `arguments` / `extra`, in place. A static-cache prefill whose last column is padding in a row with real tokens
    (right padding: generate() reads that row's next token there, which varlen kernels skip) steps aside as
    right_padded_generation; documents longer than the model's sliding window as window_under_4d_mask."""
    documents = documents_in_4d_mask(arguments, extra)
    if documents is not None:
        window = sliding_window(module.config)
        if window is not None and documents[1] > window:  # transformers applies no window over a 4D mask
            return "window_under_4d_mask"
        take_documents(arguments, extra, documents)
        return None
    found = padding_from_slots_mask(module, arguments)
    if found is None:
        return "custom_4d_mask"
    keys, past = found
    if past == 0 and bool(((keys[:, -1] == 0) & (keys != 0).any(-1)).any()):
        return "right_padded_generation"
    arguments["attention_mask"] = keys
    return None
