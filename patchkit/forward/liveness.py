"""Which attention layers ran through a patch: counted so that torch.compile, FSDP and garbage collection cannot lie.

Dynamo compiles one attention frame for all layers and replays its Python side effects from trace time: it drops
a `WeakSet.add` once the set holds an item (torch 2.13), guards on (and recompiles for) any value it reads, such
as a call counter, and a graph break inside the decoder loop makes it run the whole loop eagerly. An attribute
store is replayed on the runtime object, so a compiled call only stores: the state's mark on the layer, and
`compiled` on the state. Eager calls also count calls and remember the layers.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import torch
from torch import nn

LIVE_MARK = "_patchkit_live"  # every attention layer that ran through a patch holds that PatchState's `mark` here
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling  # <2.3


def _tracing_one_graph() -> bool:
    """Run by dynamo while it traces (its result a constant of the graph): whether this trace may not break,
    torch.compile(fullgraph=True) or error_on_graph_break. False where this torch does not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tracer = InstructionTranslator.current_tx()
        return bool(tracer.one_graph or getattr(tracer, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - a torch without these internals: the graph may break, as before
        return False


_one_graph = torch._dynamo.assume_constant_result(_tracing_one_graph)


def traced_by() -> Optional[str]:
    """What records this call, where a forward must run as transformers' does, else None: "functorch_transform" (a
    torch.func transform, grad, vmap, jacrev: unpadding reads the mask on the host, which vmap refuses, and the fused
    head's autograd function has no `setup_context`, which the transforms need) or "jit_trace" (torch.jit.trace:
    every host read of the batch, its lengths and splits, would become a constant another batch silently reuses)."""
    if torch._C._are_functorch_transforms_active():
        return "functorch_transform"
    return "jit_trace" if torch.jit.is_tracing() else None


def in_one_graph() -> bool:
    """Inside a compiled graph that may not break (fullgraph=True, torch.export): no host read, no contextvar, no
    step aside by data there. Decided when dynamo traces the call, so it costs nothing at run time."""
    return is_compiling() and (_one_graph() or exporting())


def exporting() -> bool:
    """torch.export traces the call (its graph never breaks, and a non-recursive compiler.disable is refused)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())



def record_call(state: Any, module: nn.Module) -> None:
    """One attention call of `module` through the patch whose state is `state`."""
    if is_compiling():
        setattr(module, LIVE_MARK, state.mark)
        state.compiled = True  # a constant store: no guard, no recompile; calls are not counted in graphs
        return
    state.calls += 1
    marked = vars(module).get(LIVE_MARK) is state.mark
    if marked and not state.compiled:  # eager calls mark and add together: a layer seen before
        return  # no WeakSet lookup (it builds a weak reference) per layer call
    if not marked:  # nn.Module.__setattr__ is costly: once per layer and state
        setattr(module, LIVE_MARK, state.mark)
    if module not in state.layers:
        state.layers.add(module)
        state.layers_seen += 1


def live_layers(state: Any) -> int:
    """Distinct live attention layers that ran through `state`: `layers`, or once compiled calls ran, the marked ones.

    Compiled calls leave no Python-side set, only each layer's mark, so count the objects that hold the mark:
    modules whose `__dict__` holds it. A dict that is no module's `__dict__` is not a layer: a copy of one (dynamo,
    a wrapper, a test's `dict(vars(layer))`) may hold the mark for a while and is never counted. A report-time scan,
    never on the hot path.
    """
    if not state.compiled:
        return len(state.layers)
    holders = gc.get_referrers(state.mark)
    layers = {id(h) for h in holders if isinstance(h, nn.Module) and vars(h).get(LIVE_MARK) is state.mark}  # inline
    dicts = {id(h): h for h in holders if type(h) is dict and h.get(LIVE_MARK) is state.mark}
    if dicts:  # their owners, in one more scan of the heap (not one per layer)
        layers.update(id(m) for m in gc.get_referrers(*dicts.values())
                      if isinstance(m, nn.Module) and id(m.__dict__) in dicts)
    return len(layers)
