"""A sparse attention's indexer (DeepSeek-V3.2's DSA, GLM-5's) in a served forward: every key kept, none scored.

The indexer scores every (query, key) pair and keeps the `index_topk` best keys of each query; the layer then
attends to those alone. A query that sees no more than `index_topk` keys keeps all of them, so its attention is the
dense causal one that patchkit's kernels compute. The plan steps aside any forward with a query that sees more
(`sparse_attention`, `hooks/decide/step_aside.py`); in the forwards it serves, the indexer's (B, S, T) scores,
computed for a top-k that keeps every key, are not computed. Its keys still go to the forward's cache, as
transformers' own code computes them, so that a later step past `index_topk` (stepped aside) reads the same cache.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

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
    at least one key), read by the attention function as "no key dropped" (`arguments.check_call`)."""
    return hidden_states.new_empty((*hidden_states.shape[:2], 0), dtype=torch.int32)


def kept_every_key(indices: Any) -> bool:
    """`indices` (a layer's `indices=` to its attention function) is `every_key`'s."""
    return isinstance(indices, torch.Tensor) and indices.dim() == 3 and indices.shape[-1] == 0


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
