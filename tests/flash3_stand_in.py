"""flash-attn 3's `flash_attn_interface` (the Hopper build, "flash_attention_3" in transformers) on the CPU: its
functions' exact signatures over patchkit's torch-native sdpa math, recording each call.

transformers reads which keywords to pass from these signatures (`_lazy_define_process_function`): flash-attn 3 has no
dropout, no ALiBi and no attention sink, so none is passed, and the stand-in refuses what the kernel refuses (fp32, a
head dim over 256). `flash_attn_with_kvcache` serves only transformers' continuous batching, which these tests do not
run: it raises.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from patchkit.backends import sdpa


class RecordingFlash3(types.ModuleType):
    """The `flash_attn_interface` module: `calls` records each call's layout, lengths and options."""

    def __init__(self) -> None:
        super().__init__("flash_attn_interface")
        self.calls: list[dict] = []

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
        softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
        sm_margin=0, return_attn_probs=False,
    ):
        """(total_q, H, D) with cu_seqlens -> out, or (out, lse (H, total_q)) with return_attn_probs."""
        assert seqused_q is None and seqused_k is None and qv is None and attention_chunk == 0
        assert q_descale is None and k_descale is None and v_descale is None
        for cu, total in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == total, f"bad cu_seqlens {cu}"
        seqlens_q, seqlens_k = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        for hint, lengths in ((max_seqlen_q, seqlens_q), (max_seqlen_k, seqlens_k)):
            assert int(hint) >= max(lengths, default=0), f"max_seqlen {hint} under {max(lengths)}"
        out, lse = self._attend(q, k, v, seqlens_q, seqlens_k, softmax_scale, causal, window_size, softcap,
                                return_attn_probs, layout="varlen", cu=cu_seqlens_q.tolist())
        return (out, lse) if return_attn_probs else out

    def flash_attn_func(
        self, q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
        sm_margin=0, return_attn_probs=False,
    ):
        """(B, S, H, D) -> out (B, S, H, D), or (out, lse (B, H, S)) with return_attn_probs."""
        assert qv is None and attention_chunk == 0 and q_descale is None and k_descale is None and v_descale is None
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        assert k.shape[0] == batch and v.shape[:3] == k.shape[:3]
        flat = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out, lse = self._attend(*flat, [sq] * batch, [sk] * batch, softmax_scale, causal, window_size, softcap,
                                return_attn_probs, layout="batch", cu=None)
        out = out.view(*q.shape[:3], v.shape[-1])
        if not return_attn_probs:
            return out
        return out, lse.view(q.shape[2], batch, sq).transpose(0, 1)

    def flash_attn_with_kvcache(self, *args, **kwargs):
        raise NotImplementedError("the flash-attn 3 stand-in serves no paged cache (continuous batching)")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: list, seqlens_k: list,
                softmax_scale: Optional[float], causal: bool, window_size: tuple, softcap: float, lse: bool,
                layout: str, cu: Optional[list]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        assert q.dtype in (torch.float16, torch.bfloat16) and q.dtype == k.dtype == v.dtype, "fp16 or bf16 only"
        assert q.shape[-1] <= 256 and q.shape[-2] % k.shape[-2] == 0
        window = tuple(int(w) for w in window_size)
        self.calls.append(dict(layout=layout, cu=cu, causal=causal, window_size=window, softcap=softcap,
                               shapes=[tuple(t.shape) for t in (q, k, v)]))
        return sdpa.varlen_attention(q, k, v, seqlens_q, seqlens_k, 0.0, softmax_scale, causal, window, softcap,
                                     return_lse=lse)
