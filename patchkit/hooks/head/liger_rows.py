"""Liger-Kernel's fused linear cross-entropy on the rows it scores: its kernel computes every row's logits, padding's
and a prompt's included, and a causal LM under Liger's forward hands it the padded batch's rows.

Liger's `lce_forward` (the HF Trainer's `use_liger_kernel=True`, axolotl's plugin, `apply_liger_kernel_to_*`) computes
its loss from the hidden states of every position (`LigerForCausalLMLoss`), and its kernel
(`liger_fused_linear_cross_entropy`) multiplies each row by the head's weight before it drops the rows whose target is
`ignore_index`. patchkit's base model runs the layers on real tokens and hands Liger's forward the padded exit it
reads, so the head's matmuls ran on padding. While a patch is applied, that function gets only the rows it scores:
their loss, z-loss and accuracy are sums over those rows, and the rows left out get a zero gradient, as in Liger's
own run. A call asking for per-row outputs (`reduction="none"`, predicted tokens) is left as it is.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

import torch

from patchkit.forward.liveness import is_compiling

FUNCTIONAL = "liger_kernel.transformers.functional"
NAME = "liger_fused_linear_cross_entropy"
MARK = "__patchkit_scored_rows__"
_original: Optional[Callable] = None  # the function wrapped, for `remove`


def scored_rows(original: Callable) -> Callable:
    """`original` (Liger's fused linear cross-entropy) called on the rows whose target is not `ignore_index`."""
    signature = inspect.signature(original)
    names = list(signature.parameters)[:3]  # its input, the head's weight, the targets

    @functools.wraps(original)
    def fused(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a call this version's signature does not take: Liger's own error, unchanged
            return original(*args, **kwargs)
        given = bound.arguments
        hidden, target = given.get(names[0]), given.get(names[-1])
        if (is_compiling() or not isinstance(hidden, torch.Tensor) or not isinstance(target, torch.Tensor)
                or hidden.dim() != 2 or target.dim() != 1 or target.shape[0] != hidden.shape[0]
                or given.get("reduction", "mean") not in ("mean", "sum") or given.get("return_predicted_tokens")):
            return original(*args, **kwargs)
        scored = (target != given.get("ignore_index", -100)).nonzero().squeeze(1)
        if scored.numel() in (0, hidden.shape[0]):  # none scored: Liger's zero loss; all: nothing to leave out
            return original(*args, **kwargs)
        given[names[0]], given[names[-1]] = hidden.index_select(0, scored), target.index_select(0, scored)
        return original(*bound.args, **bound.kwargs)

    setattr(fused, MARK, True)
    return fused


def ensure() -> None:
    """Wrap Liger's function once Liger is imported (a patched forward asks: the Trainer imports Liger after the
    patch); cheap when it is not, or already wrapped."""
    global _original
    module = sys.modules.get(FUNCTIONAL)
    function = getattr(module, NAME, None) if module is not None else None
    if function is None or getattr(function, MARK, False):
        return
    _original = function
    setattr(module, NAME, scored_rows(function))


def remove() -> None:
    """Liger's function as it was (the last patch reverted), where the wrapper there is patchkit's."""
    global _original
    module = sys.modules.get(FUNCTIONAL)
    if module is not None and _original is not None and getattr(getattr(module, NAME, None), MARK, False):
        setattr(module, NAME, _original)
    _original = None
