"""Continuous batching's layer calls on the varlen path: its requests' lengths as the metadata, its mask checked."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.forward.inputs.paged import (
    MISMATCH,
    PAGED_ARGUMENTS,
    cache_beside,
    mask_window,
    paged_lengths,
    paged_metadata,
)
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.attention.eager import loaded_function
from patchkit.hooks.decide.step_aside import step_aside

PAGED_MISMATCH = ("continuous batching built a 4D mask other than the causal pattern its per-request lengths "
                  "describe, which is what patchkit's kernels would run")
CACHE_BESIDE = ("continuous batching handed attention its paged cache to update (transformers before 5.24, whose "
                "attention functions read and write it themselves)")
NO_LENGTHS = "continuous batching gave a layer no key lengths of its own type (patchkit found no layer_type on it)"


def paged_step(state: Any, function: Callable, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, kwargs: dict, loaded: Optional[str]) -> Any:
    """A continuous-batching layer call on a patch's state (the forward's route, or the registered name's alone).
    One patchkit does not serve runs the attention the model was loaded with (`loaded`: sdpa under the name alone),
    as unpatched, counted once per step (its `cu_seq_lens_q` is the step's own): a mask other than the requests'
    lengths say, a paged cache still to update, a layer whose keys' lengths it cannot tell."""
    step = kwargs.get("cu_seq_lens_q")

    def aside(why: str) -> Any:
        if not getattr(step, "patchkit_counted", False):
            step_aside(state, "continuous_batching", {}, {}, why)
            if isinstance(step, torch.Tensor):
                step.patchkit_counted = True
        return loaded_function(module, loaded)(module, query, key, value, attention_mask, **kwargs)

    if cache_beside(kwargs):
        return aside(CACHE_BESIDE)
    lengths = paged_lengths(module, kwargs)
    if lengths is None:
        return aside(NO_LENGTHS)
    return paged_attention(function, module, query, key, value, attention_mask, kwargs, lengths,
                           lambda: aside(PAGED_MISMATCH))


def paged_attention(
    function: Callable, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: Any, kwargs: dict, lengths: tuple[torch.Tensor, torch.Tensor], aside: Callable[[], Any],
) -> Any:
    """One layer's attention in a continuous-batching step (`forward/inputs/paged.py`): patchkit's attention
    `function` on the requests as packed documents, their `lengths` (`paged_lengths`). The 4D mask sdpa and eager
    get is checked first, against the layer's own window, the config's and none (continuous batching windows a mask
    by its layer type, and some layers leave their window to the mask: Qwen2-MoE's): one that is none of them is
    `aside()`, transformers' attention over it."""
    meta = paged_metadata(query.shape[2], key.shape[2], *lengths)
    window = kwargs.get("sliding_window")
    if isinstance(attention_mask, torch.Tensor):
        configured = getattr(getattr(module, "config", None), "sliding_window", None)
        window = mask_window(attention_mask, meta, (window, configured if isinstance(configured, int) else None, None))
        if window is MISMATCH:
            return aside()
    rest = {k: v for k, v in kwargs.items() if k not in PAGED_ARGUMENTS and k != "sliding_window"}
    return function(module, query, key, value, VarlenMask(None, meta, window=window), **rest)
