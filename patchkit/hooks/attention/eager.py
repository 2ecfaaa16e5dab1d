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
    """transformers' eager attention of `module`'s family over its 4D mask (sdpa's boolean one made additive), and
    over the keys a sparse attention's indexer selected (`indices`, which transformers hands a kernel by any name
    but eager's and sdpa's: it merges them into their mask itself, and so does this)."""
    if mask.dtype == torch.bool:  # sdpa's format (True: attend) -> eager's additive one
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    indices = kwargs.pop("indices", None)
    if isinstance(indices, torch.Tensor) and indices.shape[-1]:  # (B, S, top-k) of the keys each query sees
        dropped = torch.ones((*indices.shape[:2], key.shape[-2]), dtype=torch.bool, device=indices.device)
        mask = mask.masked_fill(dropped.scatter(-1, indices.long(), False).unsqueeze(1), torch.finfo(mask.dtype).min)
    return family_eager_attention(module)(module, query, key, value, mask, **kwargs)
