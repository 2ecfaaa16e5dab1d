"""What one base model's forward is, decided once from its arguments: stepped aside (and why), unpadded at the
model into one packed row, or served per layer (with the documents its layers read). `plan_forward` is the one
place that decides; the forward wrapper (`model_forward.py`) carries the plan out, and it rides the forward's
context (`ForwardContext.plan`) to every mask builder and layer."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Optional

import torch
from torch import nn

from patchkit.forward.context import ForwardPlan, current
from patchkit.forward.documents import documents, has_packed_rows
from patchkit.forward.inputs.arguments import (
    binary_4d_masks,
    given_cache,
    input_tokens,
    legacy_llama,
    resolved_use_cache,
    sliding_window,
    unserved_arguments,
)
from patchkit.forward.inputs.module_hooks import (
    input_embedding,
    layout_hook,
    own_attention_forward,
    own_layer,
    row_mixing_module,
    said_layout,
    said_own_layer,
)
from patchkit.forward.inputs.paged import paged_cache
from patchkit.forward.inputs.token_inputs import token_inputs
from patchkit.forward.masks import build_metadata, fixed_slots
from patchkit.forward.metadata import VarlenMetadata
from patchkit.hooks.decide.model_masks import model_masks_cause
from patchkit.hooks.decide.outer_caller import unwrapped_head
from patchkit.hooks.decide.self_check import untrusted_cause
from patchkit.hooks.decide.step_aside import documents_metadata, forward_cause, packed_call, padded
from patchkit.hooks.generation.filled_cache import caches_in_training, fillable_cache, makes_own_cache
from patchkit.hooks.generation.slots_mask import served_cause
from patchkit.hooks.install.patching import unpatched
from patchkit.hooks.install.registry import NONCAUSAL, config_cause, mixes_rows, pools_by_column
from patchkit.names import WHOLE_MODEL

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")  # caller-made packing: the per-layer path serves it
UNREAD = ("custom_4d_mask", "static_cache_mask")  # transformers' masks that no reading of patchkit's took


@torch.compiler.disable  # host reads throughout: one break at the call, not one per read and a frame per callee
def plan_forward(
    module: nn.Module, arguments: dict, extra: dict, state: Any, unpad: str, sequence_parallel: bool,
    caller: Optional[dict] = None,
) -> ForwardPlan:
    """The plan of this forward. With a patch state (`state`), a forward the varlen path cannot serve exactly steps
    aside (`forward_cause`; a transformers newer than CI's: the family's self-check). The masks patchkit serves are
    put in the form its path reads first, in `arguments` / `extra` in place (`served_cause`). Under unpad="model"
    the forward unpads its batch at the model where it can; its layers unpad per call otherwise. `caller`: the
    arguments as the caller gave them, before a training forward's default cache was dropped (`joined`)."""
    given, given_extra = dict(arguments), dict(extra)  # what the caller gave, which an aside runs on
    cause = forward_cause(module, arguments, extra) if state is not None else None
    if cause is None and state is not None and own_attention_forward(module) is not None:
        cause = "own_attention_forward"  # a subclass's or a script's attention forward: transformers' mask for it
    if cause is None and state is not None and row_mixing_module(module) and padded(arguments.get("attention_mask")):
        cause = "rows_mixed_by_a_module"  # torch's dynamic quantization: each scale read over every row
    if cause is None and state is not None and legacy_llama() and fixed_slots(given_cache(arguments)):
        cause = "legacy_static_cache"  # transformers < 4.48: the LLaMA patch places no preallocated slots
    if cause is None and state is not None and paged_cache(given_cache(arguments)):
        # continuous batching: the layers read its requests' lengths and check its masks (`hooks/attention/paged`)
        return ForwardPlan(aside=untrusted_cause(module, state))
    if cause is None and state is not None and unserved_arguments(extra):
        cause = "unserved_argument"  # a collator's other keys in `model(**batch)`: transformers' attention ignores them
    cause = served_cause(module, arguments, extra, cause)  # packed documents, static caches' masks: patched
    blocks = None
    if cause in UNREAD and not binary_4d_masks():  # a multimodal model's own masks (and its image blocks), a static
        # cache's too: patched (transformers before 4.41 read a caller's 4D mask as binary: theirs alone)
        read, blocks = model_masks_cause(module, arguments)
        cause = cause if read == "custom_4d_mask" else read
    noncausal = state is not None and config_cause(module.config) == NONCAUSAL
    if noncausal and cause in UNREAD:
        cause = NONCAUSAL  # PaliGemma's masks in a pattern patchkit does not read: its layers are the reason
    if cause is None and state is not None and unwrapped_head(module) and padded(arguments.get("attention_mask")):
        cause = "unwrapped_head"  # ColPali's retrieval head: every position's hidden state (its 2D mask read back);
        # its head first: known per model, where the mask's padding is a host read (a device sync) per forward
    if cause is None and state is not None:
        cause = untrusted_cause(module, state)
    if cause is None and blocks is not None and sequence_parallel:
        cause = "bidirectional_image_tokens"  # a rank's shard would cut its blocks
    if cause is not None:  # the masks read back (a 2D mask, documents) are the served path's: an aside gets the
        arguments.clear(), arguments.update(given)  # caller's own (a multimodal model's 4D masks, its image blocks)
        extra.clear(), extra.update(given_extra)
        return ForwardPlan(aside=cause)
    no_mask = arguments.get("attention_mask") is None
    joined = joined_by_transformers(module, caller, extra) if caller is not None else None  # None under most masks
    if sequence_parallel:  # every rank keeps its equal-length shard: attention unpads the gathered one
        return ForwardPlan(no_mask=no_mask, mask_decides=noncausal)
    meta = unpad_plan(module, arguments, extra) if unpad in WHOLE_MODEL else None
    if meta is not None:
        meta.blocks = blocks
        own = given_cache(arguments) is None and fills_a_cache(module, arguments)  # made here, returned filled
        return ForwardPlan(padded=meta, packed=packed_row_metadata(meta), no_mask=no_mask, own_cache=own,
                           blocks=blocks, mask_decides=noncausal)
    return ForwardPlan(packed=documents_metadata(arguments, extra), no_mask=no_mask, blocks=blocks,
                       mask_decides=noncausal, joined=joined)


