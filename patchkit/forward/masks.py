"""Key-padding masks: what patched layers receive instead of a 4D mask, and the metadata built from them once."""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

import torch

from patchkit.errors import PatchInputError, PatchStateError
from patchkit.forward.cache_length import query_offset
from patchkit.forward.context import current
from patchkit.forward.documents import (
    APART,
    check_seq_idx,
    document_lengths,
    packing_restart_with_past,
    seq_idx_lengths,
)
from patchkit.forward.metadata import (
    PastMetadata,
    VarlenMetadata,
    dense_metadata,
    host_lengths,
    real_runs,
    split_at_chunks,
)
from patchkit.forward.padding import cu_seqlens_from_lengths

FOUR_D_MASK_MESSAGE = (
    "patchkit received a 4D attention mask of shape {shape}. A 4D mask (a custom attention pattern) cannot be "
    "expressed as a key-padding mask, so the varlen kernels cannot serve it exactly. Pass the 2D "
    "[batch, past + q_len] padding mask instead, or revert the patch (handle.revert()) for this model."
)

FOREIGN_USE_MESSAGE = (
    "patchkit's key-padding mask reached attention code that patchkit does not own ({what}). The mask was built "
    "under a patchkit patch, but this layer's attention is not patched: the patch was reverted or applied, or the "
    "model's attention implementation changed, while this forward was in flight (or before the backward of a "
    "gradient-checkpointed forward, which recomputes its layers). Change patches between steps, after backward, "
    "and run the step again. If nothing changed them, this model's own code reads the mask (a remote-code or "
    "subclassed attention that adds a bias to it or builds its own mask), or hands it its layers in a way patchkit "
    "does not follow (for transformers' own classes, a patchkit bug: report the model type); run this model with "
    "attn_implementation='sdpa' and without the patch."
)


INDEX_MESSAGE = (
    "the model's own code indexed patchkit's key-padding mask with {item}, as it would a (B, 1, q_len, kv_len) mask. "
    "patchkit serves a slice of the last queries (Gemma 4 keeps only logits_to_keep queries before its KV-shared "
    "layers) on a padded batch with no cache or a dynamic one; this index it cannot place. Pass logits_to_keep=0 "
    "(every position's logits), or use the default dynamic cache, or apply patchkit as a patch "
    "(patchkit.apply_patch) rather than by attn_implementation='patchkit' alone."
)


def check_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Accept None or a 2D mask; refuse a 4D one with an error that says why and what to do."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise PatchInputError(f"attention_mask must be a tensor or None, got {type(mask).__name__}")
    if mask.dim() == 4:
        raise PatchInputError(FOUR_D_MASK_MESSAGE.format(shape=tuple(mask.shape)) + four_d_cause(False))
    if mask.dim() != 2:
        raise PatchInputError(
            f"attention_mask must be 2D [batch, past + q_len] (1 = real token, 0 = padding); got shape "
            f"{tuple(mask.shape)}"
        )
    return mask


def _from_cu_seqlens(
    batch: int, q_len: int, kv_len: int, cu_q: torch.Tensor, cu_k: Optional[torch.Tensor]
) -> VarlenMetadata:
    """Explicit `cu_seq_lens_q/k` (DataCollatorWithFlattening): documents over the flattened tokens."""
    if q_len != kv_len:
        raise PatchInputError(
            "cu_seq_lens_q/k describe packed documents, which a KV cache's past tokens cannot join; run packed "
            "batches without a past (use_cache=False or a fresh cache)"
        )
    cu_q, cu_k = cu_q.to(torch.int32), (cu_q if cu_k is None else cu_k).to(torch.int32)
    lens_q, lens_k = host_lengths(cu_q.diff(), cu_k.diff())
    if sum(lens_q) != batch * q_len:
        raise PatchInputError(
            f"cu_seq_lens_q covers {sum(lens_q)} tokens but the batch holds {batch * q_len} ({batch} x {q_len}): "
            "tokens joined the rows after the collator counted them (PEFT's prompt tuning prepends its virtual "
            "tokens, which padding-free rows cannot carry: pad the batch), or pass the cu_seq_lens it built"
        )
    return VarlenMetadata(
        batch, q_len, kv_len, None, None, cu_q, cu_k, max(lens_q, default=0), max(lens_k, default=0),
        lens_q, lens_k, packed=len(lens_q) > batch,
    )


