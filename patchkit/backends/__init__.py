"""Attention backends behind one small interface, chosen once when a patch is applied."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..masks import VarlenMetadata
from . import sdpa

BACKEND_NAMES = ("auto", "flash_attn", "torch_varlen", "sdpa")


class Backend(Protocol):
    """What a patched layer needs: flash-attn's two varlen entry points, fed with patchkit metadata."""

    name: str
    half_only: bool

    def varlen_qkvpacked(
        self, qkv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float, causal: bool,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor: ...

    def varlen_kvpacked(
        self, q: torch.Tensor, kv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float,
        causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor: ...

    def missing_feature(self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0) -> Optional[str]:
        """Why this backend cannot run a window, softcap or attention dropout here (None: it can)."""


class SdpaBackend:
    """Torch-native backend: `patchkit.backends.sdpa` with host-side lengths (no device sync per layer)."""

    name = "sdpa"
    half_only = False

    def varlen_qkvpacked(
        self, qkv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float, causal: bool,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor:
        q, k, v = qkv.unbind(1)
        out, _ = sdpa.varlen_attention(
            q, k, v, meta.seqlens_q, meta.seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap
        )
        return out

    def varlen_kvpacked(
        self, q: torch.Tensor, kv: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float, softmax_scale: float,
        causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor:
        k, v = kv.unbind(1)
        out, _ = sdpa.varlen_attention(
            q, k, v, meta.seqlens_q, meta.seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap
        )
        return out

    def missing_feature(self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0) -> Optional[str]:
        return None


def make_backend(name: str) -> Backend:
    """Instantiate a backend by its resolved name ("flash_attn", "torch_varlen" or "sdpa")."""
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash_attn":
        from .flash_attn import FlashAttnBackend

        return FlashAttnBackend()
    if name == "torch_varlen":
        from .torch_varlen import TorchVarlenBackend

        return TorchVarlenBackend()
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKEND_NAMES}")
