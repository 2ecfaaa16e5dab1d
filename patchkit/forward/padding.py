"""Unpad and repad helpers in the shape of flash-attn's `bert_padding`, pure torch and autograd-friendly."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather rows of `x` along its first axis (a differentiable `index_select`)."""
    return x.index_select(0, on_device(indices, x))


def on_device(indices: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`indices` on `x`'s device: a model split across devices ends on another than its metadata's (the first's)."""
    return indices if indices.device == x.device else indices.to(x.device)


def unpad_rows(x: torch.Tensor, indices: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, S, ...) -> (nnz, ...): the real tokens' rows; a reshape when `indices` is None (every token real)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return flat if indices is None else index_first_axis(flat, indices)


def pad_input(hidden: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int, fill: float = 0.0) -> torch.Tensor:
    """Scatter (nnz, ...) rows back into a (batch, seqlen, ...) tensor of `fill` (zeros by default)."""
    out = hidden.new_full((batch * seqlen, *hidden.shape[1:]), fill)
    out = out.index_copy(0, on_device(indices, hidden), hidden)
    return out.view(batch, seqlen, *hidden.shape[1:])


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """(n,) lengths -> (n+1,) int32 cumulative offsets starting at 0."""
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(
    hidden: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """flash-attn >= 2.7's `unpad_input`: (unpadded, indices, cu_seqlens, max_seqlen, seqused)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens_from_lengths(seqlens), max_seqlen, used
