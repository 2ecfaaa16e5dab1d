"""The torch-native kernel of a decode step on the padded KV cache in place (SDPA with the step's key mask), which
the sdpa and torch_varlen backends run for `patchkit.forward.decode`'s plan instead of gathering the cache."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from patchkit.forward.decode_plan import DecodePlan


def attend_padded_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DecodePlan, *, softmax_scale: float, dropout_p: float,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> torch.Tensor:
    """Torch-native decode attention on the cache in place, a backend's `attend_kvcache`: q (B, H, q_len, D) and k/v
    (B, Hk, K, D), the cache's own layout and SDPA's -> (B, q_len, H, D).

    SDPA with the plan's boolean mask and `enable_gqa` (on CPU the query heads of a K/V head folded into query rows
    instead; no repeated K/V either way), or, for one token per row over a lot of padding, SDPA per row on its real
    keys without a mask; softcap, which SDPA cannot apply, by the math of
    transformers' eager attention with the query heads grouped over their K/V head (no repeat either).
    """
    if softcap:
        return _softcap_attention(q, k, v, plan.mask(window_size), softmax_scale, softcap, dropout_p).transpose(1, 2)
    batch, heads, q_len, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    starts = plan.row_starts(window_size, k)
    mask = None if starts is not None else plan.mask(window_size)
    if group > 1 and q.device.type == "cpu":  # a K/V head's query heads as more query rows: ~2x enable_gqa on CPU
        q = q.reshape(batch, kv_heads, group * q_len, dim)
        mask = mask.repeat(1, 1, group, 1) if mask is not None and q_len > 1 else mask
    gqa = kv_heads != q.shape[1]
    if starts is not None:
        out = torch.cat([
            F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, s:], v[b : b + 1, :, s:],
                                           dropout_p=dropout_p, scale=softmax_scale, enable_gqa=gqa)
            for b, s in enumerate(starts)
        ])
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale,
                                             enable_gqa=gqa)
    return out.reshape(batch, heads, q_len, -1).transpose(1, 2)  # values of their own width (MLA)


def _grouped_scores(
    q: torch.Tensor, k: torch.Tensor, visible: Optional[torch.Tensor], scale: float, softcap: float,
    compute: torch.dtype,
) -> torch.Tensor:
    """(B, H, q_len, D) x (B, Hk, K, D) -> (B, Hk, group, q_len, K) logits in `compute`, the query heads of a K/V head
    grouped over it (no repeated K/V), capped by `softcap * tanh(s / softcap)`, -inf where `visible` (B, 1, q_len, K)
    hides a key."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(batch, kv_heads, group * q_len, dim).to(compute),
                          k.to(compute).transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, kv_heads, group, q_len, kv_len)
    return scores if visible is None else scores.masked_fill(~visible[:, :, None], float("-inf"))


def _softcap_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor], scale: float, softcap: float,
    dropout_p: float,
) -> torch.Tensor:
    """(B, H, q_len, D) x (B, Hk, K, D): scores capped by `softcap * tanh(s / softcap)`, softmax in fp32 (eager's)."""
    batch, heads, q_len, _ = q.shape
    scores = _grouped_scores(q, k, visible, scale, softcap, q.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.view(batch, k.shape[1], -1, k.shape[2]), v)
    return out.view(batch, heads, q_len, -1)


def attend_padded_cache_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor], *, softmax_scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step on the cache in place with its log-sum-exp, for what merges more logits into the softmax
    (attention sinks, DeepSeek-V4's compressed entries): q (B, H, q_len, D), k/v (B, Hk, K, D), `visible` a
    `DecodePlan.mask` -> out (B, q_len, H, D), lse (B, q_len, H) fp32. The sdpa backend's math path (fp32 or wider),
    on every row at once instead of each row's gathered keys."""
    batch, heads, q_len, _ = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = _grouped_scores(q, k, visible, softmax_scale, softcap, compute)
    lse = torch.logsumexp(scores, dim=-1).view(batch, heads, q_len)
    probs = torch.softmax(scores, dim=-1).view(batch, k.shape[1], -1, k.shape[2])
    out = torch.matmul(probs, v.to(compute)).view(batch, heads, q_len, -1).to(q.dtype)
    return out.transpose(1, 2), lse.transpose(1, 2).float()
