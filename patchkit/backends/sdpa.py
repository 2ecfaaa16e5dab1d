"""Torch-native varlen attention with flash-attn 2's semantics, on CPU or GPU: the sdpa backend's kernel.

Semantics kept (see flash-attn's `flash_attn_interface.py`): causal masks aligned bottom-right when
q_len != kv_len, GQA/MQA with fewer K/V heads, `softmax_scale` defaulting to D ** -0.5, `window_size`,
`softcap`, `alibi_slopes`, dropout, zeros (never NaN) for a query that sees no key, and the log-sum-exp
(`return_lse`). tests/flash_stand_in.py wraps it in flash-attn's own functions for the contract tests.

Speed: each sequence goes to `F.scaled_dot_product_attention` without an explicit mask whenever its
causal pattern allows (that reaches SDPA's fused flash kernels on CPU and GPU); only the rare patterns
that need a mask (chunked prefill, windows) build one, for that one sequence. Sequences of one query each (a
continuous-batching decode step: a query per request) go in groups instead, one call per group over the group's
keys with a key mask, the group's size bounded so that the scores it adds across sequences stay small
(`single_query_groups`): a call costs about 100 us from a thread that is not the main one (OpenMP wakes its team
per call; continuous batching runs the model in its own thread), where the attention of one query is a few us.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["varlen_attention"]


def _visible(sq: int, sk: int, causal: bool, window: tuple[int, int], device: torch.device) -> Optional[torch.Tensor]:
    """Bool (sq, sk) mask of keys each query may see (flash-attn's bottom-right alignment); None = all."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _alibi_bias(slopes: torch.Tensor, sq: int, sk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """flash-attn's ALiBi: -slope * |i + sk - sq - j| (causal: only keys to the left are ever seen)."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    dist = (i - j).abs() if not causal else (i - j)
    return -slopes.reshape(-1, 1, 1) * dist.to(slopes.dtype)


def masked_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, window: tuple[int, int], softcap: float,
    alibi: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One sequence's attention logits, q (H, sq, D), k (H, sk, D) -> (H, sq, sk) in fp32 or wider: scaled,
    soft-capped, ALiBi-biased, -inf where a key is not visible."""
    sq, sk = q.shape[1], k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)  # half types upcast; float64 stays float64
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        scores = scores + _alibi_bias(alibi.to(compute), sq, sk, causal, q.device)
    visible = _visible(sq, sk, causal, window, q.device)
    return scores if visible is None else scores.masked_fill(~visible, float("-inf"))


def _attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: tuple[int, int],
    softcap: float, alibi: Optional[torch.Tensor], dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path for one sequence: q (H, sq, D), k/v (H, sk, D) -> out (H, sq, D), lse (H, sq) fp32."""
    scores = masked_scores(q, k, scale, causal, window, softcap, alibi)
    # Probabilities from softmax, not exp(scores - lse): the ~eps * |lse| rounding of lse becomes the same
    # relative error in every probability of a row, which dq sums coherently (fp32 out and gradients had
    # 1.1-1.25x, with softcap 1.5x, the rms error of a plain PyTorch softmax). lse is only returned.
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # rows that see no key: zeros, not NaN
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v.to(scores.dtype)).to(q.dtype)
    return out, lse.masked_fill(torch.isneginf(lse), float("inf")).float()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: tuple[int, int],
    softcap: float, alibi: Optional[torch.Tensor], dropout_p: float, need_lse: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One sequence, heads first: q (H, sq, D), k/v (Hk, sk, D) -> out (H, sq, D), lse (H, sq) or None."""
    h, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if sk == 0 or sq == 0:
        lse = torch.full((h, sq), float("inf"), device=q.device) if need_lse else None
        return q.new_zeros(h, sq, v.shape[-1]), lse
    gqa = k.shape[0] != h
    windowed = window != (-1, -1)
    plain = not need_lse and softcap == 0 and alibi is None and (causal or not windowed)
    if plain and not (causal and sq > sk):  # sq > sk: some queries see no key; the math path zeros them
        # Without an explicit mask SDPA takes its fused flash kernel: full causal (sq == sk) or a decode
        # step (sq == 1 sees every key). Chunked prefill needs the bottom-right mask, and a causal window its band
        # (every query still sees itself, so no row of the softmax is empty).
        # 4D on purpose: on CPU, 3D (H, S, D) inputs skip the fused flash kernel for the math path (2.5x slower
        # forward + backward at these sizes, torch 2.13); a leading batch of 1 reaches the fused kernel.
        needs_mask = (causal and 1 < sq < sk) or windowed
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=_visible(sq, sk, causal, window, q.device) if needs_mask else None,
            dropout_p=dropout_p, is_causal=causal and sq == sk and sq > 1 and not needs_mask, scale=scale,
            enable_gqa=gqa,
        )
        return out.squeeze(0), None
    if gqa:
        k, v = k.repeat_interleave(h // k.shape[0], dim=0), v.repeat_interleave(h // v.shape[0], dim=0)
    return _attend_math(q, k, v, scale, causal, window, softcap, alibi, dropout_p)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: Sequence[int], seqlens_k: Sequence[int],
    dropout_p: float = 0.0, softmax_scale: Optional[float] = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Varlen attention with host-side lengths: q (Tq, H, D), k/v (Tk, Hk, D) -> out (Tq, H, D), lse (H, Tq)."""
    h, hk = q.shape[1], k.shape[1]
    if h % hk:
        raise ValueError(f"number of query heads ({h}) must be divisible by the number of key/value heads ({hk})")
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(f"cu_seqlens_q has {len(seqlens_q)} sequences but cu_seqlens_k has {len(seqlens_k)}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    window = (int(window_size[0]), int(window_size[1]))
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first, no copy
    n = len(seqlens_q)
    uniform = n > 0 and len(set(seqlens_q)) == 1 and list(seqlens_q) == list(seqlens_k)
    if uniform and alibi_slopes is None and n > 1 and seqlens_q[0] > 0:
        # Equal lengths: one batched call instead of a loop (the common unpadded training batch).
        s = seqlens_q[0]
        qb = q.view(n, s, h, -1).transpose(1, 2)
        kb, vb = k.view(n, s, hk, -1).transpose(1, 2), v.view(n, s, hk, -1).transpose(1, 2)
        out, lse = _attend_batched(qb, kb, vb, scale, causal, window, softcap, dropout_p, return_lse)
        out = out.transpose(1, 2).reshape(n * s, h, -1)
        return out, (lse.permute(1, 0, 2).reshape(h, n * s) if lse is not None else None)
    if n > 1 and alibi_slopes is None and not return_lse and softcap == 0 and dropout_p == 0 and (
            single_queries(seqlens_q, seqlens_k, q.shape[0], k.shape[0])):
        return _attend_single_queries(qh, kh, vh, seqlens_k, scale, window), None
    outs, lses = [], []
    # One split per tensor, not a slice per sequence: autograd sums a slice's gradient into a zeroed tensor of the
    # whole input, once per sequence (18% of a CPU training step at 8 sequences); a split's gradient is one cat.
    rest_q, rest_k = q.shape[0] - sum(seqlens_q), k.shape[0] - sum(seqlens_k)
    if rest_q < 0 or rest_k < 0:
        raise ValueError(f"cu_seqlens cover {sum(seqlens_q)} query and {sum(seqlens_k)} key tokens, but q has "
                         f"{q.shape[0]} and k {k.shape[0]}")
    # a fixed-size cu_seqlens (a compiled graph's) pads with empty documents, one per token: split into as many
    # views, they cost more than the attention (4.6 ms a split at 800 tokens); they hold no token, so none is made
    kept = [i for i in range(n) if seqlens_q[i] or seqlens_k[i]] if 0 in seqlens_q or 0 in seqlens_k else range(n)
    pieces_q = qh.split([*(seqlens_q[i] for i in kept), rest_q], dim=1)
    pieces_k, pieces_v = (t.split([*(seqlens_k[i] for i in kept), rest_k], dim=1) for t in (kh, vh))
    for piece, idx in enumerate(kept):
        sq = seqlens_q[idx]
        if sq == 0:  # keys no query reads: no row to emit
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[idx]
        out, lse = _attend(
            pieces_q[piece], pieces_k[piece], pieces_v[piece], scale, causal, window, softcap, slopes, dropout_p,
            return_lse,
        )
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    if rest_q:
        outs.append(q.new_zeros(rest_q, h, v.shape[-1]))  # tokens past cu_seqlens[-1]: untouched
        lses.append(torch.full((h, rest_q), float("inf"), device=q.device) if return_lse else None)
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, h, v.shape[-1])
    if not return_lse:
        return out, None
    return out, torch.cat(lses, dim=1) if lses else torch.full((h, 0), float("inf"), device=q.device)  # no query