def fills_a_cache(module: nn.Module, args: dict) -> bool:
    """This forward returns a cache the packed path must fill padded: with use_cache in eval, and in training only
    where the caller asked (use_cache=True; a cache brought in training keeps the per-layer path, as before)."""
    if not resolved_use_cache(module, args.get("use_cache")):
        return False
    return not module.training or (args.get("use_cache") is True and caches_in_training(module))


def unpad_plan(module: nn.Module, args: dict, extra: dict) -> Optional[VarlenMetadata]:
    """The padded batch's metadata when this forward can run packed, else None (run the original as is).

    Packed needs a 2D mask with padding, no past, and no caller-made packing (`cu_seq_lens_*`). A cache to return
    must be an empty DynamicCache (generate()'s prefill), or none where the model would make one itself (an eval
    forward with use_cache: `own_cache`); `filled_padded` fills it padded. Everything else, decode steps above all,
    keeps the per-layer path, which is exact there too.
    """
    mask = args.get("attention_mask")
    tokens = input_tokens(args)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tokens is None or tokens.dim() < 2:
        return None
    if any(extra.get(k) is not None for k in FLASH_KWARGS):
        return None
    if args.get("output_attentions") or extra.get("output_attentions"):
        return None  # refused by the attention layers with the reason
    if current().lm_cause is not None:
        return None  # padding positions' logits are read (eras without stepping aside: the per-layer path)
    cache = given_cache(args)
    if fills_a_cache(module, args):
        if cache is None and not makes_own_cache(module):
            return None  # an era whose own cache was not checked: the per-layer path lets the model make it
        if cache is not None and not fillable_cache(cache):
            return None  # a cache with a past, or one patchkit cannot fill from the packed row: the per-layer path
    elif cache is not None:
        return None
    batch, seqlen = tokens.shape[:2]
    if tuple(mask.shape) != (batch, seqlen):
        return None  # the per-layer path raises its clear shape error
    if token_inputs(args, extra, batch, seqlen) is None:
        return None  # an input of the tokens' shape the packed row cannot carry: the padded layout keeps it
    position_ids = args.get("position_ids")
    meta = build_metadata(mask, batch, seqlen, seqlen, tokens.device, position_ids)
    if meta.indices_q is None or meta.nnz_q == 0:
        return None  # no padding, nothing to gain; or no real token, which the per-layer path answers with zeros
    if rope_reads_padded_length(module, mask, position_ids, seqlen):
        return None
    if meta.holes and (sliding_window(module.config) is not None or chunked(module.config) or mixes_rows(
            module.config)):
        return None  # a window that does not bite (else stepped aside), chunks (Llama 4's) that count a hole's
        # columns, or mixers whose state decays (whose convolution spans) across them: the per-layer path sees the
        # padded distances
    visual = args.get("visual_pos_masks")  # Qwen3-VL's deepstack features go to these tokens, padding or not
    if isinstance(visual, torch.Tensor) and bool((visual.bool() & ~mask.bool()).any()):
        return None  # an image token at padding: the packed row would drop it, the per-layer path keeps it
    if keeps_layout(module, input_embedding(module)):
        return None  # a hook of the user's, or PEFT's per-row arguments, read the (B, S, H) layout: kept
    return meta


