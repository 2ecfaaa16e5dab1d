"""generate()'s 4D masks for a static cache, read back as the 2D key-padding mask they were made from, when they
are that; and a caller's 2D mask over every slot, cut to the filled ones.

With a compileable cache, transformers' `prepare_inputs_for_generation` builds the masks before the model runs
(`create_masks_for_generate`, with the model's own eager or sdpa mask function, outside the patch): per layer type,
a (B, 1, q_len, K) tensor over the keys that type's cache layers return (a full layer's every slot; a sliding
layer's slots, or its window's last keys once full), causal (query i sits at position past + i), inside the window
for sliding layers, AND the 2D padding mask. Each key a query sees is real; rebuilding every 4D mask from those
keys and comparing it exactly (every entry, additive masks only 0 or the dtype's minimum) proves it is that and
nothing else. Only StaticCaches of full-attention StaticLayers and (4.57+) in-order StaticSlidingWindowLayers
qualify, which the varlen path already places (`VarlenMask`, `cache_placement`); anything else keeps stepping aside.
"""

from __future__ import annotations

import sys
from typing import Any, Collection, Optional

import torch

from patchkit.forward.documents import allowed_keys
from patchkit.forward.inputs.arguments import (
    binary_4d_masks,
    documents_in_4d_mask,
    ends_in_padding,
    given_cache,
    input_tokens,
    sliding_window,
    take_documents,
    window_over_hole,
)
from patchkit.forward.liveness import is_compiling
from patchkit.forward.masks import cache_placement, fixed_slots
from patchkit.hooks.install.routing import attn_name


def static_cache(cache: Any) -> bool:
    """`cache` is transformers' StaticCache, whatever its layers."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(cache, getattr(cache_utils, "StaticCache", ()))


def static_layers(cache: Any, cross: Collection[int] = ()) -> Optional[list[tuple[bool, int]]]:
    """A StaticCache's attention layers as (sliding, slots): full-attention StaticLayers and, from transformers 4.57,
    the StaticSlidingWindowLayers that keep a window's last keys in order (a hybrid's layers that hold such keys
    beside a recurrent state alike); None for any other cache or layer (4.56's sliding layers among them).

    A hybrid's layers that hold no keys (a Mamba or linear-attention layer's `LinearAttentionLayer`, a KV-sharing
    or MLP-only layer's `DummyLayer`) are left out: no attention mask places anything in them; so are the layers
    `cross` indexes (Mllama's cross-attention layers, which hold the image tiles' keys: `cross_layers`)."""
    try:
        from transformers import cache_utils
    except ImportError:  # before 4.36: tuple caches, no cache_utils
        return None
    full = getattr(cache_utils, "StaticLayer", None)  # before 4.56 (no cache layers): not served
    layers = getattr(cache, "layers", None)
    if full is None or type(cache) is not cache_utils.StaticCache or not layers:
        return None
    kinds = {full: False, getattr(cache_utils, "StaticSlidingWindowLayer", None): True,
             getattr(cache_utils, "LinearAttentionAndStaticFullAttentionLayer", None): False,
             getattr(cache_utils, "LinearAttentionAndStaticSlidingWindowAttentionLayer", None): True}
    keyless = tuple(k for k in (getattr(cache_utils, "LinearAttentionLayer", None),
                                getattr(cache_utils, "DummyLayer", None)) if k is not None)
    attending = [layer for i, layer in enumerate(layers) if type(layer) not in keyless and i not in cross]
    if not attending or any(type(layer) not in kinds for layer in attending):
        return None
    return [(kinds[type(layer)], layer.max_cache_len) for layer in attending]


def cross_layers(module: Any) -> frozenset[int]:
    """The indices of `module`'s cross-attention layers (Mllama's `cross_attention_layers`), whose cache layers hold
    another tower's keys, which no attention mask of the text places."""
    found = getattr(getattr(module, "config", None), "cross_attention_layers", None)
    return frozenset(found) if isinstance(found, (list, tuple)) else frozenset()


