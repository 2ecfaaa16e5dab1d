"""Whose hooks hold the LM head's weight (DeepSpeed ZeRO-3, FSDP2, accelerate's device map) and `held`, which runs
what reads that weight as the forward of the module they hold it on, so that they gather, place or load it for it.

Under DeepSpeed ZeRO-3 each rank holds a shard of the head's weight, gathered by DeepSpeed's hooks around the head's
forward and again before its backward; under FSDP2, where the head is a unit of its own or of one with the final
norm (accelerate's FSDP2 preparation), a DTensor shard outside that unit's forwards; under accelerate's device-map
hook (a model dispatched across devices, or offloaded), on its device, or offloaded between forwards. Whatever reads
the weight for the fused loss (`fused_head.py`: the probes, the check, the loss) runs as that module's forward.
Under FSDP2 and ZeRO-3 the loss, the probes and the check run in the family's own call of the head (`in_its_call`),
the one call an unpatched forward makes: every rank then gathers and reduces the head in the same order, fused or
not.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from patchkit.forward.inputs.module_hooks import fsdp2_hook, hooked, hooks_on, zero3_hook
from patchkit.hooks.install.forward_source import accelerate_forward


class Holding(Protocol):
    """What `held` reads of a fused head (`fused_head.FusedHead`)."""

    linear: nn.Linear
    hooks: str
    holder: nn.Module

    def adapters(self) -> list[nn.Module]: ...


def held(fused: Holding, fn: Callable[..., Any], *tensors: torch.Tensor) -> Any:
    """`fn(*tensors)`, which reads the head's weight and bias: as the head's forward where hooks place them around
    it. The head is called, so DeepSpeed ZeRO-3's hooks gather them for `fn` and, where `fn`'s output takes a
    gradient, again before its backward; accelerate's device-map hook moves `tensors` to the head's device (and loads
    an offloaded weight). `tensors` pass through the hooks as the head's inputs."""
    head = fused.linear
    if fused.hooks == "zero3":  # a LoRA head's B weights too: each adapter's term reads its B's whole (V, r) weight
        return _as_forwards([head, *fused.adapters()], fn, tensors)
    if fused.hooks == "fsdp2":  # the rows stay out of the call: FSDP2 would register its unit's post-backward on them,
        # which would reshard a unit shared with the final norm (accelerate's) before the norm's backward had run
        return _as_forwards([fused.holder], lambda: fn(*tensors), ())
    if fused.hooks == "accelerate":
        inner = head._old_forward
        head._old_forward = fn
        try:
            return head(*tensors)
        finally:
            head._old_forward = inner
    return fn(*tensors)


def _as_forwards(modules: list[nn.Module], fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...]) -> Any:
    """`fn(*tensors)` as the forward of each of `modules` in turn, one call inside the other: the hooks of each
    gather its weights around `fn` and, where its output takes a gradient, again before its backward."""
    if not modules:
        return fn(*tensors)
    module = modules[0]
    module.forward = lambda *rows: _as_forwards(modules[1:], fn, rows)
    try:
        return module(*tensors)
    finally:
        del module.forward


class _Tied(torch.autograd.Function):
    """`a`, with `b` among its inputs: `b`'s backward then waits for `a`'s (`b` gets a zero gradient from it)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.b = (b.shape, b.dtype, b.device)
        return a.clone()  # a view would lose FSDP2's pre-backward hook to an in-place op on it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.b
        return grad, torch.zeros(shape, dtype=dtype, device=device)


class InItsCall:
    """The fused loss computed in the family's own call of the head (on the zero row), as `in_its_call` installs
    it; `loss(logits)` is it, once that call ran, else None."""

    __slots__ = ("value", "undo", "checked")

    def __init__(self, undo: Callable[[], None]) -> None:
        self.value: Optional[torch.Tensor] = None
        self.undo = undo
        self.checked: Optional[torch.Tensor] = None  # on the checking call: the fused head's logits of its rows

    def loss(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The loss, tied to the family's `logits` of that call: its backward runs after the hooks' pre-backward on
        the call's output (which gathers the weight it reads) and before their post-backward on the call's input
        (which reduces or frees it), where an unpatched head's backward runs."""
        return None if self.value is None else _Tied.apply(self.value, logits)


def one_call(fused: Holding) -> bool:
    """The hooks on the head gather its weight by collectives around each call (FSDP2's; ZeRO-3's, but for a LoRA
    head's adapters, each gathered by a module of its own): the fused loss runs in the family's own call of it."""
    return fused.hooks == "fsdp2" or (fused.hooks == "zero3" and not fused.adapters())


def in_its_call(fused: Holding, fn: Callable[[], torch.Tensor],
                before: Optional[Callable[[torch.Tensor, InItsCall], torch.Tensor]] = None) -> InItsCall:
    """Where the head's weight is gathered by collectives around each call (`one_call`), have the head's next call
    (the family's own head on the zero row, or on the checking call's rows) compute `fn()` too, and first
    `before(rows, call)` (the checking call's probes). Otherwise the fused loss, the probes and the check each call
    the head once more than the family does: ranks whose forwards take other head paths in one step (one fused, one
    stepped aside or with no labelled token) would run their collectives in another order and hang. `undo()` takes
    it off, where that call never came."""
    module = fused.holder
    had = vars(module).get("forward")
    own = module.forward

    def undo() -> None:
        if vars(module).get("forward") is forward:
            if had is None:
                del module.forward
            else:
                module.forward = had

    call = InItsCall(undo)

    def forward(*args: Any, **kwargs: Any) -> Any:
        undo()
        if before is not None and args:
            args = (before(args[0], call), *args[1:])
        out = own(*args, **kwargs)
        call.value = fn()
        return _Tied.apply(out, call.value)

    module.forward = forward
    return call


