"""flash-attn 2's Python functions, on patchkit's torch-native sdpa backend: the stand-in tests run flash-attn's
contract against (no GPU here). Not part of the wheel.

The semantics are the sdpa backend's (`patchkit.backends.sdpa.varlen_attention`): causal masks aligned bottom-right
when q_len != kv_len, GQA/MQA, `softmax_scale` defaulting to D ** -0.5, `window_size`, `softcap`, `alibi_slopes`,
dropout, zeros for a query that sees no key, the log-sum-exp with `return_attn_probs=True` (the dropout mask as
None); here also flash-attn's signatures, its packed entry points and the paged KV cache of
`flash_attn_varlen_func(..., block_table=...)`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from patchkit.backends.sdpa import _visible, varlen_attention


def _check_paged(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, seqlens_k: Sequence[int]) -> None:
    """flash-attn's checks for a paged cache, as ValueErrors: shapes, int32 table, one row per sequence."""
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "with block_table, k and v must be paged caches of shape (num_blocks, page_block_size, nheads_k, "
            f"headdim), got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v paged caches must agree on (num_blocks, page_block_size, nheads_k), got {tuple(k.shape[:3])} "
            f"and {tuple(v.shape[:3])}"
        )
    if k.shape[1] < 1:
        raise ValueError(f"page_block_size must be positive, got k of shape {tuple(k.shape)}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != len(seqlens_k):
        raise ValueError(
            f"block_table must have shape (batch_size, max_num_blocks_per_seq) = ({len(seqlens_k)}, ...) for "
            f"{len(seqlens_k)} sequences in cu_seqlens_k, got {tuple(block_table.shape)}"
        )
    page, capacity = k.shape[1], block_table.shape[1] * k.shape[1]
    for b, n in enumerate(seqlens_k):
        if n > capacity:
            raise ValueError(
                f"sequence {b} has {n} keys but block_table gives each sequence {block_table.shape[1]} pages of "
                f"{page} tokens ({capacity} keys): add columns to block_table"
            )


def gather_pages(
    k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, seqlens_k: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged caches (num_blocks, page, Hk, D) -> packed k/v (sum(seqlens_k), Hk, D), as cu_seqlens_k lays them out.

    Key t of sequence b lives at page `block_table[b, t // page]`, row `t % page` (flash-attn's kernel reads
    it there). Only the entries a sequence's length reaches are read, and checked to name a page of the cache;
    the rest of a row may hold anything (-1 padding, say). The gather is an `index_select`, so gradients flow
    back into the caches (a page shared by several sequences sums them). Any page size is accepted: the CUDA
    build's "divisible by 256" is a kernel constraint, not part of the semantics.
    """
    _check_paged(k, v, block_table, seqlens_k)
    num_blocks, page = k.shape[0], k.shape[1]
    device = k.device
    lens = torch.tensor(list(seqlens_k), dtype=torch.long, device=device)
    total = int(sum(seqlens_k))
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # sequence of each packed key
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - starts[seq]  # position of each key inside its sequence
    pages = block_table.to(device=device, dtype=torch.long)[seq, pos // page]
    bad = (pages < 0) | (pages >= num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        b, t = int(seq[i]), int(pos[i])
        raise ValueError(
            f"block_table[{b}, {t // page}] = {int(pages[i])} is not a page of the cache (num_blocks = {num_blocks}); "
            f"sequence {b} reads it for key {t}"
        )
    rows = pages * page + pos % page
    flat_k = k.reshape(num_blocks * page, *k.shape[2:])
    flat_v = v.reshape(num_blocks * page, *v.shape[2:])
    return flat_k.index_select(0, rows), flat_v.index_select(0, rows)


def _check(*tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"q, k and v must have the same dtype, got {sorted(map(str, dtypes))}")


def _lengths(cu_seqlens: torch.Tensor) -> list[int]:
    return cu_seqlens.diff().tolist()


def _result(out: torch.Tensor, lse: Optional[torch.Tensor], return_attn_probs: bool):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):
    """q (Tq, H, D), k/v (Tk, Hk, D), int32 cu_seqlens (B+1,) -> out (Tq, H, D) [, lse (H, Tq), None].

    With `block_table` (B, max_blocks_per_seq) int32, k/v are paged caches (num_blocks, page_block_size, Hk, D):
    sequence b's keys are the first `cu_seqlens_k[b+1] - cu_seqlens_k[b]` tokens of its pages `block_table[b]`.
    """
    _check(q, k, v)
    seqlens_k = _lengths(cu_seqlens_k)
    if block_table is not None:
        k, v = gather_pages(k, v, block_table, seqlens_k)
    out, lse = varlen_attention(
        q, k, v, _lengths(cu_seqlens_q), seqlens_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_attn_probs,
    )
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """qkv (T, 3, H, D) -> out (T, H, D)."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):
    """q (Tq, H, D), kv (Tk, 2, Hk, D) -> out (Tq, H, D)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D) [, lse (B, H, Sq), None]."""
    _check(q, k, v)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    out, lse = varlen_attention(
        q.reshape(b * sq, h, d), k.reshape(b * sk, k.shape[2], d), v.reshape(b * sk, v.shape[2], v.shape[-1]),
        [sq] * b, [sk] * b, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
    )
    out = out.view(b, sq, h, -1)
    if lse is not None:
        lse = lse.view(h, b, sq).transpose(0, 1)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """qkv (B, S, 3, H, D) -> out (B, S, H, D)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """q (B, Sq, H, D), kv (B, Sk, 2, Hk, D) -> out (B, Sq, H, D)."""
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )


def reference_attention(q, k, v, causal: bool, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Dense float64 reference for tests: q (B, Sq, H, D), k/v (B, Sk, Hk, D), bottom-right causal."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(d)
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(h // hk, 1), vd.repeat_interleave(h // hk, 1)
    scores = qd @ kd.transpose(-1, -2) * scale
    vis = _visible(sq, k.shape[1], causal, (-1, -1), q.device)
    if vis is not None:
        scores = scores.masked_fill(~vis, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return (probs @ vd).transpose(1, 2)
