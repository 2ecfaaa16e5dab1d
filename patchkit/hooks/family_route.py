"""One patch for every family on transformers 4.48+ (LLaMA's included): the builder of its replacements.

From transformers 4.48 each family's attention forward projects q, k, v, applies its own bias, q/k norms and
RoPE, updates the cache, then calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` with what differs
(`sliding_window`, `softcap`, `scaling`); from 4.53 its masks go through `AttentionMaskInterface` by the same
name (4.48-4.52: the base model's `_update_causal_mask`, replaced here). So patchkit replaces no attention code:
the base model's forward is wrapped to route that forward's masks to patchkit's registered name
(`attention_interface`) and to unpad once when no cache is kept, and the attention forward routes each call given
patchkit's mask to that name on the patch's own state, for the module's lifetime (`routing`: checkpoint
recomputes included). A family module declares its classes.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, Optional

from torch import nn

from patchkit.errors import PatchTargetError
from patchkit.forward.context import current
from patchkit.forward.inputs.arguments import transformers_mask_in_graph
from patchkit.forward.masks import VarlenMask, cache_placement, refuse_4d
from patchkit.gates import GateResult
from patchkit.hooks.attention.compressed_kv import make_compressor_forward
from patchkit.hooks.attention.sparse_indexer import make_indexer_forward
from patchkit.hooks.attention.varlen import KV_PACKED
from patchkit.hooks.decide.outer_caller import generative_head, wrapped
from patchkit.hooks.decide.task_reads import task_of
from patchkit.hooks.forwards.lm_forward import make_lm_forward
from patchkit.hooks.forwards.mixer_rows import hand_rows, make_mixer_forward
from patchkit.hooks.forwards.model_forward import make_model_forward
from patchkit.hooks.forwards.padded_layers import make_padded_layer_forward
from patchkit.hooks.forwards.recorded_router import make_recording_forward
from patchkit.hooks.forwards.task_forward import make_task_forward
from patchkit.hooks.install.model_walk import find_modules
from patchkit.hooks.install.patching import Replacement, bound_replacement, dressed_as
from patchkit.hooks.install.registry import PatchSpec
from patchkit.hooks.install.routing import current_method, make_attention_forward, rerouting, routes_to
from patchkit.hooks.install.state import PatchState
from patchkit.hooks.name import attention_interface

ROUTE_TRANSFORMERS = ">=4.53,<6"  # AttentionMaskInterface: a registered name receives the 2D mask
PADDED = "runs on the padded batch inside a packed forward"
EVERY_KEY = "keeps every key in a served forward"
ENTRY_BIAS = "hands its entries' bias to patchkit's attention"


def family_spec(
    model_type: str, module: str, prefix: str, description: str, *, lm: str = "ForCausalLM", base: str = "Model",
    attention: str = "Attention", transformers: str = ROUTE_TRANSFORMERS, records: tuple[str, ...] = (),
) -> PatchSpec:
    """The PatchSpec of a family served through the attention interface: `{prefix}Attention`, `{prefix}Model`;
    `records`: the models around the base model that record router logits with hooks of their own
    (`recorded_router`)."""

    def modeling() -> Any:
        return importlib.import_module(f"transformers.models.{module}.modeling_{module}")

    def classes() -> tuple[type, type, Optional[type]]:
        mod = modeling()
        return getattr(mod, prefix + attention), getattr(mod, prefix + base), getattr(mod, prefix + lm, None)

    def recorders() -> tuple[type, ...]:
        return tuple(getattr(modeling(), prefix + name) for name in records)

    return family_spec_of(model_type, classes, description, transformers=transformers, recorders=recorders)


def family_spec_of(
    model_type: str, classes: Callable[[], tuple[type, type, Optional[type]]], description: str, *,
    transformers: str = ROUTE_TRANSFORMERS, recorders: Callable[[], tuple[type, ...]] = tuple,
    unpad: Optional[str] = None, verified: bool = True, mixers: Callable[[], tuple[type, ...]] = tuple,
    check_model: Optional[Callable[[nn.Module], list[GateResult]]] = None, model_gate: str = "",
    padded_layers: Callable[[], tuple[type, ...]] = tuple, indexers: Callable[[], tuple[type, ...]] = tuple,
    compressors: Callable[[], tuple[type, ...]] = tuple,
) -> PatchSpec:
    """The PatchSpec of a family whose (attention, base model, causal LM) `classes()` gives; `unpad`: the mode the
    family always runs in ("attention": its base model reads the mask itself or mixes tokens outside attention);
    `verified`: the census saw it exact (else each process checks it on a tiny model before its first forward);
    `mixers`: its token mixers outside attention, run the packed row's rows in groups of similar length
    (`mixer_rows`); `check_model`: its model gate (the configs the table refuses, `registry.config_gate`), which
    requires `model_gate`; `padded_layers`: its decoder layers that read the padded batch, run on it inside a packed
    forward (`padded_layers`: Mllama's cross-attention ones); `indexers`: its sparse-attention indexers, which keep
    every key in the forwards patchkit serves (`sparse_indexer`); `compressors`: its KV compressors, whose entries'
    bias they hand to patchkit's attention (`compressed_kv`)."""
    return PatchSpec(
        name=model_type,
        description=description,
        packing=KV_PACKED,
        transformers=transformers,
        flash_attn_min="2.1",
        flash_attn_why="bottom-right causal alignment for the KV cache; windows need 2.3, softcap 2.6",
        build_class=lambda state: class_replacements(state, classes, recorders, unpad) + mixer_replacements(mixers)
        + layer_replacements(padded_layers(), make_padded_layer_forward, PADDED)
        + layer_replacements(indexers(), make_indexer_forward, EVERY_KEY)
        + layer_replacements(compressors(), make_compressor_forward, ENTRY_BIAS),
        build_instance=lambda state, model: instance_replacements(state, model, classes, recorders, unpad)
        + mixer_replacements(mixers, model, state)
        + layer_replacements(padded_layers(), make_padded_layer_forward, PADDED, model, state)
        + layer_replacements(indexers(), make_indexer_forward, EVERY_KEY, model, state)
        + layer_replacements(compressors(), make_compressor_forward, ENTRY_BIAS, model, state),
        attention_class=lambda: classes()[0],
        model_types=(model_type,),
        live_layers=lambda model, state: live_layers(model, state, classes),
        verified=verified,
        unpad=unpad,
        check_model=check_model,
        model_gate=model_gate,
        outer_heads=lambda state, model: outer_head_replacements(state, model, classes, unpad),
    )


def class_replacements(
    state: PatchState, classes: Callable, recorders: Callable = tuple, unpad: Optional[str] = None
) -> list[Replacement]:
    """Before load: every model of the family routes through patchkit, whatever implementation it names."""
    attention, base, lm = classes()
    recording = recorders()
    by_interface = attention_interface.register_route()
    attention_interface.function_for(state)
    routing = Replacement(attention, "forward", make_attention_forward(attention.forward, state),
                          f"{attention.__name__}.forward (routes attention to patchkit)")
    keep = rerouting(attention, routing, state)  # a framework's rewritten attention forward, set after the patch
    out = [Replacement(base, "forward", make_model_forward(base.forward, unpad or state.unpad, route=state,
                                                           keep_routed=keep),
                       f"{base.__name__}.forward (routes masks to patchkit)"), routing]
    if lm is not None:  # the causal LM tells the base model's forward what of its call reads padding (step_aside)
        out.append(Replacement(lm, "forward", outer_forward(lm.forward, lm in recording, unpad or state.unpad, state),
                               f"{lm.__name__}.forward"))
    for outer in vision_lms(lm or base):
        out.append(Replacement(outer, "forward", outer_forward(outer.forward, False, unpad or state.unpad, state),
                               f"{outer.__name__}.forward"))
    for head in task_heads(lm or base):
        out.append(Replacement(head, "forward", make_task_forward(head.forward),
                               f"{head.__name__}.forward (what its task reads at padding)"))
    for records in (r for r in recording if r is not lm):
        out.append(Replacement(records, "forward", make_recording_forward(records.forward),
                               f"{records.__name__}.forward (returns the repadded router logits)"))
    if not by_interface:
        update = make_update_causal_mask(base._update_causal_mask)
        out.append(Replacement(base, "_update_causal_mask", update, f"{base.__name__}._update_causal_mask"))
    return out


def instance_replacements(
    state: PatchState, model: nn.Module, classes: Callable, recorders: Callable = tuple, unpad: Optional[str] = None
) -> list[Replacement]:
    """A loaded instance: only its base model's (and LM's) forward change; the config only during a forward."""
    attention, base, lm = classes()
    recording = recorders()
    bases = find_modules(model, base)
    if not bases or not find_modules(model, attention):
        raise PatchTargetError(
            f"found no {base.__name__} with {attention.__name__} layers in {type(model).__name__}: patched 0 layers; "
            "nothing was patched."
        )
    by_interface = attention_interface.register_route()
    attention_interface.function_for(state)
    out = []
    for b in bases:
        wrapped = make_model_forward(current_method(b), unpad or state.unpad, b.config._attn_implementation,
                                     route=state)
        out.append(bound_replacement(wrapped, b, "forward", f"{type(b).__name__}.forward (routes masks to patchkit)",
                                     state.track_copy))
        if not by_interface:
            update = make_update_causal_mask(current_method(b, "_update_causal_mask"))
            out.append(bound_replacement(update, b, "_update_causal_mask", f"{type(b).__name__}._update_causal_mask",
                                         state.track_copy))
    for m in find_modules(model, attention):
        own = "forward" in vars(m)  # a framework's forward set on the instance; else the class's, followed
        out.append(bound_replacement(make_attention_forward(current_method(m), state, None if own else type(m)),
                                     m, "forward",
                                     f"{type(m).__name__}.forward (layer {getattr(m, 'layer_idx', '?')}, routes "
                                     "attention to patchkit)", state.track_copy))
    if lm is not None:
        for m in find_modules(model, lm):
            forward = outer_forward(current_method(m), lm in recording, unpad or state.unpad, state)
            out.append(bound_replacement(forward, m, "forward", f"{type(m).__name__}.forward", state.track_copy))
    for m in (m for outer in vision_lms(lm or base) for m in find_modules(model, outer)):
        forward = outer_forward(current_method(m), False, unpad or state.unpad, state)
        out.append(bound_replacement(forward, m, "forward", f"{type(m).__name__}.forward", state.track_copy))
    out += outer_head_replacements(state, model, classes, unpad)
    for m in (m for head in task_heads(lm or base) for m in find_modules(model, head)):
        out.append(bound_replacement(make_task_forward(current_method(m)), m, "forward",
                                     f"{type(m).__name__}.forward (what its task reads at padding)", state.track_copy))
    for records in (r for r in recording if r is not lm):
        for m in find_modules(model, records):
            out.append(bound_replacement(make_recording_forward(current_method(m)), m, "forward",
                                         f"{type(m).__name__}.forward (returns the repadded router logits)",
                                         state.track_copy))
    return out


def mixer_replacements(
    mixers: Callable[[], tuple[type, ...]], model: Optional[nn.Module] = None, state: Optional[PatchState] = None
) -> list[Replacement]:
    """The token mixers' forwards (the classes', or `model`'s instances'), which run the packed row's rows in groups."""
    classes = mixers()
    for mixer in classes:
        hand_rows(sys.modules[mixer.__module__])
    return layer_replacements(classes, make_mixer_forward, "the packed row's rows in groups", model, state)


def layer_replacements(
    classes: tuple[type, ...], make: Callable[[Callable], Callable], what: str, model: Optional[nn.Module] = None,
    state: Optional[PatchState] = None,
) -> list[Replacement]:
    """`classes`' forwards wrapped by `make` (the classes', or `model`'s instances'); `what` says what for."""
    if model is None or state is None:
        return [Replacement(cls, "forward", make(cls.forward), f"{cls.__name__}.forward ({what})") for cls in classes]
    return [bound_replacement(make(current_method(m)), m, "forward",
                              f"{cls.__name__}.forward (layer {getattr(m, 'layer_idx', '?')}, {what})",
                              state.track_copy)
            for cls in classes for m in find_modules(model, cls)]


def outer_forward(original: Callable, records: bool, unpad: str, state: PatchState) -> Callable:
    """The causal LM's wrapped forward; one that records router logits of its own returns the repadded ones."""
    forward = make_lm_forward(original, unpad, state)
    return make_recording_forward(forward) if records else forward


def outer_heads(model: nn.Module, base: type, lm: Optional[type]) -> list[nn.Module]:
    """The transformers models in `model` (itself included) that generate from a `base` model inside them, reading
    its logits at every position (`generative_head`), and that the family's own LM classes do not cover: a multimodal
    model of another modeling module around the family's language model (LLaVA, Mistral 3, InternVL, SmolVLM around
    LLaMA, Mistral, Qwen2). Those a wrapper of patchkit's serves already (`wrapped`) are left out."""
    pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    own = tuple(c for c in (lm, *vision_lms(lm or base)) if c is not None)
    return [m for m in model.modules()
            if isinstance(m, pretrained) and not isinstance(m, (base, *own)) and not wrapped(m)
            and generative_head(type(m)) and find_modules(m, base)]


def outer_head_replacements(
    state: PatchState, model: nn.Module, classes: Callable, unpad: Optional[str] = None
) -> list[Replacement]:
    """`outer_heads` of `model` wrapped on the instance like the causal LM: each tells its language model what of its
    call reads padding positions (labels predicted from padding, generate()'s next token at padding) and runs its
    head on the real tokens. Without it such a model's padding-predicted loss and right-padded generation differed
    from unpatched, silently."""
    _, base, lm = classes()
    return [bound_replacement(outer_forward(current_method(m), False, unpad or state.unpad, state), m, "forward",
                              f"{type(m).__name__}.forward (its language model's head and loss)", state.track_copy)
            for m in outer_heads(model, base, lm)]


def vision_lms(lm: Optional[type]) -> tuple[type, ...]:
    """The other generative heads beside the family's causal LM in its modeling module, whose forward takes the
    labels: the vision-language models (Gemma 3's and Gemma 4's `ForConditionalGeneration`) and GPT-2's
    `DoubleHeadsModel`. Wrapped like the causal LM, they tell the language model's forward what of their call reads
    padding positions (labels predicted from padding, generate()'s next token), which it must know to serve the masks
    they build themselves (`model_masks`), and to step aside where generate() reads a token at padding."""
    return beside(lm, lambda name, cls: name.endswith(("ForConditionalGeneration", "DoubleHeadsModel"))
                  and "labels" in inspect.signature(cls.forward).parameters)


def task_heads(lm: Optional[type]) -> tuple[type, ...]:
    """The task heads beside the family's causal LM in its modeling module (`...ForSequenceClassification`,
    `...ForTokenClassification`, `...ForQuestionAnswering`) whose forward takes a mask: wrapped, they tell the base
    model what of their call reads padding positions (`task_reads`)."""
    return beside(lm, lambda name, cls: task_of(cls) is not None
                  and "attention_mask" in inspect.signature(cls.forward).parameters)


def beside(lm: Optional[type], keep: Callable[[str, type], bool]) -> tuple[type, ...]:
    """The classes of `lm`'s modeling module, other than `lm`, defined there and kept by `keep(name, cls)`."""
    module = sys.modules.get(lm.__module__) if lm is not None else None
    if module is None:
        return ()
    return tuple(cls for name, cls in vars(module).items()
                 if isinstance(cls, type) and cls is not lm and cls.__module__ == lm.__module__ and keep(name, cls))


def live_layers(model: nn.Module, state: PatchState, classes: Callable) -> tuple[int, int]:
    """(attention layers whose base model routes through `state`, attention layers in `model`)."""
    attention, base, _ = classes()
    total = len(find_modules(model, attention))
    live = sum(1 for b in find_modules(model, base) if routes_to(b.forward, state)
               for m in find_modules(b, attention) if routes_to(m.forward, state))
    return live, total


def make_update_causal_mask(original: Callable) -> Callable:
    """The mask entry of transformers 4.48-4.52 (no mask interface): `_update_causal_mask` hands attention the 2D
    mask, wrapped, with where the queries sit."""

    def _update_causal_mask(
        self: nn.Module, attention_mask: Any, input_tensor: Any = None, cache_position: Any = None,
        past_key_values: Any = None, *args: Any, **kwargs: Any,
    ) -> Any:
        if transformers_mask_in_graph(attention_mask) or current().plan.aside is not None:
            return original(self, attention_mask, input_tensor, cache_position, past_key_values, *args, **kwargs)
        past_len, fixed = cache_placement(past_key_values, cache_position)
        refuse_4d(attention_mask, fixed)
        return VarlenMask.for_forward(attention_mask, past_len, fixed)

    return dressed_as(_update_causal_mask, original)
