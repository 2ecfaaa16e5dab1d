"""A patched family's attention is patchkit's for the module's lifetime, not for the span of one model forward.

Gradient checkpointing recomputes a decoder layer in backward, after the model's forward has returned; hooks and
re-entrant calls run a layer outside it too. So each patched attention module's own forward routes its call to
patchkit's registered attention name, on the patch's state, whenever the mask it receives is patchkit's
(`VarlenMask`), and the recompute sees the same mask object, with the same metadata, as the forward did. A mask
transformers built itself (a forward patchkit stepped aside for) goes to transformers' own attention, untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

from torch import nn

from patchkit.forward.context import current, within
from patchkit.forward.inputs.temperature import QUERY_SCALE, column_temperature, own_scaling_off
from patchkit.forward.liveness import is_compiling
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.install.patching import Replacement, dressed_as, unpatched
from patchkit.hooks.parallel.sequence_parallel import (
    refuse_shard_local,
    refuse_unfound,
    ulysses_active,
    ulysses_wrapper,
)

ROUTE_NAME = "patchkit"  # the registered attention name (no "flash", no "/"; attention_interface.ATTENTION_NAME)


@dataclasses.dataclass(frozen=True)
class Route:
    """What a routed call carries: the patch state serving it, the sequence-parallel wrapper (DeepSpeed Ulysses)
    registered under the model's own attention name, which the call must go through, and that name (None under
    patchkit's own), whose mask rules the served forward keeps."""

    state: Any
    ulysses: Optional[Callable] = None
    loaded: Optional[str] = None


def loads_flash_masks(name: Optional[str]) -> bool:
    """Whether a model loaded with attention `name` gets transformers' `flash_attention_mask` (flash-attn 2, 3, 4 and
    their hub kernels): a one-row mask with no padding is no mask there, and its flash attention then reads packed
    documents from restarting position_ids."""
    if name is None or name == ROUTE_NAME:
        return False
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: nothing loaded
        return False
    flash = getattr(masking_utils, "flash_attention_mask", None)  # 4.53+
    return flash is not None and masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.get(name) is flash


_FIELD = "_attn_implementation_internal"
_DIRECT: dict[type, bool] = {}  # per config class: may its attention name be read and written as a plain field


def _fields(config: Any) -> Optional[dict]:
    """`config`'s own fields, where its `_attn_implementation` is a property over `_attn_implementation_internal`
    and it has no sub-configs to pass a write on to (transformers 5.x's text configs): there a plain field read or
    write is all the property does, without its Python calls (a write validates: ~30 of them; a decode step's host
    cost). Read past the config's own `__getattribute__` (Python too). None elsewhere."""
    if is_compiling():  # dynamo traces the property, not object.__getattribute__ (a graph break in every layer)
        return None
    cls = type(config)
    direct = _DIRECT.get(cls)
    if direct is None:
        prop = inspect.getattr_static(cls, "_attn_implementation", None)
        direct = _DIRECT[cls] = isinstance(prop, property) and not getattr(cls, "sub_configs", None)
    if not direct:
        return None
    fields = object.__getattribute__(config, "__dict__")
    return fields if _FIELD in fields else None


def attn_name(config: Any) -> Optional[str]:
    """`config._attn_implementation` (None where the era has none)."""
    fields = _fields(config)
    return fields[_FIELD] if fields is not None else getattr(config, "_attn_implementation", None)


def names_patchkit(config: Any) -> bool:
    """`config` resolves attention to patchkit's name (a composite's per-part dict naming it counts)."""
    name = attn_name(config)
    return ROUTE_NAME in name.values() if isinstance(name, dict) else name == ROUTE_NAME


# id(config) -> the config, for every part of every model adopted by the name (as `named._built`, gone with it)
_adopted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def record_adopted(config: Any) -> None:
    """`config`'s model part serves patchkit's name alone (`hooks/name/named.adopt`, or a deepcopy of such a part)."""
    _adopted[id(config)] = config


def adopted(config: Any) -> bool:
    """`config` is one of an adopted model's parts (or of a deepcopy of one)."""
    return _adopted.get(id(config)) is config


_before: dict[int, tuple[weakref.ref, str]] = {}  # id(config) -> (the config, the name it had before patchkit's)


