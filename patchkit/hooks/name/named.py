"""Models opted in by attn_implementation="patchkit" alone are adopted where they get the name, not found up the stack.

Under the registered name no patch wraps a model's class, yet its mask function must know what only the causal LM's
call shows (labels predicted from padding, generate()'s right-padded prefill) and tell generate()'s masks, made
before the model runs, from the model's own. So patchkit watches the three places a model gets the name (built with
it, `set_attn_implementation`, the config's `_attn_implementation` property) and adopts it there: its causal LM's
`forward` and its `prepare_inputs_for_generation` become instance wrappers (`BoundPatch`: they follow deepcopies and
pickle as the originals) that put what they see on the forward's context. A model named where patchkit could not
see it (a config field written past the property, a model built before patchkit was imported) is not adopted; its
forwards step aside, exact and warned (`named_unseen`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import sys
import weakref
from typing import Any, Callable, Optional

from torch import nn

from patchkit.forward.context import current, within
from patchkit.forward.documents import APART, kept_apart
from patchkit.forward.inputs.arguments import (
    check_caller_documents,
    check_one_cache,
    given_cache,
    input_tokens,
    renames_past_key_values,
    weights_wanted,
    window_over_hole,
)
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.hooks.attention.compressed_kv import make_compressor_forward
from patchkit.hooks.attention.eager import supports_sdpa
from patchkit.hooks.attention.sparse_indexer import make_indexer_forward
from patchkit.hooks.decide import self_check
from patchkit.hooks.decide.outer_caller import LM_WRAPPERS
from patchkit.hooks.decide.plan import joined_by_transformers
from patchkit.hooks.decide.step_aside import lm_cause, misfit_cause, mixer_cause
from patchkit.hooks.decide.task_reads import CHOICE, choice_cause, task_cause, task_of
from patchkit.hooks.forwards.lm_forward import takes_logits_to_keep
from patchkit.hooks.forwards.mixer_rows import hand_rows, make_mixer_forward
from patchkit.hooks.forwards.model_forward import bound_call
from patchkit.hooks.generation import padded_slots
from patchkit.hooks.generation.slots_mask import static_layers
from patchkit.hooks.install.patching import BoundPatch, Replacement, apply_replacements, bound_replacement, dressed_as
from patchkit.hooks.install.registry import TABLE, pools_by_column
from patchkit.hooks.install.routing import (
    ROUTE_NAME,
    adopted,
    attn_name,
    is_patched_forward,
    named_before,
    names_patchkit,
    record_adopted,
    record_before,
)

_built: dict[int, weakref.WeakSet] = {}  # id(config) -> the model parts built with it (the entry goes with the config)
_watching: list[Replacement] = []
_ready: list[Callable[[], Any]] = []  # `watch`'s: what a model getting the name needs made first
# a causal LM class -> (its **kwargs name, its binder of a call's arguments, whether it takes logits_to_keep)
_binders: dict[type, tuple] = {}
# a base model class -> its **kwargs name and its binder of a call's arguments (`base_forward`)
_base_binders: dict[type, tuple] = {}
SEEN = "_patchkit_seen"  # every model built while patchkit watches holds a `Seen` here


class Seen:
    """A model part's record that patchkit saw it built (and adopted it, `named`): a deepcopy of the part carries
    one for the copy, so a copy named later is found; a pickle carries none (it loads where patchkit is not
    installed)."""

    __slots__ = ("config", "module", "named")

    def __init__(self, config: Any, module: nn.Module, named: bool) -> None:
        self.config, self.module, self.named = config, weakref.ref(module), named
        if id(config) not in _built:
            _built[id(config)] = weakref.WeakSet()
            weakref.finalize(config, _built.pop, id(config), None)
        _built[id(config)].add(module)
        if named:
            record_adopted(config)

    def __deepcopy__(self, memo: dict) -> Any:
        module = self.module()  # the part being copied: its copy is in `memo` already
        if module is None:
            return False
        config = copy.deepcopy(self.config, memo)
        record_before(config, named_before(self.config))  # the copy steps aside onto the same attention
        return Seen(config, copy.deepcopy(module, memo), self.named)

    def __reduce__(self) -> tuple:
        return bool, ()


def seen(module: nn.Module, named: bool = False) -> None:
    """Record that patchkit saw `module` (a model part) built, and adopted it where `named`."""
    record = vars(module).get(SEEN)
    if not isinstance(record, Seen) or record.config is not module.config or (named and not record.named):
        setattr(module, SEEN, Seen(module.config, module, named))


def adopt(model: nn.Module) -> None:
    """Count `model`'s parts as named and wrap its causal LMs' calls and generate()'s input preparation (once); a
    transformers newer than the tested one is said here, at the line that built or named the model."""
    self_check.untested()
    pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    if not class_served(model, pretrained):  # else its forwards run on the class patch's state, never the route's
        for make in _ready:  # (whose backend would be chosen, and its fallback warned, for nothing)
            make()
    replacements: list[Replacement] = []
    wrapping: set[int] = set()  # the layers wrapped by this adoption (a causal LM's and its base model's are the same)
    for m in (m for root in (model, *sharing(model, pretrained)) for m in root.modules()):
        if not isinstance(m, pretrained):
            continue
        seen(m, named=True)
        supports_sdpa(type(m.config))  # read here, on the host: a compiled forward's step aside reads it in its graph
        reads = "labels" in inspect.signature(type(m).forward).parameters or task_of(type(m)) is not None
        if reads and not _ours(m, "forward"):
            replacements.append(wrapped(m, "forward", lm_forward, "tells masks of its labels"))
        elif not _ours(m, "forward"):
            replacements.append(wrapped(m, "forward", base_forward, "tells masks of its call"))
        if hasattr(m, "prepare_inputs_for_generation") and not _ours(m, "prepare_inputs_for_generation"):
            replacements.append(wrapped(m, "prepare_inputs_for_generation", preparation, "masks made ahead"))
        replacements += mixers_apart(m, wrapping) + layers_kept(m, wrapping)
    apply_replacements(replacements)


def built(config: Any) -> list[nn.Module]:
    """The live model parts built with `config` (and holding it still)."""
    return [m for m in _built.get(id(config), ()) if getattr(m, "config", None) is config]


def sharing(model: nn.Module, pretrained: type) -> list[nn.Module]:
    """The outermost other models built on a config one of `model`'s parts holds (a policy and its reference): the
    name written to that config names them too."""
    inside = {id(m) for m in model.modules()}
    others = {id(o): o for m in model.modules() if isinstance(m, pretrained) for o in built(m.config)
              if id(o) not in inside}
    held = {id(sub) for o in others.values() for sub in o.modules() if sub is not o}
    return [o for key, o in others.items() if key not in held]


def class_served(model: nn.Module, pretrained: type) -> bool:
    """Whether every part of `model` that names patchkit is, or holds, or lies inside a base model whose class a
    class patch wraps (`apply_patch()` before `from_pretrained(..., attn_implementation="patchkit")`)."""
    parts = [m for m in model.modules() if isinstance(m, pretrained) and names_patchkit(m.config)]
    patched = {id(m) for m in parts if is_patched_forward(type(m).forward)}
    inside = {id(sub) for m in parts if id(m) in patched for sub in m.modules()}
    return bool(patched) and all(id(m) in inside or any(id(sub) in patched for sub in m.modules()) for m in parts)


def mixers_apart(part: nn.Module, wrapping: set[int]) -> list[Replacement]:
    """A hybrid's token mixers (`patches/table.py` `ROW_MIXERS`) wrapped on the instance, so that packed documents
    with no mask run each from a zero state, as attention keeps them apart (`mixer_rows.document_rows`); `wrapping`:
    the ids of the modules wrapped so far, to which these are added."""
    classes = importlib.import_module(TABLE).mixer_classes(getattr(part.config, "model_type", None))
    if not classes:
        return []
    for mixer in classes:
        hand_rows(sys.modules[mixer.__module__])
    return [wrapped(m, "forward", functools.partial(make_mixer_forward, like=type(m).forward), "packed documents apart")
            for m in unwrapped(part, classes, wrapping)]


# the layers patchkit wraps on a model adopted by the name, as the class patch wraps their class: the table's function
# naming their classes for a family, the wrapper, what it is for
LAYER_WRAPPERS = (
    ("indexer_classes", make_indexer_forward, "keeps every key when served"),  # a sparse attention's (`sparse_indexer`)
    ("compressor_classes", make_compressor_forward, "hands its entries' bias on"),  # DeepSeek-V4's (`compressed_kv`)
)


def layers_kept(part: nn.Module, wrapping: set[int]) -> list[Replacement]:
    """`part`'s layers of the kinds `LAYER_WRAPPERS` names (`patches/table.py` `SPARSE_INDEXERS`, `COMPRESSORS`)
    wrapped on the instance, as the class patch's are."""
    table, model_type = importlib.import_module(TABLE), getattr(part.config, "model_type", None)
    return [wrapped(m, "forward", functools.partial(make, like=type(m).forward), why)
            for classes_of, make, why in LAYER_WRAPPERS
            for m in unwrapped(part, getattr(table, classes_of)(model_type), wrapping)]


