"""The flash_attn backend: calls flash-attn 2's varlen kernels with patchkit's unpadding metadata."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..masks import VarlenMetadata


class FlashAttnBackend:
    """Runs flash-attn's `flash_attn_varlen_qkvpacked_func` / `flash_attn_varlen_kvpacked_func`."""

    name = "flash_attn"
    half_only = True

    def __init__(self, module: ModuleType | None = None) -> None:
        self._fa = module if module is not None else importlib.import_module("flash_attn")

    def varlen_qkvpacked(
        self, qkv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float, causal: bool
    ) -> torch.Tensor:
        return self._fa.flash_attn_varlen_qkvpacked_func(
            qkv, meta.cu_seqlens_q, meta.max_seqlen_q, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal,
        )

    def varlen_kvpacked(
        self, q: torch.Tensor, kv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float,
        causal: bool,
    ) -> torch.Tensor:
        return self._fa.flash_attn_varlen_kvpacked_func(
            q, kv, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        )
