"""Continuous batching's attention calls as varlen metadata: its requests are packed documents already.

transformers' continuous batching (`generate_batch()`, `generate(cache_implementation="paged")`, `transformers serve`)
runs every scheduled request as one packed row of queries, and its paged cache hands each layer the keys of every
request read back in order: a request's past, then its new tokens. Beside them come `cu_seq_lens_q` / `cu_seq_lens_k`
(per request) and, under sdpa and eager, a 4D additive mask over the whole batch (queries x every request's keys),
which its attention multiplies out in full. A request's queries are its last keys and see its keys causally (within
the sliding window, for sliding layers): flash-attn's varlen semantics, bottom-right aligned. Here the lengths become
the metadata patchkit's kernels read, and the mask continuous batching built is checked against that pattern before
it is trusted (`mask_window`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from patchkit.errors import PatchInputError
from patchkit.forward.metadata import VarlenMetadata, host_lengths

# what continuous batching adds to a layer's attention call, none of which patchkit's attention reads once the
# metadata is made (`is_causal`: False under sdpa and eager, whose 4D mask holds the pattern)
PAGED_ARGUMENTS = frozenset({
    "read_index", "write_index", "block_table", "k_cache", "v_cache", "logits_indices", "logits_processor_args",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal",
})

MISMATCH = "mismatch"  # the 4D mask is not the pattern the lengths say


def paged_cache(cache: Any) -> bool:
    """Continuous batching's cache (`generate_batch()`, `generate(cache_implementation="paged")`): blocks of keys
    shared by many requests, read and written by index, under masks it builds itself. Read by class name: the module
    moved between transformers releases."""
    return type(cache).__name__ == "PagedAttentionCache"


def cache_beside(kwargs: Mapping[str, Any]) -> bool:
    """The paged cache handed to attention itself, still to update (transformers before 5.24: its attention functions
    read and write it; the layer's keys are its new tokens alone)."""
    return any(paged_cache(kwargs.get(name)) for name in ("cache", "past_key_values"))


def paged_lengths(module: Any, kwargs: Mapping[str, Any]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(cu_seq_lens_q, cu_seq_lens_k) of a layer's attention call inside continuous batching, or None where they
    are not there to read. The cache's update resolves the key lengths to the layer's type; a layer that reads
    another's keys (KV sharing: Gemma 3n's last layers) updates no cache and gets them by its own type here."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if "write_index" not in kwargs or not isinstance(cu_q, torch.Tensor):
        return None
    if isinstance(cu_k, Mapping):
        cu_k = cu_k.get(getattr(module, "layer_type", None))
    return (cu_q, cu_k) if isinstance(cu_k, torch.Tensor) else None


def paged_metadata(q_len: int, kv_len: int, cu_q: torch.Tensor, cu_k: torch.Tensor) -> VarlenMetadata:
    """The metadata of one packed batch of requests: (1, q_len) queries, (1, kv_len) keys, documents by the
    cumulative lengths. Tokens past the last request's (a batch padded to a captured size) are padding. Kept on
    `cu_k`, which every layer of one layer type shares within a forward: one host read per layer type."""
    kept = getattr(cu_k, "patchkit_paged", None)
    if kept is not None and kept[0] is cu_q and (kept[1].q_len, kept[1].kv_len) == (q_len, kv_len):
        return kept[1]
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)
    lens_q, lens_k = host_lengths(cu_q32.diff(), cu_k32.diff())
    real_q, real_k = sum(lens_q), sum(lens_k)
    if real_q > q_len or real_k > kv_len or any(q > k for q, k in zip(lens_q, lens_k)):
        raise PatchInputError(
            f"continuous batching handed attention {q_len} queries and {kv_len} keys, but its cu_seq_lens describe "
            f"{real_q} queries over {real_k} keys (per request: queries {lens_q}, keys {lens_k}); patchkit reads no "
            "batch it cannot place. Report it with your transformers version."
        )
    device = cu_q.device
    meta = VarlenMetadata(
        1, q_len, kv_len,
        None if real_q == q_len else torch.arange(real_q, device=device),
        None if real_k == kv_len else torch.arange(real_k, device=device),
        cu_q32, cu_k32, max(lens_q, default=0), max(lens_k, default=0), lens_q, lens_k, packed=True,
    )
    cu_k.patchkit_paged = (cu_q, meta)
    return meta


def allowed(meta: VarlenMetadata, window: Optional[int]) -> torch.Tensor:
    """(real queries, real keys) bool: what each query sees under the lengths: its own request's keys up to its own
    position (its request's queries are that request's last keys), the `window` last of them where given."""
    device = meta.cu_seqlens_q.device
    lens_q = torch.tensor(meta.seqlens_q, device=device)
    lens_k = torch.tensor(meta.seqlens_k, device=device)
    requests = torch.arange(len(meta.seqlens_q), device=device)
    doc_q, doc_k = requests.repeat_interleave(lens_q), requests.repeat_interleave(lens_k)
    pos_q = torch.arange(len(doc_q), device=device) - meta.cu_seqlens_q[doc_q] + (lens_k - lens_q)[doc_q]
    pos_k = torch.arange(len(doc_k), device=device) - meta.cu_seqlens_k[doc_k]
    seen = (doc_q[:, None] == doc_k[None]) & (pos_k[None] <= pos_q[:, None])
    if window is not None:
        seen &= pos_k[None] > pos_q[:, None] - window
    return seen


def mask_window(mask: torch.Tensor, meta: VarlenMetadata, windows: tuple[Optional[int], ...]) -> Any:
    """The first of `windows` (None: no window) whose pattern is exactly what continuous batching's 4D `mask` lets
    the real queries see, or MISMATCH. Kept on the mask, which the layers of one layer type share per forward."""
    kept = getattr(mask, "patchkit_paged", None)
    if kept is not None and kept[0] is meta and kept[1] == windows:
        return kept[2]
    found = MISMATCH
    rows = mask[0, 0] if mask.dim() == 4 and mask.shape[:2] == (1, 1) else None
    if rows is not None and rows.shape[0] >= meta.nnz_q and rows.shape[1] == meta.kv_len:
        rows = rows[: meta.nnz_q]
        given = rows if rows.dtype == torch.bool else rows == 0  # additive: 0 where a key is seen
        real_k = sum(meta.seqlens_k)
        if not bool(given[:, real_k:].any()):  # padded keys are never seen
            given = given[:, :real_k]
            found = next((w for w in dict.fromkeys(windows) if torch.equal(given, allowed(meta, w))), MISMATCH)
    mask.patchkit_paged = (meta, windows, found)
    return found
