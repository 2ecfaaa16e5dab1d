"""A task head's forward wrapper (sequence and token classification, question answering): tell its base model what of
the call reads padding positions (`task_reads`), so that such a forward steps aside where varlen kernels skip them."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from patchkit.forward.context import within
from patchkit.forward.liveness import in_one_graph
from patchkit.hooks.decide.graph_plan import lm_in_graph
from patchkit.hooks.decide.task_reads import reads_by_position, task_cause, task_of
from patchkit.hooks.forwards.model_forward import bound_call, tuple_cache_kwargs
from patchkit.hooks.install.patching import dressed_as

eager_task_cause = torch.compiler.disable(task_cause)  # host reads: one break at the call in a compiled forward


def make_task_forward(original: Callable) -> Callable:
    """Wrap a task head's forward: its base model steps aside where the call reads a padding position's value."""
    signature, var_kw, bind, _ = bound_call(original)
    takes_use_cache = "use_cache" in signature.parameters or var_kw is not None  # the tuple's cache element

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = bind(self, args, kwargs)
        if in_one_graph():  # whether a read position is padding is data the graph cannot branch on
            mask = arguments.get("attention_mask")
            with lm_in_graph(isinstance(mask, torch.Tensor) and mask.dim() == 2
                             and reads_by_position(task_of(type(self)), arguments)):
                return original(self, *args, **kwargs)
        if takes_use_cache:
            kwargs = tuple_cache_kwargs(self, arguments, arguments.get(var_kw, {}) if var_kw else {}, kwargs)
        cause = eager_task_cause(self, arguments)
        if cause is None:
            return original(self, *args, **kwargs)
        with within(lm_cause=cause):
            return original(self, *args, **kwargs)

    return dressed_as(forward, original, signature)

