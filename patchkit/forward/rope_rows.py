"""Multimodal RoPE's position rows (Qwen2-VL): kept out of the padding checks, unpadded row by row with the batch."""

from __future__ import annotations

from typing import Optional

import torch

from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import unpad_rows


def take_rope_rows(arguments: dict) -> Optional[torch.Tensor]:
    """Take a (k, B, S) `position_ids` out of a base model forward's `arguments` and leave what transformers reads
    for documents in its place: the text row of 4 (row 0, which the caller packs by), none of 3 (time, height and
    width rows, which restart inside an image). None when the positions are the usual (B, S)."""
    positions = arguments.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return None
    arguments["position_ids"] = positions[0] if positions.shape[0] == 4 else None
    return positions


def put_rope_rows(arguments: dict, rows: Optional[torch.Tensor], meta: Optional[VarlenMetadata] = None) -> dict:
    """Put the rows `take_rope_rows` took back into `arguments`: as they were, or, for a forward run packed on
    `meta`, each row's real tokens as one (k, 1, nnz) row."""
    if rows is not None:
        arguments["position_ids"] = rows if meta is None else torch.stack(
            [unpad_rows(row, meta.indices_q) for row in rows]).unsqueeze(1)
    return arguments
