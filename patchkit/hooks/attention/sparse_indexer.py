"""A sparse attention's indexer (DeepSeek-V3.2's DSA, GLM-5's) in a served forward: every key kept and none scored,
or, in a decode step past its top-k, the keys it selected as a cache of their own.

The indexer scores every (query, key) pair and keeps the `index_topk` best keys of each query; the layer then
attends to those alone. A query that sees no more than `index_topk` keys keeps all of them, so its attention is the
dense causal one that patchkit's kernels compute. The plan steps aside a forward of several queries a row with one
that sees more (`sparse_attention`, `hooks/decide/step_aside.py`); in the forwards it serves, the indexer's (B, S, T)
scores, computed for a top-k that keeps every key, are not computed. Its keys still go to the forward's cache, as
transformers' own code computes them. A decode step (one query a row) past `index_topk` keys runs the indexer as
transformers does, over the step's 2D mask, and attends densely to the keys it selected, gathered from the cache
(`selected_keys`): each row's keys, padding first, as a left-padded cache of `index_topk` columns.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.errors import PatchStateError
from patchkit.forward.inputs.arguments import CACHE_NAMES
from patchkit.forward.masks import VarlenMask


class _KeysStored(Exception):
    """The indexer's keys are in the cache: its forward ends there."""


class _StoreKeys:
    """The cache as a served forward's indexer sees it: its keys are stored as transformers' own code made them, and
    the scores after them are not computed."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def update_indexer(self, keys: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.cache.update_indexer(keys, layer_idx, *args, **kwargs)
        raise _KeysStored


def every_key(hidden_states: torch.Tensor) -> torch.Tensor:
    """The indices of a selection that kept every key: (B, S, 0), which no top-k of transformers' returns (it keeps
    at least one key), read by patchkit's attention function as "no key dropped" (`varlen.make_attention_function`)."""
    return hidden_states.new_empty((*hidden_states.shape[:2], 0), dtype=torch.int32)


def behind_growing_cache(mask: Any) -> bool:
    """`mask` is patchkit's 2D key-padding mask of a forward behind a past in a growing cache (no preallocated
    slots, no sliding offset): a decode step's, where its queries are one a row."""
    return (isinstance(mask, VarlenMask) and mask.mask is not None and mask.mask.dim() == 2 and bool(mask.past_len)
            and not mask.fixed_cache and not mask.key_offset)


def selecting(mask: VarlenMask, hidden_states: torch.Tensor, topk: int) -> bool:
    """A decode step on a growing cache with more key columns than the indexer keeps: its selection is run."""
    return hidden_states.shape[1] == 1 and behind_growing_cache(mask) and mask.mask.shape[-1] > topk


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (B, T) key-padding mask as the indexer reads a layer's mask: (B, 1, T), 0 at real keys, -inf at padding."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask.bool(), float("-inf"))[:, None]


def selected_keys(key: torch.Tensor, value: torch.Tensor, mask: Any, indices: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, VarlenMask]:
    """A decode step's keys and values at the indexer's `indices` (B, 1, k), gathered from the padded cache (B, Hk, T,
    D) in column order, and their key-padding mask: the padding it selected (a row with fewer than k real keys) comes
    first, so the k columns are a left-padded cache whose query, at its end, sees each real one."""
    if not (behind_growing_cache(mask) and indices.shape[1] == 1 and key.shape[-2] == mask.mask.shape[-1]):
        raise PatchStateError("a sparse attention's key selection reached patchkit's attention outside a decode step "
                              "on a growing cache, which the plan steps aside: a patchkit bug (report the model type)")
    columns = indices[:, 0].long().sort(dim=-1).values  # (B, k)
    real = mask.mask.gather(1, columns).bool()
    order = real.long().argsort(dim=-1, stable=True)  # padding first, each group in column order
    columns, real = columns.gather(1, order), real.gather(1, order)
    at = columns[:, None, :, None]
    key = key.gather(2, at.expand(-1, key.shape[1], -1, key.shape[-1]))
    value = value.gather(2, at.expand(-1, value.shape[1], -1, value.shape[-1]))
    selected = VarlenMask(real.to(mask.mask.dtype), past_len=columns.shape[-1] - 1, route=mask.route)
    selected.window, selected.mask_decides = mask.window, mask.mask_decides
    return key, value, selected


def make_indexer_forward(original: Callable, like: Optional[Callable] = None) -> Callable:
    """The indexer's forward: transformers' own where the layer was handed a 4D mask (a forward stepped aside), else
    the keys stored in the cache (where there is one) and `every_key`. `like`: the forward whose parameters `original`
    takes, where it does not say (an instance's wrapper of its class's)."""
    names = list(inspect.signature(like or original).parameters)[1:]  # after self; the mask's and cache's places
    at_mask = names.index("attention_mask") if "attention_mask" in names else None
    cache_name = next((n for n in CACHE_NAMES if n in names), None)
    at_cache = names.index(cache_name) if cache_name is not None else None

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attention_mask", args[at_mask] if at_mask is not None and len(args) > at_mask else None)
        if not isinstance(mask, VarlenMask):
            return original(self, *args, **kwargs)
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        if selecting(mask, hidden_states, self.index_topk):  # transformers' selection, over the step's 2D mask
            read = additive(mask.mask, torch.float32)
            if at_mask is not None and len(args) > at_mask:
                return original(self, *args[:at_mask], read, *args[at_mask + 1:], **kwargs)
            return original(self, *args, **{**kwargs, "attention_mask": read})
        positional = at_cache is not None and len(args) > at_cache
        cache = args[at_cache] if positional else kwargs.get(cache_name) if cache_name else None
        if cache is not None:
            if positional:
                args = (*args[:at_cache], _StoreKeys(cache), *args[at_cache + 1:])
            else:
                kwargs = {**kwargs, cache_name: _StoreKeys(cache)}
            try:
                original(self, *args, **kwargs)
            except _KeysStored:
                pass
        return every_key(hidden_states)

    return forward
