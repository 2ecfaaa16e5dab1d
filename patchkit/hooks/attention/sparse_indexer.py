"""A sparse attention's indexer (DeepSeek-V3.2's DSA, GLM-5's, Kolibri-1.1's) in a served forward: every key kept and
none scored, or, in a decode step past its budget, the keys it selected as a cache of their own.

The indexer scores every (query, key) pair and keeps the best keys of each query (DSA: `index_topk`; Kolibri-1.1:
that many, plus its first sink and last local tokens); the layer then attends to those alone. A query that sees no
more keys than that keeps all of them, so its attention is the dense causal one that patchkit's kernels compute. The
plan steps aside a forward of several queries a row with one that sees more (`sparse_attention`,
`hooks/decide/step_aside.py`); in the forwards it serves, the indexer's scores, computed for a selection that keeps
every key, are not computed. DSA's indexer keys still go to the forward's cache, as transformers' own code computes
them. A decode step (one query a row) past the budget runs the indexer as transformers does, over the step's 2D mask,
and attends densely to the keys it selected, gathered from the cache (`selected_keys`): each row's keys, padding
first, as a left-padded cache. A DSA indexer returns their indices (handed to the attention as `indices=`); Kolibri's
returns a mask of them, which the layer hands on in place of its own (`VarlenMask.selection`).
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


def selecting(mask: VarlenMask, queries: int, keeps: int) -> bool:
    """A decode step (`queries` a row) on a growing cache with more key columns than the indexer `keeps`: its
    selection is run."""
    return queries == 1 and behind_growing_cache(mask) and mask.mask.shape[-1] > keeps


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (B, T) key-padding mask as the indexer reads a layer's mask: (B, 1, T), 0 at real keys, -inf at padding."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask.bool(), float("-inf"))[:, None]


def chosen_by(indices: torch.Tensor, mask: VarlenMask) -> torch.Tensor:
    """The real keys a decode step's DSA `indices` (B, 1, k) select, as a (B, T) boolean over the mask's columns."""
    chosen = torch.zeros(mask.mask.shape, dtype=torch.bool, device=indices.device)
    return chosen.scatter_(1, indices[:, 0].long(), True) & mask.mask.bool()


def selected_keys(key: torch.Tensor, value: torch.Tensor, mask: Any, chosen: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, VarlenMask]:
    """A decode step's keys and values that its indexer `chosen` (B, T: the real keys it selected), gathered from the
    padded cache (B, Hk, T, D) in column order, and their key-padding mask: k columns, k the most any row chose, a
    row's keys at the end and padding (keys it did not choose) before them, so that they are a left-padded cache whose
    query, at its end, sees each chosen one."""
    if not (behind_growing_cache(mask) and key.shape[-2] == mask.mask.shape[-1] == chosen.shape[-1]):
        raise PatchStateError("a sparse attention's key selection reached patchkit's attention outside a decode step "
                              "on a growing cache, which the plan steps aside: a patchkit bug (report the model type)")
    keep = int(chosen.sum(-1).max())
    columns = chosen.long().argsort(dim=-1, stable=True)[:, chosen.shape[-1] - keep:]  # (B, k): unchosen first
    real = chosen.gather(1, columns)
    at = columns[:, None, :, None]
    key = key.gather(2, at.expand(-1, key.shape[1], -1, key.shape[-1]))
    value = value.gather(2, at.expand(-1, value.shape[1], -1, value.shape[-1]))
    selected = VarlenMask(real.to(mask.mask.dtype), past_len=keep - 1, route=mask.route)
    selected.window, selected.mask_decides = mask.window, mask.mask_decides
    return key, value, selected


def make_indexer_forward(original: Callable, like: Optional[Callable] = None) -> Callable:
    """The indexer's forward: transformers' own where the layer was handed a 4D mask (a forward stepped aside), else
    the keys stored in the cache (where there is one) and `every_key`, or, for an indexer whose layer overlays a mask
    of its selection on its own (Qwen4-Exp's QSA: `overlays`), that mask itself. `like`: the forward whose parameters
    `original` takes, where it does not say (an instance's wrapper of its class's)."""
    names = list(inspect.signature(like or original).parameters)[1:]  # after self; the mask's and cache's places
    if "query_states" in names:
        return make_selecting_forward(original, like)
    at_mask = names.index("attention_mask") if "attention_mask" in names else None
    cache_name = next((n for n in CACHE_NAMES if n in names), None)
    at_cache = names.index(cache_name) if cache_name is not None else None

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask", args[at_mask] if at_mask is not None and len(args) > at_mask else None)
        if not isinstance(mask, VarlenMask):
            if overlays(self):
                remember_cause(self, mask)
            return original(self, *args, **kwargs)
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        if selecting(mask, hidden_states.shape[1], budget(self)):  # transformers' selection, over the step's 2D mask
            # as the indexer reads a layer's mask: DSA's (B, 1, T) additive, QSA's (B, 1, 1, T) boolean
            read = visible(mask) if overlays(self) else additive(mask.mask, torch.float32)
            if at_mask is not None and len(args) > at_mask:
                chosen = original(self, *args[:at_mask], read, *args[at_mask + 1:], **kwargs)
            else:
                chosen = original(self, *args, **{**kwargs, "attention_mask": read})
            return with_selection(mask, chosen) if overlays(self) else chosen
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
        return mask if overlays(self) else every_key(hidden_states)

    return forward


def overlays(indexer: nn.Module) -> bool:
    """The indexer returns a mask of the keys it selects, which its layer overlays on its own (Qwen4-Exp's QSA:
    `token_budget`), not their indices (DSA's)."""
    return hasattr(indexer, "token_budget")


def make_selecting_forward(original: Callable, like: Optional[Callable] = None) -> Callable:
    """The forward of an indexer that returns a mask of the keys it selects and the pool it chose them from
    (Kolibri-1.1's: `(query_states, key_states, attention_mask, index_pool)`): transformers' own under a 4D mask;
    in a served forward the layer's own mask (every key) and the pool as it came; in a decode step past its budget
    the mask with the step's selection (`VarlenMask.selection`), made by transformers' code over the step's 2D mask."""
    signature = inspect.signature(like or original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        given = signature.bind(self, *args, **kwargs).arguments
        mask, queries = given.get("attention_mask"), given["query_states"]
        if not isinstance(mask, VarlenMask):
            remember_cause(self, mask)
            return original(self, *args, **kwargs)
        if not selecting(mask, queries.shape[2], budget(self)):
            return mask, given.get("index_pool")
        chosen, pool = original(self, queries, given["key_states"], visible(mask), given.get("index_pool"))
        return with_selection(mask, chosen), pool

    return forward


def budget(indexer: nn.Module) -> int:
    """How many keys an indexer keeps for each query: its top-k, and its sink and local tokens where it has them;
    QSA's budget of whole blocks, and the incomplete block of a query's last keys (`registry.index_topk`)."""
    if overlays(indexer):
        return indexer.token_budget + indexer.compress_ratio - 1
    topk = getattr(indexer, "index_topk", None)
    if topk is None:
        topk = indexer.topk
    return topk + getattr(indexer, "num_local_tokens", 0) + getattr(indexer, "num_sink_tokens", 0)


def visible(mask: VarlenMask) -> torch.Tensor:
    """A decode step's 2D mask as a mask-returning indexer reads its layer's: (B, 1, 1, T), every real key seen."""
    return mask.mask.bool()[:, None, None, :]


def with_selection(mask: VarlenMask, chosen: torch.Tensor) -> VarlenMask:
    """`mask` with the real keys of a decode step that a mask-returning indexer `chosen` ((B, 1, 1, T))."""
    return mask.with_selection(chosen[:, 0, 0] & mask.mask.bool())


def remember_cause(indexer: nn.Module, mask: Any) -> None:
    """The cause patchkit made a handed-back mask for, kept on a mask-returning indexer: its layer overlays the
    selection on that mask as a new tensor, which carries no tag (`overlaid_cause`)."""
    indexer.patchkit_cause = getattr(mask, "patchkit_cause", None)


def overlaid_cause(module: nn.Module) -> Optional[str]:
    """The step-aside cause of the mask a layer's indexer overlaid its selection on (Kolibri-1.1's and Qwen4-Exp's
    layers hand attention a new tensor, without the tags of patchkit's own), or None."""
    return getattr(getattr(module, "indexer", None), "patchkit_cause", None)
