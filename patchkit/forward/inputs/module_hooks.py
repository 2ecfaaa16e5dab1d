"""The hooks a model carries, read without deciding: which may read a batch's (B, S, H) layout, which read none."""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from typing import Any, Callable, Iterator, Optional

from torch import nn

from patchkit.warn import warn_user

# Frameworks whose hooks gather, move, record or re-derive weights and never read a batch's layout: ZeRO-3's and
# FSDP's gathers, torch's pruning and weight norms, transformers' output recorders (whose records patchkit repads),
# TRL's activation offloading, wandb's logging. Not transformers' NEFTune (its noise reads the shape), nor
# accelerate's context-parallel hook (it drops the mask).
SHAPE_FREE_FROM = ("deepspeed.runtime.zero.", "deepspeed.utils.nvtx", "torch.distributed.", "torch.nn.utils.",
                   "torch.utils.module_tracker", "transformers.utils.output_capturing",
                   "trl.models.activation_offloading", "wandb.")
# transformers' `enable_input_require_grads` and PEFT's and TRL's copies (mark an output as requiring grad); TRL's
# GRPO dtype cast of a tied embedding's output
SHAPE_FREE_NAMES = frozenset({"make_inputs_require_grads", "make_inputs_require_grad",
                              "cast_outputs_to_original_dtype"})
MARK = "__patchkit_shape_free__"
# PEFT's hooks carry per-row arguments to its layers for a forward's duration (a mixed-adapter batch's
# `adapter_names`, Activated LoRA's `alora_offsets`, Poly's `task_ids`, X-LoRA's scalings), read by row of the
# (B, S, H) batch: the padded layout serves them, unannounced
QUIET_FROM = ("peft.",)
_warned: set[str] = set()  # the hooks already named in this process


def shape_free(hook: Callable) -> Callable:
    """Mark `hook` (a forward or pre-forward hook of yours: a function, a bound method, a partial or a callable
    object) as reading no shape of what it sees, so the forwards it sees still run their layers on one packed row of
    real tokens. A method or a partial marks the function behind it. Returns `hook`."""
    setattr(function_of(hook), MARK, True)
    return hook


def function_of(hook: Callable) -> Any:
    """The function behind `hook`: unwrapped, out of its partials, a bound method's function."""
    fn = inspect.unwrap(hook)
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__func__", fn)


def input_embedding(model: nn.Module) -> Optional[nn.Module]:
    """The model's input embedding, None where it names none."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def zero3_hook(hook: Callable) -> bool:
    """`hook` is DeepSpeed ZeRO-3's (it gathers or releases a module's parameters)."""
    fn = inspect.unwrap(hook)
    if getattr(fn, "__module__", None) == "deepspeed.utils.nvtx":  # instrument_w_nvtx's wrapper keeps no __wrapped__
        fn = next((c.cell_contents for c in fn.__closure__ or () if callable(c.cell_contents)), fn)
    return origin_of(fn).startswith("deepspeed.runtime.zero.")


def fsdp2_hook(hook: Callable) -> bool:
    """`hook` is FSDP2's (`fully_shard`: it gathers a unit's parameters around its modules' forwards)."""
    return origin_of(inspect.unwrap(hook)).startswith("torch.distributed.fsdp._fully_shard.")


def reads_no_shape(hook: Callable) -> bool:
    """`hook` is known to read no shape: marked (`shape_free`), named, or a framework's (`SHAPE_FREE_FROM`)."""
    fn = function_of(hook)
    if getattr(fn, MARK, False) or getattr(fn, "__name__", None) in SHAPE_FREE_NAMES or zero3_hook(hook):
        return True
    return origin_of(fn).startswith(SHAPE_FREE_FROM)


def origin_of(fn: Any) -> str:
    """The module `fn` (a `function_of` a hook) was defined in; a callable object's, its class's."""
    origin = getattr(fn, "__module__", None) or type(fn).__module__
    return origin if isinstance(origin, str) else ""


# An attention module, by its class's or a base's name, transformers' (LlamaAttention, GPT2Attention,
# LlamaFlashAttention2 before 4.48)
ATTENTION_CLASS = re.compile(r"Attention\d*$")
# Where an attention forward serves the layer it is handed, packed row included: transformers' own (which call the
# attention function patchkit serves), patchkit's (its patch modules and routing wrappers), torch's
TRUSTED_FORWARDS = ("transformers.", "patchkit.", "torch.")
_seen: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Optional[str]]] = weakref.WeakKeyDictionary()


