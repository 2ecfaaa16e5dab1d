"""Find the pieces of a loaded model (attention layers, its config) through PEFT / DDP / FSDP wrappers."""

from __future__ import annotations

from typing import Any

from torch import nn

from patchkit.errors import PatchTargetError


def find_modules(model: nn.Module, cls: type) -> list[nn.Module]:
    """Every instance of `cls` inside `model`, through PEFT / DDP / FSDP wrappers (they are modules too)."""
    return [m for m in model.modules() if isinstance(m, cls)]


def model_config(model: nn.Module) -> Any:
    """The transformer config inside `model` (the first module whose config has attention heads)."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "num_attention_heads"):
            return config
    raise PatchTargetError(f"{type(model).__name__} has no module with a transformers config (num_attention_heads)")


def head_dim(model: nn.Module) -> int:
    """The attention head size of `model`: the config's head_dim, else hidden_size / heads."""
    config = model_config(model)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
