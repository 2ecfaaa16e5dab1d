"""The transformers eras LLaMA's patch serves, and which module holds the patch targets of the installed one.

| era | what changed there | targets |
|---|---|---|
| 4.31-4.35 | rotary inside attention, tuple KV cache, 3-tuple return; mask method, module-level from 4.35 | `legacy` |
| 4.36-4.47 | per-layer attention classes, Cache objects; `_update_causal_mask` from 4.38 | `legacy` |
| 4.48-5.x | one attention class, the attention interface; `create_causal_mask` from 4.53 | `route_patch` |
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

from patchkit.eras import legacy
from patchkit.hooks import family_route
from patchkit.hooks.install.model_walk import find_modules
from patchkit.hooks.install.patching import Replacement
from patchkit.hooks.install.routing import routes_to
from patchkit.hooks.install.state import PatchState

LLAMA_TRANSFORMERS = ">=4.31,<6"  # the union of the eras below


@dataclasses.dataclass(frozen=True)
class Era:
    name: str
    transformers: str
    changes: str

    def __contains__(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.transformers)


ERAS = (
    Era("4.31-4.35", ">=4.31,<4.36", "rotary inside attention, tuple KV cache; the mask from "
        "_prepare_decoder_attention_mask (4.31-4.34) or a module-level 4D helper (4.35)"),
    Era("4.36-4.47", ">=4.36,<4.48", "per-layer attention classes (eager, sdpa, flash_attention_2), Cache objects; "
        "module-level mask helpers (4.36-4.37), _update_causal_mask (4.38+)"),
    Era("4.48+", ">=4.48,<6", "one attention class through the attention interface; _update_causal_mask "
        "(4.48-4.52), create_causal_mask (4.53+)"),
)


def installed_version() -> str:
    return importlib.import_module("transformers").__version__


def installed_era() -> Era:
    """The era of the installed transformers (the transformers gate has already refused one outside them all)."""
    version = installed_version()
    return next((era for era in ERAS if version in era), ERAS[-1])


def legacy_installed() -> bool:
    """An era before 4.48, where patchkit's own legacy forward serves LLaMA."""
    return installed_era() is not ERAS[-1]


def modeling_llama() -> Any:
    return importlib.import_module("transformers.models.llama.modeling_llama")


def attention_class() -> type:
    """LLaMA's attention class: every version's other attention classes derive from it."""
    return modeling_llama().LlamaAttention


def llama_classes() -> tuple[type, type, type]:
    """LLaMA's attention, base model and causal LM: what the family route patches from 4.48."""
    mod = modeling_llama()
    return mod.LlamaAttention, mod.LlamaModel, mod.LlamaForCausalLM


def class_replacements(state: PatchState) -> list[Replacement]:
    """The installed era's targets of a before-load patch."""
    if legacy_installed():
        return legacy.class_replacements(state, modeling_llama())
    return family_route.class_replacements(state, llama_classes)


def instance_replacements(state: PatchState, model: nn.Module) -> list[Replacement]:
    """The installed era's targets of a loaded-instance patch."""
    if legacy_installed():
        return legacy.instance_replacements(state, model, modeling_llama())
    return family_route.instance_replacements(state, model, llama_classes)


def outer_head_replacements(state: PatchState, model: nn.Module) -> list[Replacement]:
    """A model built under the class patch: its multimodal heads around LLaMA (LLaVA's), from 4.48."""
    if legacy_installed():
        return []
    return family_route.outer_head_replacements(state, model, llama_classes)


def live_layers(model: nn.Module, state: PatchState) -> tuple[int, int]:
    """(LLaMA attention layers that run through `state`, LLaMA attention layers in `model`)."""
    if not legacy_installed():
        return family_route.live_layers(model, state, llama_classes)
    layers = find_modules(model, attention_class())
    return sum(1 for m in layers if routes_to(m.forward, state)), len(layers)
