"""Which document each token belongs to: position_ids restarts, and TRL's `seq_idx` checked against them.

Padding-free collators (TRL's) pass `seq_idx` beside `position_ids` and `cu_seq_lens_*`, for the short convolutions
of linear-attention layers. Attention takes its documents from the other two; a `seq_idx` that disagrees with them
would mean the caller meant other documents, so it is refused by name rather than ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from patchkit.errors import PatchInputError
from patchkit.warn import warn_user

if TYPE_CHECKING:
    from patchkit.forward.metadata import VarlenMetadata

_said: set[str] = set()  # the reasons `kept_apart` said, once a process each
APART = [0]  # how many masks' metadata kept a row's documents apart (no mask given), in this process so far


def kept_apart(why: str) -> None:
    """Say once per reason that patchkit keeps a caller's packed documents apart where transformers' own sdpa or
    eager run of this forward lets them see each other (`why`: how it does), as its flash_attention_2 does not; an
    attention mask of ones, with no cu_seq_lens, joins them in patchkit too."""
    if why in _said:
        return
    _said.add(why)
    warn_user(f"patchkit: packed documents (position_ids restarting with no attention_mask, or cu_seq_lens_*) are "
              f"kept apart here, as transformers' flash_attention_2 keeps them (4.44+), where its sdpa and eager "
              f"attention {why}: this forward gives each document's numbers alone, not theirs. Pass an "
              "attention_mask of ones and no cu_seq_lens_* to join them as those do.")

def document_lengths(
    real: torch.Tensor, indices: torch.Tensor, position_ids: Optional[torch.Tensor]
) -> torch.Tensor:
    """Lengths of the documents among the real tokens at `indices` (row-major), in order.

    A document starts at the first real token of each row and, for packed rows, wherever a real token's
    position does not increase over the previous *real* token of its row (0 after 5, 0 after 0): padding
    between them is skipped, never compared. Gaps (0, 3, 6) stay one document.
    """
    rows = torch.div(indices, real.shape[1], rounding_mode="floor")
    new = torch.ones_like(indices, dtype=torch.bool)
    new[1:] = rows[1:] != rows[:-1]
    if position_ids is not None:
        pos = position_ids.expand(real.shape[0], -1).reshape(-1).index_select(0, indices)
        new[1:] |= pos[1:] <= pos[:-1]
    starts = torch.nonzero(new).flatten()
    return torch.diff(starts, append=starts.new_tensor([indices.numel()]))


def restart_lengths(position_ids: torch.Tensor, batch: int) -> list[int]:
    """Lengths of the documents of `batch` rows with no mask, in order, by transformers' rule for them
    (`masking_utils.find_packed_sequence_indices`): a new one at each row's start and wherever a position is not the
    previous one plus 1."""
    positions = position_ids.expand(batch, -1)
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    return seq_idx_lengths(documents, batch, positions.shape[-1], None)


def document_ids(position_ids: torch.Tensor, checked: bool = True) -> Optional[torch.Tensor]:
    """(B, N) document ids of packed rows, a new one wherever a position does not increase (patchkit's attention's
    rule, `document_lengths`; gaps stay one document), or None where no row restarts (`checked`;
    unchecked in a graph, which cannot branch on it: one document per row is the causal mask there too)."""
    restarts = torch.zeros_like(position_ids, dtype=torch.long)
    restarts[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
    ids = restarts.cumsum(-1)
    return ids if not checked or bool(ids[:, -1].any()) else None


def has_packed_rows(mask: Optional[torch.Tensor], position_ids: Any) -> bool:
    """A row holds several documents: its real tokens' position_ids restart (`document_lengths`)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return False
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return False
    batch, seqlen = (position_ids.shape if mask is None else mask.shape)
    real = (torch.ones(batch, seqlen, dtype=torch.bool, device=position_ids.device) if mask is None
            else mask.to(device=position_ids.device, dtype=torch.bool))
    if position_ids.shape[-1] != seqlen:
        return False
    indices = torch.nonzero(real.reshape(-1)).flatten()
    return document_lengths(real, indices, position_ids).numel() > int(real.any(-1).sum())


