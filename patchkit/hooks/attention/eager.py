"""transformers' own attention for the calls patchkit hands back over a 4D mask: the one the model had before it was
named (or was loaded with), else its family's default, sdpa where the family supports it, as an unpatched model runs."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.forward.liveness import is_compiling
from patchkit.hooks.install.routing import ROUTE_NAME, named_before


def family_eager_attention(module: nn.Module) -> Callable:
    """transformers' own eager attention of `module`'s family (its softcap, sinks and scaling included)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def loaded_function(module: nn.Module, loaded: Optional[str]) -> Callable:
    """The attention function of the name the model was loaded with (`loaded`; sdpa, transformers' default, where it
    was loaded with patchkit's own): the family's eager attention for "eager", else transformers' registered one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = "sdpa" if loaded in (None, ROUTE_NAME) else loaded
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        return family_eager_attention(module)
    return ALL_ATTENTION_FUNCTIONS[name]


_SUPPORTS_SDPA: dict[type, bool] = {}  # read on the host (an import), then inside a graph too (a plain dict read)


def supports_sdpa(config_class: type) -> bool:
    """The family of `config_class` runs sdpa by default (its model's `_supports_sdpa`); False where unknown."""
    known = _SUPPORTS_SDPA.get(config_class)
    if known is None:
        known = _SUPPORTS_SDPA[config_class] = _family_supports_sdpa(config_class)
    return known


def _family_supports_sdpa(config_class: type) -> bool:
    name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        modeling = importlib.import_module(name)
        pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    except Exception:  # noqa: BLE001 - remote code, a config without a modeling module: eager
        return False
    return any(getattr(c, "_supports_sdpa", False) for c in vars(modeling).values()
               if isinstance(c, type) and issubclass(c, pretrained) and c.__module__ == name)


def aside_name(config: Any) -> str:
    """The attention a forward stepped aside under patchkit's name alone runs: "eager" or "sdpa", the one the model
    had before it was named, else transformers' default for its family (what the model runs without patchkit).
    Inside a graph, where the family's modeling module is not imported, what the host read of it (a model named
    'patchkit' is read when it gets the name, `named.adopt`); eager where nothing was."""
    before = named_before(config)
    if before in ("eager", "sdpa"):
        return before
    if config is None:
        return "eager"
    sdpa = _SUPPORTS_SDPA.get(type(config)) if is_compiling() else supports_sdpa(type(config))
    return "sdpa" if sdpa else "eager"


def aside_name_for(loaded: Optional[str], config: Any) -> str:
    """`loaded` (a patch's model's own attention) where it is eager or sdpa, else `aside_name`."""
    if loaded in ("eager", "sdpa"):
        return loaded
    return aside_name(config)


def aside_mask(args: tuple, kwargs: dict, loaded: Optional[str] = None) -> Optional[torch.Tensor]:
    """transformers' own mask for a mask-interface call, in the format of the attention `aside_name_for` runs
    (eager's additive floats, sdpa's booleans, never skipped for is_causal)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    name = aside_name_for(loaded, kwargs.get("config"))
    if name == "sdpa":
        return for_attention(sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False}), name)
    return for_attention(eager_mask(*args, **kwargs), name)


def for_attention(mask: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """`mask`, telling `transformers_attention` inside a compiled graph (where the record of the model's attention
    before its name is not read) which attention it was made for."""
    if mask is not None:
        mask.patchkit_attention = name
    return mask


def transformers_attention(module: nn.Module, query: Any, key: Any, value: Any, mask: torch.Tensor,
                           loaded: Optional[str] = None, **kwargs: Any) -> Any:
    """transformers' attention of `module`'s family over its 4D mask, the one `aside_name_for` names; eager where the
    call passes what sdpa refuses or drops (softcap, sinks). Over the keys a sparse attention's indexer selected
    (`indices`, which transformers hands a kernel by any name but eager's and sdpa's: it merges them into their mask
    itself, and so does this)."""
    made_for = getattr(mask, "patchkit_attention", None) if is_compiling() else None  # made on the host
    name = made_for or aside_name_for(loaded, getattr(module, "config", None))
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        name = "eager"
    if mask.dtype == torch.bool and name == "eager":  # sdpa's format (True: attend) -> eager's additive one
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    indices = kwargs.pop("indices", None)
    if isinstance(indices, torch.Tensor) and indices.shape[-1]:  # (B, S, top-k) of the keys each query sees
        dropped = torch.ones((*indices.shape[:2], key.shape[-2]), dtype=torch.bool, device=indices.device)
        dropped = dropped.scatter(-1, indices.long(), False).unsqueeze(1)
        mask = mask & ~dropped if mask.dtype == torch.bool else mask.masked_fill(dropped, torch.finfo(mask.dtype).min)
    return loaded_function(module, name)(module, query, key, value, mask, **kwargs)  # sdpa: the registered one, as
    # transformers calls it (a framework may have wrapped it)
