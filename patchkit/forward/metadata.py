"""The unpadding metadata one model forward computes from its mask once, and every patched layer then shares."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional

import torch

from patchkit.forward.padding import cu_seqlens_from_lengths

if TYPE_CHECKING:
    from patchkit.forward.decode_plan import DecodePlan


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
    # queries that also see the later keys of their block (an image's, both ways), in the unpadded rows
    blocks: Optional[BlockQueries] = None
    # patchkit.forward.decode_plan's DecodePlan for this forward's decode steps, built by the first layer that needs it
    decode_plan: Optional[DecodePlan] = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _elsewhere: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # every layer asks; the lengths never change. A field, not a cached_property: Python 3.11's takes an RLock,
        # which breaks a compiled graph in every layer
        self.nnz_q = sum(self.seqlens_q)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    def on(self, device: torch.device) -> VarlenMetadata:
        """This metadata on `device`: itself there, else its copy there, made once. A model dispatched across
        devices (accelerate's `device_map`) runs each layer on its own: a kernel reads cu_seqlens and gathers by
        indices on the device of its q, k and v."""
        if self.device == device:
            return self
        moved = self._elsewhere.get(device)
        if moved is None:
            moved = self._elsewhere[device] = self._moved(device)
        return moved

    def _moved(self, device: torch.device) -> VarlenMetadata:
        fields = ("indices_q", "indices_k", "cu_seqlens_q", "cu_seqlens_k")
        blocks = None if self.blocks is None else self.blocks.on(device)
        return dataclasses.replace(self, blocks=blocks, **{f: _to(getattr(self, f), device) for f in fields})

    @property
    def same_qk(self) -> bool:
        """Queries and keys are the same tokens (no past): one set of indices serves both."""
        return self.q_len == self.kv_len

    def real_masks(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(B, q_len) and (B, kv_len) bool masks of the real queries and keys; None where every token is real."""
        device = self.cu_seqlens_q.device
        return (mask_from_indices(self.indices_q, self.batch, self.q_len, device),
                mask_from_indices(self.indices_k, self.batch, self.kv_len, device))

    def key_lengths(self) -> torch.Tensor:
        """(B,) each row's count of real keys, on the device."""
        return self.cu_seqlens_k.diff()


def split_at_chunks(meta: VarlenMetadata, chunk: Optional[int]) -> VarlenMetadata:
    """Every sequence cut each `chunk` tokens from its first (chunked attention, Llama 4's: a query sees the keys
    of its own chunk only), as more, shorter documents over the same tokens; `meta` itself where none is cut."""
    if not chunk or not meta.same_qk or meta.max_seqlen_q <= chunk:
        return meta
    lengths = [piece for n in meta.seqlens_q for piece in [chunk] * (n // chunk) + [n % chunk][: n % chunk > 0]]
    cu = cu_seqlens_from_lengths(torch.tensor(lengths, dtype=torch.int32, device=meta.cu_seqlens_q.device))
    return dataclasses.replace(meta, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=chunk, max_seqlen_k=chunk,
                               seqlens_q=lengths, seqlens_k=lengths, packed=True)


def host_lengths(*lengths: torch.Tensor) -> list[list[int]]:
    """Bring several 1D length vectors (any integer or bool dtypes: cat promotes them) to the host in one transfer
    (one sync per model forward)."""
    sizes = [t.numel() for t in lengths]
    flat = torch.cat(lengths).tolist()
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
    """Per row (int32), how many runs of real tokens it has: more than one means a padding hole inside the row."""
    before = torch.nn.functional.pad(real, (1, 0))[:, :-1]  # each column's left neighbour, padding before the row
    return (real > before).sum(-1, dtype=torch.int32)  # where a run starts


def dense_metadata(batch: int, q_len: int, kv_len: int, device: torch.device) -> VarlenMetadata:
    """No padding anywhere: every row is one sequence; no gather needed. (Rows of no token, q_len 0, too.)"""
    rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
    cu_q = rows * q_len
    cu_k = cu_q if q_len == kv_len else rows * kv_len
    return VarlenMetadata(
        batch, q_len, kv_len, None, None, cu_q, cu_k, q_len, kv_len, [q_len] * batch, [kv_len] * batch
    )


class PastMetadata(VarlenMetadata):
    """A forward behind cached keys (a decode step, a chunk of prefill): its 2D masks are kept for the decode plan,
    which reads nothing else, and the gather indices and cu_seqlens, which only the varlen path reads, are built on
    first use (once: then they are plain attributes). A decode step then costs no gather index and no cumsum."""

    def __init__(
        self, batch: int, q_len: int, kv_len: int, real_q: Optional[torch.Tensor], real_k: Optional[torch.Tensor],
        lens_q: torch.Tensor, lens_k: torch.Tensor, host_q: list[int], host_k: list[int], holes: bool,
    ) -> None:
        self.batch, self.q_len, self.kv_len = batch, q_len, kv_len
        self.max_seqlen_q, self.max_seqlen_k = max(host_q, default=0), max(host_k, default=0)
        self.seqlens_q, self.seqlens_k, self.nnz_q = host_q, host_k, sum(host_q)
        self.packed, self.holes, self.decode_plan, self._elsewhere = False, holes, None, {}
        self._real, self._lengths = (real_q, real_k), (lens_q, lens_k)  # real_*: None where every token is real

    @property
    def device(self) -> torch.device:
        return self._lengths[0].device

    def _moved(self, device: torch.device) -> VarlenMetadata:
        real, lengths = (tuple(_to(t, device) for t in pair) for pair in (self._real, self._lengths))
        return PastMetadata(self.batch, self.q_len, self.kv_len, *real, *lengths, self.seqlens_q, self.seqlens_k,
                            self.holes)

    def real_masks(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self._real

    def key_lengths(self) -> torch.Tensor:
        return self._lengths[1]

    @functools.cached_property
    def indices_q(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        real = self._real[0]
        return None if real is None else real_indices(real, sum(self.seqlens_q))

    @functools.cached_property
    def indices_k(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        real = self._real[1]
        return None if real is None else real_indices(real, sum(self.seqlens_k))

    @functools.cached_property
    def cu_seqlens_q(self) -> torch.Tensor:  # type: ignore[override]
        return cu_seqlens_from_lengths(self._lengths[0])

    @functools.cached_property
    def cu_seqlens_k(self) -> torch.Tensor:  # type: ignore[override]
        return cu_seqlens_from_lengths(self._lengths[1])


def _to(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)


def mask_from_indices(indices: Optional[torch.Tensor], batch: int, width: int, device: torch.device) -> Optional[
        torch.Tensor]:
    """(batch, width) bool of the real tokens from metadata indices; None when every token is real."""
    if indices is None:
        return None
    real = torch.zeros(batch * width, dtype=torch.bool, device=device)
    return real.index_fill_(0, indices, True).view(batch, width)


# Image blocks. Queries that also see the later keys of their own block (an image's tokens, both ways, in Gemma 3's
# multimodal masks): a varlen kernel is causal, so each block's queries get a second, non-causal pass over the keys
# from their row's start to the block's end, whose output replaces theirs (`hooks/attention/attend.attend_blocks`).
# In the unpadded rows (the real tokens in order, a packed row's too) a block's keys are one contiguous range ending
# at its last query, so flash-attn's bottom-right alignment places each query where it is, and a sliding window's
# left edge (`(w - 1, -1)`) falls where transformers puts it: keys after the query's position minus the window.
# Gemma 4's blocks are its sliding layers' alone (`sliding_only`).


@dataclasses.dataclass
class BlockQueries:
    """The block queries of a forward, in its unpadded rows: which query rows (`q_index`), the key rows each block
    sees one block after another (`k_index`), and the varlen metadata of the blocks as sequences (`meta`)."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    meta: VarlenMetadata
    sliding_only: bool = False  # the blocks are the sliding layers' alone (Gemma 4's full layers stay causal)
    windowed: bool = True  # a sliding window cuts a block's keys (Gemma 3's); else a block sees all of itself

    def on(self, device: torch.device) -> BlockQueries:
        if self.q_index.device == device:
            return self
        return BlockQueries(self.q_index.to(device), self.k_index.to(device), self.meta.on(device), self.sliding_only,
                            self.windowed)

    def for_window(self, window: tuple[int, int]) -> bool:
        """The blocks apply to a layer of this (flash-attn) window: every layer, or the sliding ones."""
        return not self.sliding_only or window[0] >= 0


def block_queries(reach: torch.Tensor, real: torch.Tensor) -> Optional[BlockQueries]:
    """From each query's reach (B, N) (the last position it sees; its own where it sees nothing later) and the real
    tokens (B, N), no past: the block queries, or None where the pattern is no set of blocks. What padding queries
    see (PaliGemma's left padding belongs to its prompt's block) is left out.

    A block is a run of real queries that all reach the same token, the next real one after the run (which reaches
    itself): transformers' bidirectional image block from its first token to its last, read in the unpadded rows
    (a padding hole inside a block does not cut it). Its pass takes the run and that last token as queries, and the
    keys from the row's first real token to the last token."""
    real = real.bool()
    positions = torch.arange(real.shape[-1], device=real.device).expand_as(real)
    if bool((reach < positions).any()):
        return None  # a query that reaches back: no block
    rows, columns = real.nonzero(as_tuple=True)  # the unpadded rows, in order: index i is the token's there
    reach = reach[rows, columns]
    later = reach > columns
    if not bool(later.any()):
        return None
    same_row = rows[1:] == rows[:-1]  # tokens i and i + 1 of one row
    shifted = torch.nn.functional.pad  # the neighbour before (1, 0) or after (0, 1), none across rows
    before = shifted(later[:-1] & same_row, (1, 0)) & (shifted(reach[:-1], (1, 0), value=-1) == reach)
    after = shifted(later[1:] & same_row, (0, 1)) & (shifted(reach[1:], (0, 1), value=-1) == reach)
    first, end = (later & ~before).nonzero().squeeze(-1), (later & ~after).nonzero().squeeze(-1)
    last = (end + 1).clamp(max=len(rows) - 1)
    if not bool((shifted(same_row, (0, 1))[end] & (columns[last] == reach[end]) & (reach[last] == columns[last]))
                .all()):
        return None  # the run's reach is not the next real token after it, the block's last
    row_first = cu_seqlens_from_lengths(real.sum(-1))[:-1].long()[rows[first]]  # its row's first unpadded token
    lengths_q, lengths_k = last - first + 1, last - row_first + 1
    host_q, host_k = lengths_q.tolist(), lengths_k.tolist()
    meta = VarlenMetadata(len(host_q), max(host_q), max(host_k), None, None, cu_seqlens_from_lengths(lengths_q),
                          cu_seqlens_from_lengths(lengths_k), max(host_q), max(host_k), host_q, host_k, packed=True)
    return BlockQueries(ranges(first, lengths_q), ranges(row_first, lengths_k), meta)


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenated ranges [start, start + length) of each pair."""
    offsets = torch.arange(int(lengths.sum()), device=starts.device) - torch.repeat_interleave(
        cu_seqlens_from_lengths(lengths)[:-1].long(), lengths)
    return torch.repeat_interleave(starts, lengths) + offsets


def id_blocks(ids: torch.Tensor, real: torch.Tensor, from_row_start: bool = False) -> Optional[BlockQueries] | bool:
    """The block queries transformers' block ids (B, N) say over the real tokens (B, N), no past: each id >= 0 a block
    whose real tokens see each other both ways (what is not a block, causally); None where no two real tokens share
    a block; False where the blocks are none that `block_queries` serves (a block in pieces), or, `from_row_start`,
    one that does not begin at its row's first real token."""
    real = real.bool()
    positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    grouped = (ids >= 0) & real
    slot = ids.clamp(min=0)
    last = torch.full((ids.shape[0], int(slot.max()) + 1), -1, dtype=torch.long, device=ids.device)
    last.scatter_reduce_(1, slot, torch.where(grouped, positions, -1), "amax")  # each block's last real token
    reach = torch.maximum(torch.where(grouped, last.gather(1, slot), positions), positions)
    if not bool((reach > positions).any()):
        return None
    if from_row_start:
        first = torch.where(real, positions, ids.shape[-1]).amin(-1, keepdim=True)
        before = torch.nn.functional.pad(ids, (1, 0), value=-2)[:, :-1]
        starts = grouped & ((before != ids) | ~torch.nn.functional.pad(real, (1, 0))[:, :-1])
        if bool((starts & (positions != first)).any()):
            return False
    return block_queries(reach, real) or False
