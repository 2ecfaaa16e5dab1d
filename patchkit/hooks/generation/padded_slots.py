"""A cache a padded forward filled holds other numbers at its padding slots, which every later forward must mask.

patchkit's attention computes nothing for padding tokens, so the keys and values transformers' padded prefill stores
there (those of the pad tokens' hidden states, layer by layer) do not exist: unpadded once per forward,
`filled_cache.filled_padded` stores a filler; unpadded in each attention layer (or under the registered name alone),
the padding rows' hidden states differ from the first layer on. generate() and every decode loop that passes the
prefill's mask, extended by the new tokens, never read them. A forward over such a cache with
no mask, or with one that leaves those slots unmasked (a mask of ones), would read them: its numbers would differ
from transformers', which reads the pad tokens' keys there, and no path can make those. It is refused, naming the fix.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from patchkit.errors import PatchInputError
from patchkit.forward.cache_length import past_length
from patchkit.forward.inputs.arguments import fills_short_masks, input_tokens
from patchkit.forward.liveness import is_compiling

MARK = "patchkit_padding"  # on the cache: the filling forward's 2D mask (unread), `Read` (padding there, read by a
# forward of one token), or True: padding there, where unknown


class Read:
    """A filling forward's 2D mask read once, with padding: a later forward of one token (a decode step, which
    extends the mask it was given) is not read again; one of several tokens (a next turn, a chunk, assisted
    decoding's candidates), whose mask a caller builds anew, is."""

    __slots__ = ("mask",)

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask


def mark(cache: Any, mask: Any, padding: Optional[bool]) -> None:
    """A forward of several tokens run patched filled `cache` under `mask` (2D, over the past too): `padding`, whether
    some new token was padding (its slots hold filler), or None where unknown (the layers ran the padded batch, whose
    padding rows got other numbers than transformers'), read by the next forward's `check` where it matters. A
    padded past stays marked until `check` sees the cache emptied."""
    if padding is False or is_compiling() or cache is None or not hasattr(cache, "__dict__"):
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        filled = past_length(cache)  # the keys stored so far: a static cache's mask may cover its unfilled slots too
        vars(cache)[MARK] = mask[:, : int(filled)] if filled is not None and 0 < filled < mask.shape[1] else mask
    elif padding:
        vars(cache)[MARK] = True


def marked_by(out: Any, arguments: dict) -> None:
    """The cache of a forward whose layers ran on the padded batch (`unpad="attention"`, the name alone), marked with
    its mask where it ran several tokens (a decode step's one new token is no padding)."""
    tokens = input_tokens(arguments)
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tokens.shape[1] > 1 and isinstance(out, Mapping):
        keys = out.keys()  # read as items, not attributes: 5.24+ logs a deprecation for `past_key_values`
        cache = next((out[key] for key in ("cache", "past_key_values") if key in keys), None)
        mark(cache, arguments.get("attention_mask"), None)


def check(cache: Any, mask: Any, tokens: Any) -> None:
    """Refuse a forward of `tokens` over `cache` that would read the filler at its padding slots: no mask, or a 2D
    mask that leaves one of them unmasked. A marked mask is read by the next forward (one device sync), and
    forgotten where it had no padding; then again by each forward of several tokens (`Read`) and each with no mask,
    not by the decode steps that extend the mask they were given. An emptied cache (`reset()`) forgets its mark."""
    marked = vars(cache).get(MARK) if cache is not None and hasattr(cache, "__dict__") else None
    if marked is None or is_compiling():
        return
    past = past_length(cache)
    if not past:
        del vars(cache)[MARK]
        return
    new = tokens.shape[1] if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else 0
    narrow = isinstance(mask, torch.Tensor) and mask.shape[-1] < int(past) + new  # transformers masks the rest
    filled = marked.mask if isinstance(marked, Read) and (new > 1 or mask is None or narrow) else marked
    if isinstance(filled, torch.Tensor):
        read = unmasked(filled, mask, int(past) + new)
        if read is None:
            return  # not lined up with the filled columns: the shape checks refuse or read it
        had, seen = read
        if seen:
            raise PatchInputError(_refusal("no attention_mask masks that forward's padding" if mask is None else
                                           "its attention_mask leaves that forward's padding unmasked"))
        if had:
            vars(cache)[MARK] = Read(filled)
        else:
            del vars(cache)[MARK]
    elif mask is None:
        raise PatchInputError(_refusal("no attention_mask masks that forward's padding"))


def unmasked(filled: torch.Tensor, mask: Any, keys: int) -> Optional[tuple[bool, bool]]:
    """(whether `filled`, the filling forward's mask, had padding; whether `mask`, no mask or a 2D one over the past
    and new columns, lets a query see one of those slots), in one device read; None where they do not line up (a
    mask of fewer rows; before 4.53, of more rows, or more columns than the `keys`). A wider one is read as
    transformers 4.53+ does, by its first rows and columns (`mask_beyond_call`); a narrower one covers the first
    columns, and transformers masks the others (it pads the mask with zeros); a row whose narrow mask hides every key
    attends evenly to all of them in transformers' attention, padding slots included (a full-width one's is a padding
    row)."""
    padding = filled == 0
    if mask is None:
        seen = padding.any()
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2 and (
            (mask.shape[0] == filled.shape[0] and mask.shape[1] <= keys)
            or (mask.shape[0] >= filled.shape[0] and fills_short_masks())):
        visible = mask[: filled.shape[0], :keys] != 0  # transformers' masks read a wider one's first rows and columns
        width = min(visible.shape[1], filled.shape[1])
        seen = (padding[:, :width] & visible[:, :width]).any()
        if mask.shape[1] < keys:  # a real query that sees no key (its own column masked with the rest)
            seen = seen | (padding.any(-1) & ~visible.any(-1)).any()
    else:
        return None
    had, read = torch.stack([padding.any(), seen]).tolist()
    return bool(had), bool(read)


def _refusal(what: str) -> str:
    return (
        f"this forward continues a cache that a padded forward filled, and {what}: patchkit's attention computes "
        "nothing for padding tokens, so the cache holds other keys and values at their slots than transformers' "
        "padded forward stores, and attending to them gives other results. Fix: pass attention_mask over the past and "
        "new tokens, the padding 0, as generate() does: torch.cat([mask, mask.new_ones(batch, new_tokens)], -1)"
    )
