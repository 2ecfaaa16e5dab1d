"""LLaMA's attention forward for transformers 4.31-4.47, where each attention class computes its own rotary.

What differs from the 4.48+ forward (`attention.make_forward`), by the transformers version that brought it:
- 4.31: rotary from `position_ids` inside attention, `rotary_emb(v, seq_len=...)`; a tuple `(k, v)` KV cache;
  a 3-tuple `(out, weights, past)` return.
- 4.34: a `padding_mask` keyword (the same 2D mask the VarlenMask already carries).
- 4.36: a `Cache` object (`update(k, v, layer_idx, cache_kwargs)`), `attention_dropout`.
- 4.38: `rotary_emb(v, position_ids)` and `cache_position`.
- 4.43: `position_embeddings` computed once by the model and handed down.
q, k, v leave this function for the same `varlen_core` as every other era.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.forward.inputs.arguments import check_call
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.attention.varlen import varlen_core
from patchkit.hooks.install.state import PatchState

STATIC_CACHES = ("StaticCache", "SlidingWindowCache", "HybridCache", "OffloadedStaticCache")


def _past_length(module: nn.Module, past: Any, q_len: int) -> int:
    """Tokens already cached for this layer: a tuple's key length (4.31-4.35; a list's, as contrastive search hands
    its candidates' past there) or the Cache's (4.36+)."""
    if past is None:
        return 0
    if isinstance(past, (tuple, list)):
        return past[0].shape[-2]
    return past.get_usable_length(q_len, module.layer_idx)


def rotary_takes_position_ids(rotary_class: type) -> bool:
    """True from 4.38, where `rotary_emb(v, position_ids)` replaced `rotary_emb(v, seq_len=...)`."""
    return "position_ids" in inspect.signature(rotary_class.forward).parameters


def _rotary(
    module: nn.Module, v: torch.Tensor, position_ids: Any, past: Any, embeddings: Any, by_position_ids: bool,
    mask: Any = None,
) -> tuple:
    """cos, sin as this version's attention computes them: before 4.38 for `seq_len`, the padded batch's length
    behind its past (a packed forward's row holds its real tokens alone: dynamic NTK scaling would pick another base
    from its length, and keep those tables on the module)."""
    if embeddings is not None:  # 4.43+
        return embeddings
    if by_position_ids:  # 4.38+
        return module.rotary_emb(v, position_ids)
    padded = getattr(mask, "padded", None) if isinstance(mask, VarlenMask) else None
    q_len = padded.q_len if padded is not None else v.shape[-2]
    return module.rotary_emb(v, seq_len=q_len + _past_length(module, past, q_len))  # 4.31-4.37


def _cache_step(
    module: nn.Module, k: torch.Tensor, v: torch.Tensor, past: Any, use_cache: bool, cache_kwargs: dict,
    tuple_cache: bool,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Append this step's keys and values; returns all keys, all values and what the layer returns as its past."""
    if past is None:  # 4.36+ hands every layer a Cache whenever one is kept
        return k, v, ((k, v) if use_cache and tuple_cache else None)
    if isinstance(past, (tuple, list)):  # 4.31-4.35 (contrastive search's candidates: lists)
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        return k, v, ((k, v) if use_cache else None)
    if type(past).__name__ in STATIC_CACHES:
        raise PatchInputError(
            f"a {type(past).__name__} reached patchkit's attention on transformers < 4.48, whose static caches "
            "return preallocated slots patchkit does not place there; use the default dynamic cache (drop "
            "cache_implementation), or transformers >= 4.48."
        )
    k, v = past.update(k, v, module.layer_idx, cache_kwargs)  # 4.36+
    return k, v, past


def make_legacy_forward(
    state: PatchState, apply_rotary: Callable, tuple_cache: bool, rotary_by_position_ids: bool,
    original: Optional[Callable] = None,
) -> Callable:
    """The replacement `forward` of LLaMA's attention classes for transformers 4.31-4.47 (`tuple_cache`: < 4.36;
    `rotary_by_position_ids`: >= 4.38), both decided once per version, not per call. A forward that stepped aside
    hands its layers transformers' own mask (a tensor, not patchkit's VarlenMask; in a checkpoint's recompute too):
    those run the class's `original` forward."""

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_value: Any = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None, Any]:
        if original is not None and isinstance(attention_mask, torch.Tensor):  # transformers' mask: stepped aside
            return original(self, hidden_states, attention_mask, position_ids, past_key_value, output_attentions,
                            use_cache, **kwargs)
        if output_attentions:
            raise PatchInputError(
                "output_attentions=True cannot be served by patchkit's varlen attention (the kernels never form the "
                "attention matrix). Call handle.revert() and run that forward unpatched."
            )
        kwargs.pop("padding_mask", None)  # 4.34-4.35: the 2D mask again, already in the VarlenMask
        cache_position = kwargs.pop("cache_position", None)  # 4.38+
        embeddings = kwargs.pop("position_embeddings", None)  # 4.43+
        batch, q_len = hidden_states.shape[:2]
        shape = (batch, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = _rotary(self, v, position_ids, past_key_value, embeddings, rotary_by_position_ids, attention_mask)
        q, k = apply_rotary(q, k, cos, sin, position_ids)  # (B, H, S, D), as each version's own forward calls it
        cache_kwargs = {"sin": sin, "cos": cos, **({"cache_position": cache_position} if cache_position is not None
                                                    else {})}
        k, v, present = _cache_step(self, k, v, past_key_value, use_cache, cache_kwargs, tuple_cache)
        check_call(self, kwargs)
        dropout = getattr(self, "attention_dropout", 0.0) if self.training else 0.0
        out = varlen_core(
            state, self, q, k, v, attention_mask, position_ids,
            kwargs, dropout=dropout, scaling=self.head_dim ** -0.5,
        )
        return self.o_proj(out.reshape(batch, q_len, -1)), None, present

    forward.__patchkit_route__ = state  # type: ignore[attr-defined]
    return forward
