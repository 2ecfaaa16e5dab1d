"""The unpadding metadata one model forward computes from its mask once, and every patched layer then shares."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch


@dataclasses.dataclass
class VarlenMetadata:
    """Where the real tokens are: gather indices, cu_seqlens and max lengths for queries and keys.

    `indices_*` is None when every token is real (a reshape replaces the gather). The host copies of the
    sequence lengths let the torch-native backend loop without a device sync per layer.
    """

    batch: int
    q_len: int
    kv_len: int
    indices_q: Optional[torch.Tensor]
    indices_k: Optional[torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seqlens_q: list[int]
    seqlens_k: list[int]
    packed: bool = False
    holes: bool = False  # some row has padding between real tokens (left/right padding is no hole)
    # patchkit.forward.decode's DecodePlan for this forward's decode steps, built by the first layer that needs it
    decode_plan: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def nnz_q(self) -> int:
        return sum(self.seqlens_q)

    @property
    def same_qk(self) -> bool:
        """Queries and keys are the same tokens (no past): one set of indices serves both."""
        return self.q_len == self.kv_len


def host_lengths(*lengths: torch.Tensor) -> list[list[int]]:
    """Bring several length vectors to the host in one transfer (one sync per model forward)."""
    sizes = [t.numel() for t in lengths]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in lengths]).cpu().tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start : start + n])
        start += n
    return out


def real_indices(real: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of `real`'s True entries, whose `count` the host already has: on CUDA without a device sync."""
    flat = real.reshape(-1)
    if hasattr(torch, "nonzero_static"):
        return torch.nonzero_static(flat, size=count).flatten()
    return torch.nonzero(flat).flatten()


def has_holes(mask: torch.Tensor) -> bool:
    """Some row of the 2D mask has padding between real tokens (one host sync)."""
    return bool((real_runs(mask.bool()) > 1).any())


def real_runs(real: torch.Tensor) -> torch.Tensor:
    """Per row, how many runs of real tokens it has: more than one means a padding hole inside the row."""
    return (real[:, 1:] & ~real[:, :-1]).sum(-1) + real[:, 0].long()


def dense_metadata(batch: int, q_len: int, kv_len: int, device: torch.device) -> VarlenMetadata:
    """No padding anywhere: every row is one sequence; no gather needed."""
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    cu_k = cu_q
    if q_len != kv_len:
        cu_k = torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32, device=device)
    return VarlenMetadata(
        batch, q_len, kv_len, None, None, cu_q, cu_k, q_len, kv_len, [q_len] * batch, [kv_len] * batch
    )