def packing_restart_with_past(
    mask: Optional[torch.Tensor], batch: int, q_len: int, position_ids: Optional[torch.Tensor], device: torch.device
) -> bool:
    """A chunk with a past whose positions restart among its real tokens holds a new packed document."""
    if position_ids is None or q_len < 2 or position_ids.shape[-1] != q_len:
        return False
    real_q = (torch.ones(batch, q_len, dtype=torch.bool, device=device) if mask is None
              else mask[:, -q_len:].to(device=device, dtype=torch.bool))
    return has_packed_rows(real_q, position_ids.to(device))


def seq_idx_lengths(seq_idx: torch.Tensor, batch: int, q_len: int, indices: Optional[torch.Tensor]) -> list[int]:
    """Lengths of the runs of equal `seq_idx` over the real tokens (row-major), a new run at each row's start."""
    flat = seq_idx.to(torch.int64).expand(batch, q_len).reshape(-1)
    rows = torch.arange(batch * q_len, device=flat.device).div(q_len, rounding_mode="floor")
    if indices is not None:
        flat, rows = flat.index_select(0, indices), rows.index_select(0, indices)
    if flat.numel() == 0:
        return []
    new = torch.ones_like(flat, dtype=torch.bool)
    new[1:] = (flat[1:] != flat[:-1]) | (rows[1:] != rows[:-1])
    starts = torch.nonzero(new).flatten()
    return torch.diff(starts, append=starts.new_tensor([flat.numel()])).tolist()


def check_seq_idx(seq_idx: Optional[torch.Tensor], meta: VarlenMetadata) -> None:
    """Refuse a `seq_idx` whose documents differ from those of the mask, `position_ids` or `cu_seq_lens_*`."""
    if not isinstance(seq_idx, torch.Tensor) or not meta.same_qk:
        return
    if seq_idx.shape[-1] != meta.q_len or seq_idx.numel() not in (meta.q_len, meta.batch * meta.q_len):
        raise PatchInputError(
            f"seq_idx has shape {tuple(seq_idx.shape)} but this forward has {meta.batch} rows of {meta.q_len} "
            "tokens; pass the seq_idx your collator built for this batch (one index per token)."
        )
    lengths = seq_idx_lengths(seq_idx, meta.batch, meta.q_len, meta.indices_q)
    if lengths != list(meta.seqlens_q):
        raise PatchInputError(
            f"seq_idx names documents of lengths {_short(lengths)}, but position_ids / cu_seq_lens_q / the "
            f"attention mask give {_short(meta.seqlens_q)}. Attention follows the latter, so patchkit refuses "
            "rather than guess which one you meant: build seq_idx, position_ids and cu_seq_lens from the same "
            "documents (TRL's padding-free collator does)."
        )


def check_positions(mask: Any, position_ids: Any, cu_seq_lens: Any) -> None:
    """Refuse a caller's `position_ids` that restart at other places than its `cu_seq_lens_q`'s documents, with no
    mask: transformers' sdpa and eager attention keep apart the documents of the former, its flash_attention_2 those
    of the latter. (A 4D mask's documents, which patchkit passes on as cu_seq_lens, are read before they are made.)"""
    if mask is not None or not isinstance(cu_seq_lens, torch.Tensor) or not has_packed_rows(None, position_ids):
        return
    batch, seqlen = position_ids.shape
    real = torch.ones(batch, seqlen, dtype=torch.bool, device=position_ids.device)
    indices = torch.arange(batch * seqlen, device=position_ids.device)
    by_position = document_lengths(real, indices, position_ids).tolist()
    by_cu = cu_seq_lens.diff().tolist()
    if by_position != by_cu:
        raise PatchInputError(
            f"position_ids restart into documents of lengths {_short(by_position)}, but cu_seq_lens_q gives "
            f"{_short(by_cu)}. transformers' sdpa and eager attention follow the former, its flash_attention_2 the "
            "latter, so patchkit refuses rather than guess which one you meant: build position_ids and cu_seq_lens "
            "from the same documents (DataCollatorWithFlattening and TRL's padding-free collator do)."
        )


