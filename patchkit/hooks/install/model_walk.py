"""Find the pieces of a loaded model (attention layers, its config) through PEFT / DDP / FSDP wrappers."""

from __future__ import annotations

from typing import Any, Collection, Optional

from torch import nn

from patchkit.errors import PatchTargetError


def find_modules(model: nn.Module, cls: type) -> list[nn.Module]:
    """Every instance of `cls` inside `model`, through PEFT / DDP / FSDP wrappers (they are modules too)."""
    return [m for m in model.modules() if isinstance(m, cls)]


def model_config(model: nn.Module, model_types: Optional[Collection[str]] = None) -> Any:
    """The transformer config inside `model`: the first module's whose `model_type` is one of `model_types` (or its
    `_text` part: a vision-language model's language model, not its vision tower), else the first language model's
    (a config with a vocabulary), else the first module's with attention heads."""
    first = language = None
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is None or not hasattr(config, "num_attention_heads"):
            continue
        kind = getattr(config, "model_type", None) or ""
        if model_types is not None and (kind in model_types or kind.removesuffix("_text") in model_types):
            return config
        if language is None and getattr(config, "vocab_size", None):
            language = config
        first = config if first is None else first
    found = language if language is not None else first
    if found is not None:
        return found
    raise PatchTargetError(f"{type(model).__name__} has no module with a transformers config (num_attention_heads)")


def head_dim(model: nn.Module, model_types: Optional[Collection[str]] = None) -> Optional[int]:
    """The head size `model`'s kernel calls take (of its `model_types` part): the config's head_dim, else hidden /
    heads, or a latent attention's query-and-key width; None where it varies by layer (transformers' heterogeneous
    configs, Gemma 4's, refuse a global read of it): each layer's calls are gated by their own size then
    (`PatchState.backend_for`)."""
    config = model_config(model, model_types)
    try:
        size = getattr(config, "head_dim", None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError (5.2x): a per-layer attribute
        return None
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if isinstance(nope, int) and isinstance(rope, int):  # latent attention: its head_dim is the rotary part alone
        return max(nope + rope, getattr(config, "v_head_dim", None) or 0)  # the kernel's (`attend.one_head_size`)
    return size or config.hidden_size // config.num_attention_heads


def modeling_files(cls: type) -> frozenset[str]:
    """The transformers modeling files ("llama", "gemma3") that `cls` or its bases come from: a subclass under a
    model_type of its own (LLaVA's `llava_llama` LlamaForCausalLM) still runs its family's code."""
    files = _FILES.get(cls)
    if files is None:
        prefix = "transformers.models."
        files = _FILES[cls] = frozenset(c.__module__.rpartition(".modeling_")[2] for c in cls.__mro__
                                        if c.__module__.startswith(prefix) and ".modeling_" in c.__module__)
    return files


_FILES: dict[type, frozenset[str]] = {}  # a plain dict, not functools.cache: compiled forwards read it