def record_before(config: Any, name: Any) -> None:
    """`config`'s model part had attention `name` before it was given patchkit's name (`named.watch`)."""
    if isinstance(name, str) and name != ROUTE_NAME:
        key = id(config)

        def forget(ref: weakref.ref) -> None:  # the config died: its entry goes, unless its id was reused since
            if _before.get(key, (None,))[0] is ref:
                del _before[key]

        _before[key] = (weakref.ref(config, forget), name)


def named_before(config: Any) -> Optional[str]:
    """The attention `config`'s part had before it was given patchkit's name, or None (built with it)."""
    entry = _before.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def set_attn_name(config: Any, name: Optional[str]) -> None:
    """`config._attn_implementation = name`, as a plain field write where that is all the property does."""
    fields = _fields(config)
    if fields is not None:
        fields[_FIELD] = name
    else:
        config._attn_implementation = name


_LOCKS: dict[int, threading.RLock] = {}  # per config (by id, dropped with it): who may write its attention name


def _lock(config: Any) -> Any:
    """The config's lock: a routed forward holds it while the config names patchkit, so a forward of another thread
    on the same model (a server's threads, nn.DataParallel's replicas, which share the config) neither reads
    patchkit's name in transformers' code nor restores the name under a forward still running; it waits its turn.
    Re-entrant: a forward's own layers and nested models route inside it. No lock where dynamo traces."""
    if is_compiling():
        return contextlib.nullcontext()
    key = id(config)
    lock = _LOCKS.get(key)
    if lock is None:
        lock = _LOCKS.setdefault(key, threading.RLock())
        with contextlib.suppress(TypeError):  # a config without weak references keeps its entry
            weakref.finalize(config, _LOCKS.pop, key, None)
    return lock


@contextlib.contextmanager
def routed(config: Any, state: Any) -> Iterator[None]:
    """Within the block, `config`'s attention (and masks) resolve to patchkit's name, served on `state`; the
    config's lock is held meanwhile (`_lock`)."""
    with _lock(config):
        name = attn_name(config)
        scope = contextlib.nullcontext()
        if state is not None:
            refuse_shard_local()
            outer = current().route
            if outer is not None and name == ROUTE_NAME:  # a layer inside a routed forward: the forward's route
                ulysses, loaded = outer.ulysses, outer.loaded
            else:  # under patchkit's own name transformers finds a wrapper itself
                ulysses = None if name == ROUTE_NAME else ulysses_wrapper(name)
                loaded = None if name == ROUTE_NAME else name
                if ulysses is None and name != ROUTE_NAME and ulysses_active():
                    raise refuse_unfound(name)
            scope = within(route=Route(state, ulysses, loaded))
        with scope:  # the name is written within the route: the config's watched property adopts nothing then
            set_attn_name(config, ROUTE_NAME)
            try:
                yield
            finally:
                set_attn_name(config, name)


def inside_route(config: Any, state: Any, mask: VarlenMask) -> bool:
    """A layer inside a forward already routed on `state` (its config and its mask say so): nothing to set per layer
    (a config write costs more than the attention call's own Python work on transformers 5.x). Read from the mask,
    not the forward's context: dynamo traces an attribute read, and breaks the graph on a contextvar's."""
    route = mask.route
    return route is not None and route.state is state and attn_name(config) == ROUTE_NAME


def routed_unless_inside(config: Any, state: Any, mask: VarlenMask) -> contextlib.AbstractContextManager:
    """`routed`, where the layer is not inside a forward already routed on `state` (`inside_route`)."""
    return contextlib.nullcontext() if inside_route(config, state, mask) else routed(config, state)


def current_method(module: nn.Module, attr: str = "forward") -> Callable:
    """`module.attr` as a function of (self, ...): the instance's own (a framework's `model.forward = ...`) if it
    has one, else its class's (transformers' own, under a class patch too: the instance's forwards then run and are
    counted on the instance patch alone, before and after the class patch's revert); what an instance patch wraps."""
    own = vars(module).get(attr)
    if own is None:  # the class's own function under any class patch of patchkit's: an instance patch stands alone
        return unpatched(getattr(type(module), attr))

    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return own(*args, **kwargs)

    signature = inspect.signature(own)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return dressed_as(method, own, signature.replace(parameters=[this, *signature.parameters.values()]))


