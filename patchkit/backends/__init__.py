"""Attention backends behind one small interface, chosen once when a patch is applied."""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from patchkit.backends import sdpa, sdpa_op
from patchkit.backends.padded_decode import attend_padded_cache
from patchkit.dtypes import autocast_dtype
from patchkit.forward.liveness import is_compiling
from patchkit.forward.metadata import VarlenMetadata
from patchkit.names import BACKEND_NAMES  # noqa: F401 - re-exported


class Backend(Protocol):
    """What a patched layer needs: one varlen entry, q (nnz_q, H, D) and k/v (nnz_k, Hk, D) on real tokens with
    patchkit's metadata -> (nnz_q, H, Dv). How a kernel wants them laid out is the backend's own business.

    Optional (`patchkit.forward.decode` looks them up with getattr; a backend without them runs decode steps through
    `varlen` on the gathered cache): `attend_kvcache(q, k, v, plan, *, softmax_scale, dropout_p,
    window_size, softcap)`, a decode step on the padded cache in place (q (B, H, q_len, D), k/v (B, Hk, K, D) as
    transformers keeps them -> (B, q_len, H, D)), returning None for a layout it cannot take; and
    `kvcache_missing(plan)`, why this install cannot serve such a step (a version gate), or None. A backend with
    `takes_sinks = True` (flash_attn_4) also takes `learnable_sink` (H,) in `varlen` and `attend_kvcache`: GPT-OSS's
    attention sinks on its kernel; the others' layers with sinks run the exact sdpa path. `ambient()`: the state
    outside the layer whether the kernel can run hangs on (torch_varlen from torch 2.15: SDPA's FlashAttention switch),
    part of the key a layer's backend is memoized under.
    """

    name: str
    half_only: bool

    def varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float,
        softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor: ...

    def missing_feature(self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0) -> Optional[str]:
        """Why this backend cannot run a window, softcap or attention dropout here (None: it can). A backend may take
        more needs after these, with defaults (`head_dim`; flash_attn_4: `backward`, `sinks`)."""


class SdpaBackend:
    """Torch-native backend: `patchkit.backends.sdpa` with host-side lengths (no device sync per layer)."""

    name = "sdpa"
    half_only = False
    in_graph = True  # its op takes cu_seqlens inside a graph that may not break (`sdpa_op`; dropout excepted)
    values_apart = True  # SDPA and its math take values narrower than queries and keys (MLA's)

    @staticmethod
    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float,
               softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1),
               softcap: float = 0.0) -> torch.Tensor:
        """Eager: the loop on the metadata's host lengths. In a compiled graph: one op on cu_seqlens (`sdpa_op`),
        so the graph is not guarded on the lengths (a recompile per batch)."""
        if is_compiling() and sdpa_op.served(dropout_p):
            ambient = autocast_dtype(q.device.type)  # autocast has no rule for the op: cast as it casts SDPA's
            if ambient is not None:  # inputs (RoPE's fp32 cos/sin leave q and k fp32 beside a bf16 v)
                q, k, v = q.to(ambient), k.to(ambient), v.to(ambient)
            return sdpa_op.varlen_sdpa(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, softmax_scale, causal,
                                       window_size, softcap)
        out, _ = sdpa.varlen_attention(
            q, k, v, meta.seqlens_q, meta.seqlens_k, dropout_p, softmax_scale, causal, window_size, softcap
        )
        return out

    def missing_feature(self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0,
                        head_dim: Optional[int] = None, backward: bool = False, sinks: bool = False) -> Optional[str]:
        return None

    # A decode step on the padded cache in place: SDPA (or softcap's math) by `patchkit.forward.decode`'s plan.
    attend_kvcache = staticmethod(attend_padded_cache)


def make_backend(name: str) -> Backend:
    """Instantiate a backend by its resolved name ("flash_attn", "flash_attn_4", "torch_varlen" or "sdpa")."""
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash_attn":
        from patchkit.backends.flash_attn import FlashAttnBackend

        return FlashAttnBackend()
    if name == "torch_varlen":
        from patchkit.backends.torch_varlen import TorchVarlenBackend

        return TorchVarlenBackend()
    if name == "flash_attn_4":
        from patchkit.backends.flash_attn_4 import FlashAttn4Backend

        return FlashAttn4Backend()
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKEND_NAMES}")