def _short(lengths: list[int]) -> str:
    return str(lengths) if len(lengths) <= 8 else f"[{', '.join(map(str, lengths[:8]))}, ...] ({len(lengths)})"


MASKED = -1e4  # an additive mask's entry at or below this gives its key no weight (exp underflows: 0 exactly)


def binary_masking(mask: torch.Tensor) -> bool:
    """Every entry of an additive mask is 0 (attend) or masked (`MASKED` and below, -inf): it adds nothing to a
    visible key's score, as a boolean mask; not a 0/1 mask (transformers adds its ones to the scores), nor a bias."""
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask <= MASKED)).all())


def allowed_keys(mask: torch.Tensor) -> torch.Tensor:
    """A (B, 1, Q, K) mask, boolean (True: attend) or additive (0: attend), as (B, Q, K) booleans."""
    return mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0


def real_tokens_of_4d(mask: torch.Tensor) -> torch.Tensor:
    """(B, S) booleans: the tokens of a square 4D mask that see themselves, i.e. the real ones."""
    return allowed_keys(mask).diagonal(dim1=-2, dim2=-1)


def block_diagonal_documents(mask: torch.Tensor) -> Optional[tuple[torch.Tensor, int]]:
    """A 4D mask that is causal attention within contiguous documents of each row, padding masked and on one side
    (LLaMA-Factory's `neat_packing` mask): (cu_seqlens over every token, each padding token a document of its own,
    longest document), so the varlen path serves it exactly; else None."""
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2] or not binary_masking(mask):
        return None
    allowed = allowed_keys(mask)
    seqlen = allowed.shape[-1]
    real = allowed.diagonal(dim1=-2, dim2=-1)
    idx = torch.arange(seqlen, device=mask.device)
    starts = real & (allowed.to(torch.int8).argmax(-1) == idx)  # a real token whose first visible key is itself
    doc = starts.cumsum(-1)
    expected = (real[:, :, None] & real[:, None, :] & (idx[:, None] >= idx[None, :])
                & (doc[:, :, None] == doc[:, None, :]))
    runs = (real[:, 1:] & ~real[:, :-1]).sum(-1) + real[:, 0].long()  # runs of real tokens per row
    if not bool(torch.equal(expected, allowed & real[:, :, None]) and (runs <= 1).all() and real.any(-1).all()):
        return None
    boundary = (starts | ~real).reshape(-1)
    boundary[:: seqlen] = True  # every row starts a segment
    first = torch.nonzero(boundary).flatten()
    lengths = torch.diff(first, append=first.new_tensor([boundary.numel()]))
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return cu, int(lengths.max())


class Rows(NamedTuple):
    """A packed row's documents laid out as rows of their own: each token's place in the (count, length) layout."""

    indices: torch.Tensor
    count: int
    length: int


def documents(position_ids: Optional[torch.Tensor]) -> Optional[Rows]:
    """The documents of one packed row (1, N) whose positions count 0, 1, ... in each, where it holds several; else
    None (a host read of the positions)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    positions = position_ids[0]
    starts = (positions == 0).nonzero().squeeze(1)
    if starts.numel() < 2 or int(starts[0]) != 0:
        return None
    lengths = torch.diff(torch.cat([starts, starts.new_tensor([positions.numel()])]))
    offsets = torch.arange(positions.numel(), device=positions.device) - starts.repeat_interleave(lengths)
    if not torch.equal(positions, offsets.to(positions.dtype)):
        return None
    length = int(lengths.max())
    rows = torch.arange(len(lengths), device=positions.device).repeat_interleave(lengths)
    return Rows(rows * length + offsets, len(lengths), length)