def own_attention_forward(model: nn.Module) -> Optional[str]:
    """The first attention module in `model` whose forward is not transformers' or patchkit's, nor a copy of
    transformers' (`dispatches`): a subclass's, one a script put on the class or on the module, as old FastChat and
    xformers patches did, PEFT's adaption prompt; as "<its qualified name> on '<module path>'", else None. Such a
    forward may read the (B, S, H) layout and the 4D mask transformers hands it, and need not call the attention
    function patchkit serves. Walked once per model, again where an attention class's forward changed since (a
    script's patch of the class)."""
    seen = _seen.get(model)
    if seen is not None and all(cls.forward is forward for cls, forward in seen[0]):
        return seen[1]
    classes: dict[type, Any] = {}
    found = None
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in classes and not any(ATTENTION_CLASS.search(c.__name__) for c in cls.__mro__):
            continue
        classes[cls] = cls.forward
        fn = forward_function(module)
        if found is None and not origin_of(fn).startswith(TRUSTED_FORWARDS) and not dispatches(fn):
            found = f"{described(fn)} on '{name}'"
    _seen[model] = (tuple(classes.items()), found)
    return found


# Whose forwards around a decoder layer or as the input embedding read no layout: transformers' and patchkit's,
# torch's (checkpoint and FSDP wrappers, compiled modules), and the frameworks' that wrap layers or embeddings
FRAMEWORKS = (*TRUSTED_FORWARDS, "peft.", "deepspeed.", "accelerate.", "bitsandbytes.")
_layers: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Optional[str]]] = weakref.WeakKeyDictionary()


def forward_function(module: nn.Module) -> Any:
    """The function `module`'s call runs: an instance's forward, else its class's (under accelerate's device-map
    hook, the forward it wraps; under an instance patch's attention wrapper, what its class has now)."""
    forward = module.__dict__.get("forward", type(module).forward)
    if isinstance(forward, functools.partial) and hasattr(module, "_old_forward"):
        forward = module._old_forward
    runs = getattr(forward, "patchkit_runs", None)
    return function_of(runs() if callable(runs) else forward)


def described(fn: Any) -> str:
    """"<module>.<qualname>" of a function (`function_of` a hook or a forward)."""
    return f"{origin_of(fn)}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def own_module(module: Optional[nn.Module]) -> bool:
    """`module`'s forward is none of the frameworks' (`FRAMEWORKS`) nor marked `shape_free`: a script's own, which
    may read the layout."""
    fn = forward_function(module) if module is not None else None
    return fn is not None and not getattr(fn, MARK, False) and not origin_of(fn).startswith(FRAMEWORKS)


def own_layer(model: nn.Module) -> Optional[str]:
    """The first decoder layer of `model` (an item of one of its ModuleLists) whose forward is a script's own
    (`own_module`: repeng's steering wrapper reads position_ids and the (B, S, H) output), as "<its forward> on
    '<path>'", else None. Read again where the lists' items changed."""
    lists = [(name, child) for name, child in model._modules.items() if isinstance(child, nn.ModuleList)]
    items = tuple(layer for _, layers in lists for layer in layers)
    seen = _layers.get(model)
    if seen is not None and len(seen[0]) == len(items) and all(a is b for a, b in zip(seen[0], items)):
        return seen[1]
    found = next((f"{described(forward_function(layer))} on '{name}.{i}'" for name, layers in lists
                  for i, layer in enumerate(layers) if own_module(layer)), None)
    _layers[model] = (items, found)
    return found


# Modules whose output at one row depends on every row they are handed: torch's dynamically quantized ones scale
# their input by the whole tensor's range (`torch.ao.quantization.quantize_dynamic`), padding's included
MIXING_FROM = ("torch.ao.nn.quantized.dynamic.", "torch.nn.quantized.dynamic.")


_mixing: weakref.WeakKeyDictionary[nn.Module, Optional[str]] = weakref.WeakKeyDictionary()


def reads_every_row(module: nn.Module) -> bool:
    """`module` is of `MIXING_FROM`, or bitsandbytes' LLM.int8() layer with an outlier threshold (`load_in_8bit`, 6.0
    by default): it computes in full precision the input columns where any row it is handed passes the threshold."""
    kind = type(module)
    return kind.__module__.startswith(MIXING_FROM) or kind.__name__ == "Linear8bitLt" and kind.__module__.startswith(
        "bitsandbytes.") and getattr(getattr(module, "state", None), "threshold", 0.0) > 0.0


def row_mixing_module(model: nn.Module) -> Optional[str]:
    """The first module in `model` whose output at a row depends on the other rows it is handed (`MIXING_FROM`), as
    "<its class> on '<module path>'", else None: handed the packed row, it gives other numbers at real tokens. Walked
    once per model (quantized before its first forward, as `quantize_dynamic` returns a new model)."""
    if model in _mixing:
        return _mixing[model]
    found = next((f"{type(m).__name__} on '{name}'" for name, m in model.named_modules() if reads_every_row(m)), None)
    _mixing[model] = found
    return found


