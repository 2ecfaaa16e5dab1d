"""LLaMA's patch targets on transformers 4.31-4.47: the attention classes each version builds and its mask builder.

Where the decoder mask is built, by the version that moved it (each replacement hands attention the 2D mask, wrapped
in a VarlenMask, so no (B, 1, N, N) mask is ever built):
- 4.31-4.34: the method `LlamaModel._prepare_decoder_attention_mask`.
- 4.35-4.37: module-level helpers imported into `modeling_llama`: `_prepare_4d_causal_attention_mask`, plus
  `_for_sdpa` from 4.36. Only a class patch can replace them (an instance patch is refused, naming why).
- 4.38-4.47: the method `LlamaModel._update_causal_mask` (its signature changed at 4.38, 4.39, 4.40 and 4.41).
From 4.36 the attention class is chosen per layer (`LLAMA_ATTENTION_CLASSES`: eager, sdpa, flash_attention_2),
and each overrides `forward`: every one of them is patched, so the patch reaches the class the model built.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.eras.legacy_attention import make_legacy_forward, rotary_takes_position_ids
from patchkit.errors import PatchGateError, PatchTargetError
from patchkit.forward.context import current
from patchkit.forward.masks import VarlenMask, refuse_4d
from patchkit.hooks import family_route
from patchkit.hooks.forwards.lm_forward import make_lm_forward
from patchkit.hooks.forwards.model_forward import make_model_forward
from patchkit.hooks.forwards.task_forward import make_task_forward
from patchkit.hooks.install.model_walk import find_modules
from patchkit.hooks.install.patching import Replacement, bound_replacement
from patchkit.hooks.install.state import PatchState

ATTENTION_CLASSES = ("LlamaAttention", "LlamaFlashAttention2", "LlamaSdpaAttention")  # the last two: 4.34, 4.36
MODULE_LEVEL_BUILDERS = ("_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa")


def _varlen_mask(attention_mask: Any, past_len: Any) -> VarlenMask:
    """The 2D mask (None where the model made an all-ones one up: inside a packed forward, or the caller gave none,
    so that position_ids define documents as they do without a mask) and where the queries sit."""
    refuse_4d(attention_mask, False)
    plan = current().plan
    made_up = plan.packed is not None or plan.no_mask
    return VarlenMask.for_forward(None if made_up else attention_mask, past_len)


def prepare_decoder_attention_mask(
    self: nn.Module, attention_mask: Any, input_shape: Any, inputs_embeds: Any, past_key_values_length: int
) -> VarlenMask:
    """Replacement for `LlamaModel._prepare_decoder_attention_mask` (4.31-4.34)."""
    return _varlen_mask(attention_mask, past_key_values_length)


def prepare_4d_causal_attention_mask(
    attention_mask: Any, input_shape: Any, inputs_embeds: Any, past_key_values_length: int, *args: Any, **kwargs: Any
) -> VarlenMask:
    """Replacement for `_prepare_4d_causal_attention_mask(_for_sdpa)` in `modeling_llama` (4.35-4.37)."""
    return _varlen_mask(attention_mask, past_key_values_length)


def update_causal_mask(
    self: nn.Module, attention_mask: Any, input_tensor: Any = None, cache_position: Any = None, *args: Any,
    **kwargs: Any,
) -> VarlenMask:
    """Replacement for `LlamaModel._update_causal_mask` (4.38-4.47): `cache_position` says where the queries sit."""
    past = int(cache_position.reshape(-1)[0]) if isinstance(cache_position, torch.Tensor) and cache_position.numel() \
        else None
    return _varlen_mask(attention_mask, past)


def aside_or(original: Callable, ours: Callable) -> Callable:
    """A mask builder that hands a forward stepping aside (`step_aside`) transformers' own mask, and any other
    patchkit's VarlenMask."""

    def build(*args: Any, **kwargs: Any) -> Any:
        return (original if current().plan.aside is not None else ours)(*args, **kwargs)

    return build


def attention_classes(mod: Any) -> list[type]:
    """The LLaMA attention classes of this version that define their own forward."""
    return [getattr(mod, n) for n in ATTENTION_CLASSES if hasattr(mod, n) and "forward" in vars(getattr(mod, n))]


