"""Unpad once per model forward: the whole decoder stack runs on real tokens only, as one packed row."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from .masks import VarlenMetadata, build_metadata, packed_forward
from .padding import pad_input, unpad_rows

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")


def _resolved_use_cache(module: nn.Module, use_cache: Optional[bool]) -> bool:
    return bool(module.config.use_cache if use_cache is None else use_cache)


def unpad_plan(module: nn.Module, args: dict, extra: dict) -> Optional[VarlenMetadata]:
    """The padded batch's metadata when this forward can run packed, else None (run the original as is).

    Packed needs a 2D mask with padding, no past and no cache to return (or training, where the cache is not
    kept), and no caller-made packing (`cu_seq_lens_*`). Everything else, generation above all, keeps the
    per-layer path, which is exact there too.
    """
    mask = args.get("attention_mask")
    tokens = args.get("input_ids") if args.get("inputs_embeds") is None else args.get("inputs_embeds")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or tokens.dim() < 2:
        return None
    if args.get("past_key_values") is not None or any(extra.get(k) is not None for k in FLASH_KWARGS):
        return None
    if args.get("output_attentions") or extra.get("output_attentions"):
        return None  # refused by the attention layers with the reason
    if _resolved_use_cache(module, args.get("use_cache")) and not module.training:
        return None
    batch, seqlen = tokens.shape[:2]
    if tuple(mask.shape) != (batch, seqlen):
        return None  # the per-layer path raises its clear shape error
    position_ids = args.get("position_ids")
    meta = build_metadata(mask, batch, seqlen, seqlen, tokens.device, position_ids)
    if meta.indices_q is None or meta.nnz_q == 0:
        return None  # no padding, nothing to gain; or no real token, which the per-layer path answers with zeros
    return meta


def packed_row_metadata(meta: VarlenMetadata) -> VarlenMetadata:
    """The same documents as one row of `nnz` real tokens: no gather, the cu_seqlens unchanged."""
    nnz = meta.nnz_q
    return dataclasses.replace(
        meta, batch=1, q_len=nnz, kv_len=nnz, indices_q=None, indices_k=None, packed=len(meta.seqlens_q) > 1
    )


def _unpad_inputs(args: dict, meta: VarlenMetadata) -> None:
    """input_ids / inputs_embeds and position_ids (B, S, ...) -> (1, nnz, ...) in place in `args`."""
    for name in ("input_ids", "inputs_embeds"):
        x = args.get(name)
        if x is not None:
            args[name] = unpad_rows(x, meta.indices_q).unsqueeze(0)
    positions = args.get("position_ids")
    if positions is None:  # transformers' default for a forward without past: 0..S-1 in every row
        positions = torch.arange(meta.q_len, device=meta.cu_seqlens_q.device)
    args["position_ids"] = unpad_rows(positions.expand(meta.batch, meta.q_len), meta.indices_q).unsqueeze(0)
    args["attention_mask"] = None
    args["use_cache"] = False
    if args.get("cache_position") is not None:
        args["cache_position"] = None  # recomputed for the packed row


def repad_outputs(out: Any, meta: VarlenMetadata) -> Any:
    """Put every (1, nnz, ...) tensor of the model output back to (B, S, ...), zeros at padding."""
    indices = meta.indices_q

    def repad(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (1, meta.nnz_q):
            return pad_input(x[0], indices, meta.batch, meta.q_len)
        if isinstance(x, tuple) and not hasattr(x, "keys"):
            return tuple(repad(t) for t in x)
        return x

    if hasattr(out, "keys"):  # a ModelOutput: update its fields in place, keeping its class
        for key in list(out.keys()):
            out[key] = repad(out[key])
        return out
    return repad(out)


def make_model_forward(original: Callable) -> Callable:
    """Wrap `LlamaModel.forward`: unpad its batch once, run the original on the packed row, repad its outputs."""
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)

    def call(self: nn.Module, arguments: dict) -> Any:
        # by keyword: transformers 5.x decorators fill some arguments (use_cache) in by keyword themselves
        named = {k: v for k, v in arguments.items() if k not in (params[0].name, var_kw)}
        return original(self, **named, **arguments.get(var_kw, {}))

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(self, *args, **kwargs).arguments
        meta = unpad_plan(self, arguments, arguments.get(var_kw, {}) if var_kw else {})
        if meta is None:
            return original(self, *args, **kwargs)
        _unpad_inputs(arguments, meta)
        with packed_forward(packed_row_metadata(meta)):
            out = call(self, arguments)
        return repad_outputs(out, meta)

    forward.__wrapped_original__ = original  # type: ignore[attr-defined]
    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward
