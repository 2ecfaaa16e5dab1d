"""Paged KV cache (flash-attn's `block_table`) for the torch-native backend: gather pages, then run plain varlen."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["gather_pages"]


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