def causal_over_slots(
    keys: torch.Tensor, past: int, q_len: int, slots: int, window: Optional[int] = None, offset: int = 0,
    reach: Optional[torch.Tensor] = None, unwindowed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(B, 1, q_len, slots) booleans: query i (at position past + i) sees the key at position offset + j (column j)
    when it is not after the query (after `reach` (B, q_len), the last position each query sees, where given),
    inside the window (`window`: less than that many positions back; the queries `unwindowed` (B, q_len) marks have
    none) and real in `keys` (B, past + q_len); no unfilled slot."""
    positions = torch.arange(offset, offset + slots, device=keys.device)
    queries = torch.arange(past, past + q_len, device=keys.device)[:, None]
    seen = positions[None, :] <= (queries if reach is None else reach[:, :, None])
    if window is not None:
        inside = positions[None, :] > queries - window
        seen = seen & (inside if unwindowed is None else inside | unwindowed[:, :, None])
    real = keys[:, offset : offset + slots]
    padding = torch.nn.functional.pad(real, (0, slots - real.shape[-1]))
    return ((seen if seen.dim() == 3 else seen[None]) & padding[:, None, :])[:, None]


def same_mask(mask: torch.Tensor, expected: torch.Tensor) -> bool:
    """`mask` (boolean, or additive: 0 and the dtype's minimum only) is exactly `expected`; one host sync."""
    if mask.dtype == torch.bool:
        return torch.equal(mask, expected)
    if not mask.is_floating_point():
        return False
    blocked = torch.tensor(torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device)
    return torch.equal(mask, torch.where(expected, torch.zeros_like(blocked), blocked))


def returned_keys(layers: list[tuple[bool, int]], sliding: bool, past: int, q_len: int) -> Optional[int]:
    """How many keys the cache's full (or sliding) layers return to a forward of q_len tokens behind `past`: a full
    layer its slots; a sliding one its slots until they overflow, then every key, and once full, its window's last
    keys and the new ones (StaticSlidingWindowLayer.update). None where its layers disagree."""
    sizes = {slots for kind, slots in layers if kind == sliding}
    if len(sizes) != 1:
        return None
    slots = sizes.pop()
    if not sliding or past + q_len <= slots:
        return slots
    return past + q_len if past < slots else slots + q_len - 1


def layer_type_masks(module: Any, mask: Any) -> Optional[dict[Optional[int], Any]]:
    """generate()'s mask (one tensor, or one per layer type) keyed by the window its layers apply (None: none), or
    None for a layer type patchkit does not place (chunked attention, ...)."""
    window = sliding_window(module.config)
    if not isinstance(mask, dict):
        return {window: mask}
    kinds = {"full_attention": None, "sliding_attention": window}
    mask = {kind: m for kind, m in mask.items() if kind not in RECURRENT_KINDS}
    if not mask or not set(mask) <= set(kinds) or (window is None and "sliding_attention" in mask):
        return None
    return {kinds[kind]: m for kind, m in mask.items()}


# a hybrid's Mamba, linear-attention and convolution layers: generate() hands them the 2D padding mask
# (`create_recurrent_attention_mask`), not an attention mask
RECURRENT_KINDS = ("linear_attention", "conv")


def same_recurrent_masks(mask: Any, keys: torch.Tensor, q_len: int) -> bool:
    """Each recurrent layer type's mask in generate()'s `mask` is what the model builds from the 2D mask `keys`
    (`create_recurrent_attention_mask`): None for one token or a mask without padding, else its last q_len columns."""
    if not isinstance(mask, dict):
        return True
    bare = q_len == 1 or bool(keys.all())
    for m in (mask[kind] for kind in RECURRENT_KINDS if kind in mask):
        rebuilt = m is None if bare else isinstance(m, torch.Tensor) and torch.equal(m, keys[:, -q_len:].to(m.dtype))
        if not rebuilt:
            return False
    return True


def padding_from_slots_mask(module: Any, arguments: dict) -> Optional[tuple[torch.Tensor, int]]:
    """(the 2D mask (B, past + q_len), 1 = real, that generate()'s 4D masks for this static cache exactly are, past),
    or None.

    A full-attention layer's mask covers the cache's slots from position 0; a sliding layer's (4.57+) the keys its
    layer returns: its slots from 0 while the window is not yet full, else the last keys in order, ending at the
    last query. Each column's key is real where some query sees it; the masks rebuilt from those keys must equal
    the given ones. A layer type whose mask sdpa skipped (None: causal, no padding) has every key real. Positions
    no mask covers (before a sliding-only model's window) are never read: zero.
    """
    masks, cache = layer_type_masks(module, arguments.get("attention_mask")), given_cache(arguments)
    layers, tokens = static_layers(cache, cross_layers(module)), input_tokens(arguments)
    if masks is None or layers is None or tokens is None or {w is not None for w in masks} != {s for s, _ in layers}:
        return None  # each mask's layers are the cache's: sliding ones under the window's mask, full ones not
    batch, q_len = tokens.shape[:2]
    given = {window: m for window, m in masks.items() if m is not None}  # None: sdpa's causal skip, no padding
    if not given or any(not isinstance(m, torch.Tensor) or m.dim() != 4 or m.shape[:3] != (batch, 1, q_len)
                        for m in given.values()):
        return None
    past, _ = cache_placement(cache, arguments.get("cache_position"))
    end = past + q_len
    sizes = {window: returned_keys(layers, window is not None, past, q_len) for window in masks}
    if None in sizes.values() or any(m.shape[-1] != sizes[window] for window, m in given.items()):
        return None  # a mask sized for another cache
    offsets = {window: max(end - size, 0) for window, size in sizes.items()}  # the first column's position
    if offsets.get(None, 0):  # full layers' slots begin at position 0: this forward overflows them
        return None
    keys = torch.zeros(batch, end, dtype=torch.bool, device=tokens.device)
    for window, m in masks.items():  # a key is real where some query sees it
        keys[:, offsets[window] :] |= True if m is None else allowed_keys(m[..., : end - offsets[window]]).any(dim=1)
    for window, m in given.items():
        if not same_mask(m, causal_over_slots(keys, past, q_len, m.shape[-1], window, offsets[window])):
            return None
    if not same_recurrent_masks(arguments.get("attention_mask"), keys, q_len):
        return None
    return keys.long(), past


def served_cause(module: Any, arguments: dict, extra: dict, cause: Optional[str]) -> Optional[str]:
    """`forward_cause`'s verdict once the masks patchkit serves are put in the form its path reads (in place): a 4D
    one (`served_4d_cause`), or a 2D mask over a static cache's every slot on a windowed model (`cut_slots_mask`)."""
    if cause == "custom_4d_mask":
        return served_4d_cause(module, arguments, extra)
    if cause is None:
        no_masks_made(arguments)
        flash_masks_made(arguments)
        cut_slots_mask(module, arguments)
    return cause


def no_masks_made(arguments: dict) -> None:
    """Masks per layer type made before this forward (a multimodal model's for its language model, generate()'s)
    that are all None, transformers' sdpa skip (causal, no padding, nothing else): no mask at all, so this forward
    builds its own, patchkit's. Handed on as None, its layers would run patchkit's attention on the forward's route
    and transformers' in a checkpoint's recompute, which sees no patchkit mask (Gemma 4's CheckpointError)."""
    mask = arguments.get("attention_mask")
    if isinstance(mask, dict) and mask and all(m is None for m in mask.values()):
        arguments["attention_mask"] = None


def flash_masks_made(arguments: dict) -> None:
    """Masks per layer type made before this forward by transformers' `flash_attention_mask` (generate()'s for a
    static cache, on a model loaded with flash attention): 2D masks, each the last columns of the widest, or None (no
    padding). Handed on, they would reach the layers as they are, past the mask function that places a static
    cache's slots (a crash: the mask is shorter than the slots); the widest is this forward's 2D mask."""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, dict):
        return
    given = [m for m in mask.values() if m is not None]
    if not given or any(not isinstance(m, torch.Tensor) or m.dim() != 2 for m in given):
        return
    widest = max(given, key=lambda m: m.shape[-1])
    if all(m.shape[0] == widest.shape[0] and torch.equal(m, widest[:, widest.shape[-1] - m.shape[-1]:])
           for m in given):
        arguments["attention_mask"] = widest


def cut_slots_mask(module: Any, arguments: dict) -> None:
    """A 2D mask over a static cache's every slot, on a model with a sliding window: its first past + q_len columns.

    Causal attention never sees a column past its query, so the unfilled tail is never read, unpatched either; a
    sliding layer's rolling buffer is placed by the shorter mask, and full layers by either (`keys_in_use`).
    """
    mask, tokens = arguments.get("attention_mask"), input_tokens(arguments)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or mask.shape[-1] <= tokens.shape[1]:
        return
    cache = given_cache(arguments)
    if not fixed_slots(cache) or sliding_window(module.config) is None or is_compiling():
        return
    past, _ = cache_placement(cache, arguments.get("cache_position"))
    if mask.shape[-1] > past + tokens.shape[1]:
        arguments["attention_mask"] = mask[:, : past + tokens.shape[1]]


def adds_a_bool_mask(module: Any, mask: Any) -> bool:
    """A boolean 4D mask on a model loaded with eager attention: transformers' eager attention adds the mask to the
    scores, so a boolean one masks nothing there (True is +1, False 0). Only stepping aside gives those numbers."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.bool and (
        attn_name(module.config) == "eager")


def served_4d_cause(module: Any, arguments: dict, extra: dict) -> Optional[str]:
    """What a forward given a 4D mask steps aside for, or None where the mask is one the varlen path serves exactly:
    packed documents (now `cu_seq_lens`), or a static cache's causal-and-padding mask (now the 2D mask), both in
    `arguments` / `extra`, in place. A static-cache prefill whose last column is padding in a row with real tokens
    (right padding: generate() reads that row's next token there, which varlen kernels skip) steps aside as
    right_padded_generation; documents longer than the model's sliding window as window_under_4d_mask; a boolean
    mask that eager attention adds to its scores as bool_mask_on_eager. transformers before 4.41 read a caller's 4D
    mask as binary, not additive: there every one steps aside as custom_4d_mask."""
    if adds_a_bool_mask(module, arguments.get("attention_mask")):
        return "bool_mask_on_eager"
    if binary_4d_masks():
        return "custom_4d_mask"
    documents = documents_in_4d_mask(arguments, extra)
    if documents is not None:
        window = sliding_window(module.config)
        if window is not None and documents[1] > window:  # transformers applies no window over a 4D mask
            return "window_under_4d_mask"
        take_documents(arguments, extra, documents)
        return None
    found = padding_from_slots_mask(module, arguments)
    if found is None:  # generate()'s masks per layer type for a static cache (a dict: transformers' alone), or others
        made = isinstance(arguments.get("attention_mask"), dict) and static_cache(given_cache(arguments))
        return "static_cache_mask" if made else "custom_4d_mask"
    keys, past = found
    if past == 0 and ends_in_padding(keys):
        return "right_padded_generation"
    if window_over_hole(module.config, keys):  # a right-padded prompt's decode steps on a windowed model
        return "window_over_padding_hole"
    arguments["attention_mask"] = keys
    return None
