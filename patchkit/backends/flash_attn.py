"""The flash_attn backend: calls flash-attn 2's varlen kernels with patchkit's unpadding metadata."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch
from packaging.version import InvalidVersion, Version

from patchkit.backends.limits import check_index_range
from patchkit.forward.decode_plan import DecodePlan
from patchkit.forward.metadata import VarlenMetadata
from patchkit.gates import build_config


class FlashAttnBackend:
    """Runs flash-attn's `flash_attn_varlen_func` (and `flash_attn_with_kvcache` for decode steps)."""

    name = "flash_attn"
    half_only = True

    def __init__(self, module: ModuleType | None = None) -> None:
        self._fa = module if module is not None else importlib.import_module("flash_attn")
        self.version = getattr(self._fa, "__version__", None)
        self.build = build_config(self._fa)

    @staticmethod
    def _features(window_size: tuple[int, int], softcap: float) -> dict:
        """Only the arguments in use: a flash-attn older than a feature keeps working for models without it."""
        out: dict = {}
        if tuple(window_size) != (-1, -1):
            out["window_size"] = tuple(window_size)
        if softcap:
            out["softcap"] = softcap
        return out

    def missing_feature(
        self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0, head_dim: Optional[int] = None,
        backward: bool = False, sinks: bool = False,
    ) -> Optional[str]:
        """flash-attn added sliding windows in 2.3 and softcap in 2.6; a trimmed build may lack more. (It has the
        backward wherever it runs; sinks never reach it: `takes_sinks` is unset.)"""
        for feature, minimum in (("window_size", "2.3"), ("softcap", "2.6")):
            if feature in self._features(window_size, softcap) and not _at_least(self.version, minimum):
                return f"flash_attn_version: {feature} needs flash-attn>={minimum} (found {self.version})"
        return build_lacks(self.build, window_size, softcap, dropout_p, head_dim)

    def kvcache_missing(self, plan: DecodePlan) -> Optional[str]:
        """`flash_attn_with_kvcache` came in 2.2 and its `cache_leftpad` (a left-padded batch) in 2.6.1."""
        if plan.cache_seqlens is None:
            return None  # a layout the kernel cannot express: attend_kvcache declines it, nothing to gate
        feature, minimum = ("cache_leftpad", "2.6.1") if plan.cache_leftpad is not None else ("kvcache", "2.2")
        if hasattr(self._fa, "flash_attn_with_kvcache") and _at_least(self.version, minimum):
            return None
        found = self.version
        return f"flash_attn_version: flash_attn_with_kvcache with {feature} needs flash-attn>={minimum} (found {found})"

    def attend_kvcache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan, *, softmax_scale: float,
        dropout_p: float, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> Optional[torch.Tensor]:
        """`flash_attn_with_kvcache` on the padded cache in place, each row's keys [leftpad, K): q (B, H, q_len, D) and
        k/v (B, Hk, K, D) as transformers keeps them, handed over as (B, S, H, D) views (the kernel's layout).

        Declined (None, the varlen path runs) where the kernel would not be exact: a row with a padding hole or a
        padding query, dropout, or a step that needs gradients (the kernel has no backward).
        """
        if plan.cache_seqlens is None or dropout_p or (torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad)):
            return None
        extra = self._features(window_size, softcap)
        if plan.cache_leftpad is not None:
            extra["cache_leftpad"] = plan.cache_leftpad
        return self._fa.flash_attn_with_kvcache(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=plan.cache_seqlens,
            softmax_scale=softmax_scale, causal=True, **extra,
        )

    def varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float,
        softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (Tq, H, D), k/v (Tk, Hk, D) as they are: the kernel reads strided rows (views of one projection, as
        `VarlenSelfAttention` hands them, need no copy), so nothing is stacked for its packed entry points."""
        check_index_range(self.name, meta, q.shape[1], q.shape[2], q, k, v)
        return self._fa.flash_attn_varlen_func(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, **self._features(window_size, softcap),
        )


def build_lacks(
    build: dict, window_size: tuple[int, int], softcap: float, dropout_p: float, head_dim: Optional[int]
) -> Optional[str]:
    """Why this trimmed build cannot run the call, else None. Its kernel would refuse it (or, for a trimmed head-dim
    bucket, has been seen to crash the process while formatting the refusal), so the call must not reach it."""
    if not build:
        return None
    rebuild = "rebuild with tools/build_flash_attn.py"
    disabled = set(build.get("disabled", ()))
    for feature, needed in (("dropout", dropout_p), ("softcap", softcap), ("local", tuple(window_size) != (-1, -1))):
        if needed and feature in disabled:
            return (f"flash_attn_build: this flash-attn build was compiled without {feature} "
                    f"(--disable {feature}); {rebuild} without that flag")
    if head_dim is None:
        return None
    bucket = next((b for b in build.get("head_dim_buckets", ()) if head_dim <= b), None)
    if bucket in build.get("head_dims_trimmed", ()):
        kept = ",".join(str(d) for d in build.get("head_dims", ()))
        return (f"flash_attn_build: this flash-attn build has no kernels for head_dim {head_dim} (bucket {bucket}; "
                f"built for head dims {kept}); {rebuild} --head-dims {kept},{bucket}")
    if "uneven_k" in disabled and head_dim % 32:
        return (f"flash_attn_build: this flash-attn build was compiled without uneven head dims (--disable uneven_k): "
                f"head_dim {head_dim} is not a multiple of 32; {rebuild} without that flag")
    return None


def _at_least(found: Optional[str], minimum: str) -> bool:
    try:
        return found is not None and Version(found) >= Version(minimum)
    except InvalidVersion:
        return False
