"""What a decode step's layers share, `DecodePlan`: which keys each query sees on the padded cache, built once per
model forward by `forward/decode.py` and kept on the forward's `VarlenMetadata` (which therefore names its type
here, not in decode.py: the metadata and the planner would otherwise import each other)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

# One new token per row on CPU: one SDPA call per row on its real keys (a view of the cache) instead of one masked
# call over every slot, once the padding it skips outweighs the calls (about 30 us each on CPU, the time to read
# this many bytes; measured on 2 cores, torch 2.13). GPUs read padding faster than they launch: never split there.
ROW_SPLIT_BYTES = {"cpu": 256 * 1024}


@dataclasses.dataclass(eq=False)
class DecodePlan:
    """Where a decode step's real keys and queries are, from the forward's metadata; shared by all its layers.

    `visible` (B, 1, q_len, K) is None when every query sees every key (one new token, no padding anywhere).
    `cache_seqlens` / `cache_leftpad` (B,) int32 describe each row's keys as one run [leftpad, K) for
    flash-attn's `flash_attn_with_kvcache`; None when some row has a hole or a padding query (not expressible).
    Built when a backend first reads them: torch's kernels never do.
    """

    batch: int
    q_len: int
    kv_len: int
    device: torch.device
    visible: Optional[torch.Tensor]
    real_q: Optional[torch.Tensor]  # (B, q_len, 1, 1) bool; None: every query is real
    one_run: bool  # every query is real and each row's keys are one run ending at the last column
    key_lengths: Optional[torch.Tensor]  # (B,) real keys per row; None: no key is padding
    starts: Optional[list[int]] = None  # host: row b's keys are [starts[b], K), for a one-token step over such runs
    _windowed: dict = dataclasses.field(default_factory=dict, repr=False)
    _split: dict = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def cache_seqlens(self) -> Optional[torch.Tensor]:
        return torch.full((self.batch,), self.kv_len, dtype=torch.int32, device=self.device) if self.one_run else None

    @functools.cached_property
    def cache_leftpad(self) -> Optional[torch.Tensor]:  # None with cache_seqlens set: no row is padded
        if not self.one_run or self.key_lengths is None:
            return None
        return (self.kv_len - self.key_lengths).to(device=self.device, dtype=torch.int32)

    def row_starts(self, window: tuple[int, int], k: torch.Tensor) -> Optional[list[int]]:
        """Where each row's visible keys begin, when one SDPA call per row on them beats one masked call; else None.
        Decided once per window and key layout: every layer of the step asks."""
        limit = ROW_SPLIT_BYTES.get(self.device.type)
        if self.starts is None or limit is None:
            return None
        left, key_bytes = int(window[0]), k.shape[1] * k.shape[3] * k.element_size()  # k: (B, Hk, K, D)
        if (left, key_bytes) not in self._split:
            starts = self.starts if left < 0 else [max(s, self.kv_len - 1 - left) for s in self.starts]
            skipped = sum(starts) * key_bytes * 2  # padding bytes of K and V not read
            self._split[left, key_bytes] = starts if skipped >= limit * self.batch else None
        return self._split[left, key_bytes]

    def mask(self, window: tuple[int, int]) -> Optional[torch.Tensor]:
        """The (B, 1, q_len, K) visibility for a layer with flash-attn's `window` ((-1, -1): none), built once."""
        left = int(window[0])
        if left < 0 or left >= self.kv_len - 1:
            return self.visible  # the window reaches every key: nothing more to hide
        if left not in self._windowed:
            band = columns(self.q_len, self.kv_len, self.device)
            band = band[1] >= band[0] - left  # key j >= the query's column - left
            visible = band[None, None] if self.visible is None else self.visible & band
            if self.real_q is not None:
                visible = visible | ~self.real_q[:, :, 0, 0][:, None, :, None]
            self._windowed[left] = visible
        return self._windowed[left]


def columns(q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the queries' key columns as (q_len, 1), the key columns as (1, K)): queries are the last q_len keys."""
    keys = torch.arange(kv_len, device=device)
    return keys[kv_len - q_len :, None], keys[None, :]
