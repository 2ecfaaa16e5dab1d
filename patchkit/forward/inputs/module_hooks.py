"""Hooks inside a model that may read its batch's (B, S, H) layout: a forward they would see keeps that layout."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator, Optional

from torch import nn

from patchkit.warn import warn_user

# Frameworks whose hooks gather, move, record or re-derive weights and never read a batch's layout: ZeRO-3's and
# FSDP's gathers, torch's pruning and weight norms, transformers' output recorders (whose records patchkit repads),
# TRL's activation offloading, wandb's logging. Not transformers' NEFTune (its noise reads the shape), nor
# accelerate's context-parallel hook (it drops the mask).
SHAPE_FREE_FROM = ("deepspeed.runtime.zero.", "deepspeed.utils.nvtx", "torch.distributed.", "torch.nn.utils.",
                   "transformers.utils.output_capturing", "trl.models.activation_offloading", "wandb.")
# transformers' `enable_input_require_grads` and PEFT's and TRL's copies (mark an output as requiring grad); TRL's
# GRPO dtype cast of a tied embedding's output
SHAPE_FREE_NAMES = frozenset({"make_inputs_require_grads", "make_inputs_require_grad",
                              "cast_outputs_to_original_dtype"})
# PEFT's hooks carry per-row arguments to its layers for a forward's duration (a mixed-adapter batch's
# `adapter_names`, Activated LoRA's `alora_offsets`, Poly's `task_ids`, X-LoRA's scalings), read by row of the
# (B, S, H) batch: the padded layout serves them, unannounced
QUIET_FROM = ("peft.",)
MARK = "__patchkit_shape_free__"
_warned: set[str] = set()  # the hooks already named in this process


def shape_free(hook: Callable) -> Callable:
    """Mark `hook` (a forward or pre-forward hook of yours) as reading no shape of what it sees, so the forwards it
    sees still run their layers on one packed row of real tokens. Returns `hook`."""
    setattr(inspect.unwrap(hook), MARK, True)
    return hook


def _function(hook: Callable) -> Any:
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
    return getattr(fn, "__module__", "").startswith("deepspeed.runtime.zero.")


def reads_no_shape(hook: Callable) -> bool:
    """`hook` is known to read no shape: marked (`shape_free`), named, or a framework's (`SHAPE_FREE_FROM`)."""
    fn = _function(hook)
    if getattr(fn, MARK, False) or getattr(fn, "__name__", None) in SHAPE_FREE_NAMES or zero3_hook(hook):
        return True
    origin = getattr(fn, "__module__", None) or type(fn).__module__  # a callable object: its class's module
    return isinstance(origin, str) and origin.startswith(SHAPE_FREE_FROM)


def _hooks(module: nn.Module) -> Iterator[Callable]:
    yield from module._forward_pre_hooks.values()
    yield from module._forward_hooks.values()


def layout_hook(model: nn.Module, skip: Optional[nn.Module]) -> Optional[Callable]:
    """The first hook on a module inside `model` (itself, whose hooks see its repadded outputs, and `skip`, its input
    embedding, aside) that may read the batch's layout, else None."""
    for module in model.modules():
        if module is model or module is skip or not (module._forward_hooks or module._forward_pre_hooks):
            continue
        for hook in _hooks(module):
            if not reads_no_shape(hook):
                return hook
    return None


def keeps_layout(model: nn.Module, skip: Optional[nn.Module]) -> bool:
    """A hook inside `model` may read the (B, S, H) layout (`layout_hook`): the forward keeps it. Said once per hook,
    with where it sits and the fix, unless it is PEFT's (`QUIET_FROM`)."""
    hook = layout_hook(model, skip)
    if hook is None:
        return False
    fn = _function(hook)
    name = f"{getattr(fn, '__module__', None) or type(fn).__module__}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if not name.startswith(QUIET_FROM) and name not in _warned:
        _warned.add(name)
        where = next((n for n, m in model.named_modules() if any(h is hook for h in _hooks(m))), "?")
        warn_user(
            f"patchkit: a forward hook ({name}) on {type(model).__name__}'s '{where}' may read the batch's (B, S, H) "
            "layout, so the forwards it sees keep that layout in their layers (attention still patched, padding "
            "computed in the rest). If it reads no shape, mark it with patchkit.shape_free(hook) to run them on real "
            "tokens only; unpad='attention' keeps the layout without this warning."
        )
    return True