def sequence_ids_metadata(seq_ids: torch.Tensor) -> VarlenMetadata:
    """Packed documents given as a (B, N) id per token, a new document wherever the id changes in a row
    (transformers' `packed_sequence_mask`, found from position_ids): the metadata of their runs, no past."""
    batch, seqlen = seq_ids.shape
    lengths = seq_idx_lengths(seq_ids, batch, seqlen, None)  # on the host: one sync
    cu = cu_seqlens_from_lengths(torch.tensor(lengths, dtype=torch.int32, device=seq_ids.device))
    longest = max(lengths, default=0)
    return VarlenMetadata(batch, seqlen, seqlen, None, None, cu, cu, longest, longest, lengths, lengths,
                          packed=len(lengths) > batch)


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
        fix = (f"give it one row per sequence of the batch ({batch})" if mask.shape[0] != batch else
               "give it a column per key, as generate() extends it by a column of ones per new token (PEFT's prompt "
               "tuning and p-tuning, peft<=0.21 on transformers>=5.24, prepend their virtual tokens at every step: "
               "use a peft release that supports this transformers)" if mask.shape[-1] < kv_len else
               "do not prepend past columns to a mask that already has them")
        raise PatchInputError(
            f"attention_mask has shape {tuple(mask.shape)} but this attention call has batch {batch} and "
            f"{kv_len} keys (past + q_len). The 2D mask must cover every key exactly once: [batch, past + q_len] (a "
            "StaticCache's: up to all its slots; past + q_len where attn_implementation='patchkit' alone serves "
            f"sliding layers, which hold fewer slots); {fix}")
    if cu_seq_lens_q is not None and (mask is None or bool(mask.all())):  # as flash_attention_2 reads them: beside
        return _from_cu_seqlens(batch, q_len, kv_len, cu_seq_lens_q, cu_seq_lens_k)  # a padded mask, the mask alone

    # transformers' rule (masking_utils): position_ids define packed documents only when no attention_mask is given;
    # a 2D mask is padding only, and documents in its rows attend to each other (LLaMA-Factory's plain packing).
    by_position = mask is None and position_ids is not None
    packing_hint = by_position and q_len == kv_len and position_ids.shape[-1] == q_len and q_len > 1
    if q_len != kv_len and by_position and packing_restart_with_past(mask, batch, q_len, position_ids, device):
        raise PatchInputError(
            "position_ids restart inside a chunk that has a KV cache behind it: packed documents with a past would "
            "see the previous documents' cached keys (unpatched transformers lets them, silently). Run packed rows "
            "without a past (use_cache=False), or one document per row when generating."
        )
    if mask is None and not packing_hint:
        return dense_metadata(batch, q_len, kv_len, device)

    mask = mask.to(device=device, dtype=torch.bool) if mask is not None else None
    real_k = mask if mask is not None else torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    real_q = real_k[:, -q_len:]
    if q_len == kv_len:
        indices = torch.nonzero(real_q.reshape(-1)).flatten()
        lengths = document_lengths(real_q, indices, position_ids.to(device) if packing_hint else None)
        host, rows_with_tokens, rises = host_lengths(lengths, real_q.any(-1), real_runs(real_q))
        packed = len(host) > sum(rows_with_tokens)
        every_token_real = sum(host) == batch * q_len
        if every_token_real and not packed:
            return dense_metadata(batch, q_len, kv_len, device)
        indices = None if every_token_real else indices  # packed rows without padding: no gather, a reshape
        cu = cu_seqlens_from_lengths(lengths.to(torch.int32))
        return VarlenMetadata(
            batch, q_len, kv_len, indices, indices, cu, cu, max(host, default=0), max(host, default=0),
            host, host, packed=packed, holes=max(rises, default=0) > 1,
        )

    lens_q = real_q.sum(-1, dtype=torch.int32)
    lens_k = real_k.sum(-1, dtype=torch.int32)
    host_q, host_k, rises = host_lengths(lens_q, lens_k, real_runs(real_k))
    dense_q = sum(host_q) == batch * q_len
    dense_k = sum(host_k) == batch * kv_len
    if dense_q and dense_k:
        return dense_metadata(batch, q_len, kv_len, device)
    return PastMetadata(batch, q_len, kv_len, None if dense_q else real_q, None if dense_k else real_k, lens_q, lens_k,
                        host_q, host_k, holes=max(rises, default=0) > 1)