def hooks_of(head: nn.Module) -> str:
    """Whose hooks place the weight of a `plain_head`: "zero3", "fsdp2", "accelerate", or ""."""
    if hooked(head):
        return "fsdp2" if fsdp2_held(head) else "zero3"
    return "accelerate" if "forward" in vars(head) and accelerate_hooks(head) else ""


def zero3_held(head: nn.Module) -> bool:
    """Every hook on the head is DeepSpeed ZeRO-3's: they gather its weights around its forward and change nothing of
    what it computes (a hook of anyone else's might: the family's own head runs)."""
    return all(zero3_hook(h) for h in hooks_on(head))


def zero3_partitioned(linear: nn.Linear) -> bool:
    """DeepSpeed ZeRO-3 holds `linear`'s weight in shards, gathered by its hooks around its forward."""
    return bool(linear._forward_hooks or linear._forward_pre_hooks) and hasattr(held_weight(linear), "ds_shape")


def held_weight(linear: nn.Module) -> Any:
    """`linear.weight` as the module holds it, read past ZeRO-3's parameter dict: its lookup gathers a partitioned
    weight outside the module's call, a collective that a rank whose forward stepped aside does not run (the ranks'
    collectives then mismatch: gloo aborts)."""
    own = vars(linear)
    params = own.get("_parameters")
    if "weight" not in own and isinstance(params, dict) and "weight" in params:
        return dict.get(params, "weight")
    return getattr(linear, "weight", None)  # FSDP1's view of its gathered weight is an attribute of its own


def fsdp2_held(head: nn.Module) -> bool:
    """The head is a unit of FSDP2's, or one of a group (accelerate's FSDP2 puts the final norm and the head in one):
    its hooks, FSDP2's alone, gather its weight around its forward (a DTensor outside it) and register its backward's
    reduce-scatter; a call that skips the head, or calls it again, is FSDP2's to complete (chunked losses do so)."""
    hooks = list(hooks_on(head))
    return bool(hooks) and all(fsdp2_hook(h) for h in hooks)


def fsdp2_holder(*modules: Optional[nn.Module]) -> Optional[nn.Module]:
    """The first of `modules` (the output embeddings, outermost first) that FSDP2 holds as a unit, or None."""
    return next((m for m in modules if m is not None and fsdp2_held(m)), None)


def gathering_hooks(module: nn.Module) -> bool:
    """Every hook on `module` is ZeRO-3's or FSDP2's: they gather its weights around its forward, nothing else."""
    return all(zero3_hook(h) or fsdp2_hook(h) for h in hooks_on(module))


def own_class(module: Optional[nn.Module]) -> type:
    """`module`'s class, or the one FSDP2's `fully_shard` made its class of (FSDPModule first in its two bases)."""
    bases = type(module).__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and bases[0].__module__.startswith("torch.distributed"):
        return bases[1]
    return type(module)


def is_linear(module: nn.Module) -> bool:
    """`module` is an nn.Linear: torch's own class, or the one FSDP2's `fully_shard` makes of it."""
    return own_class(module) is nn.Linear


def own_forward(head: nn.Module, forward: Any) -> bool:
    """`forward` is nn.Linear's own, bound to the head (what accelerate leaves on a module whose hook it removed)."""
    return getattr(forward, "__func__", None) is nn.Linear.forward and getattr(forward, "__self__", None) is head


ALIGNING = ("AlignDevicesHook",)  # accelerate's hooks that place weights and inputs and change nothing computed


def accelerate_hooks(head: nn.Module) -> bool:
    """The head's forward is accelerate's device-map hook (`dispatch_model`: a model split across devices, or
    offloaded) around nn.Linear's own, and its hooks only place: its inputs on the head's device, an offloaded weight
    loaded for the forward. Anything else on it (another hook, a forward of someone's own) runs the family's head."""
    forward, hook, inner = vars(head)["forward"], getattr(head, "_hf_hook", None), getattr(head, "_old_forward", None)
    if not accelerate_forward(forward) or not own_forward(head, inner):
        return False
    hooks = getattr(hook, "hooks", None) if type(hook).__name__ == "SequentialHook" else (hook,)
    return bool(hooks) and all(type(h).__name__ in ALIGNING and type(h).__module__ == "accelerate.hooks"
                               and not getattr(h, "io_same_device", False) and not getattr(h, "no_grad", False)
                               for h in hooks)


def device_of(linear: nn.Linear, hooks: str) -> torch.device:
    """Where the head runs: its weight's device, or the device accelerate's hook runs it on (an offloaded weight is
    on the meta device between forwards)."""
    hook = linear._hf_hook if hooks == "accelerate" else None
    for h in getattr(hook, "hooks", None) or (hook,):
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    return held_weight(linear).device
