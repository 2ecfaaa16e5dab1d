"""Where the varlen path cannot give transformers' numbers, patchkit steps aside for that forward.

transformers' own masks and attention then run it, exact by construction, with one warning per cause (what, and
what would keep the forward patched) and a count in the handle's report; `strict=True` refuses instead. The
decision is made once, at the base model's forward, and it travels with the mask: a stepped-aside forward's
layers receive transformers' own mask, so a checkpoint recompute in backward steps aside too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from patchkit.errors import PatchInputError
from patchkit.forward.cache_length import past_length
from patchkit.forward.context import current
from patchkit.forward.documents import check_seq_idx, has_packed_rows, real_tokens_of_4d
from patchkit.forward.inputs.arguments import (
    cross_attends,
    ends_in_padding,
    given_cache,
    input_tokens,
    mask_beyond_call,
    mask_short_of_keys,
    one_token_rows,
    quantizes_across_slots,
    resolved_use_cache,
    sliding_window,
    transformers_made,
    weights_wanted,
    window_over_hole,
)
from patchkit.forward.inputs.module_hooks import row_mixing_module
from patchkit.forward.inputs.paged import paged_cache
from patchkit.forward.liveness import is_compiling, traced_by
from patchkit.forward.loss.cross_entropy import IGNORE_INDEX
from patchkit.forward.masks import build_metadata, fixed_slots
from patchkit.forward.metadata import VarlenMetadata
from patchkit.hooks.decide.causes import BRIEF, CAUSES
from patchkit.hooks.decide.outer_caller import (
    LABEL_NAMES,
    foreign_call,
    foreign_forward,
    head_outside_patch,
    subclass_labels,
    trainer_labels,
)
from patchkit.hooks.install.registry import NONCAUSAL, config_cause, index_topk, padding_into_mixers, pools_by_column
from patchkit.hooks.install.routing import attn_name, loads_flash_masks

# their masks keep packed documents apart themselves
OWN_DOCUMENTS = ("custom_4d_mask", "static_cache_mask", "continuous_batching")


def step_aside(state: Any, cause: str, arguments: dict, extra: dict, what: Optional[str] = None) -> None:
    """Count one forward stepped aside for `cause` and warn once per cause (`what`: this forward's own words for
    it); strict mode refuses it instead, and so does a batch of packed documents that transformers' attention
    would let see each other (no exact path)."""
    what, fix = what or CAUSES[cause][0], CAUSES[cause][1]
    if cause not in OWN_DOCUMENTS and packed_call(arguments, extra):  # a caller's 4D mask defines its own documents
        raise PatchInputError(
            f"patch {state.patch!r}: {what}, in a batch of packed documents (position_ids restarting inside a row, "
            "or cu_seq_lens). transformers' own attention would let those documents attend to each other, and "
            f"patchkit's varlen path cannot serve the request, so no path gives exact numbers. {fix[0].upper()}"
            f"{fix[1:]}, give each document its own row, or pass use_cache=False with restarting position_ids "
            "(transformers' mask then keeps the documents apart)."
        )
    if state.strict:
        raise PatchInputError(
            f"patch {state.patch!r} (strict=True): {what}. patchkit would run this forward on transformers' own "
            f"attention; strict refuses instead. To stay patched: {fix}."
        )
    state.stepped_aside[cause] = state.stepped_aside.get(cause, 0) + 1
    brief, short_fix = BRIEF[cause]
    said = brief if what is CAUSES[cause][0] else what  # the forward's own words where it gave them
    state.warn_once(
        f"aside:{cause}:{what}",
        f"patchkit: {said} ({cause}): ran on transformers' attention, exact and counted in patchkit.report(). "
        f"Fix: {short_fix}.",
    )


def packed_call(arguments: dict, extra: dict) -> bool:
    """Packed documents that transformers' attention would let see each other: cu_seq_lens, or position_ids
    restarting inside a row of a call without a mask, unless transformers' own mask keeps them apart."""
    if arguments.get("attention_mask") is not None:
        return False  # a 2D mask is padding only (transformers' rule): its rows' documents attend to each other
    restarts = has_packed_rows(None, arguments.get("position_ids", extra.get("position_ids")))
    if restarts and documents_kept_apart(arguments, extra):
        return False
    return restarts or any(extra.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k"))


def documents_kept_apart(arguments: dict, extra: dict) -> bool:
    """transformers keeps the documents of restarting position_ids apart itself: its masks read them
    (`find_packed_sequence_indices`, 4.5x-5.x) when the forward has neither a mask nor a cache; a forward that makes
    its own cache (`use_cache`, from the call or else the config, as the plan reads it) does not (5.23's silent
    join)."""
    try:
        from transformers import masking_utils
    except ImportError:  # before 4.53: no masking_utils, documents joined
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices") and makes_no_cache(arguments, extra)


def forward_cause(module: Any, arguments: dict, extra: dict) -> Optional[str]:
    """Why the base model's forward with these arguments cannot run patched exactly, or None."""
    told = current().lm_cause
    if told is not None:
        return told
    if (traced := traced_by()) is not None:
        return traced
    config = config_cause(module.config)  # Falcon-RW's ALiBi: its whole model, every forward
    if config is not None and not mask_decides(config, arguments):
        return config
    head = None if is_compiling() else head_outside_patch(module)
    if head is not None and padded(arguments.get("attention_mask")):
        call = foreign_call(head) if foreign_forward(head) is not None else None
        if call is None:
            return "head_outside_patch"  # LLaVA built before the class patch: its head reads what it cannot say
        cause = lm_cause(call[0], call[0], head.training, call[1], head)  # Liger's forward: what its call reads
        if cause is not None:
            return cause
    mixer = mixer_cause(module.config, arguments)
    if mixer is not None and not loads_flash_masks(attn_name(module.config)):  # nor does a flash attention compute
        return mixer                                                            # at padding
    if cross_attends(arguments, extra):
        return "cross_attention"  # before routing: the whole forward on the attention the model was loaded with
    if weights_wanted(module.config, arguments, extra):
        return "output_attentions"
    cache, either = given_cache(arguments), given_cache(arguments, extra)
    if beyond_topk(index_topk(module.config), arguments, either):
        return "sparse_attention"
    if paged_cache(either):  # its layers read the requests' lengths (`forward/inputs/paged.py`)
        return None if paged_servable(arguments, extra) else "continuous_batching"
    if transformers_made(arguments.get("attention_mask")):
        return "custom_4d_mask"  # a dict: generate()'s precomputed masks per layer type (static caches, Gemma3)
    if mask_short_of_keys(arguments.get("attention_mask"), cache):
        return "short_mask"
    if (misfit := misfit_cause(arguments, cache, module.training)) is not None:
        return misfit
    if fixed_slots(cache) and getattr(cache, "layers", None) is None and sliding_window(module.config) is not None:
        return "window_rolling_cache"
    return "window_over_padding_hole" if window_over_hole(module.config, arguments.get("attention_mask")) else None


def beyond_topk(topk: Optional[int], arguments: dict, cache: Any) -> bool:
    """A query of this forward sees more keys than a sparse attention's indexer keeps (`topk`; None: no indexer) and
    its layers can select (`keys_beyond`). A continuous-batching step is counted by its columns: its requests'
    lengths are read in its layers."""
    if topk is None:
        return False
    if paged_cache(cache):
        return True
    tokens, positions = input_tokens(arguments), arguments.get("position_ids")
    new = tokens.shape[1] if tokens is not None else 0
    past = int(past_length(cache) or 0) if cache is not None else 0
    starts = None
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == new > 1:
        starts = torch.ones_like(positions, dtype=torch.bool)  # a document starts where a position is not its
        starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1  # predecessor's plus one (packed rows)
    return keys_beyond(topk, arguments.get("attention_mask"), past, new, not fixed_slots(cache), starts)


def keys_beyond(topk: int, mask: Any, past: int, new: int, growing: bool,
                starts: Optional[torch.Tensor] = None) -> bool:
    """More than `topk` keys seen by one query that its layers cannot select, counted as transformers' mask lets it:
    a row's real keys, past included (a 2D mask); the columns of a 4D one; with no mask and no past, the tokens of the
    longest document that `starts` (B, S; True at each row's first column) begins (packed rows: transformers'
    `find_packed_sequence_indices`); else every key. A decode step on a `growing` cache under a 2D mask is never
    beyond: its layers run the indexer's selection (`sparse_indexer.selected_keys`)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and new == 1 and past and growing:
        return False
    if isinstance(mask, torch.Tensor):
        return (int(mask.sum(-1).max()) if mask.dim() == 2 else mask.shape[-1]) > topk
    if starts is not None and not past:
        at = torch.cat([starts.flatten().nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
        return int((at[1:] - at[:-1]).max()) > topk
    return past + new > topk


def mask_decides(cause: str, arguments: dict) -> bool:
    """Layers that are not causal by their config (PaliGemma's Gemma) attend as the mask they are given says, under
    eager and sdpa alike: one that transformers built (PaliGemma's own, its prompt prefix both ways), which the plan
    reads back exactly or steps aside for; or any mask over a single query, which sees the same keys either way."""
    if cause != NONCAUSAL:
        return False
    tokens = input_tokens(arguments)
    return transformers_made(arguments.get("attention_mask")) or (tokens is not None and tokens.shape[1] == 1)


def padded(mask: Any) -> bool:
    """A 2D mask with a padding position."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())


def paged_servable(arguments: dict, extra: dict) -> bool:
    """patchkit's layers serve a continuous-batching step (`hooks/attention/paged.py`) under the 4D mask(s) it makes
    for sdpa and eager, which they check before they trust its lengths, where the paged cache is the forward's own
    cache argument: its layers update it and hand attention every request's keys (transformers 5.24+; before, it went
    beside, in the kwargs, to transformers' attention functions, which updated it themselves). Not a step with no
    masks (a flash attention loaded: transformers' own varlen kernels serve it), nor a decode step read through block
    tables, nor one compiled or captured in a CUDA graph (the lengths are host reads)."""
    if not paged_cache(given_cache(arguments)):
        return False
    masks = arguments.get("attention_mask")  # one per layer type, or the one tensor of a single type
    masks = list(masks.values()) if isinstance(masks, dict) else [masks]
    return all(isinstance(m, torch.Tensor) and m.dim() == 4 for m in masks) and (
        extra.get("block_table") is None and not is_compiling() and not capturing())


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (continuous batching's `use_cuda_graph`)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def documents_metadata(arguments: dict, extra: dict) -> Optional[VarlenMetadata]:
    """Caller-made documents with no mask (`cu_seq_lens_*`, or a 4D block-diagonal mask turned into them) as the
    metadata the mask builders hand every layer (`ForwardPlan.packed`): on the mask object they reach a
    checkpoint's recompute, where kwargs may not (transformers 4.48-4.51 call checkpointed layers without them)."""
    cu_q, tokens = extra.get("cu_seq_lens_q"), input_tokens(arguments)
    if cu_q is None or arguments.get("attention_mask") is not None or tokens is None or tokens.dim() < 2:
        return None
    batch, seqlen = tokens.shape[:2]
    meta = build_metadata(None, batch, seqlen, seqlen, tokens.device, arguments.get("position_ids"), cu_q,
                          extra.get("cu_seq_lens_k"))
    check_seq_idx(extra.get("seq_idx"), meta)
    return meta


def right_padded_generation(mask: Any, cache: Any, logits_to_keep: Any, cache_position: Any = None) -> bool:
    """generate()'s prefill where some row's last position is padding: that row's next token is read there.

    generate() passes `logits_to_keep` (1, or 0 when told) and either its empty dynamic cache (5.4+) or a
    `cache_position` from 0 (up to 5.3, which lets the model make the cache); a plain forward passes neither. A
    model whose forward takes no `logits_to_keep` (Qwen2-VL before 5.0) is told by the `cache_position` alone.
    Behind a past already there (PEFT's prefix tuning fills the cache with its virtual tokens before the prefill),
    `logits_to_keep` with a padding last column is enough: generate()'s decode steps end in a real column.
    """
    if (logits_to_keep is not None and not isinstance(logits_to_keep, int)) or fixed_slots(cache):
        return False  # continuous batching passes a tensor; a static cache's mask covers its slots
    from_zero = isinstance(cache_position, torch.Tensor) and cache_position.numel() and int(cache_position[0]) == 0
    if logits_to_keep is None and not from_zero:
        return False  # not generate()
    if cache is not None:
        if getattr(cache, "get_seq_length", None) is None or (logits_to_keep is None and past_length(cache) != 0):
            return False  # a cache that cannot say; or a past, read only where generate() is not known
    elif not from_zero:
        return False
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[-1] < 2:
        return False
    return ends_in_padding(mask)


def labels_from_padding(mask: Any, labels: Any, shift_labels: Any, past: bool = True,
                        ignore_index: int = IGNORE_INDEX) -> bool:
    """True when a loss term is predicted from a padding position (a real token after padding, labelled); a 4D
    mask's real tokens are those that see themselves. `past`: a cache was given, so labels narrower than the mask
    are the new tokens' behind it (else they do not line up: transformers' loss refuses them)."""
    if labels is None or not isinstance(labels, torch.Tensor) and not isinstance(shift_labels, torch.Tensor):
        return False  # no loss here (generate()'s steps; `shift_labels` alone, as transformers): nothing to read
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == mask.shape[-2]:
        mask = real_tokens_of_4d(mask)
    read = shift_labels if isinstance(shift_labels, torch.Tensor) else labels  # given, the loss reads them alone
    if isinstance(mask, torch.Tensor) and mask.dim() == 3 and read.shape == mask.shape:  # (batch, choices, tokens):
        mask, read = mask.flatten(0, 1), read.flatten(0, 1)  # GPT-2's DoubleHeadsModel, a row per choice
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    new = read.shape
    if past and len(new) == 2 and new[0] == mask.shape[0] and new[1] < mask.shape[1]:
        mask = mask[:, -new[1]:]  # behind a past (a chunked loop, prefix tuning): the new tokens' own columns
    if new != mask.shape:
        return False
    pad = mask == 0
    if isinstance(shift_labels, torch.Tensor):  # `labels` may then be anything (a sequence-parallel script's copy)
        return bool(((read != ignore_index) & pad).any())
    return bool(((read[:, 1:] != ignore_index) & pad[:, :-1]).any())


@torch.compiler.disable  # host reads: one break at the call in a compiled forward (one that may not break never asks)
def lm_cause(arguments: dict, extra: dict, training: bool = False, takes_keep: bool = True,
             module: Any = None) -> Optional[str]:
    """What of a causal LM's call reads transformers' values at padding positions: its labels, or generate()'s next
    token (its prefill; a plain forward's logits at padding are zeros, as documented), or a hand-written decode
    loop's for a row that is all padding, in eval mode (`training`: the model's mode).

    `takes_keep`: the model's forward takes `logits_to_keep`. One that does not (GPT-2's double-heads model) cannot be
    told generate()'s prefill by it, nor, on 5.x, by a `cache_position`: there a prefill into an empty cache the caller
    brought, in eval mode, with a row ending in padding is read as generate()'s and steps aside too. `module`: the
    causal LM, whose config says whether its cache keeps entries pooled from padding (`cache_over_padding`)."""
    if (traced := traced_by()) is not None:
        return traced
    mask = arguments.get("attention_mask")  # the labels of a subclass's own forward may be named otherwise
    labels = next((arguments[name] for name in LABEL_NAMES if isinstance(arguments.get(name), torch.Tensor)), None)
    if labels is None and module is not None:
        labels = subclass_labels(module)  # a subclass's own forward that computes its loss from this call's logits
    if labels is None and not one_token_rows(arguments):  # the Trainer's loss of its own from logits (label
        labels = trainer_labels()  # smoothing, compute_loss_func), off its frame; one token predicts nothing here
    cache = given_cache(arguments, extra)
    if (misfit := misfit_cause(arguments, cache, training)) is not None:
        return misfit  # under the name alone too, where no base model's forward asks `forward_cause`
    ignore = extra.get("ignore_index", IGNORE_INDEX)  # the loss's, where the call passes one
    if labels_from_padding(mask, labels, extra.get("shift_labels"), cache is not None,
                           ignore if isinstance(ignore, int) else IGNORE_INDEX):
        return "labels_from_padding"
    keep = arguments.get("logits_to_keep", arguments.get("num_logits_to_keep", extra.get("logits_to_keep")))
    position = arguments.get("cache_position", extra.get("cache_position"))
    if labels is None and right_padded_generation(mask, cache, keep, position):  # generate() passes no labels
        return "right_padded_generation"
    if keep is None and not training and caller_prefill_with_an_empty_row(mask, cache, input_tokens(arguments),
                                                                          ending=not takes_keep):
        return "right_padded_generation"
    if module is not None and not training and cache_over_padding(module, arguments, extra):
        return "cache_over_padding"
    return "rows_mixed_by_a_module" if module is not None and row_mixing_module(module) and padded(mask) else None


def cache_over_padding(module: Any, arguments: dict, extra: dict) -> bool:
    """An eval forward without labels that keeps its cache, with a row ending in padding, in a family whose cache
    keeps entries pooled by column (DeepSeek-V4's compressors): every entry is seen by the tokens a caller's loop
    appends after that padding, and those pooled from it hold what transformers computed there, which varlen kernels
    never compute. (A training forward's cache is not continued; generate()'s prefill is `right_padded_generation`.)"""
    mask = arguments.get("attention_mask")
    if not pools_by_column(module.config) or arguments.get("labels") is not None or not isinstance(
            mask, torch.Tensor) or mask.dim() != 2 or not ends_in_padding(mask):
        return False
    return given_cache(arguments, extra) is not None or resolved_use_cache(
        module, arguments.get("use_cache", extra.get("use_cache")))


def caller_prefill_with_an_empty_row(mask: Any, cache: Any, tokens: Any, ending: bool = False) -> bool:
    """A hand-written decode loop's prefill (in eval mode) into an empty cache the caller brought (dynamic or static)
    with a row that is all padding: the loop reads that row's next token at padding, as generate() would
    (`right_padded_generation`), where transformers computes logits of its own and the packed row gives zeros. (A
    row with real tokens ending in padding stays patched: its logits at padding are zeros, as documented.) A static
    cache's mask may cover all its slots: its first q_len columns are the prompt's. `ending`: a row whose last prompt
    column is padding counts too (a model whose generate() prefill cannot be told otherwise: `lm_cause`'s
    `takes_keep`)."""
    if cache is None or not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or not isinstance(mask, torch.Tensor):
        return False
    q_len = tokens.shape[1]
    if mask.dim() != 2 or mask.shape[-1] < q_len or (mask.shape[-1] > q_len and not fixed_slots(cache)):
        return False  # behind a past: a decode step, or a chunk after the first
    if is_compiling() or past_length(cache) != 0:  # None: a cache that cannot say
        return False
    if ending:
        return bool((mask[:, q_len - 1] == 0).any())
    return bool((mask[:, :q_len] == 0).all(dim=-1).any())


def mixer_cause(config: Any, arguments: dict) -> Optional[str]:
    """`padding_into_mixer` where this call's recurrent layers or compressors would read what transformers computes
    at padding positions (left padding; a padded row whose positions run past its real tokens in a family whose
    compressors pool by column); `joined_documents` where such a family's row holds packed documents under a mask
    that joins them and no cache (transformers pools their entries across them), else None."""
    if not padding_into_mixers(config):
        return None
    mask, positions = arguments.get("attention_mask"), arguments.get("position_ids")
    tokens = input_tokens(arguments)
    new = new_columns(mask, tokens.shape[1] if isinstance(tokens, torch.Tensor) and tokens.dim() > 1 else None)
    if padding_before_real(new) or pools_by_column(config) and position_past_real(new, positions):
        return "padding_into_mixer"
    if pools_by_column(config) and isinstance(mask, torch.Tensor) and has_packed_rows(mask, positions) and (
            makes_no_cache(arguments)):
        return "joined_documents"  # its compressors, given no cache, would pool each document alone
    return None


def misfit_cause(arguments: dict, cache: Any, training: bool) -> Optional[str]:
    """A call's mask or cache that transformers reads otherwise than patchkit's layers could: a mask of more rows or
    columns than the call (`mask_beyond_call`), or new padding written into a cache that quantizes it together with
    real tokens (`quantizes_across_slots`: patchkit stores a filler there, transformers the pad tokens' keys)."""
    if mask_beyond_call(arguments, cache, training):
        return "mask_shape"
    tokens = input_tokens(arguments)
    if quantizes_across_slots(cache) and tokens is not None and padded(
            new_columns(arguments.get("attention_mask"), tokens.shape[1])):
        return "quantized_cache"
    return None


def new_columns(mask: Any, length: Optional[int]) -> Any:
    """A 2D mask's columns of a forward's `length` new tokens (its last ones: a decode step's padding in its past was
    computed when it was new); the mask as it is where it has no more columns or `length` is unknown."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not length:
        return mask
    return mask[:, -length:] if length < mask.shape[-1] else mask


def makes_no_cache(arguments: dict, extra: Optional[dict] = None) -> bool:
    """A base model's call that is given no cache and makes none (use_cache off, on the call or else its config)."""
    extra = extra or {}
    if given_cache(arguments, extra) is not None:
        return False
    module, use_cache = arguments.get("self"), arguments.get("use_cache", extra.get("use_cache"))
    if module is None and use_cache is None:  # no config to read it from: assume the cache is made
        return False
    return not resolved_use_cache(module, use_cache)


def position_past_real(mask: Any, position_ids: Any) -> bool:
    """A padded row with a real token whose position id exceeds the real tokens before it (a caller's offsets):
    DeepSeek-V4's compressors let it see entries pooled from the padding columns after its row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not isinstance(position_ids, torch.Tensor):
        return False
    real = mask.bool()
    if position_ids.shape[-1] != real.shape[-1] or bool(real.all()):
        return False
    past = (position_ids.to(real.device) > real.cumsum(-1) - 1) & real & ~real.all(-1, keepdim=True)
    return bool(past.any())


def padding_before_real(mask: Any) -> bool:
    """A 2D mask with a row that has padding before a real token (left padding, or a hole)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] > 1 and bool(
        (mask[:, :-1] < mask[:, 1:]).any())
