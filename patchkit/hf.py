"""Where transformers' LLaMA builds its decoder mask and runs attention: the objects the patches replace."""

from __future__ import annotations

import importlib
import inspect
from types import MethodType, ModuleType
from typing import Any, Callable

from torch import nn

from . import attn_interface
from .attention import PatchState, make_forward
from .attn_interface import ATTENTION_NAME
from .errors import PatchInputError, PatchTargetError
from .masks import VarlenMask
from .model_unpad import make_model_forward
from .patching import Replacement


def modeling_llama() -> ModuleType:
    return importlib.import_module("transformers.models.llama.modeling_llama")


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


def make_create_causal_mask(original: Callable) -> Callable:
    """Replacement for `create_causal_mask` (4.53+): hand attention the 2D mask, never a 4D one."""
    signature = inspect.signature(original)

    def create_causal_mask(*args: Any, **kwargs: Any) -> VarlenMask:
        bound = signature.bind_partial(*args, **kwargs).arguments
        _refuse_mask_extras(bound)
        return VarlenMask.for_forward(bound.get("attention_mask"))

    create_causal_mask.__wrapped_original__ = original  # type: ignore[attr-defined]
    return create_causal_mask


def _update_causal_mask(self: nn.Module, attention_mask: Any, *args: Any, **kwargs: Any) -> VarlenMask:
    """Replacement for `LlamaModel._update_causal_mask` (4.48-4.52): the 2D mask, wrapped."""
    return VarlenMask.for_forward(attention_mask)


def class_replacements(state: PatchState) -> list[Replacement]:
    """Targets of a before-load patch: every LLaMA model built (or already built) runs through it."""
    mod = modeling_llama()
    forward = make_forward(state, mod.apply_rotary_pos_emb)
    out = [Replacement(mod.LlamaAttention, "forward", forward, "LlamaAttention.forward")]
    if state.unpad == "model":
        out.append(
            Replacement(mod.LlamaModel, "forward", make_model_forward(mod.LlamaModel.forward), "LlamaModel.forward")
        )
    if uses_create_causal_mask(mod):
        out.append(
            Replacement(
                mod, "create_causal_mask", make_create_causal_mask(mod.create_causal_mask),
                "modeling_llama.create_causal_mask",
            )
        )
    else:
        out.append(
            Replacement(mod.LlamaModel, "_update_causal_mask", _update_causal_mask, "LlamaModel._update_causal_mask")
        )
    return out


def find_modules(model: nn.Module, cls: type) -> list[nn.Module]:
    """Every instance of `cls` inside `model`, through PEFT / DDP / FSDP wrappers (they are modules too)."""
    return [m for m in model.modules() if isinstance(m, cls)]


def instance_replacements(state: PatchState, model: nn.Module) -> list[Replacement]:
    """Targets of a loaded-instance patch: only this model's modules and config change."""
    mod = modeling_llama()
    attentions = find_modules(model, mod.LlamaAttention)
    bases = find_modules(model, mod.LlamaModel)
    if not attentions or not bases:
        raise PatchTargetError(
            f"found {len(attentions)} LlamaAttention layers and {len(bases)} LlamaModel in "
            f"{type(model).__name__}: patched 0 layers. patchkit's LLaMA patches need transformers' "
            "LlamaForCausalLM/LlamaModel (not a trust_remote_code copy); nothing was patched."
        )
    forward = make_forward(state, mod.apply_rotary_pos_emb)
    out = [
        Replacement(m, "forward", MethodType(forward, m), f"{type(m).__name__}.forward (layer {m.layer_idx})")
        for m in attentions
    ]
    for base in bases:
        if state.unpad == "model":
            wrapped = MethodType(make_model_forward(type(base).forward), base)
            out.append(Replacement(base, "forward", wrapped, "LlamaModel.forward (unpad once per forward)"))
        if uses_create_causal_mask(mod):
            attn_interface.register()  # the mask function for ATTENTION_NAME; attention stays this instance's
            out.append(
                Replacement(base.config, "_attn_implementation", ATTENTION_NAME, "config._attn_implementation")
            )
        else:
            out.append(
                Replacement(
                    base, "_update_causal_mask", MethodType(_update_causal_mask, base), "LlamaModel._update_causal_mask"
                )
            )
    return out


def model_config(model: nn.Module) -> Any:
    """The LLaMA config inside `model`, looking through PEFT / DDP / FSDP wrappers."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "num_attention_heads"):
            return config
    raise PatchTargetError(f"{type(model).__name__} has no module with a LLaMA config (num_attention_heads)")