def _mask_method(mod: Any) -> tuple[str, Any]:
    """The LlamaModel method building the mask in this version, or ("", None) when it is module-level (4.35-4.37)."""
    if "_update_causal_mask" in vars(mod.LlamaModel):
        return "_update_causal_mask", update_causal_mask
    if any(hasattr(mod, name) for name in MODULE_LEVEL_BUILDERS):
        return "", None
    return "_prepare_decoder_attention_mask", prepare_decoder_attention_mask


def _forward(state: PatchState, mod: Any, original: Callable) -> Any:
    return make_legacy_forward(
        state, mod.apply_rotary_pos_emb, tuple_cache=not hasattr(mod, "LlamaSdpaAttention"),
        rotary_by_position_ids=rotary_takes_position_ids(mod.LlamaRotaryEmbedding), original=original,
    )


def reader_replacements(state: PatchState, mod: Any, model: Optional[nn.Module] = None) -> list[Replacement]:
    """The causal LM and the task heads (the classes', or `model`'s instances'): each tells the model's forward what
    of its call reads padding positions (labels predicted from padding, a classifier's pooled token), where it steps
    aside."""
    readers = [(mod.LlamaForCausalLM, lambda f: make_lm_forward(f, state.unpad, state))]
    readers += [(head, make_task_forward) for head in family_route.task_heads(mod.LlamaForCausalLM)]
    if model is None:
        return [Replacement(cls, "forward", wrap(cls.forward), f"{cls.__name__}.forward") for cls, wrap in readers]
    return [bound_replacement(wrap(type(m).forward), m, "forward", f"{type(m).__name__}.forward", state.track_copy)
            for cls, wrap in readers for m in find_modules(model, cls)]


def class_replacements(state: PatchState, mod: Any) -> list[Replacement]:
    """Before load: every LLaMA attention class of this version, the model forward and the mask builder."""
    out = [Replacement(cls, "forward", _forward(state, mod, vars(cls)["forward"]), f"{cls.__name__}.forward")
           for cls in attention_classes(mod)]
    out.append(Replacement(mod.LlamaModel, "forward", make_model_forward(mod.LlamaModel.forward, state.unpad,
                                                                         state=state), "LlamaModel.forward"))
    out += reader_replacements(state, mod)
    attr, builder = _mask_method(mod)
    if builder is not None:
        return out + [Replacement(mod.LlamaModel, attr, aside_or(getattr(mod.LlamaModel, attr), builder),
                                  f"LlamaModel.{attr}")]
    return out + [Replacement(mod, name, aside_or(getattr(mod, name), prepare_4d_causal_attention_mask),
                              f"modeling_llama.{name}") for name in MODULE_LEVEL_BUILDERS if hasattr(mod, name)]


def instance_replacements(state: PatchState, model: nn.Module, mod: Any) -> list[Replacement]:
    """A loaded instance: its attention layers, its model forward and its mask method (refused at 4.35-4.37)."""
    attr, builder = _mask_method(mod)
    if builder is None:
        raise PatchGateError(
            "transformers 4.35-4.37 build LLaMA's decoder mask in a module-level function, which only a class patch "
            "can replace: call patchkit.apply_patch('llama2') (or use the launcher) before the model is loaded. "
            "Nothing was patched."
        )
    attentions = find_modules(model, mod.LlamaAttention)
    bases = find_modules(model, mod.LlamaModel)
    if not attentions or not bases:
        raise PatchTargetError(
            f"found {len(attentions)} LlamaAttention layers and {len(bases)} LlamaModel in {type(model).__name__}: "
            "patched 0 layers; nothing was patched."
        )
    out = [bound_replacement(_forward(state, mod, type(m).forward), m, "forward",
                             f"{type(m).__name__}.forward (layer {i})", state.track_copy)
           for i, m in enumerate(attentions)]
    for base in bases:
        out.append(bound_replacement(make_model_forward(type(base).forward, state.unpad, state=state), base,
                                     "forward", f"{type(base).__name__}.forward (unpad={state.unpad})",
                                     state.track_copy))
        out.append(bound_replacement(aside_or(getattr(type(base), attr), builder), base, attr, f"LlamaModel.{attr}",
                                     state.track_copy))
    return out + reader_replacements(state, mod, model)
