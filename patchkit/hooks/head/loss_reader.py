"""Whether a causal LM's caller provably reads its loss alone (the HF Trainer's own steps, a training loop's code).

The HF Trainer's own `compute_loss` returns the loss alone to its training step (`return_outputs=False`), and its
own `prediction_step` drops the logits it was given when asked for the loss alone (`prediction_loss_only`: an
evaluation with no `compute_metrics`). A causal LM called there can return its loss alone (`unpad="loss"`'s fused head
and loss), as the Trainer already tells Liger's head by `skip_logits`: the numbers the Trainer reads are the same, and
the (B, N, V) logits of an evaluation at the length training reaches are never held. Any other caller (a training loop
of the user's own, a Trainer subclass's `compute_loss`) is served so only where its own code provably reads nothing of
the output but the loss (`caller_code`).

This is read off the running frames, not set by a wrapper on the Trainer, so that a subclass that reads the logits is
never served: every frame between the LM's forward and its caller must be a wrapper that only passes the output on
(torch's module call and its parallel wrappers, accelerate's, PEFT's, DeepSpeed's, transformers' decorators, and
patchkit's own) or a function of the user's that returns the call's output as it is (`caller_code.result_read_at`),
with no forward hook of anyone else's. Anything else (TRL's trainers, which read log-probs, a model of the user's own
that reads its LM's output, a loop that reads the logits) keeps the logits.
"""
from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Optional

from patchkit.hooks.head.caller_code import LOSS, RETURNED, calls_directly, reads_what_it_keeps, result_read_at
from patchkit.warn import MAX_FRAMES, package_home, real_path, trainers

# Packages whose frames between the Trainer and the LM pass its output on as it is, as paths under each package
PASSING = {
    "torch": ("nn/modules/module.py", "nn/parallel/", "distributed/", "_dynamo/", "amp/autocast_mode.py",
              "utils/_contextlib.py"),
    "accelerate": ("",),
    "peft": ("",),
    "deepspeed": ("",),
    "transformers": ("utils/", "integrations/deepspeed.py"),  # decorators; Ulysses' loss (it reads `loss`)
    "patchkit": ("",),
}


# ... but PEFT's, whose frames are read as a user's where they keep the output in a local: PEFT's CPT calls the LM
# with its labels, then computes a loss of its own from the logits
READ_WHERE_KEPT = ("peft",)


def _passing(filename: str) -> bool:
    """A frame of this file only passes the output of the call it makes on."""
    return _passing_package(filename) is not None


def _passing_package(filename: str) -> Optional[str]:
    """The package of PASSING whose frames of this file only pass the output of the call they make on, else None."""
    filename = real_path(filename)
    for package, paths in PASSING.items():
        home = package_home(package) if package in sys.modules else None
        if home is not None and filename.startswith(home):
            rest = filename[len(home):].replace(os.sep, "/")
            return package if any(rest.startswith(p) for p in paths) else None
    return None


def reads_loss_alone(frame: Optional[FrameType] = None) -> bool:
    """The running causal LM's forward was called, through wrappers that only pass its output on, by a caller that
    reads the loss alone: the HF Trainer's own `compute_loss` for its training step, or for its `prediction_step` with
    `prediction_loss_only` (the Trainer's `past_index`, which reads an output by position, or a loss of its own,
    `compute_loss_func` or label smoothing, keeps the logits); or code whose bytecode reads the loss alone, called
    through helpers of the user's that return the output as it is. `frame`: the first frame read (unset: the
    caller of this function, the LM's forward)."""
    frame, child = (sys._getframe(1) if frame is None else frame), None
    for _ in range(MAX_FRAMES):
        if frame is None:
            return False
        if trainers(frame, "compute_loss"):
            return _reads_loss(frame)
        package = _passing_package(frame.f_code.co_filename)
        if package is None or package in READ_WHERE_KEPT and reads_what_it_keeps(frame):
            if child is not None and not calls_directly(frame, child):
                return False  # a C function between (a cache, `map`, a key function) may keep or read the output
            read = result_read_at(frame)  # the caller's own code: a training loop, a Trainer subclass's, a helper
            if read != RETURNED:
                return read == LOSS
        if _hooked_call(frame):
            return False
        frame, child = frame.f_back, frame
    return False


# Whose forward hooks only place or gather weights: they never read a module's output
HOOKS_FROM = ("deepspeed.", "torch.distributed.", "accelerate.", "peft.", "patchkit.")


def _hooked_call(frame: FrameType) -> bool:
    """`frame` is torch's call of a module that has forward hooks of someone else's, which read its output."""
    if frame.f_code.co_name != "_call_impl" or not frame.f_code.co_filename.endswith("module.py"):
        return False
    import torch.nn.modules.module as torch_module

    module = frame.f_locals.get("self")
    hooks = [*getattr(module, "_forward_hooks", {}).values(), *torch_module._global_forward_hooks.values()]
    return any(not (getattr(h, "__module__", None) or "").startswith(HOOKS_FROM) for h in hooks)


def _reads_loss(frame: FrameType) -> bool:
    names = frame.f_locals
    trainer = names.get("self")
    args = getattr(trainer, "args", None)
    if (getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None) is not None
            or getattr(args, "past_index", -1) >= 0):
        return False
    if not names.get("return_outputs", False):
        return True  # the training step's call: the Trainer returns the loss alone
    caller = frame.f_back
    return caller is not None and trainers(caller, "prediction_step") and (
        caller.f_locals.get("prediction_loss_only") is True)
