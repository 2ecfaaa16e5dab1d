"""Where transformers' LLaMA builds its decoder mask and runs attention: the objects the patches replace."""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any, Callable

from torch import nn

from . import attn_interface
from .attention import PatchState, make_forward
from .errors import PatchInputError, PatchTargetError
from .masks import VarlenMask, cache_placement, refuse_4d
from .model_unpad import make_lm_forward, make_model_forward
from .model_walk import find_modules
from .patching import Replacement, bound_replacement
from .routing import current_method
from .step_aside import is_stepping_aside, transformers_mask


def modeling_llama() -> ModuleType:
    return importlib.import_module("transformers.models.llama.modeling_llama")


def attention_class() -> type:
    """The class of LLaMA's attention layers (one class from transformers 4.48)."""
    return modeling_llama().LlamaAttention


def uses_create_causal_mask(mod: ModuleType) -> bool:
    """transformers >= 4.53 builds masks with the module-level `create_causal_mask` (masking_utils)."""
    return hasattr(mod, "create_causal_mask")


def _refuse_mask_extras(bound: dict) -> None:
    for name in ("or_mask_function", "and_mask_function", "block_sequence_ids"):
        if bound.get(name) is not None:
            raise PatchInputError(
                f"create_causal_mask got {name}: a custom attention pattern that a key-padding mask cannot express. "
                "patchkit refuses it rather than drop it; revert the patch for this model."
            )
    if getattr(bound.get("config"), "is_causal", True) is False:
        raise PatchInputError(
            "this model's config sets is_causal=False (bidirectional attention), which patchkit's causal varlen "
            "attention does not serve; revert the patch for this model."
        )


def make_create_causal_mask(original: Callable) -> Callable:
    """Replacement for `create_causal_mask` (4.53+): hand attention the 2D mask, never a 4D one."""
    signature = inspect.signature(original)

    def create_causal_mask(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        # a 4D mask made before the model ran (read first: a compiled static-cache step reads no contextvar), or a
        # forward patchkit steps aside for: transformers' own mask
        if transformers_mask(bound.get("attention_mask")) or is_stepping_aside():
            return original(*args, **kwargs)
        _refuse_mask_extras(bound)
        past_len, fixed = cache_placement(bound.get("past_key_values"), bound.get("cache_position"))
        return VarlenMask.for_forward(bound.get("attention_mask"), past_len, fixed)

    create_causal_mask.__wrapped_original__ = original  # type: ignore[attr-defined]
    return create_causal_mask


def make_update_causal_mask(original: Callable) -> Callable:
    """Replacement for `LlamaModel._update_causal_mask` (4.48-4.52): the 2D mask, wrapped, and where the queries sit."""

    def _update_causal_mask(
        self: nn.Module, attention_mask: Any, input_tensor: Any = None, cache_position: Any = None,
        past_key_values: Any = None, *args: Any, **kwargs: Any,
    ) -> Any:
        if is_stepping_aside():
            return original(self, attention_mask, input_tensor, cache_position, past_key_values, *args, **kwargs)
        past_len, fixed = cache_placement(past_key_values, cache_position)
        refuse_4d(attention_mask, fixed)
        return VarlenMask.for_forward(attention_mask, past_len, fixed)

    return _update_causal_mask


def class_replacements(state: PatchState) -> list[Replacement]:
    """Targets of a before-load patch: every LLaMA model built (or already built) runs through it."""
    mod = modeling_llama()
    forward = make_forward(state, mod.apply_rotary_pos_emb, mod.LlamaAttention.forward)
    out = [
        Replacement(mod.LlamaAttention, "forward", forward, "LlamaAttention.forward"),
        Replacement(mod.LlamaModel, "forward", make_model_forward(mod.LlamaModel.forward, state.unpad, state=state),
                    "LlamaModel.forward"),
    ]
    # the causal LM tells the base model's forward what of its call reads padding positions (step_aside)
    out.append(Replacement(mod.LlamaForCausalLM, "forward", make_lm_forward(mod.LlamaForCausalLM.forward),
                           "LlamaForCausalLM.forward"))
    if uses_create_causal_mask(mod):
        out.append(
            Replacement(
                mod, "create_causal_mask", make_create_causal_mask(mod.create_causal_mask),
                "modeling_llama.create_causal_mask",
            )
        )
    else:
        update = make_update_causal_mask(mod.LlamaModel._update_causal_mask)
        out.append(Replacement(mod.LlamaModel, "_update_causal_mask", update, "LlamaModel._update_causal_mask"))
    return out


def instance_replacements(state: PatchState, model: nn.Module) -> list[Replacement]:
    """Targets of a loaded-instance patch: only this model's modules change (its config only during a forward)."""
    mod = modeling_llama()
    attentions = find_modules(model, mod.LlamaAttention)
    bases = find_modules(model, mod.LlamaModel)
    if not attentions or not bases:
        raise PatchTargetError(
            f"found {len(attentions)} LlamaAttention layers and {len(bases)} LlamaModel in "
            f"{type(model).__name__}: patched 0 layers. patchkit's LLaMA patches need transformers' "
            "LlamaForCausalLM/LlamaModel (not a trust_remote_code copy); nothing was patched."
        )

    def bind(func: Any, module: nn.Module, attr: str, label: str) -> Replacement:
        return bound_replacement(func, module, attr, label, state.track_copy)

    out = [bind(make_forward(state, mod.apply_rotary_pos_emb, current_method(m)), m, "forward",
                f"{type(m).__name__}.forward (layer {m.layer_idx})") for m in attentions]
    masks_by_name = uses_create_causal_mask(mod)
    if masks_by_name:
        attn_interface.register()  # the mask function for ATTENTION_NAME; attention stays this instance's
    for base in bases:
        impl = base.config._attn_implementation if masks_by_name else None
        wrapped = make_model_forward(current_method(base), state.unpad, impl, state=state)
        out.append(bind(wrapped, base, "forward", f"{type(base).__name__}.forward (unpad={state.unpad})"))
        if not masks_by_name:
            update = make_update_causal_mask(current_method(base, "_update_causal_mask"))
            out.append(bind(update, base, "_update_causal_mask", "LlamaModel._update_causal_mask"))
    for lm in find_modules(model, mod.LlamaForCausalLM):  # what of its call reads padding positions (step_aside)
        out.append(bind(make_lm_forward(current_method(lm)), lm, "forward", f"{type(lm).__name__}.forward"))
    return out
