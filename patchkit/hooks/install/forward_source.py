"""What a causal LM's forward runs, read from its code: through the wrappers put around it (patchkit's, accelerate's,
mixed precision's, transformers' own decorators), and whether its head and loss are transformers' own."""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from typing import Any, Callable, Optional

from patchkit.warn import package_home, real_path


def accelerate_forward(forward: Any) -> bool:
    """`forward` is accelerate's device-map hook around a module's own forward (`add_hook_to_module`'s partial)."""
    return isinstance(forward, functools.partial) and getattr(forward.func, "__module__", None) == "accelerate.hooks"


def servable_forward(forward: Callable) -> bool:
    """A causal LM's (unpatched) forward computes its loss through `self.loss_function` from its head's logits, and
    no other way, and slices by `logits_to_keep`: its head and loss can run on the packed row (read once, when it
    is wrapped). Liger's and Unsloth's forwards also call `self.loss_function`, on the path where they keep the
    logits, and otherwise compute the loss from the hidden states with their own fused kernel, which takes the
    padded batch's shape (`own_loss`)."""
    try:
        source = textwrap.dedent(inspect.getsource(_undecorated(innermost(forward)).__code__))
    except (OSError, TypeError, AttributeError):
        return False
    if "self.loss_function(" not in source or "logits_to_keep" not in source or "CrossEntropyLoss" in source:
        return False
    try:
        return not own_loss(ast.parse(source))
    except SyntaxError:
        return False


def unservable_why(forward: Callable) -> Optional[str]:
    """None where `servable_forward`, else why not, said of "<the LM's class>'s forward": the function named where it
    is not transformers' own (Liger's `lce_forward`, Unsloth's)."""
    if servable_forward(forward):
        return None
    func = _undecorated(innermost(forward))
    module = getattr(func, "__module__", None) or ""
    if module.startswith("transformers."):
        return "computes its loss without transformers' loss_function"
    name = f"{module}.{getattr(func, '__qualname__', getattr(func, '__name__', '?'))}"
    return f"is {name}, which computes its head or loss its own way"


def own_loss(tree: ast.AST) -> bool:
    """`loss` is assigned something other than None, a call of `self.loss_function`, or an expression of the loss
    itself (transformers' auxiliary terms: `loss + coef * aux_loss`): the forward has a loss of its own."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(n, ast.Name) and n.id == "loss" for t in targets for n in ast.walk(t)):
            continue
        if isinstance(value, ast.Constant) and value.value is None:
            continue
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "self.loss_function":
            continue
        if any(isinstance(n, ast.Name) and n.id == "loss" for n in ast.walk(value)):
            continue
        return True
    return False


def innermost(forward: Callable, through_patchkit: bool = True) -> Callable:
    """The forward a wrapper runs: through patchkit's dressing of an instance's own forward (unless not
    `through_patchkit`), accelerate's device-map hook (a dispatched model's), which calls the forward it names, and the
    mixed-precision wrappers `Accelerator.prepare` puts on a model (`convert_outputs_to_fp32` around torch's autocast
    decorator), which run it in a dtype context. Any other `__wrapped__` is not followed: `functools.wraps` names what
    a wrapper looks like, not what it runs (TRL's fused-head forward wears the class's forward and runs the base model
    and its own head; worn over a class patch, it copies the patch's `__wrapped_original__` too)."""
    for _ in range(16):
        inner = getattr(forward, "__wrapped_original__", None) if through_patchkit else None
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
