"""The registry: patch name -> PatchSpec (targets, gates, transformers range), one module per patch."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Iterator, Optional

from packaging.specifiers import SpecifierSet
from torch import nn

from patchkit.errors import PatchNameError, PatchTargetError
from patchkit.gates import GateResult
from patchkit.hooks.install.model_walk import model_config
from patchkit.hooks.install.patching import Replacement
from patchkit.hooks.install.state import PatchState
from patchkit.names import ALIASES, PATCH_MODULES


@dataclasses.dataclass(frozen=True)
class PatchSpec:
    """What one patch declares: how it packs q/k/v, where it applies, what it needs, and what it replaces."""

    name: str
    description: str
    packing: str
    transformers: str
    flash_attn_min: str
    flash_attn_why: str
    build_class: Callable[[PatchState], list[Replacement]]
    build_instance: Callable[[PatchState, nn.Module], list[Replacement]]
    attention_class: Callable[[], type]  # the attention layer class whose instances run through the patch
    live_layers: Callable[[nn.Module, PatchState], tuple[int, int]]  # (layers through the patch, layers)
    check_model: Optional[Callable[[nn.Module], list[GateResult]]] = None
    model_gate: str = ""  # what `check_model` requires, in a few words (`patchkit doctor`)
    aliases: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ("llama",)  # the `config.model_type`s this patch serves
    verified: bool = True  # the census saw it exact on CI's transformers (else: a self-check before the first forward)
    unpad: Optional[str] = None  # the mode the family always runs in ("attention": its layers read the padded batch)
    # a model built under the class patch: its generative heads of other modeling modules, wrapped on the instance
    outer_heads: Callable[[PatchState, nn.Module], list[Replacement]] = lambda state, model: []

    @property
    def family(self) -> str:
        """What the patch's class-level targets belong to: patches of one family exclude each other."""
        return self.model_types[0]

    @property
    def supported(self) -> SpecifierSet:
        return SpecifierSet(self.transformers)

    def gate_names(self) -> list[str]:
        names = ["transformers_version", "flash_attn_installed", "flash_attn_version", "cuda_available",
                 "compute_capability", "dtype", "head_dim"]
        return names + (["model_config"] if self.check_model else [])


TABLE = "patchkit.patches.table"  # every other decoder LM, served from data (imported by name: no import circle)


def resolve(name: str) -> PatchSpec:
    """The spec for a patch name or alias, else for a model type the table serves; an unknown name lists the known
    ones, a family the table refuses is named with the feature that stops it."""
    if not isinstance(name, str):
        raise TypeError(f"patch name must be a string, got {type(name).__name__}")
    key = ALIASES.get(name.lower(), name.lower())
    if key in PATCH_MODULES:
        return importlib.import_module(PATCH_MODULES[key]).SPEC
    try:
        return table_spec(key)
    except PatchTargetError as stop:
        if "-" in key:  # `gpt-oss`, as a checkpoint's name spells it: the model_type is `gpt_oss`
            try:
                return resolve(key.replace("-", "_"))
            except ValueError:
                pass
        known = ", ".join(sorted(PATCH_MODULES) + [f"{a} (= {t})" for a, t in ALIASES.items()])
        raise PatchNameError(f"unknown patch {name!r}; available patches: {known}; or a decoder model_type served from "
                         f"data ({stop})") from None


# model_type -> its spec, or the reason none can be made. The reason is kept as text and raised as a new error each
# time: one error object raised again keeps every raise's frames on its traceback (each apply_patch's handles, and
# whatever its callers held: ~8000 objects an apply_patch and revert, never freed).
_TABLE_SPECS: dict[str, PatchSpec | str] = {}


def table_spec(model_type: Optional[str]) -> PatchSpec:
    """The table's spec for `model_type` (made once), or `PatchTargetError` naming what stops it."""
    if not isinstance(model_type, str):
        raise PatchTargetError(f"model_type {model_type!r} is no family")
    if model_type not in _TABLE_SPECS:
        try:
            _TABLE_SPECS[model_type] = importlib.import_module(TABLE).spec(model_type)
        except (PatchTargetError, ImportError, AttributeError, KeyError) as stop:
            _TABLE_SPECS[model_type] = str(stop)
    found = _TABLE_SPECS[model_type]
    if isinstance(found, str):
        raise PatchTargetError(found)
    return found


def imported_table_types() -> list[str]:
    """The model types the table could serve whose modeling module is imported already (see table.imported_types)."""
    return list(importlib.import_module(TABLE).imported_types())


_TABLE_LISTS: dict[str, Any] = {}  # the table's lists, read once (an import inside a traced forward guards sys.modules)


def _table_list(name: str, kind: type) -> Any:
    """The table's list `name` as `kind` (dict, frozenset), read at its first use; empty where the table lacks it."""
    if name not in _TABLE_LISTS:
        _TABLE_LISTS[name] = kind(getattr(importlib.import_module(TABLE), name, ()))
    return _TABLE_LISTS[name]