def unwrapped(part: nn.Module, classes: tuple[type, ...], wrapping: set[int]) -> list[nn.Module]:
    """`part`'s modules of `classes` that no adoption wrapped yet, added to `wrapping` (the ids wrapped so far)."""
    if not classes:
        return []
    found = [m for m in part.modules() if isinstance(m, classes) and not _ours(m, "forward") and id(m) not in wrapping]
    wrapping.update(map(id, found))
    return found


def _copied(_module: nn.Module, _attr: str) -> None:
    """A deepcopy of an adopted module keeps its wrappers (its `Seen` record adopts the copy)."""


def _ours(module: nn.Module, attr: str) -> bool:
    own = vars(module).get(attr)
    return isinstance(own, BoundPatch) and own.on_copy is _copied


def wrapped(module: nn.Module, attr: str, make: Callable[[Callable], Callable], what: str) -> Replacement:
    """`module.attr` on this instance replaced by `make`'s wrapper of what it is now, as introspection sees the
    class's own (generate() and the Trainer read its parameters)."""
    defers = vars(module).get(attr) is None  # it calls its class's method at call time: routed as that one is
    wrapper = dressed_as(make(present(module, attr)), getattr(type(module), attr))
    if defers:
        wrapper.__patchkit_defers__ = attr  # type: ignore[attr-defined] # `routing.routes_to` reads the class's
    return bound_replacement(wrapper, module, attr, f"{type(module).__name__}.{attr} ({what})", _copied)


