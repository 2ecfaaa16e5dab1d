"""Router logits that the models around the base model record with hooks of their own (Qwen3-VL-MoE's `Model` and
`ForConditionalGeneration` before transformers 5.2): during a packed forward they record them unpadded, (nnz,
experts), and the load-balancing loss fails on their shape. Each returns the base model's repadded ones instead."""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional

from torch import nn

from patchkit.forward.liveness import in_one_graph
from patchkit.hooks.install.patching import dressed_as

_HANDED_UP: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("patchkit_router_logits", default=None)


def hand_up(out: Any) -> None:
    """Give a packed forward's repadded router logits to the recording model around it, if there is one."""
    holder = _HANDED_UP.get()
    logits = out.get("router_logits") if holder is not None and hasattr(out, "keys") else None
    if logits:
        holder.append(logits)


def make_recording_forward(original: Callable) -> Callable:
    """Wrap the recording model's forward: its output's router logits become those its base model handed up."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if in_one_graph():  # fullgraph: no contextvar there, and no forward unpads at the model: nothing to hand up
            return original(self, *args, **kwargs)
        holder: list = []
        token = _HANDED_UP.set(holder)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _HANDED_UP.reset(token)
        if holder and hasattr(out, "keys") and out.get("router_logits") is not None:
            out["router_logits"] = holder[-1]
            hand_up(out)  # on to a recording model around this one
        return out

    return dressed_as(forward, original)
