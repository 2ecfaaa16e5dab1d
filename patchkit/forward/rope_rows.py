"""Multimodal RoPE's position rows (Qwen2-VL): kept out of the padding checks, unpadded row by row with the batch, and
never read as text positions."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import unpad_rows


def take_rope_rows(arguments: dict) -> Optional[torch.Tensor]:
    """Take a (k, B, S) `position_ids` out of a base model forward's `arguments` and leave what transformers reads
    for documents in its place: the text row of 4 (row 0, which the caller packs by), none of 3 (time, height and
    width rows, constant over an image's tokens). None when the positions are the usual (B, S)."""
    positions = arguments.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return None
    arguments["position_ids"] = positions[0] if positions.shape[0] == 4 else None
    return positions


def put_rope_rows(arguments: dict, rows: Optional[torch.Tensor], meta: Optional[VarlenMetadata] = None) -> dict:
    """Put the rows `take_rope_rows` took back into `arguments`: as they were, or, for a forward run packed on
    `meta`, each row's real tokens as one (k, 1, nnz) row. Three rows with no mask get a text row in front, one
    document per row (`with_text_row`)."""
    if rows is not None:
        if meta is None and rows.shape[0] == 3 and arguments.get("attention_mask") is None:
            rows = with_text_row(rows)
        arguments["position_ids"] = rows if meta is None else torch.stack(
            [unpad_rows(row, meta.indices_q) for row in rows]).unsqueeze(1)
    return arguments


def with_text_row(rows: torch.Tensor) -> torch.Tensor:
    """(3, B, S) RoPE rows with a text row in front that marks each row one document. Before transformers 4.57
    (Qwen2-VL) and 5.3 (Qwen3-VL) the text model hands the time row on as text positions where no text row is given:
    constant over an image's tokens, which a forward without a mask would read as document starts."""
    batch, seqlen = rows.shape[1:]
    text = torch.arange(seqlen, device=rows.device, dtype=rows.dtype).expand(batch, seqlen)
    return torch.cat([text[None], rows])


def text_positions(module: nn.Module, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """`position_ids` as attention reads documents from them, or None where they cannot be text positions: a
    multimodal-RoPE model's time row (handed to attention where no text row was given, before transformers 4.57 for
    Qwen2-VL and 5.3 for Qwen3-VL, and under `attn_implementation="patchkit"` alone) repeats a nonzero position over
    an image's tokens, which text positions never do. One host sync, once per forward without a mask."""
    config = getattr(module, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict) or "mrope_section" not in rope or position_ids.dim() != 2:
        return position_ids
    later = position_ids[..., 1:]
    return None if bool(((later == position_ids[..., :-1]) & (later != 0)).any()) else position_ids
