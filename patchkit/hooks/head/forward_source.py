"""What a causal LM's forward runs, read from its code: through the wrappers put around it (patchkit's, accelerate's,
mixed precision's, transformers' own decorators), and whether its head and loss are transformers' own."""

from __future__ import annotations

import inspect
import sys
from typing import Callable

from patchkit.hooks.head.weight_holders import accelerate_forward
from patchkit.warn import package_home, real_path


def servable_forward(forward: Callable) -> bool:
    """A causal LM's (unpatched) forward computes its loss through `self.loss_function` from its head's logits and
    slices by `logits_to_keep`: its head and loss can run on the packed row (read once, when it is wrapped)."""
    try:
        source = inspect.getsource(_undecorated(innermost(forward)).__code__)
    except (OSError, TypeError, AttributeError):
        return False
    return "self.loss_function(" in source and "logits_to_keep" in source and "CrossEntropyLoss" not in source


def innermost(forward: Callable) -> Callable:
    """The forward a wrapper runs: through patchkit's dressing of an instance's own forward, accelerate's device-map
    hook (a dispatched model's), which calls the forward it names, and the mixed-precision wrappers
    `Accelerator.prepare` puts on a model (`convert_outputs_to_fp32` around torch's autocast decorator), which run it
    in a dtype context. Any other `__wrapped__` is not followed: `functools.wraps` names what a wrapper looks like,
    not what it runs (TRL's fused-head forward wears the class's forward and runs the base model and its own head)."""
    for _ in range(16):
        inner = getattr(forward, "__wrapped_original__", None)
        if inner is None and (accelerate_forward(forward) or _mixed_precision(forward)):
            inner = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
            inner = getattr(inner, "model_forward", inner)  # accelerate's ConvertOutputsToFp32 holds what it calls
        if inner is None:
            break
        forward = inner
    return forward


# (module, the wrapper's function name): accelerate's `convert_outputs_to_fp32`'s and torch's `autocast_decorator`'s
MIXED_PRECISION = (("accelerate.utils.operations", "forward"), ("torch.amp.autocast_mode", "decorate_autocast"))


def _mixed_precision(forward: Callable) -> bool:
    """`forward` is one of the wrappers that run what they wrap in another dtype and change nothing else, known by
    its code (`functools.wraps` gives the autocast decorator's wrapper the name of what it wraps)."""
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and any(
        code.co_name == name and real_path(code.co_filename) == real_path(getattr(sys.modules.get(module), "__file__",
                                                                                 None) or "?")
        for module, name in MIXED_PRECISION)


def _undecorated(forward: Callable) -> Callable:
    """The function under transformers' own decorators of a forward (`can_return_tuple`, `deprecate_kwarg`, ...):
    a wrapper whose code is transformers' is followed to what it names, any other is the function itself."""
    import transformers  # noqa: F401 - imported, so that its home is known

    home = package_home("transformers") or "?"
    func = getattr(forward, "__func__", forward)
    for _ in range(16):
        inner, code = getattr(func, "__wrapped__", None), getattr(func, "__code__", None)
        if inner is None or code is None or not real_path(code.co_filename).startswith(home):
            break
        func = getattr(inner, "__func__", inner)
    return func
