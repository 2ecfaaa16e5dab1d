"""Continuous batching's layer calls on the varlen path: its requests' lengths as the metadata, its mask checked."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from patchkit.forward.inputs.paged import MISMATCH, PAGED_ARGUMENTS, mask_window, paged_metadata
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.attention.eager import transformers_attention
from patchkit.hooks.decide.step_aside import step_aside

PAGED_MISMATCH = ("continuous batching built a 4D mask other than the causal pattern its per-request lengths "
                  "describe, which is what patchkit's kernels would run")


def paged_step(state: Any, function: Callable, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, kwargs: dict, lengths: tuple[torch.Tensor, torch.Tensor]
               ) -> Any:
    """A continuous-batching layer call on a patch's state (the forward's route, or the registered name's alone);
    a mask other than its lengths say steps aside, counted once per step (its `cu_seq_lens_q` is the step's own)."""

    def aside() -> Any:
        step = lengths[0]
        if not getattr(step, "patchkit_counted", False):
            step_aside(state, "continuous_batching", {}, {}, PAGED_MISMATCH)
            step.patchkit_counted = True
        return transformers_attention(module, query, key, value, attention_mask, **kwargs)

    return paged_attention(function, module, query, key, value, attention_mask, kwargs, lengths, aside)


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
