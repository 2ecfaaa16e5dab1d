"""The flash_attn_4 backend: flash-attn 4's CuTe DSL varlen kernels (`flash_attn.cute`) with patchkit's metadata.

Read from flash-attn-4 4.0.0b36 (`flash_attn/cute/interface.py`). `flash_attn_varlen_func(q, k, v, qv=None,
cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, ..., seqused_k=None, ...,
page_table=None, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, ...,
return_lse=False, ...)` returns `(out, lse)` (lse None unless it needs one). Its fourth positional argument is `qv`
(MLA), so patchkit passes everything after k, v by keyword. Unlike flash-attn 2: a window side is None for
unbounded (-1 with the other side set makes the window "local"), the max lengths are optional hints (patchkit's
host values are passed), GQA is packed by the kernel, and `learnable_sink` (one logit per query head, in the scaled
score's natural-log units: GPT-OSS's `s_aux`) is an argument, with its gradient. It has no dropout, no ALiBi, no
`cache_leftpad` and no `flash_attn_with_kvcache`.

Where it runs (the interface's asserts): forward on compute capability 8.x-12.x, backward on 9.x-12.x (none on
Ampere), the sink's backward on 9.x-11.x, head dims 8-256 (multiple of 8) on sm90, 8-128 or 256 on sm100/sm110
(256 without softcap or sinks in the backward). What it cannot run is refused per call by `missing_feature` and
served by the exact sdpa backend with one warning (`serving_backend`), or refused in strict mode.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Optional

import torch

from patchkit import gates as _gates
from patchkit.backends.padded_decode import attend_padded_cache
from patchkit.errors import PatchInputError
from patchkit.forward.decode_plan import DecodePlan
from patchkit.forward.metadata import VarlenMetadata


def kernel_window(window_size: tuple[int, int]) -> tuple[Optional[int], Optional[int]]:
    """flash-attn 2's window (-1 unbounded) as flash-attn 4's (None unbounded)."""
    return tuple(None if int(w) < 0 else int(w) for w in window_size)  # type: ignore[return-value]


def _version() -> Optional[str]:
    try:
        return importlib.metadata.version(_gates.FLASH_ATTN_4_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


class FlashAttn4Backend:
    """Runs `flash_attn.cute.flash_attn_varlen_func` for training steps, prefill and decode steps."""

    name = "flash_attn_4"
    half_only = True
    takes_sinks = True  # varlen and attend_kvcache take `learnable_sink` (GPT-OSS's s_aux)

    def __init__(self, module: object = None, capability: Optional[tuple[int, int]] = None) -> None:
        self._fa = module if module is not None else importlib.import_module("flash_attn.cute")
        cap = capability if capability is not None else _gates.probe_environment().compute_capability
        self.capability: tuple[int, int] = tuple(cap) if cap is not None else (0, 0)  # type: ignore[assignment]
        self.version = _version()

    def _arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def missing_feature(
        self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0, head_dim: Optional[int] = None,
        backward: bool = False, sinks: bool = False,
    ) -> Optional[str]:
        """Why flash-attn 4 cannot run this call on this GPU (None: it can). Windows and softcap it has everywhere."""
        found = f"flash-attn-4 {self.version}"
        if dropout_p:
            return f"flash_attn_4: attention dropout is not an argument of {found}'s flash_attn_varlen_func"
        major, arch = self.capability[0], self._arch()
        if head_dim is not None:
            missing = self._head_dim_missing(head_dim, major, arch)
            if missing:
                return missing
        if not backward:
            return None
        if major == 8:
            return (f"flash_attn_4: {found} has no backward on {arch} (Ampere; its backward runs on 9.x-12.x); "
                    "train with backend='flash_attn' (flash-attn 2) on this GPU")
        if sinks and major not in (9, 10, 11):
            return f"flash_attn_4: {found} has no backward for learnable sinks on {arch} (only sm90-sm110)"
        if major in (10, 11) and head_dim == 256 and (softcap or sinks):
            what = "softcap" if softcap else "learnable sinks"
            return f"flash_attn_4: {found}'s head_dim 256 backward on {arch} has no {what}"
        return None

    @staticmethod
    def _head_dim_missing(head_dim: int, major: int, arch: str) -> Optional[str]:
        if head_dim % 8 or not 8 <= head_dim <= 256:
            return f"flash_attn_4: head_dim {head_dim} is not a multiple of 8 in 8-256"
        if major in (10, 11) and 128 < head_dim < 256:
            return f"flash_attn_4: head_dim {head_dim} is not supported on {arch} (8-128 or 256)"
        return None

    def varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float,
        softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        learnable_sink: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q (Tq, H, D), k/v (Tk, Hk, D) -> (Tq, H, D); GQA by the kernel, `learnable_sink` (H,) on the kernel."""
        if dropout_p:  # backend_for falls back before this; a direct caller must not get wrong numbers
            raise PatchInputError(f"{self.missing_feature(window_size, softcap, dropout_p)}; use backend='sdpa' or "
                                  "'flash_attn' for attention dropout")
        out, _ = self._fa.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
            window_size=kernel_window(window_size), learnable_sink=learnable_sink, softcap=softcap,
        )
        return out

    def attend_kvcache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan, *, softmax_scale: float,
        dropout_p: float, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        learnable_sink: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """A decode step on the padded cache in place: q (B, H, q_len, D), k/v (B, Hk, K, D) -> (B, q_len, H, D).

        No key is padding (every row's keys are [0, K)): the kernel in its batch layout on (B, S, H, D) views of the
        cache. A left-padded batch: flash-attn 4 has no `cache_leftpad`, and `seqused_k` counts keys from 0, so the
        exact torch-native SDPA on the cache in place (what torch_varlen runs). Declined (None: the varlen kernel on
        the gathered cache) for sinks over padding, a hole or a padding query, dropout, or a step that needs
        gradients.
        """
        if plan.cache_seqlens is None or dropout_p or (torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad)):
            return None
        if plan.cache_leftpad is not None:
            if learnable_sink is not None:
                return None
            return attend_padded_cache(q, k, v, plan, softmax_scale=softmax_scale, dropout_p=0.0,
                                       window_size=window_size, softcap=softcap)
        out, _ = self._fa.flash_attn_varlen_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=softmax_scale, causal=True,
            window_size=kernel_window(window_size), learnable_sink=learnable_sink, softcap=softcap,
        )
        return out
