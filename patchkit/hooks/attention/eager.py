"""transformers' own eager attention of a layer's family, for the calls patchkit hands back over a 4D mask."""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn


def family_eager_attention(module: nn.Module) -> Callable:
    """transformers' own eager attention of `module`'s family (its softcap, sinks and scaling included)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def transformers_attention(module: nn.Module, query: Any, key: Any, value: Any, mask: torch.Tensor,
                           **kwargs: Any) -> Any:
    """transformers' eager attention of `module`'s family over its 4D mask (sdpa's boolean one made additive)."""
    if mask.dtype == torch.bool:  # sdpa's format (True: attend) -> eager's additive one
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return family_eager_attention(module)(module, query, key, value, mask, **kwargs)