def mask_argument(original: Callable) -> Callable[[tuple, dict], Any]:
    """A reader of the `attention_mask` argument of a call of `original` (positional or keyword), built once; of
    patchkit's mask among them where the family hands its layers a mapping of masks."""
    names = list(inspect.signature(original).parameters)
    index = names.index("attention_mask") - 1 if "attention_mask" in names else None  # after self

    def read(args: tuple, kwargs: dict) -> Any:
        if "attention_mask" in kwargs:
            mask = kwargs["attention_mask"]
        else:
            mask = args[index] if index is not None and index < len(args) else None
        if isinstance(mask, dict):  # a family's masks by use (ZAYA: {"causal": ..., "conv": ...}): the attention one
            return next((m for m in mask.values() if isinstance(m, VarlenMask)), mask)
        return mask

    return read


def make_attention_forward(original: Callable, state: Any, of_class: Optional[type] = None) -> Callable:
    """Wrap a family's attention forward: a call given patchkit's mask runs on `state` through the registered name
    (the family's own projections, norms, RoPE and cache update first); any other mask, transformers' attention.
    `of_class`: an instance patch's wrapper of that class's forward, which runs a forward a script sets on the class
    later in its place, as the module would unpatched (its model's forward steps aside for it:
    `module_hooks.own_attention_forward` reads `patchkit_runs`)."""
    read_mask = mask_argument(original)

    def runs() -> Callable:
        return unpatched(of_class.forward) if of_class is not None else original

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = original if of_class is None else runs()
        mask = read_mask(args, kwargs)
        if not isinstance(mask, VarlenMask):
            return run(self, *args, **kwargs)
        scales = column_temperature(self, mask, kwargs.get("hidden_states", args[0] if args else None))
        if scales is not None:  # Llama 4's NoPE layer on a packed row: its temperature by the padded columns
            with own_scaling_off(self), routed_unless_inside(self.config, state, mask):
                return run(self, *args, **{**kwargs, QUERY_SCALE: scales})
        if inside_route(self.config, state, mask):
            return run(self, *args, **kwargs)
        with routed(self.config, state):
            return run(self, *args, **kwargs)

    forward.__patchkit_route__ = state  # type: ignore[attr-defined]
    dressed = dressed_as(forward, original)
    dressed.patchkit_runs = runs  # type: ignore[attr-defined]
    # Frameworks that rewrite the attention forward from its source (axolotl's LoRA kernels, unsloth) read it with
    # inspect.getsource, which follows __wrapped__: they find the family's own code, not this wrapper's.
    dressed.__wrapped__ = original  # type: ignore[attr-defined]
    return dressed


def rerouting(attention: type, replacement: Replacement, state: Any) -> Callable[[], None]:
    """A check for the base model's forward: when code set its own `attention.forward` on the class after the patch
    (axolotl's LoRA kernels and unsloth exec a rewritten copy of the family's forward and set it there), that forward
    is wrapped in turn, so its calls route to patchkit for the module's lifetime, checkpoint recomputes included;
    revert then puts the framework's forward back, as the class would be without patchkit."""

    def keep() -> None:
        forward = vars(attention).get("forward")
        if forward is replacement.new or forward is None or routes_to(forward, state):
            return
        replacement.original = forward
        replacement.new = make_attention_forward(forward, state)
        attention.forward = replacement.new

    return keep


def routes_to(forward: Any, state: Any) -> bool:
    """True when `forward` (bound or not) is a routing wrapper on `state`, or an instance's wrapper that calls its
    class's method at call time (the registered name's, `named.wrapped`) where that one is."""
    function = getattr(forward, "__func__", forward)
    defers = getattr(function, "__patchkit_defers__", None)
    if defers is not None and hasattr(forward, "__self__"):
        return routes_to(getattr(type(forward.__self__), defers, None), state)
    return getattr(function, "__patchkit_route__", None) is state


def is_patched_forward(forward: Any) -> bool:
    """True when `forward` (bound or not) is one of patchkit's attention or model forwards on some patch state."""
    return getattr(getattr(forward, "__func__", forward), "__patchkit_route__", None) is not None