GROUP_SCORES = 1 << 14  # a group's queries x its keys: cross-sequence scores stay under this per head


def single_queries(seqlens_q: Sequence[int], seqlens_k: Sequence[int], q_tokens: int, k_tokens: int) -> bool:
    """One query per sequence behind keys of its own, and no token past the last sequence's."""
    return all(n == 1 for n in seqlens_q) and min(seqlens_k) > 0 and q_tokens == len(seqlens_q) and (
        k_tokens == sum(seqlens_k))


def single_query_groups(seqlens_k: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive sequences as [first, end) groups, each as large as GROUP_SCORES lets its queries x its keys be
    (a sequence longer than that is a group of its own)."""
    groups, first, keys = [], 0, 0
    for i, n in enumerate(seqlens_k):
        if i > first and (i - first + 1) * (keys + n) > GROUP_SCORES:
            groups.append((first, i))
            first, keys = i, 0
        keys += n
    groups.append((first, len(seqlens_k)))
    return groups


def _attend_single_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_k: Sequence[int],
                           scale: float, window: tuple[int, int]) -> torch.Tensor:
    """Heads first, q (H, n, D), k/v (Hk, Tk, D): each query over its own sequence's keys, whose last position it is
    (causal or not, it sees them all; its window, the last of them), group by group (`single_query_groups`), each
    group one SDPA call over its keys with a key mask -> (n, H, D)."""
    starts = [0]
    for n in seqlens_k:
        starts.append(starts[-1] + n)
    outs = []
    for first, end in single_query_groups(seqlens_k):
        lo, hi = starts[first], starts[end]
        columns = torch.arange(hi - lo, device=q.device)
        begin = torch.tensor(starts[first:end], device=q.device) - lo
        stop = torch.tensor(starts[first + 1 : end + 1], device=q.device) - lo
        if window[0] >= 0:
            begin = torch.maximum(begin, stop - 1 - window[0])
        seen = (columns >= begin[:, None]) & (columns < stop[:, None])  # (queries, keys)
        out = F.scaled_dot_product_attention(
            q[:, first:end].unsqueeze(0), k[:, lo:hi].unsqueeze(0), v[:, lo:hi].unsqueeze(0),
            attn_mask=seen[None, None], scale=scale, enable_gqa=k.shape[0] != q.shape[0])
        outs.append(out[0].transpose(0, 1))  # (queries, H, D)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attend_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window: tuple[int, int],
    softcap: float, dropout_p: float, need_lse: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Equal-length sequences, (B, H, S, D): one SDPA call when no explicit mask is needed."""
    if not need_lse and softcap == 0 and window == (-1, -1):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal and q.shape[2] > 1, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out, None
    outs = [_attend(q[b], k[b], v[b], scale, causal, window, softcap, None, dropout_p, need_lse) for b in range(len(q))]
    out = torch.stack([o for o, _ in outs])
    lse = torch.stack([lse for _, lse in outs]) if need_lse else None
    return out, lse
