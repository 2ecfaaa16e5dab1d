"""A decode step's later layers reuse the kernel call its first layer settled on: on a GPU a decode step waits on the
host, and the decisions behind that call (the mask's metadata, the keys in use, the backend, the decode plan) were
most of patchkit's Python per layer. A lane is kept on the forward's mask, per layer signature."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.forward.decode_plan import DecodePlan
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.attention.attend import attend_on_cache


@dataclasses.dataclass(frozen=True)
class Lane:
    """The padded-cache kernel call of a decode step (`attend.decode_attention`'s), with every decision made: the
    backend's `attend_kvcache`, the forward's plan, the keys in use (a static cache's unfilled slots left out)."""

    attend: Callable[..., torch.Tensor]
    plan: DecodePlan
    keys: int
    window: tuple[int, int]
    softcap: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> Optional[torch.Tensor]:
        """q (B, H, q_len, D), k/v (B, Hk, K, D) -> (B, q_len, H, D), padding queries zero: what the full path
        returns for this call; None where the kernel declines the layout, as it did for the first layer's."""
        if k.shape[2] != self.keys:
            k, v = k[:, :, : self.keys], v[:, :, : self.keys]
        return attend_on_cache(self.attend, self.plan, q, k, v, scaling=scaling, dropout=0.0, window=self.window,
                               softcap=self.softcap)


def lane_key(state: Any, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             window: tuple[int, int], softcap: float) -> tuple:
    """What a layer's call shares with the call whose lane it may take: the patch, the layer's class, the shapes
    (the cache's length among them), dtype and device of q/k/v, the window and softcap."""
    return (state, type(module), q.shape, k.shape, v.shape, q.dtype, k.dtype, q.device, window, softcap)


def lane_for(mask: Any, key: tuple) -> Optional[Lane]:
    """The lane the forward's mask keeps for `key`, or None (the full path then runs, and may settle one)."""
    return mask.lanes.get(key) if isinstance(mask, VarlenMask) and mask.lanes is not None else None


def may_settle(backend: Any, q_in: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> bool:
    """A call (one with a `lane_key`: no dropout, no gradients) whose kernel call later layers may take as it is: no
    cast to half, values as wide as queries, and a backend whose choice reads no state outside the layer
    (torch_varlen's `sdpa_kernel`)."""
    return q.dtype == q_in.dtype and q.shape[-1] == v.shape[-1] and getattr(backend, "ambient", None) is None


def settle(mask: VarlenMask, key: tuple, lane: Lane) -> None:
    """Keep `lane` for `key` on the forward's mask."""
    if mask.lanes is None:
        mask.lanes = {}
    mask.lanes[key] = lane