def refusal(model_type: Optional[str]) -> Optional[str]:
    """The feature the table names for a family it refuses (DeepSeek-V3.2's sparse attention, ...), else None."""
    return _table_list("REFUSED", dict).get(model_type)


def cross_layer_names() -> frozenset[str]:
    """The class names of the served families' cross-attention layers (Mllama's), which run transformers' attention."""
    return frozenset(attention for attention, _ in _table_list("CROSS_LAYERS", dict).values())


def refused_configs() -> dict[str, tuple[str, str]]:
    """model_type -> (the config field, the feature) of the families the table serves but for some configs."""
    return _table_list("REFUSED_CONFIGS", dict)


# Config fields that, true in any family's config, ask for attention a key-padding mask cannot express (field ->
# feature). Gemma's `use_bidirectional_attention` (PaliGemma sets it; EmbeddingGemma's encoders) makes every layer
# non-causal: transformers' eager and sdpa attention then follow the mask they are given (PaliGemma's prefix, both
# ways, which a forward reads back: `mask_decides`), and attend both ways over every token where sdpa skipped it.
# Gemma 4 names it by value: "all" is every layer both ways; "vision" keeps text causal (its images' own masks:
# `bidirectional_image_tokens`).
NONCAUSAL = "use_bidirectional_attention"
EVERY_FAMILY_REFUSES = {
    NONCAUSAL: "bidirectional attention (PaliGemma's image and prompt prefix, an encoder's layers), which "
               "transformers' attention implementations each read differently",
}


def config_refusals(model_type: Optional[str]) -> dict[str, str]:
    """field -> feature of the configs patchkit refuses in `model_type`: the table's for that family (Falcon's
    `alibi`), then every family's."""
    own = refused_configs().get(model_type)
    return {**({own[0]: own[1]} if own is not None else {}), **EVERY_FAMILY_REFUSES}


def padding_into_mixers(config: Any) -> bool:
    """The family's mixers read the padding positions' hidden states (the table's PADDING_INTO_MIXERS), or this
    config's mixers the bias of their input projection there (MIXER_INPUT_BIAS)."""
    model_type = getattr(config, "model_type", None)
    field = _table_list("MIXER_INPUT_BIAS", dict).get(model_type)
    return model_type in _table_list("PADDING_INTO_MIXERS", frozenset) or (
        field is not None and getattr(config, field, False) is True)


def mixes_rows(config: Any) -> bool:
    """The family's token mixers run the packed row's rows (the table's ROW_MIXERS: linear attention, Mamba,
    convolutions)."""
    return getattr(config, "model_type", None) in _table_list("ROW_MIXERS", dict)


def pools_by_column(config: Any) -> bool:
    """The family pools compressed KV entries from windows of columns (the table's COMPRESSORS: DeepSeek-V4)."""
    return getattr(config, "model_type", None) in _table_list("COMPRESSORS", dict)


def index_topk(config: Any) -> Optional[int]:
    """How many keys the family's sparse-attention indexer keeps for each query (DeepSeek-V3.2's `index_topk`, and
    Kolibri-1.1's sink and local tokens besides; Qwen4-Exp's `indexer_budget`; the table's SPARSE_INDEXERS), or None
    for a family with no indexer."""
    if getattr(config, "model_type", None) not in _table_list("SPARSE_INDEXERS", dict):
        return None
    topk = getattr(config, "index_topk", None)
    if topk is None and getattr(config, "indexer_budget", None) is not None:  # Qwen4-Exp's QSA: its budget of whole
        return config.indexer_budget + config.indexer_compress_ratio - 1  # blocks, and a query's incomplete last one
    if topk is None:
        return None
    return topk + getattr(config, "index_num_local_tokens", 0) + getattr(config, "index_num_sink_tokens", 0)


def read_table_lists() -> None:
    """Read the table's per-config and per-input lists now, outside any traced forward (an import inside a graph that
    may not break is refused by Dynamo): called where a forward is wrapped."""
    refusal(None), refused_configs(), padding_into_mixers(None), index_topk(None), mixes_rows(None)
    pools_by_column(None)


def refused_value(value: Any) -> bool:
    """A refused config field's value that asks for the feature: true, or "all" (Gemma 4's every token both ways)."""
    return value is True or value == "all"


def config_cause(config: Any) -> Optional[str]:
    """The step-aside cause, named by its config field, of a model whose config has a feature patchkit refuses
    (`config_refusals`: Falcon's `alibi`, any family's `use_bidirectional_attention`), else None."""
    for field in config_refusals(getattr(config, "model_type", None)):
        if refused_value(getattr(config, field, False)):
            return field
    return None


def config_gate(model_type: str) -> Optional[Callable[[nn.Module], list[GateResult]]]:
    """The model gate of a family the table refuses some configs of (`refused_configs`): apply_patch(model=...) on
    such a model patches nothing and says why; None for every other family."""
    entry = refused_configs().get(model_type)
    if entry is None:
        return None
    return lambda model: config_gates(model, (model_type,), dict([entry]))


