"""Decode steps on the padded KV cache: a per-row key mask instead of gathering every cached key for each new token.

This module plans such a step (which keys each query sees, once per model forward); `hooks/attention/attend.py` hands
the plan to the backend's `attend_kvcache`, and the kernels that run it live with the backends
(`patchkit.backends.padded_decode` for torch's); the plan's type is `forward/decode_plan.py`'s.

The varlen path unpads the keys of every layer: for a decode step (a few new tokens behind a cache of K keys)
that is a copy of the whole cache per layer per token, costlier than the attention itself. Here a step attends to
the cache where it lies, (B, Hk, K, D) as transformers keeps it, with a boolean mask of shape (B, 1, q_len, K),
linear in K, built once per model forward (`DecodePlan`, kept on the forward's `VarlenMetadata`).

Semantics equal the varlen path's: key j of row b is visible to query i when it is real, not after the query
(queries are the last q_len keys), and inside the layer's window. Windows count columns here and real tokens
there; they agree because a window over a row with a padding hole is refused before this point. A padding query
sees every key (so no row of the softmax is empty, no NaN) and its output is then set to zero.
"""

from __future__ import annotations

import torch

from patchkit.forward.decode_plan import DecodePlan, columns
from patchkit.forward.metadata import VarlenMetadata

DECODE_MAX_Q = 16  # new tokens per row up to which a step with a past attends on the padded cache, unless packed
def is_decode_step(meta: VarlenMetadata) -> bool:
    """A few new tokens per row behind a cache (chunked prefill beyond DECODE_MAX_Q keeps the varlen path)."""
    return 0 < meta.q_len < meta.kv_len and meta.q_len <= DECODE_MAX_Q and not meta.packed


def decode_plan(meta: VarlenMetadata, device: torch.device) -> DecodePlan:
    """The forward's decode plan: built by its first layer from the metadata, reused by the others."""
    plan = meta.decode_plan
    if plan is not None:
        return plan
    batch, q_len, kv_len = meta.batch, meta.q_len, meta.kv_len
    queries, keys = meta.real_masks()
    visible = None
    if q_len == 1 and queries is None:  # one real token per row, the last column: it sees every real key
        visible = None if keys is None else keys[:, None, None, :]
    elif keys is not None or q_len > 1:
        query_cols, key_cols = columns(q_len, kv_len, device)
        causal = key_cols <= query_cols  # (q_len, K)
        visible = causal[None] if keys is None else causal[None] & keys[:, None, :]
        if queries is not None:
            visible = visible | ~queries[:, :, None]
        visible = visible.expand(batch, q_len, kv_len)[:, None]
    one_run = queries is None and not meta.holes
    plan = DecodePlan(
        batch, q_len, kv_len, device, visible, None if queries is None else queries[:, :, None, None], one_run,
        None if keys is None else meta.key_lengths(),
        [kv_len - n for n in meta.seqlens_k] if one_run and q_len == 1 else None,
    )
    meta.decode_plan = plan
    return plan