class VarlenMask:
    """What the patched mask builder hands to every layer: the 2D mask, with metadata computed once.

    The first patched layer of a forward computes the metadata; the others reuse it. Nothing of size
    (batch, 1, q_len, kv_len) is ever built. Inside a packed forward (`ForwardPlan.packed`) a builder given no mask
    hands the layers that metadata itself: the model forward has already unpadded its batch into one packed row.

    `past_len` is how many tokens the KV cache held when the mask was built (None: no cache, or unknown) and
    `fixed_cache` whether the cache returns all its preallocated slots (a StaticCache): together they place
    the queries, whatever length the mask has. `slots`: the key count transformers sized the mask for, when
    `fixed_cache` was read from it (the mask interface): a layer handed fewer keys has no such cache. `window`: the
    sliding window transformers built this mask with (the mask interface's `local_size`), the window eager and sdpa
    apply, for a layer whose attention call does not pass it. Code that patchkit does not own gets a
    `PatchkitError`, not a type error from deep inside torch, if this object ever reaches it.
    """

    __slots__ = ("mask", "past_len", "fixed_cache", "key_offset", "slots", "route", "window", "chunk", "blocks",
                 "mask_decides", "padded", "selection", "lanes", "_key", "_meta")

    def __init__(
        self, mask: Optional[torch.Tensor], meta: Optional[VarlenMetadata] = None, past_len: Optional[int] = None,
        fixed_cache: bool = False, key_offset: int = 0, slots: Optional[int] = None, route: Any = None,
        window: Optional[int] = None, chunk: Optional[int] = None,
    ) -> None:
        self.mask = check_mask(mask)
        self.route = route  # the routed forward's route (`routing.Route`) the mask was built in, or None
        self.past_len = past_len
        self.fixed_cache = fixed_cache
        self.slots = slots
        self.key_offset = key_offset  # the mask column of the first key the cache returns (a sliding-window cache)
        self.window = window
        self.chunk = chunk  # chunked attention's size (Llama 4's): documents cut every `chunk` tokens
        self.blocks: Any = None  # the forward's image blocks (`ForwardPlan.blocks`), for the metadata of its keys
        self.mask_decides = False  # layers not causal by their config attend as it says (`ForwardPlan.mask_decides`)
        # the padded batch a packed forward unpadded (`ForwardPlan.padded`), for its layers that read that batch
        # (Mllama's cross-attention ones) and their checkpoint recomputes
        self.padded: Optional[VarlenMetadata] = None
        self.selection: Optional[torch.Tensor] = None  # a decode step's keys chosen by a mask-returning indexer (B, T)
        self.lanes: Optional[dict] = None  # a decode step's kernel calls, settled (`hooks/attention/lanes.py`)
        self._meta = split_at_chunks(meta, chunk) if meta is not None else None
        APART[0] += meta is not None and len(meta.seqlens_q) > meta.batch  # as in `metadata`
        self._key: Optional[tuple] = None if meta is None else (meta.batch, meta.q_len, meta.kv_len)

    @classmethod
    def for_forward(
        cls, mask: Optional[torch.Tensor], past_len: Optional[int] = None, fixed_cache: bool = False,
        key_offset: int = 0, slots: Optional[int] = None, window: Optional[int] = None, chunk: Optional[int] = None,
    ) -> VarlenMask:
        """The mask builders' entry: `mask`, or the packed forward's metadata when one is running; with the route of
        the forward building it, which its layers (and their checkpoint recomputes) then read from the mask."""
        context = current()
        made = cls(mask, context.plan.packed if mask is None else None, past_len, fixed_cache, key_offset, slots,
                   context.route, window, chunk)
        plan = context.plan
        made.blocks, made.mask_decides, made.padded = plan.blocks, plan.mask_decides, plan.padded
        return made

    def keys_in_use(self, q_len: int, keys: int, fixed_cache: bool = False) -> int:
        """How many of the `keys` the cache returned the queries may see: past + q_len, the rest unfilled slots.

        A dynamic cache returns exactly past + q_len keys (a sliding-window cache: from `key_offset` on); a
        static one returns all its slots, and the queries sit at `past_len`, not at the end of the mask. What
        cannot be placed is refused.
        """
        # sized for preallocated slots, but a layer handed another key count has no such cache
        fixed = fixed_cache or (self.fixed_cache and self.slots in (None, keys))
        if self.past_len == 0 and not fixed and self.mask is not None and self.mask.shape[-1] > q_len == keys:
            raise PatchInputError(
                f"attention_mask covers {self.mask.shape[-1]} columns, but this forward brings no cached tokens and "
                f"adds {q_len}. If its past_key_values came from a forward in training mode: patchkit keeps no KV "
                "cache in training unless asked (pass use_cache=True, or call model.eval() to generate with a "
                "cache; Gemma2 before transformers 5.0 keeps none in training even when asked). A StaticCache of "
                "a model with a sliding window through attn_implementation='patchkit' alone: pass past + q_len "
                "columns (its sliding layers hold fewer slots than the mask). Otherwise pass the mask of this "
                "call's tokens only."
            )
        if self.past_len is not None:
            used = self.past_len + q_len - self.key_offset
            if used > keys or (used < keys and not fixed):
                raise PatchInputError(
                    f"the KV cache returned {keys} keys, but this forward began with {self.past_len} cached tokens "
                    f"and adds {q_len}, so {used} were expected: the cache changed during the forward (for example "
                    "activation checkpointing recomputed a layer and appended its keys a second time). Pass "
                    "use_cache=False when training or checkpointing with a cache."
                )
            return used
        mask_len = keys if self.mask is None else self.mask.shape[-1]
        if mask_len < keys and fixed:
            return mask_len  # a static cache and a short mask: past + q_len columns, the queries at its end
        return keys

    def pending(self, batch: int, q_len: int, kv_len: int) -> bool:
        """The metadata of this shape is still to be computed (by the first layer that asks)."""
        return self._meta is None or self._key != (batch, q_len, kv_len)

    def metadata(
        self, batch: int, q_len: int, kv_len: int, device: torch.device,
        position_ids: Optional[torch.Tensor], fa_kwargs: Mapping[str, Any],
    ) -> VarlenMetadata:
        key = (batch, q_len, kv_len)
        if self._meta is None or self._key != key:
            self._meta = build_metadata(
                self._mask_for(kv_len), batch, q_len, kv_len, device, position_ids,
                fa_kwargs.get("cu_seq_lens_q"), fa_kwargs.get("cu_seq_lens_k"),
            )
            check_seq_idx(fa_kwargs.get("seq_idx"), self._meta)
            APART[0] += len(self._meta.seqlens_q) > batch  # a row's documents its layers keep apart
            self._meta = split_at_chunks(self._meta, self.chunk)
            if self.blocks is not None and self._meta.blocks is None:
                self._meta.blocks = self.blocks if q_len == kv_len else refuse_blocks_behind_past()
            self._key = key
        return self._meta.on(device)  # each layer's own device, where a device map splits the model

    def _mask_for(self, kv_len: int) -> Optional[torch.Tensor]:
        """The mask columns of the keys in use: from `key_offset`, and short of a static cache's unfilled slots."""
        mask = self.mask
        if mask is None or self.past_len is None:
            return mask
        start = self.key_offset
        if mask.shape[-1] > start + kv_len and self.fixed_cache:
            return mask[:, start : start + kv_len]
        return mask[:, start:] if start else mask

    def __repr__(self) -> str:
        shape = None if self.mask is None else tuple(self.mask.shape)
        return f"VarlenMask(mask={shape}, past_len={self.past_len})"

    def _foreign_use(self, what: str) -> PatchStateError:
        return PatchStateError(FOREIGN_USE_MESSAGE.format(what=what))

    @property
    def dtype(self) -> torch.dtype:
        """A boolean mask's: Kolibri-1.1's and Qwen4-Exp's sparse layers read it to overlay their selection."""
        return torch.bool

    def with_selection(self, chosen: torch.Tensor) -> VarlenMask:
        """This mask, for a layer whose sparse indexer `chosen` (B, T) the keys of a decode step (`sparse_indexer`)."""
        made = copy.copy(self)
        made.selection, made.lanes = chosen, None
        return made

    def __getattr__(self, name: str) -> Any:
        raise self._foreign_use(f"attribute {name!r}")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        """A torch op given this mask (transformers' sdpa, say) raises patchkit's error, not a TypeError."""
        raise PatchStateError(FOREIGN_USE_MESSAGE.format(what=f"torch {getattr(func, '__name__', func)}"))

    def __getitem__(self, item: Any) -> VarlenMask:
        """`mask[:, :, queries, :]`, as transformers slices a 4D mask's query rows (Gemma 4 keeps only the last
        `logits_to_keep` queries before its KV-shared layers): every query, or the last ones behind the others as
        if those were cached; `mask[:, 0, :, :]` or `mask[:, 0]`, the head axis dropped as a sparse attention's
        indexer reads it (the same mask: `hooks/attention/sparse_indexer.py`); any other index is refused by what
        it is."""
        full, rest = slice(None), None
        if item in ((full, 0, full, full), (full, 0)):
            return self
        if isinstance(item, tuple) and len(item) == 4 and item[:2] == (full, full) and item[3] == full:
            rest = item[2]
        if not isinstance(rest, slice) or rest.step not in (None, 1) or rest.stop is not None:
            raise PatchInputError(INDEX_MESSAGE.format(item=item))
        start = rest.start or 0
        if start == 0:
            return self  # every query (logits_to_keep=0)
        meta = self._meta if self.mask is None else None  # the forward's own (no mask): packed documents?
        documents = meta is not None and (meta.packed or meta.indices_q is not None)
        if start > 0 or documents or self.fixed_cache:
            raise PatchInputError(INDEX_MESSAGE.format(item=item))  # packed documents, or a cache's unfilled slots
        past = None if self.past_len is None or self.mask is None else self.mask.shape[-1] + start
        sliced = VarlenMask(self.mask, None, past, False, self.key_offset, self.slots, self.route, self.window,
                            self.chunk)
        sliced.mask_decides, sliced.padded = self.mask_decides, self.padded
        return sliced

    def __and__(self, other: Any) -> Any:
        """Qwen4-Exp's sparse layers overlay their indexer's selection on their mask: what the indexer returned for
        it (`sparse_indexer`: this mask, or this mask with a decode step's selection)."""
        if isinstance(other, VarlenMask) and other.mask is self.mask:
            return other
        raise self._foreign_use("arithmetic")

    def __add__(self, other: Any) -> Any:
        raise self._foreign_use("arithmetic")

    __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __rand__ = __or__ = __ror__ = __add__


