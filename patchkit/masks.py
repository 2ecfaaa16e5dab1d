"""Key-padding masks and the unpadding metadata every patched layer of one model forward shares."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping, Optional

import torch

from .errors import PatchInputError
from .padding import cu_seqlens_from_lengths

FOUR_D_MASK_MESSAGE = (
    "patchkit received a 4D attention mask of shape {shape}. A 4D mask (a custom attention pattern) cannot be "
    "expressed as a key-padding mask, so the varlen kernels cannot serve it exactly. Pass the 2D "
    "[batch, past + q_len] padding mask instead, or revert the patch (handle.revert()) for this model."
)


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

    @property
    def nnz_q(self) -> int:
        return sum(self.seqlens_q)

    @property
    def same_qk(self) -> bool:
        """Queries and keys are the same tokens (no past): one set of indices serves both."""
        return self.q_len == self.kv_len


def check_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Accept None or a 2D mask; refuse a 4D one with an error that says why and what to do."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise PatchInputError(f"attention_mask must be a tensor or None, got {type(mask).__name__}")
    if mask.dim() == 4:
        raise PatchInputError(FOUR_D_MASK_MESSAGE.format(shape=tuple(mask.shape)))
    if mask.dim() != 2:
        raise PatchInputError(
            f"attention_mask must be 2D [batch, past + q_len] (1 = real token, 0 = padding); got shape "
            f"{tuple(mask.shape)}"
        )
    return mask


def _host_lengths(*lengths: torch.Tensor) -> list[list[int]]:
    """Bring several length vectors to the host in one transfer (one sync per model forward)."""
    sizes = [t.numel() for t in lengths]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in lengths]).cpu().tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start : start + n])
        start += n
    return out


def _dense(batch: int, q_len: int, kv_len: int, device: torch.device) -> VarlenMetadata:
    """No padding anywhere: every row is one sequence; no gather needed."""
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=device)
    cu_k = cu_q
    if q_len != kv_len:
        cu_k = torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32, device=device)
    return VarlenMetadata(
        batch, q_len, kv_len, None, None, cu_q, cu_k, q_len, kv_len, [q_len] * batch, [kv_len] * batch
    )


def _from_cu_seqlens(
    batch: int, q_len: int, kv_len: int, cu_q: torch.Tensor, cu_k: Optional[torch.Tensor]
) -> VarlenMetadata:
    """Explicit `cu_seq_lens_q/k` (DataCollatorWithFlattening): documents over the flattened tokens."""
    if q_len != kv_len:
        raise PatchInputError(
            "cu_seq_lens_q/k describe packed documents and cannot be combined with a KV cache that holds past "
            "tokens; run packed batches without a past (use_cache=False or a fresh cache)"
        )
    cu_q = cu_q.to(torch.int32)
    cu_k = cu_q if cu_k is None else cu_k.to(torch.int32)
    lens_q, lens_k = _host_lengths(cu_q.diff(), cu_k.diff())
    if sum(lens_q) != batch * q_len:
        raise PatchInputError(
            f"cu_seq_lens_q covers {sum(lens_q)} tokens but the batch holds {batch * q_len} "
            f"({batch} x {q_len}); pass the cu_seq_lens that DataCollatorWithFlattening built for this batch"
        )
    return VarlenMetadata(
        batch, q_len, kv_len, None, None, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0),
        lens_q, lens_k, packed=len(lens_q) > batch,
    )


def _document_starts(real: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """True at the first real token of each row and, for packed rows, wherever position_ids restart.

    A restart is a position that does not increase (0 after 5, 0 after 0); gaps (0, 3, 6) stay one document.
    """
    starts = real & (real.cumsum(-1) == 1)
    if position_ids is not None:
        pos = position_ids.expand(real.shape[0], -1)
        restart = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) <= 0
        starts = starts | (real & restart)
    return starts


def build_metadata(
    mask: Optional[torch.Tensor],
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
) -> VarlenMetadata:
    """Compute the unpadding metadata for one model forward from the 2D mask and packing hints."""
    mask = check_mask(mask)
    if mask is not None and tuple(mask.shape) != (batch, kv_len):
        raise PatchInputError(
            f"attention_mask has shape {tuple(mask.shape)} but this attention call has batch {batch} and "
            f"{kv_len} keys (past + q_len). The 2D mask must cover every key exactly once: [batch, past + q_len]; "
            "do not prepend past columns to a mask that already has them"
        )
    if cu_seq_lens_q is not None:
        if mask is not None and not bool(mask.all()):
            raise PatchInputError(
                "got both cu_seq_lens_q/k (packed documents) and an attention_mask with padding; pass one of them"
            )
        return _from_cu_seqlens(batch, q_len, kv_len, cu_seq_lens_q, cu_seq_lens_k)

    packing_hint = position_ids is not None and q_len == kv_len and position_ids.shape[-1] == q_len and q_len > 1
    if mask is None and not packing_hint:
        return _dense(batch, q_len, kv_len, device)

    mask = mask.to(device=device, dtype=torch.bool) if mask is not None else None
    real_k = mask if mask is not None else torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    real_q = real_k[:, -q_len:]
    if q_len == kv_len:
        starts = _document_starts(real_q, position_ids.to(device) if packing_hint else None)
        indices = torch.nonzero(real_q.reshape(-1)).flatten()
        doc_starts = torch.nonzero(starts.reshape(-1).index_select(0, indices)).flatten()
        lengths = torch.diff(doc_starts, append=doc_starts.new_tensor([indices.numel()]))
        host, rows_with_tokens = _host_lengths(lengths, real_q.any(-1))
        packed = len(host) > sum(rows_with_tokens)
        every_token_real = sum(host) == batch * q_len
        if every_token_real and not packed:
            return _dense(batch, q_len, kv_len, device)
        indices = None if every_token_real else indices  # packed rows without padding: no gather, a reshape
        cu = cu_seqlens_from_lengths(lengths.to(torch.int32))
        return VarlenMetadata(
            batch, q_len, kv_len, indices, indices, cu, cu, max(host, default=0), max(host, default=0),
            host, host, packed=packed,
        )

    lens_q = real_q.sum(-1, dtype=torch.int32)
    lens_k = real_k.sum(-1, dtype=torch.int32)
    host_q, host_k = _host_lengths(lens_q, lens_k)
    dense_q = sum(host_q) == batch * q_len
    dense_k = sum(host_k) == batch * kv_len
    if dense_q and dense_k:
        return _dense(batch, q_len, kv_len, device)
    return VarlenMetadata(
        batch, q_len, kv_len,
        None if dense_q else torch.nonzero(real_q.reshape(-1)).flatten(),
        None if dense_k else torch.nonzero(real_k.reshape(-1)).flatten(),
        cu_seqlens_from_lengths(lens_q), cu_seqlens_from_lengths(lens_k),
        max(host_q, default=0), max(host_k, default=0), host_q, host_k,
    )


class VarlenMask:
    """What the patched mask builder hands to every layer: the 2D mask, with metadata computed once.

    The first patched layer of a forward computes the metadata; the others reuse it. Nothing of size
    (batch, 1, q_len, kv_len) is ever built. Inside `packed_forward(meta)` a builder given no mask hands the
    layers `meta` itself: the model forward has already unpadded its batch into one packed row.
    """

    __slots__ = ("mask", "_key", "_meta")

    def __init__(self, mask: Optional[torch.Tensor], meta: Optional[VarlenMetadata] = None) -> None:
        self.mask = check_mask(mask)
        self._meta = meta
        self._key: Optional[tuple] = None if meta is None else (meta.batch, meta.q_len, meta.kv_len)

    @classmethod
    def for_forward(cls, mask: Optional[torch.Tensor]) -> VarlenMask:
        """The mask builders' entry: `mask`, or the packed forward's metadata when one is running."""
        meta = _PACKED_FORWARD.get()
        return cls(mask, meta if mask is None else None)

    def metadata(
        self, batch: int, q_len: int, kv_len: int, device: torch.device,
        position_ids: Optional[torch.Tensor], fa_kwargs: Mapping[str, Any],
    ) -> VarlenMetadata:
        key = (batch, q_len, kv_len)
        if self._meta is None or self._key != key:
            self._meta = build_metadata(
                self.mask, batch, q_len, kv_len, device, position_ids,
                fa_kwargs.get("cu_seq_lens_q"), fa_kwargs.get("cu_seq_lens_k"),
            )
            self._key = key
        return self._meta

    def __repr__(self) -> str:
        shape = None if self.mask is None else tuple(self.mask.shape)
        return f"VarlenMask(mask={shape})"


_PACKED_FORWARD: contextvars.ContextVar[Optional[VarlenMetadata]] = contextvars.ContextVar(
    "patchkit_packed_forward", default=None
)


@contextlib.contextmanager
def packed_forward(meta: VarlenMetadata) -> Iterator[None]:
    """Within this block, mask builders given no mask describe the documents of one packed row by `meta`."""
    token = _PACKED_FORWARD.set(meta)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def as_varlen_mask(mask: Any) -> VarlenMask:
    """Wrap whatever reached attention (our VarlenMask, a 2D tensor, None) and refuse a 4D mask."""
    return mask if isinstance(mask, VarlenMask) else VarlenMask.for_forward(mask)
