"""Varlen attention inside a compiled graph that may not break: where the real tokens are, found on the device.

`torch.compile(fullgraph=True)` allows no host read, so the eager path's unpadding (real-token counts on the host,
a gather of exactly those tokens) cannot run there. Here every shape is the padded one: each row's real tokens are
moved to the front of the flat batch by a stable sort of the padding flags (their order kept), `cu_seqlens` is the
cumulative sum of the mask's rows, the longest sequence is bounded by the row length, and the kernel reads only
the tokens `cu_seqlens` covers: padding takes no attention work and gets zeros, as on the eager path. Packed
documents (position_ids restarting, by transformers' rule, or a collator's `cu_seq_lens`) become one `cu_seqlens`
of fixed size, documents first and empty ones after.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from patchkit.forward.masks import VarlenMask
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import cu_seqlens_from_lengths


class GraphPlan(NamedTuple):
    """What the base model's traced forward planned: the patch state serving it, and whether its caller's
    position_ids (with no mask) may restart documents, which the layers then find (patchkit's eager rule); those
    position_ids (2D), for layers handed none (GPT-BigCode's, ZAYA's) where transformers' mask packs by them."""

    state: Any
    by_position: bool
    positions: Optional[torch.Tensor] = None
    cached: bool = False  # the forward makes a cache: documents by patchkit's rule behind it (`graph_layout`)
    flash_ones: bool = False  # a model loaded with flash attention, given one row's mask and position_ids: a mask
    # with no padding is no mask there (transformers' flash_attention_mask), and the positions' documents count


# Set while dynamo traces a patched forward (never at run time: only a traced frame writes them; no contextvar,
# which dynamo refuses): the base model's plan, and whether its causal LM's call has labels over a padded batch.
GRAPH_ROUTE: list[Optional[GraphPlan]] = [None]
GRAPH_LABELS: list = [False]


class Layout(NamedTuple):
    """The flat batch's order for the kernel (None: as it is), which of its rows are real (None: all the kernel
    reads), and the kernel's cumulative sequence offsets."""

    order: Optional[torch.Tensor]
    real: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor


class GraphMask(VarlenMask):
    """The key-padding mask of a forward inside a graph: the 2D mask (or transformers' packed sequence indices,
    `documents`), laid out once for every layer (the first layer's trace computes it, the others reuse it)."""

    __slots__ = ("by_position", "positions", "cached", "_layout")

    def __init__(self, mask: Optional[torch.Tensor], by_position: bool, route: Any, window: Optional[int],
                 positions: Optional[torch.Tensor] = None, cached: bool = False) -> None:
        super().__init__(mask, None, None, False, 0, None, route, window)
        self.by_position = by_position  # documents by position_ids (no mask)
        self.positions = positions  # the forward's own position_ids, for layers handed none
        self.cached = cached  # behind the forward's own cache: a position that does not increase starts a document
        self._layout: Optional[Layout] = None

    def layout(self, batch: int, q_len: int, device: torch.device, position_ids: Optional[torch.Tensor],
               cu_seq_lens: Optional[torch.Tensor]) -> Layout:
        if self._layout is None:
            documents = (self.positions if position_ids is None else position_ids) if self.by_position else None
            self._layout = graph_layout(self.mask, documents, batch, q_len, device, cu_seq_lens, self.cached)
        return self._layout

    def __repr__(self) -> str:
        shape = None if self.mask is None else tuple(self.mask.shape)
        return f"GraphMask(mask={shape}, by_position={self.by_position})"


def graph_layout(mask: Optional[torch.Tensor], positions: Optional[torch.Tensor], batch: int, q_len: int,
                 device: torch.device, cu_seq_lens: Optional[torch.Tensor] = None, cached: bool = False) -> Layout:
    """The layout of a (batch, q_len) forward with no past, with no host read and no shape that depends on data.
    `positions`: position_ids whose every step other than +1 starts a document (transformers' rule, which its masks
    apply without a cache); `cached`, behind the forward's own empty cache, only a step that does not increase (the
    rule patchkit's attention reads documents by there, as eagerly: 0, 3, 6 stays one sequence)."""
    total = batch * q_len
    if mask is not None and positions is not None:  # one row under a flash-loaded model's rule (GraphPlan)
        return ones_or_padding_layout(mask, positions, q_len, device, cached)
    if mask is not None:
        real = mask.to(device=device, dtype=torch.bool).reshape(-1)
        order = torch.sort((~real).to(torch.uint8), stable=True).indices  # real tokens first, each row in order
        return Layout(order, real.index_select(0, order), cu_seqlens_from_lengths(mask.sum(-1, dtype=torch.int32)))
    if cu_seq_lens is not None:  # a collator's documents over the flat batch (DataCollatorWithFlattening)
        return Layout(None, None, cu_seq_lens.to(device=device, dtype=torch.int32))
    if positions is None:
        return Layout(None, None, torch.arange(0, total + 1, q_len, dtype=torch.int32, device=device))
    positions = positions.to(device).expand(batch, q_len)
    steps = positions.diff(dim=-1)
    starts = torch.nn.functional.pad(steps <= 0 if cached else steps != 1, (1, 0), value=True)
    flat = torch.arange(total, dtype=torch.int32, device=device)
    bounds = torch.where(starts.reshape(-1), flat, torch.full_like(flat, total)).sort().values  # starts, then ends
    return Layout(None, None, torch.cat((bounds, bounds.new_full((1,), total))))


def ones_or_padding_layout(mask: torch.Tensor, positions: torch.Tensor, q_len: int, device: torch.device,
                           cached: bool) -> Layout:
    """One row's layout with its mask and position_ids, as a flash-loaded model reads them: the documents of its
    positions where the mask has no padding, else its padding alone (the mask's one sequence, then empty ones to the
    documents' fixed size), chosen on the device."""
    by_mask = graph_layout(mask, None, 1, q_len, device)
    by_documents = graph_layout(None, positions, 1, q_len, device, cached=cached)
    padded = torch.cat((by_mask.cu_seqlens, by_mask.cu_seqlens[-1:].expand(q_len - 1)))
    no_padding = mask.to(device=device, dtype=torch.bool).all()
    return Layout(by_mask.order, by_mask.real, torch.where(no_padding, by_documents.cu_seqlens, padded))


def graph_metadata(batch: int, q_len: int, cu_seqlens: torch.Tensor) -> VarlenMetadata:
    """What a backend's varlen entry reads, with the row length as the bound on every sequence (no host lengths:
    a backend that needs them cannot run in a graph)."""
    return VarlenMetadata(batch, q_len, q_len, None, None, cu_seqlens, cu_seqlens, q_len, q_len, [], [])


def flat_in_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gmask: GraphMask,
                   position_ids: Optional[torch.Tensor], cu_seq_lens: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, VarlenMetadata, Layout]:
    """q, k, v (B, H, S, D), no past, as the flat batch in the mask's layout, (B * S, H, D) each, with what a
    backend's varlen entry reads of it. Rows the kernel does not read are zeroed on the way in (and out,
    `back_in_rows`), so a kernel that leaves them unwritten (flash-attn's empty outputs and gradients) adds nothing."""
    batch, _, q_len, _ = q.shape
    lay = gmask.layout(batch, q_len, q.device, position_ids, cu_seq_lens)
    q, k, v = (x.transpose(1, 2).reshape(batch * q_len, *x.shape[1:2], x.shape[-1]) for x in (q, k, v))
    if lay.order is not None:
        keep = lay.real.view(-1, 1, 1)
        q, k, v = (torch.where(keep, x.index_select(0, lay.order), 0) for x in (q, k, v))
    return q, k, v, graph_metadata(batch, q_len, lay.cu_seqlens), lay


def back_in_rows(out: torch.Tensor, lay: Layout, batch: int, q_len: int) -> torch.Tensor:
    """A kernel's (B * S, H, Dv) output in the layout's order -> (B, S, H, Dv), zeros at padding."""
    if lay.order is not None:
        out = torch.zeros_like(out).index_copy(0, lay.order, torch.where(lay.real.view(-1, 1, 1), out, 0))
    return out.view(batch, q_len, *out.shape[1:])
