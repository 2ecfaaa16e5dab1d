"""The torch_varlen backend: FlashAttention-2's varlen kernel as torch ships it, for machines without flash-attn.

`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA only) takes what `flash_attn_varlen_func` takes,
spelled torch's way (read from torch 2.11 and 2.13): `cu_seq_q`/`cu_seq_k` int32, `max_q`/`max_k`, `scale`,
`enable_gqa` for fewer K/V heads (2.13; on 2.11 K/V heads are repeated over the real tokens), and `window_size`,
where causal is `window_size=(-1, 0)` (there is no `is_causal` argument) and a causal sliding window is
`(left, 0)`. It has no dropout (fixed at 0), no softcap and no ALiBi: a call that needs one of those falls back
per call (`missing_feature`), as flash_attn's does. From torch 2.15 it runs only on the SDPA backends that
`sdpa_kernel` / `torch.backends.cuda.enable_flash_sdp` leave on (cuDNN where eligible, else FlashAttention; it raises
"No viable backend" otherwise): with SDPA's FlashAttention off, a call steps aside too (`sdpa_flash_off`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable, Optional

import torch

from patchkit.backends.limits import check_index_range
from patchkit.backends.padded_decode import attend_padded_cache
from patchkit.errors import PatchInputError
from patchkit.forward.metadata import VarlenMetadata
from patchkit.gates import torch_release_at_least


def obeys_sdpa_kernel(version: str) -> bool:
    """Whether this torch's varlen_attn picks its kernel among SDPA's enabled backends (2.15's `_select_backend`)."""
    return torch_release_at_least(version, (2, 15))


OBEYS_SDPA_KERNEL = obeys_sdpa_kernel(torch.__version__)


def sdpa_flash_off() -> bool:
    """Whether `sdpa_kernel` or `enable_flash_sdp(False)` turned SDPA's FlashAttention off here (torch's own reading
    in varlen.py, which dynamo folds to a constant; the public `flash_sdp_enabled()` breaks a fullgraph trace)."""
    return not torch._C._get_flash_sdp_enabled()


def kernel_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """flash-attn's (causal, window_size) as torch's single `window_size`: causal is (left, 0), -1 unbounded."""
    left, right = (int(w) for w in window_size)
    if causal:
        return (left if left >= 0 else -1, 0)
    return (left, right)


def takes_enable_gqa(fn: Callable) -> bool:
    """Whether this torch's varlen_attn groups query heads itself (2.13) or wants K/V heads repeated (2.11)."""
    try:
        return "enable_gqa" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class TorchVarlenBackend:
    """Runs `torch.nn.attention.varlen.varlen_attn` with patchkit's unpadding metadata."""

    name = "torch_varlen"
    half_only = True

    def __init__(self, fn: Optional[Callable] = None) -> None:
        self._varlen_attn = fn if fn is not None else importlib.import_module("torch.nn.attention.varlen").varlen_attn
        self._takes_gqa = takes_enable_gqa(self._varlen_attn)

    def ambient(self) -> bool:
        """What a call's kernel hangs on besides its layer (part of the per-need memo): SDPA's FlashAttention switch,
        which varlen_attn follows from torch 2.15."""
        return OBEYS_SDPA_KERNEL and sdpa_flash_off()

    def missing_feature(
        self, window_size: tuple[int, int], softcap: float, dropout_p: float = 0.0, head_dim: Optional[int] = None,
        backward: bool = False, sinks: bool = False,
    ) -> Optional[str]:
        """torch's varlen_attn has no softcap and no attention dropout (windows it has; head_dim has its gate); from
        2.15 it runs only where SDPA's FlashAttention is on (cuDNN, which it may take instead, is left to SDPA)."""
        if self.ambient():
            return (f"torch_varlen: SDPA's FlashAttention backend is off here (sdpa_kernel or "
                    f"enable_flash_sdp(False)), and torch {torch.__version__}'s varlen_attn follows that choice")
        if softcap:
            return f"torch_varlen: softcap is not an argument of torch {torch.__version__}'s varlen_attn"
        if dropout_p:
            return f"torch_varlen: attention dropout is fixed at 0 in torch {torch.__version__}'s varlen_attn"
        return None

    def varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *, dropout_p: float,
        softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (Tq, H, D), k/v (Tk, Hk, D) -> (Tq, H, D); what the kernel cannot honour is refused, never dropped."""
        check_index_range(self.name, meta, q.shape[1], q.shape[2], q, k, v)
        missing = self.missing_feature(window_size, softcap, dropout_p)
        if missing is not None:  # backend_for falls back before this; a direct caller must not get wrong numbers
            raise PatchInputError(f"{missing}; use backend='sdpa' (or flash_attn) for this call")
        extra = {}
        if k.shape[1] != q.shape[1]:
            if self._takes_gqa:
                extra["enable_gqa"] = True
            else:  # torch 2.11's kernel wants equal heads: repeat K/V over the real tokens (what repeat_kv does)
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return self._varlen_attn(
            q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            scale=softmax_scale, window_size=kernel_window(causal, window_size), **extra,
        )

    # A decode step on the padded cache in place (SDPA with the plan's key mask), never a gathered copy of it:
    # torch's varlen_attn has no `seqused_k`/left-padding arguments before 2.13, and a few new tokens over a cache
    # are bound by reading the cache once, which SDPA's mask does as well as the varlen kernel would.
    attend_kvcache = staticmethod(attend_padded_cache)