def present(module: nn.Module, attr: str) -> Callable:
    """`module.attr` as a function of (self, ...): the instance's own (accelerate's hooks), kept on the instance so
    that a deepcopy calls its own copy of it, else its class's at call time (a class patch applied later included)."""
    own = vars(module).get(attr)
    if own is None:
        return lambda self, *args, **kwargs: getattr(type(self), attr)(self, *args, **kwargs)
    key = f"_patchkit_own_{attr}"
    setattr(module, key, own)
    return lambda self, *args, **kwargs: vars(self)[key](*args, **kwargs)


def lm_forward(call: Callable) -> Callable:
    """A causal LM's (or a task head's) forward that, under patchkit's name, tells the masks what of its call reads
    padding positions (`step_aside.lm_cause`, `task_reads.task_cause`). Inside a graph that may not break it only
    passes the call on: a padded batch under the name alone steps aside there by its mask (`graph_plan`)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if in_one_graph() or not (names_patchkit(self.config) or names_patchkit(text_config(self.config))):
            return call(self, *args, **kwargs)  # a multimodal model named per part: its language model's name
        binder = _binders.get(type(self))
        if binder is None:
            signature, var_kw, bind, _ = bound_call(type(self).forward)
            unread = "cache" in signature.parameters and not renames_past_key_values(type(self).forward)
            binder = _binders[type(self)] = (var_kw, bind, takes_logits_to_keep(signature), unread,
                                             CHOICE in signature.parameters)
        arguments = binder[1](self, args, kwargs)
        extra = arguments.get(binder[0], {}) if binder[0] else {}
        check_one_cache(arguments)  # PEFT's prefix beside generate()'s cache: refused by its name, as under a patch
        if binder[3] and extra.get("past_key_values") is not None:
            cause = "unread_cache"  # transformers runs this forward on no past: so does its step aside
        elif weights_wanted(self.config, arguments, extra):
            cause = "output_attentions"  # the attention it ran on before the name gives them, as unnamed
        elif task_of(type(self)) is not None:  # a task head reads its own positions (`task_reads`)
            cause = task_cause(self, arguments) or current().lm_cause
        else:  # or, inside another LM's call (Llama 4's multimodal model around its causal LM), what that one reads
            choice = choice_cause(arguments) if binder[4] else None  # GPT-2's multiple-choice head's position
            cause = lm_cause(arguments, extra, self.training, binder[2], self) or choice or current().lm_cause
        if cause is not None:
            with within(lm_cause=cause):
                return call(self, *args, **kwargs)
        check_caller_documents(arguments, extra)
        joined = joined_by_transformers(self.base_model, arguments, extra)  # None under most masks
        apart = APART[0]
        out = call(self, *args, **kwargs)
        if joined is not None and APART[0] > apart:  # its layers kept the caller's packed documents apart
            kept_apart(joined)
        return out

    LM_WRAPPERS.add(forward.__code__)  # its frame tells a base model's caller check that this call is told
    return forward


def base_forward(call: Callable) -> Callable:
    """A base model's (or any other named part's) forward under patchkit's name, where no causal LM around it told a
    cause: asked for attention weights (output_attentions) it steps aside onto the attention it had before the name,
    as unnamed; in a family whose mixers read padding positions (`patches/table.py` `PADDING_INTO_MIXERS`) it tells
    the masks where this call's mask and position_ids would have its recurrent layers or compressors read what
    transformers computes at padding (`step_aside.mixer_cause`): the mask interface is handed no position_ids."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling() or not names_patchkit(self.config):
            return call(self, *args, **kwargs)  # traced: no break here (dynamo fails to resume into transformers'
            # deprecate_kwarg wrapper of the base model's forward, torch 2.13); the mask calls tell a mixer's cause
        binder = _base_binders.get(type(self))
        if binder is None:
            binder = _base_binders[type(self)] = bound_call(type(self).forward)[1:3]
        arguments = binder[1](self, args, kwargs)
        # a forward that steps aside reads a cache's padding slots as one run patched would
        padded_slots.check(given_cache(arguments), arguments.get("attention_mask"), input_tokens(arguments))
        if current().lm_cause is not None:
            return call(self, *args, **kwargs)
        extra = arguments.get(binder[0], {}) if binder[0] else {}
        cause = "output_attentions" if weights_wanted(self.config, arguments, extra) else None
        cause = cause or mixer_cause(self.config, arguments)
        cause = cause or misfit_cause(arguments, given_cache(arguments), self.training)
        if cause is None and pools_by_column(self.config) and window_over_hole(self.config, arguments.get(
                "attention_mask")):  # told here, not at the mask call: its layers append their entries' bias to
            cause = "window_over_padding_hole"  # the mask, a new tensor that carries no cause of the mask call's
        if cause is None:
            out = call(self, *args, **kwargs)
            padded_slots.marked_by(out, arguments)  # its layers ran the padded batch: its padding rows differ
            return out
        with within(lm_cause=cause):
            return call(self, *args, **kwargs)

    return forward