def chunked(config: Any) -> bool:
    """Chunked attention (Llama 4's `attention_chunk_size`)."""
    return bool(getattr(config, "attention_chunk_size", None))


def keeps_layout(model: nn.Module, skip: Optional[nn.Module]) -> bool:
    """A hook inside `model` may read the (B, S, H) layout (`layout_hook`), or a decoder layer runs a script's own
    forward around it (`own_layer`): the forward keeps it. Said once per hook, with where it sits and the fix,
    unless it is PEFT's (`module_hooks.said_layout`), and once per layer's wrapper."""
    return said_layout(model, layout_hook(model, skip)) or said_own_layer(own_layer(model))


def rope_reads_padded_length(module: nn.Module, mask: torch.Tensor, position_ids: Any, seqlen: int) -> bool:
    """Dynamic and longrope RoPE pick their frequencies from the largest position in the batch, padding included:
    when the packed row's largest position differs, the per-layer path keeps the padded positions (exact)."""
    kinds = [getattr(m, "rope_type", "") for m in module.children()]
    kinds = [k for kind in kinds for k in (kind.values() if isinstance(kind, dict) else [kind])]
    if not any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
        return False
    if position_ids is None:
        return not bool(mask[:, -1].any())  # 0..S-1 in every row: the largest is S-1 only if a row reaches it
    positions = position_ids.expand(mask.shape)
    return bool(positions.max() != positions[mask.bool()].max())


def packed_row_metadata(meta: VarlenMetadata) -> VarlenMetadata:
    """The same documents as one row of `nnz` real tokens: no gather, the cu_seqlens unchanged."""
    nnz = meta.nnz_q
    return dataclasses.replace(
        meta, batch=1, q_len=nnz, kv_len=nnz, indices_q=None, indices_k=None, packed=len(meta.seqlens_q) > 1
    )


def joined_by_transformers(module: nn.Module, arguments: dict, extra: dict) -> Optional[str]:
    """How transformers' own sdpa or eager run of this call lets the caller's packed documents (position_ids
    restarting with no mask, or `cu_seq_lens_*`) see each other, which patchkit's attention keeps apart, or None.
    Read before a training forward's default cache is dropped: transformers makes one there too."""
    mask, flash = arguments.get("attention_mask"), any(extra.get(k) is not None for k in FLASH_KWARGS[:2])
    if flash and isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all()):
        return "read the mask beside the cu_seq_lens, so they find no documents"  # patchkit reads them as flash does
    if mask is not None or paged_cache(given_cache(arguments, extra)):
        return None  # continuous batching's requests: its own masks keep them apart too
    positions = arguments.get("position_ids", extra.get("position_ids"))
    if not flash and not isinstance(positions, torch.Tensor):
        return None
    restarts = has_packed_rows(None, positions)
    if not packed_call(arguments, extra):
        if restarts and masks_miss_positions(type(module)):
            return "are not handed this family's position_ids, so they find no documents"
        if pools_by_column(module.config) and documents(positions) is not None:  # one row: its compressors pool
            return "pool DeepSeek-V4's compressed entries across them"  # each document alone (`compressed_kv`)
        return None
    if not restarts:
        return "read no cu_seq_lens, so they find no documents"
    if masks_miss_positions(type(module)):  # use_cache=False would not change it
        return "are not handed this family's position_ids, so they find no documents"
    return "find no documents behind the KV cache this forward makes or is given (use_cache=False has them find them)"


@functools.cache
def masks_miss_positions(cls: type) -> bool:
    """The base model's forward hands its layers the position_ids (patchkit's attention finds packed documents from
    them) but not its masks (where transformers finds them): GPT-OSS's and AFMoE's in 5.25. False where its code
    cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(unpatched(cls.forward))))  # not a class patch's wrapper
    except (OSError, TypeError, SyntaxError):
        return False
    masks = layers = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name, named = ast.unparse(node.func), {k.arg for k in node.keywords}
            if "mask" in name and "attention_mask" in named and "position_ids" in named:
                masks = True  # create_causal_mask(...), a family's `mask_function(...)`
            layers = layers or ("layer" in name and "position_ids" in named)
        elif isinstance(node, ast.Dict):  # the masks' keyword arguments gathered first (`mask_kwargs`)
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            masks = masks or {"attention_mask", "position_ids"} <= keys
    return layers and not masks
