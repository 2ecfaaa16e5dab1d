"""transformers' continuous batching runs only the names it knows (sdpa, eager, flash): it runs patchkit's too.

`generate_batch()`, `generate(cache_implementation="paged")` and `transformers serve` switch a model to an attention
they support first, and raise for any other name. A model loaded with `attn_implementation="patchkit"` keeps it
there: continuous batching builds it the 4D masks it builds for sdpa, and patchkit's attention serves each step from
the requests' lengths after checking that mask (`hooks/attention/paged.py`), or steps aside, exact, over it. Wrapped
once, when the name is registered; inert for every other name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

from patchkit.forward.inputs.arguments import cache_parameter
from patchkit.hooks.install.routing import ROUTE_NAME

SWITCH = "switch_to_cb_friendly_attn"


def keeps_patchkit(original: Callable) -> Callable:
    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        named = getattr(getattr(model, "config", None), "_attn_implementation", None) == ROUTE_NAME
        if named and layers_update_the_cache(model):
            return None  # kept: patchkit's attention serves continuous batching's steps
        return original(self, model, *args, **kwargs)  # before 5.24: transformers' refusal, as it was

    switch_to_cb_friendly_attn.__patchkit_name__ = True  # type: ignore[attr-defined]
    return switch_to_cb_friendly_attn


def layers_update_the_cache(model: Any) -> bool:
    """The model's layers update continuous batching's paged cache themselves (transformers 5.24+, where the cache
    argument is `cache`); before, its attention functions did, which patchkit's attention does not."""
    return cache_parameter(inspect.signature(type(model).forward).parameters) == "cache"


def install() -> None:
    """Wrap continuous batching's switch of attention once (idempotent; none where this transformers has none)."""
    try:
        api = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
    except ImportError:
        return
    manager = getattr(api, "ContinuousBatchingManager", None)
    original = getattr(manager, SWITCH, None)
    if original is None or getattr(original, "__patchkit_name__", False):
        return
    setattr(manager, SWITCH, keeps_patchkit(original))
