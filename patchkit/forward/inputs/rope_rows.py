"""Multimodal RoPE's position rows (Qwen2-VL): kept out of the padding checks, unpadded row by row with the batch, and
never read as text positions."""

from __future__ import annotations

from typing import Any, Optional

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
    `meta`, each row's real tokens as one (k, 1, nnz) row."""
    if rows is not None:
        arguments["position_ids"] = rows if meta is None else torch.stack(
            [unpad_rows(row, meta.indices_q) for row in rows]).unsqueeze(1)
    return arguments


def text_positions(module: nn.Module, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """`position_ids` as attention reads documents from them, or None where they cannot be text positions: a
    multimodal-RoPE model's time row (handed to attention where no text row was given, before transformers 4.57 for
    Qwen2-VL and 5.3 for Qwen3-VL, and under `attn_implementation="patchkit"` alone) repeats a nonzero position over
    an image's tokens, which text positions never do (the vision-start token before an image takes position 0 if
    any token does, so the repeated time is never 0). One host sync, once per forward without a mask."""
    return config_text_positions(getattr(module, "config", None), position_ids)


def multimodal_rope(config: Any) -> bool:
    """The model of `config` rotates by several position rows (time, height, width): Qwen2-VL's and Qwen3-VL's."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return isinstance(rope, dict) and "mrope_section" in rope


def config_text_positions(config: Any, position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """`text_positions` for a model of `config` (what transformers' mask preprocessing is handed). RoPE rows without
    their text row, (3, B, S) as GLM-4.5V's text model hands its layers, mark no documents: transformers builds its
    mask from the text row alone."""
    if position_ids.dim() > 2:
        return None
    if not multimodal_rope(config) or position_ids.dim() != 2:
        return position_ids
    later = position_ids[..., 1:]
    return None if bool(((later == position_ids[..., :-1]) & (later != 0)).any()) else position_ids
