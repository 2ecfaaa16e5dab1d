"""Callers known to read a causal LM's logits at padding positions, said once: patched, those are the head's of a
zero hidden state (varlen kernels compute nothing at padding), so what the caller derives from them differs.

TRL's ORPO and CPO trainers log `logits/chosen` and `logits/rejected` as the mean of the logits over every position
of their padded batch, padding included (DPO's and KTO's average over real tokens alone). Their losses, log-
probabilities, rewards and gradients read real tokens alone and are exact; the two metrics are not. Found by the
calling frames (a frame's method name and its class's) of a forward without labels over several tokens.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Optional

from patchkit.warn import warn_user

# (class name, method name): a method of such a class (or a subclass) reads the logits it gets at padding
READERS = {("ORPOTrainer", "concatenated_forward"): "logits/chosen and logits/rejected",
           ("CPOTrainer", "concatenated_forward"): "logits/chosen and logits/rejected"}
METHODS = frozenset(method for _, method in READERS)
MAX_FRAMES = 12  # from the causal LM's forward up to the trainer's method: torch's module call, accelerate's wrappers
_said: set[str] = set()


def padding_reader(frame: Optional[FrameType]) -> Optional[tuple[str, str]]:
    """(the reader's class, what it derives from the logits at padding) of a calling frame from `frame` up, or None:
    a walk of a few frames, each a name compared (the call's `self` read only where the method's name is a reader's)."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name in METHODS:
            owner = frame.f_locals.get("self")
            for cls in type(owner).__mro__:
                what = READERS.get((cls.__name__, frame.f_code.co_name))
                if what is not None:
                    return cls.__name__, what
        frame = frame.f_back
    return None


def say_padding_reader() -> None:
    """Warn once per reader (found from the caller of this function's caller up) that the values it derives from the
    logits at padding differ from unpatched."""
    found = padding_reader(sys._getframe(2))
    if found is None or found[0] in _said:
        return
    _said.add(found[0])
    warn_user(
        f"patchkit: TRL's {found[0]} logs {found[1]} as the mean of the logits over every position, padding "
        "included; patched, the logits at padding are the head's of a zero hidden state (varlen kernels compute "
        "nothing there), so those metrics differ from an unpatched run. Its loss, log-probabilities, rewards and "
        "gradients read real tokens alone and are exact. Fix: none needed for training; compare those two metrics "
        "between patched runs only."
    )