def preparation(call: Callable) -> Callable:
    """generate()'s preparation of a step's inputs: under patchkit's name, the masks it builds (a static cache's, before
    the model runs) know they are made ahead and whether patchkit places the cache they are for."""

    def prepare(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not names_patchkit(self.config):
            return call(self, *args, **kwargs)
        with within(generating=static_layers(given_cache(kwargs)) is not None):
            return call(self, *args, **kwargs)

    return prepare


def watch(ready: Optional[Callable[[], Any]] = None) -> None:
    """Watch where models get patchkit's name, from now on in this process (idempotent). `ready`: called on the host
    whenever a model gets the name (the route's state, made before any forward, the first of which may be traced)."""
    if ready is not None and ready not in _ready:
        _ready.append(ready)
    if _watching:
        return
    pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    configs = importlib.import_module("transformers.configuration_utils").PretrainedConfig
    post_init, replacements = pretrained.post_init, []

    def watched_post_init(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = post_init(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if config is not None:
            if names_patchkit(config) or names_patchkit(text_config(config)):
                adopt(self)
            else:
                seen(self)
        return out

    replacements.append(Replacement(pretrained, "post_init", dressed_as(watched_post_init, post_init)))
    setter = getattr(pretrained, "set_attn_implementation", None)  # transformers 4.54+
    if setter is not None:
        def watched_setter(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            parts = [m.config for m in self.modules() if isinstance(m, pretrained)]
            before = [attn_name(config) for config in parts]
            out = setter(self, *args, **kwargs)
            for config, name in zip(parts, before):
                if names_patchkit(config):
                    record_before(config, name)  # what a forward stepped aside runs (`eager.aside_name`)
            if any(names_patchkit(m.config) for m in self.modules() if isinstance(m, pretrained)):
                adopt(self)
            return out

        replacements.append(Replacement(pretrained, "set_attn_implementation", dressed_as(watched_setter, setter)))
    prop = inspect.getattr_static(configs, "_attn_implementation", None)
    if isinstance(prop, property) and prop.fset is not None:
        replacements.append(Replacement(configs, "_attn_implementation", watched_property(prop)))
    apply_replacements(replacements)
    _watching.extend(replacements)


def watched_property(prop: property) -> property:
    """The config's `_attn_implementation` property, adopting the model built with the config when it is named
    (`model.config._attn_implementation = "patchkit"`); never inside a trace or a routed forward (patchkit's own
    writes)."""

    def fset(config: Any, value: Any) -> None:
        before = attn_name(config) if value == ROUTE_NAME and not is_compiling() else None
        prop.fset(config, value)
        if is_compiling() or current().route is not None or not names_patchkit(config) or adopted(config):
            return
        models = built(config)  # built models named (not one being built, whose config passes through
        if models:  # transformers' default first); `adopt` adopts every other model built on it too
            record_before(config, before)
            adopt(models[0])

    return property(prop.fget, fset, prop.fdel, prop.__doc__)


def text_config(config: Any) -> Any:
    """A composite config's text part (itself elsewhere, or where the config cannot name one)."""
    get = getattr(config, "get_text_config", None)
    try:
        return get() if callable(get) else config
    except ValueError:  # several text parts: each part's own model is adopted by its own post_init
        return config