def dispatches(fn: Any) -> bool:
    """`fn` is a copy of transformers' attention forward (axolotl's LoRA kernels exec a rewritten one and set it on
    the class): it calls the attention function `ALL_ATTENTION_FUNCTIONS` names, which patchkit serves."""
    return "ALL_ATTENTION_FUNCTIONS" in getattr(getattr(fn, "__code__", None), "co_names", ())


def hooks_on(module: nn.Module) -> Iterator[Callable]:
    """`module`'s own forward pre-hooks, its forward hooks, then its backward pre-hooks and backward hooks (which see
    the gradients of what it was handed and gave: the packed row's, where it ran on it)."""
    yield from module._forward_pre_hooks.values()
    yield from module._forward_hooks.values()
    yield from module._backward_pre_hooks.values()
    yield from module._backward_hooks.values()


def hooked(module: nn.Module) -> bool:
    """`module` carries a hook of its own (`hooks_on`), read off its dicts."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def global_hooks() -> Iterator[Callable]:
    """The hooks on every module (`torch.nn.modules.module.register_module_forward_pre_hook` and `_hook`: torch's
    ModuleTracker, FlopCounterMode's, a profiler's; and the backward ones), pre-hooks first."""
    yield from nn.modules.module._global_forward_pre_hooks.values()
    yield from nn.modules.module._global_forward_hooks.values()
    yield from nn.modules.module._global_backward_pre_hooks.values()
    yield from nn.modules.module._global_backward_hooks.values()


def layout_hook(model: nn.Module, skip: Optional[nn.Module]) -> Optional[Callable]:
    """The first hook on every module, or on a module inside `model` (itself, whose hooks see its repadded outputs,
    and `skip`, its input embedding, aside), that may read the batch's layout, else None."""
    for hook in global_hooks():
        if not reads_no_shape(hook):
            return hook
    for module in model.modules():
        hook = None if module is model or module is skip else layout_hook_on(module)
        if hook is not None:
            return hook
    return None


def layout_hook_on(module: nn.Module) -> Optional[Callable]:
    """The first of `module`'s own hooks that may read the batch's layout, else None."""
    if not hooked(module):
        return None
    return next((hook for hook in hooks_on(module) if not reads_no_shape(hook)), None)


def head_hook(lm: nn.Module, base_name: str) -> Optional[Callable]:
    """The first hook on every module, or on a module of the causal LM `lm` outside its base model (the child
    `base_name`): its head, which sees the rows patchkit hands it, that may read the batch's layout, else None.
    Read off the modules' own dicts (every forward asks, decode steps too)."""
    hook = next((hook for hook in global_hooks() if not reads_no_shape(hook)), None)  # on the head too
    if hook is not None:
        return hook
    todo = [child for name, child in lm._modules.items() if name != base_name and child is not None]
    while todo:
        module = todo.pop()
        hook = layout_hook_on(module)
        if hook is not None:
            return hook
        todo.extend(child for child in module._modules.values() if child is not None)
    return None


def said_own_layer(found: Optional[str]) -> bool:
    """`found` (`own_layer`), a decoder layer a script's forward wraps, may read the layout: said once, True."""
    if found is None:
        return False
    if found not in _warned:
        _warned.add(found)
        warn_user(f"patchkit: {found}, a forward of the script's own around a decoder layer, may read the batch's "
                  "(B, S, H) layout and position_ids, so the forwards keep that layout in their layers (attention "
                  "still patched, padding computed in the rest). If it reads no shape, mark its forward with "
                  "patchkit.shape_free(...) to run them on real tokens only; unpad='attention' keeps the layout "
                  "without this warning.")
    return True


def said_layout(model: nn.Module, hook: Optional[Callable]) -> bool:
    """`hook`, found on a module of `model` (or on every module), may read the batch's layout: said once per hook
    (unless it is PEFT's), True; no hook: False."""
    if hook is None:
        return False
    fn = function_of(hook)
    name = described(fn)
    if not name.startswith(QUIET_FROM) and name not in _warned:
        _warned.add(name)
        where = next((f"on {type(model).__name__}'s '{n}'" for n, m in model.named_modules()
                      if any(h is hook for h in hooks_on(m))), "on every module (a global hook)")
        warn_user(
            f"patchkit: a hook ({name}) {where} may read the batch's (B, S, H) "
            "layout, so the forwards it sees keep that layout in their layers (attention still patched, padding "
            "computed in the rest). If it reads no shape, mark it with patchkit.shape_free(hook) to run them on real "
            "tokens only; unpad='attention' keeps the layout without this warning."
        )
    return True
