"""FlashAttention-2's varlen backward indexes with 32-bit offsets: refuse a call whose sizes reach 2**31.

A packed batch past that size does not fail in flash-attn: its backward reads and writes out of bounds (an
illegal memory access, or silently wrong gradients; flash-attn issue 1311, PR 1500). The largest index is the
fp32 dq accumulator of (total_q + 128 * batch) rows x heads x head_dim rounded up; q, k and v (or the packed
qkv / kv they are views of) must fit as well.
"""

from __future__ import annotations

import torch

from patchkit.errors import PatchInputError
from patchkit.forward.metadata import VarlenMetadata

INT32_LIMIT = 2**31


def rounded_head_dim(head_dim: int) -> int:
    """The head dimension the backward kernel allocates: a multiple of 32 up to 128, of 64 above."""
    step = 32 if head_dim <= 128 else 64
    return -(-head_dim // step) * step


def extent(t: torch.Tensor) -> int:
    """Elements a kernel indexes through `t`: its size, or its rows times its row stride for a packed view."""
    return max(t.numel(), t.shape[0] * t.stride(0)) if t.dim() else t.numel()


def index_sizes(meta: VarlenMetadata, heads: int, head_dim: int, tensors: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """The sizes of one varlen call that the backward kernel indexes with 32-bit offsets, by name."""
    total_q, batch = tensors[0].shape[0], len(meta.seqlens_q)
    sizes = {
        f"dq accumulator ((total_q {total_q:,} + 128 x batch {batch}) x heads {heads} x head_dim "
        f"{rounded_head_dim(head_dim)})": (total_q + 128 * batch) * heads * rounded_head_dim(head_dim),
    }
    sizes.update({f"input {i} {tuple(t.shape)}": extent(t) for i, t in enumerate(tensors)})
    return sizes


def check_index_range(
    backend: str, meta: VarlenMetadata, heads: int, head_dim: int, *tensors: torch.Tensor
) -> None:
    """Refuse, before the kernel runs, a call whose backward would index past 2**31 (only when it has one)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return
    for what, size in index_sizes(meta, heads, head_dim, tensors).items():
        if size >= INT32_LIMIT:
            raise PatchInputError(
                f"patchkit's {backend} backend: this batch's {what} is {size:,} elements, at or past 2**31 = "
                f"{INT32_LIMIT:,}. FlashAttention-2's varlen backward indexes it with 32-bit offsets and would "
                "access memory out of bounds (an illegal memory access or wrong gradients, not an error). Use a "
                "smaller micro-batch (fewer real tokens per step or per packed row; gradient accumulation keeps "
                "the effective batch), or backend='sdpa'."
            )
