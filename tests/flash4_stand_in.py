"""flash-attn 4's `flash_attn.cute.flash_attn_varlen_func`, on patchkit's torch-native sdpa math: the recording double
the flash_attn_4 contract tests drive (no GPU here). Not part of the wheel.

The signature is copied from flash-attn-4 4.0.0b36 (`flash_attn/cute/interface.py`); the checks are its interface's
asserts for the arguments patchkit passes (shapes, int32 cu_seqlens / seqused_k, fp16/bf16, the sink's shape and
dtype, head dims by architecture, which architectures have a backward); the numbers are flash-attn's semantics
(bottom-right causal, window sides None = unbounded and causal forcing the right side to 0, softcap, GQA) with
the learnable sink as one more softmax column per head: out * sigmoid(lse - sink), lse = logaddexp(lse, sink).
"""

from __future__ import annotations

import sys
import types
from typing import Callable, Optional, Tuple

import torch

from patchkit.backends import sdpa

SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class RecordingFlash4(types.ModuleType):
    """Stands in for the `flash_attn.cute` module on a GPU of compute capability `capability`."""

    def __init__(self, capability: tuple[int, int] = (9, 0)) -> None:
        super().__init__("flash_attn.cute")
        self.__version__ = "0.0.0"  # what 4.0.0b36 reports: it reads a distribution named "fa4"
        self.capability = capability
        self.calls: list[dict] = []

    def flash_attn_varlen_func(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_k: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None,
        min_seqlen_k: Optional[int] = None,
        seqused_q: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
        gather_kv_indices: Optional[torch.Tensor] = None,
        page_table: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[Optional[int], Optional[int]] = (None, None),
        learnable_sink: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: Optional[bool] = None,
        deterministic: bool = False,
        score_mod: Optional[Callable] = None,
        score_mod_bwd: Optional[Callable] = None,
        mask_mod: Optional[Callable] = None,
        block_sparse_tensors: Optional[object] = None,
        aux_tensors: Optional[list] = None,
        aux_scalars: Optional[tuple] = None,
        return_lse: bool = False,
        scheduler_metadata: Optional[object] = None,
        seqlen_k_per_split: Optional[int] = None,
        disable_scheduler_metadata: bool = False,
        gather_bwd_recompute_p: bool = False,
        gather_bwd_token_chunk: Optional[int] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(total_q, H, D) with cu_seqlens, or (B, S, H, D) without -> (out, lse (H, total_q) or None)."""
        unused = (qv, min_seqlen_k, seqused_q, gather_kv_indices, page_table, score_mod, score_mod_bwd, mask_mod,
                  block_sparse_tensors, aux_tensors, aux_scalars, scheduler_metadata, seqlen_k_per_split)
        assert all(a is None for a in unused), "an argument patchkit never passes was passed"
        assert num_splits == 1 and pack_gqa is None and not deterministic and not disable_scheduler_metadata
        assert not gather_bwd_recompute_p and gather_bwd_token_chunk is None
        major = self.capability[0]
        assert major in (8, 9, 10, 11, 12), "Unsupported compute capability"
        assert {q.dtype, k.dtype, v.dtype} <= {torch.float16, torch.bfloat16} and q.dtype == k.dtype == v.dtype
        heads, head_dim = q.shape[-2:]
        kv_heads = v.shape[-2]
        assert heads % kv_heads == 0, "num_head must be divisible by num_head_kv"
        _check_head_dims(major, head_dim, v.shape[-1])
        varlen = cu_seqlens_q is not None
        assert varlen == (cu_seqlens_k is not None), "patchkit passes both cu_seqlens or neither"
        if varlen:
            assert q.dim() == k.dim() == v.dim() == 3 and k.shape[:2] == v.shape[:2]
            batch = cu_seqlens_q.shape[0] - 1
            for cu, total in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_k, k.shape[0])):
                assert cu.dtype == torch.int32 and cu.stride(0) == 1 and tuple(cu.shape) == (batch + 1,)
                assert cu[0] == 0 and cu[-1] == total, f"bad cu_seqlens {cu}"
            seqlens_q, seqlens_k = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
            for hint, lengths in ((max_seqlen_q, seqlens_q), (max_seqlen_k, seqlens_k)):
                assert hint is None or (isinstance(hint, int) and hint == max(lengths)), f"max_seqlen {hint}"
            qf, kf, vf = q, k, v
        else:
            batch, sq = q.shape[:2]
            sk = k.shape[1]
            assert q.dim() == 4 and k.shape == (batch, sk, kv_heads, head_dim) and v.shape[:3] == k.shape[:3]
            assert max_seqlen_q is None and max_seqlen_k is None
            seqlens_q, seqlens_k = [sq] * batch, [sk] * batch
            qf, kf, vf = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        if seqused_k is not None:
            assert not varlen, "patchkit uses seqused_k only on the batch layout"
            assert seqused_k.dtype == torch.int32 and tuple(seqused_k.shape) == (batch,)
            raise AssertionError("patchkit's decode path passes no seqused_k (every row's keys are [0, K))")
        if learnable_sink is not None:
            assert tuple(learnable_sink.shape) == (heads,), f"learnable_sink {tuple(learnable_sink.shape)}"
            assert learnable_sink.dtype in SINK_DTYPES
        assert isinstance(window_size, tuple) and len(window_size) == 2
        assert all(w is None or (isinstance(w, int) and w >= 0) for w in window_size), f"window {window_size}"
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
        if grad:  # the interface's backward asserts, checked here at the forward
            assert major in (9, 10, 11, 12), f"no backward on compute capability {major}.x"
            assert learnable_sink is None or major in (9, 10, 11), "no learnable sink backward here"
            assert not (major in (10, 11) and head_dim == 256 and (softcap or learnable_sink is not None))
        self.calls.append(dict(
            layout="varlen" if varlen else "batch", shapes=[tuple(t.shape) for t in (q, k, v)], dtype=q.dtype,
            cu_q=cu_seqlens_q.tolist() if varlen else None, cu_k=cu_seqlens_k.tolist() if varlen else None,
            max_q=max_seqlen_q, max_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, grad=grad,
            sink=None if learnable_sink is None else learnable_sink.detach().clone(),
            storage=(k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()),
        ))
        out, lse = attention(qf, kf, vf, seqlens_q, seqlens_k, softmax_scale, causal, window_size, softcap,
                             learnable_sink, return_lse)
        if not varlen:
            out = out.view(*q.shape[:3], v.shape[-1])
            lse = None if lse is None else lse.view(heads, batch, -1).transpose(0, 1)
        return out, lse


def _check_head_dims(major: int, head_dim: int, head_dim_v: int) -> None:
    """`_validate_head_dims` for fp16/bf16 (alignment 8); the Ampere and sm120 paths are not validated there."""
    aligned = head_dim % 8 == 0 and head_dim_v % 8 == 0
    if major == 9:
        assert 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and aligned, f"head dims {head_dim}, {head_dim_v}"
    elif major in (10, 11):
        ok = (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128) or (head_dim, head_dim_v) in ((192, 128), (256, 256))
        assert ok and aligned, f"head dims {head_dim}, {head_dim_v} on SM100"


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: list[int], seqlens_k: list[int],
    softmax_scale: Optional[float], causal: bool, window_size: Tuple[Optional[int], Optional[int]], softcap: float,
    sink: Optional[torch.Tensor], return_lse: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """flash-attn 4's result with the sdpa backend's exact math: (out (Tq, H, Dv), lse (H, Tq) fp32 or None). The
    log-sum-exp only where needed: without it the sdpa backend reaches SDPA's fused kernels, as patchkit's does."""
    window = tuple(-1 if w is None else w for w in window_size)
    out, lse = sdpa.varlen_attention(q, k, v, seqlens_q, seqlens_k, 0.0, softmax_scale, causal, window, softcap,
                                     return_lse=return_lse or sink is not None)
    if sink is None:
        return out, lse
    sink = sink.float().unsqueeze(1)  # (H, 1)
    kept = torch.sigmoid(lse - sink)  # the weight the keys keep beside the sink column; 0 where no key is seen
    out = out * kept.transpose(0, 1).unsqueeze(-1).to(out.dtype)
    return out, torch.logaddexp(lse, sink.expand_as(lse)) if return_lse else None


def install_flash4_double(monkeypatch, capability: tuple[int, int] = (9, 0), environment=None) -> RecordingFlash4:
    """Put the double where `import flash_attn.cute` finds it and pretend to be a GPU of `capability` with
    flash-attn-4 installed (and flash-attn 2 unless `environment` says otherwise)."""
    import fakes

    from patchkit import gates

    fake = RecordingFlash4(capability)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    env = environment or fakes.env(compute_capability=capability, flash_attn_4_version="4.0.0b36",
                                   device_name="NVIDIA H100 80GB HBM3" if capability[0] == 9 else "NVIDIA GPU")
    monkeypatch.setattr(gates, "probe_environment", lambda: env)
    return fake