def config_gates(model: nn.Module, model_types: tuple[str, ...],
                 fields: Optional[dict[str, str]] = None) -> list[GateResult]:
    """The `model_config` gates of `model`'s config (the part of `model_types`) for `fields` (default: those every
    family refuses), one for each field its config has: a true one fails; none for a model with no config (which the
    patch then refuses by what it finds)."""
    try:
        config = model_config(model, model_types)
    except PatchTargetError:
        return []
    out = []
    for field, feature in (EVERY_FAMILY_REFUSES if fields is None else fields).items():
        if not hasattr(config, field):
            continue
        value = getattr(config, field, None)
        if field == NONCAUSAL and refused_value(value) and builds_masks_for(model, config):
            out.append(GateResult("model_config", True, f"{field}=False, or masks a multimodal model builds",
                                  f"{field}={value}, read per forward off the masks {type(model).__name__} builds"))
            continue
        out.append(GateResult("model_config", not refused_value(value), f"{field}=False", f"{field}={value}: {feature}",
                              "run this model unpatched, on transformers' attention ('sdpa' or 'eager'); under a "
                              f"class patch it steps aside ({field})"))
    return out


def builds_masks_for(model: nn.Module, config: Any) -> bool:
    """`model` is a multimodal model whose forward builds the masks of its language model (of `config`): PaliGemma,
    whose Gemma is not causal by its config and attends as those masks say (its prompt prefix both ways), which each
    forward reads back or steps aside for. An encoder of its own (EmbeddingGemma's) builds none."""
    own = getattr(model, "config", None)
    text = getattr(own, "get_text_config", None)
    return own is not None and own is not config and callable(text) and text() is config


def registered() -> list[PatchSpec]:
    return [resolve(name) for name in PATCH_MODULES]


class ServedTypes:
    """Every `config.model_type` patchkit serves: the registered patches' and the census's by name (iterated), and
    any other the table serves, asked one at a time (`in`: inspects the family once)."""

    def __init__(self, named: set[str]) -> None:
        self.named = named

    def __contains__(self, model_type: object) -> bool:
        if model_type in self.named:
            return True
        try:
            table_spec(model_type)  # type: ignore[arg-type]
        except PatchTargetError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.named))


_SERVED: Optional[ServedTypes] = None


def served_model_types() -> ServedTypes:
    """Every `config.model_type` some registered patch or the table serves."""
    global _SERVED
    if _SERVED is None:
        named = {t for spec in registered() for t in spec.model_types}
        _SERVED = ServedTypes(named | set(importlib.import_module(TABLE).verified_here()))
    return _SERVED


def for_model_type(model_type: Optional[str]) -> PatchSpec:
    """The patch serving `config.model_type` (llama2 for LLaMA, the table's for a family without a module); an
    unserved family is named with what stops it and the served ones."""
    for name in PATCH_MODULES:
        spec = resolve(name)
        if model_type in spec.model_types and name != "llama1":
            return spec
    try:
        return table_spec(model_type)
    except PatchTargetError as stop:
        why = stop
    named = sorted({t for spec in registered() for t in spec.model_types})
    more = len(set(served_model_types())) - len(named)
    raise PatchTargetError(
        f"no patch for model_type {model_type!r}: patchkit serves {', '.join(named)} and {more} families more from "
        f"data; this one: {why}. Nothing was patched."
    )


_BY_CLASS: dict[type, Optional[PatchSpec]] = {}  # a plain dict, not functools.cache: compiled layers read it


def spec_for_class(cls: type) -> Optional[PatchSpec]:
    """The patch whose attention class `cls` is or derives from (none: not a served family's attention layer)."""
    if cls not in _BY_CLASS:
        _BY_CLASS[cls] = next((spec for spec in registered() if spec.name != "llama1" and _derives(cls, spec)), None)
    return _BY_CLASS[cls]


def _derives(cls: type, spec: PatchSpec) -> bool:
    try:
        return issubclass(cls, spec.attention_class())
    except (ImportError, AttributeError):  # a family this transformers does not have
        return False


def spec_for_model(model: nn.Module) -> Optional[PatchSpec]:
    """The patch serving a loaded model: its config's `model_type`, else the family its attention layers belong to (a
    subclass under a model_type of its own, as LLaVA's `llava_llama` LlamaForCausalLM); None when neither is served."""
    served = served_model_types()
    model_type = getattr(model_config(model, served), "model_type", None)
    if model_type in served:
        return for_model_type(model_type)
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        spec = spec_for_class(cls)
        if spec is not None:
            return spec
    return None


def for_model(model: nn.Module) -> PatchSpec:
    """`spec_for_model`, or `PatchTargetError` naming the model's own model_type (a vision-language model's, not its
    vision tower's) and the served ones."""
    spec = spec_for_model(model)
    if spec is not None:
        return spec
    config = getattr(model, "config", None)
    if not hasattr(config, "model_type"):  # a user's wrapper module: the first transformers config inside it
        config = model_config(model)
    return for_model_type(config.model_type)
