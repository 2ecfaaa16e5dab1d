"""A served family's cross-attention layers (Mllama's, text to image tiles) run the attention the model was loaded with.

Their keys are another tower's tokens and their mask is the batch's own (B, 1, N, tiles): which tiles a text token
sees, not where padding is. No varlen kernel takes that; their decoder layers run on the padded batch inside a
packed forward (`hooks/forwards/padded_layers.py`). They share the language model's config, so inside a routed
forward they ask for patchkit's name too; this hands them the loaded name's function, the one their checkpoint
recompute reads after the forward, so both compute the same numbers as unpatched.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from patchkit.hooks.attention.eager import loaded_function
from patchkit.hooks.install.registry import cross_layer_names

_CROSS: dict[type, bool] = {}  # a plain dict, not functools.cache: compiled layers read it


def cross_layer(module: nn.Module) -> bool:
    """`module` is a served family's cross-attention layer (`patches/table.py` `CROSS_LAYERS`)."""
    cls = type(module)
    found = _CROSS.get(cls)
    if found is None:
        found = _CROSS[cls] = cls.__name__ in cross_layer_names()
    return found


def cross_attention(module: nn.Module, query: Any, key: Any, value: Any, mask: Any, loaded: Optional[str],
                    **kwargs: Any) -> Any:
    """The cross-attention layer's call, on the loaded name's function, as transformers would run it."""
    return loaded_function(module, loaded)(module, query, key, value, mask, **kwargs)