def cache_placement(past_key_values: Any, cache_position: Any = None) -> tuple[int, bool]:
    """(tokens the KV cache held before this forward, whether it returns preallocated slots); once per forward.

    `cache_position` (passed by transformers 4.48-5.3) is exact; otherwise the cache's own length is read.
    """
    if past_key_values is None:
        return 0, False
    fixed = fixed_slots(past_key_values)
    if isinstance(cache_position, torch.Tensor) and cache_position.numel():
        return int(cache_position.reshape(-1)[0]), fixed
    return int(query_offset(past_key_values)), fixed


def fixed_slots(cache: Any) -> bool:
    """The cache returns preallocated slots (a StaticCache and its kin): `is_compileable` from transformers 4.49;
    4.48's static caches lack that flag but have `max_cache_len`, which no growing cache has."""
    flag = getattr(cache, "is_compileable", None)
    return bool(flag) if flag is not None else getattr(cache, "max_cache_len", None) is not None


def as_varlen_mask(mask: Any, fixed_cache: bool = False) -> VarlenMask:
    """Wrap whatever reached attention (our VarlenMask, a 2D tensor, None) and refuse a 4D mask with its cause."""
    if isinstance(mask, VarlenMask):
        return mask
    refuse_4d(mask, fixed_cache)
    return VarlenMask.for_forward(mask)


def refuse_4d(mask: Any, fixed_cache: bool) -> None:
    """A 4D mask cannot be served: say so, with its most likely cause."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        raise PatchInputError(FOUR_D_MASK_MESSAGE.format(shape=tuple(mask.shape)) + four_d_cause(fixed_cache))


def four_d_cause(fixed_cache: bool) -> str:
    """Why a 4D mask reached patched attention, as far as attention can tell."""
    if fixed_cache:
        return (
            " Here the KV cache is a static kind (generate(cache_implementation='static', 'sliding_window', ...)):"
            " generate() builds its 4D mask for such caches before the model runs, outside the patch. Use the "
            "default dynamic cache (drop cache_implementation) with patchkit."
        )
    return (
        " If you did not pass it yourself, it was built outside the patch: the patch was applied while this forward"
        " was in flight, or the model's attention implementation was changed after the patch was applied."
    )


def refuse_blocks_behind_past() -> None:
    """A forward planned with image blocks (no past) whose layer got keys of a past: never served."""
    raise PatchStateError("image blocks planned for a forward without a past reached a layer with cached keys")
