"""Callers known to read a causal LM's outputs at padding positions: patched, those are the head's of a zero hidden
state (varlen kernels compute nothing at padding), so what the caller derives from them differs.

TRL's ORPO and CPO trainers log `logits/chosen` and `logits/rejected` as the mean of the logits over every position
of their padded batch, padding included (DPO's and KTO's average over real tokens alone). Their losses, log-
probabilities, rewards and gradients read real tokens alone and are exact; the two metrics are not: said once.
generate()'s contrastive search (transformers up to 4.56; after, the Hub's custom_generate copy) ranks its
candidates by their cosine similarity to the prompt's last hidden states, padding's included (a zero vector there:
not a number, and another token): its prefill steps aside. Found by the calling frames (a frame's method name and
its class's) of a forward without labels over several tokens.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional

import torch

from patchkit.forward.inputs.arguments import transformers_before
from patchkit.warn import warn_user

# (class name, method name): a method of such a class (or a subclass) reads the logits it gets at padding
READERS = {("ORPOTrainer", "concatenated_forward"): "logits/chosen and logits/rejected",
           ("CPOTrainer", "concatenated_forward"): "logits/chosen and logits/rejected"}
# ... and those whose reading changes what they return: the forward steps aside with this cause
ASIDE = {("GenerationMixin", "_contrastive_search"): "contrastive_search",
         ("GenerationMixin", "contrastive_search"): "contrastive_search"}  # its name before 4.39
# ... and the module-level functions of the Hub's `custom_generate` copies of those methods (transformers 4.57+ moved
# contrastive search to transformers-community/contrastive-search: `_contrastive_search(model, ...)`)
FUNCTIONS = {"_contrastive_search": "contrastive_search"}
# generate() before transformers 4.38 (and generate(use_cache=False) since) passes its prefill neither
# `cache_position` nor `logits_to_keep`, by which `step_aside.right_padded_generation` tells it: its frame does, where
# a row's last prompt column is padding
LEGACY_GENERATE = {("GenerationMixin", "generate"): "right_padded_generation"}
LEGACY_ASIDE = {**ASIDE, **LEGACY_GENERATE}
READS = {"contrastive_search": lambda mask: not bool(mask.all()),  # every position's hidden state
         "right_padded_generation": lambda mask: not bool(mask[:, -1].all())}  # the last column's logits
METHODS = frozenset(method for _, method in [*READERS, *ASIDE, *LEGACY_GENERATE])
MAX_FRAMES = 12  # from the causal LM's forward up to the trainer's method: torch's module call, accelerate's wrappers
_said: set[str] = set()


def padding_reader(frame: Optional[FrameType], readers: dict[tuple[str, str], str] = READERS
                   ) -> Optional[tuple[str, str]]:
    """(the reader's class, what `readers` says of it) of a calling frame from `frame` up, or None: a walk of a few
    frames, each a name compared (the call's `self` read only where the method's name is a reader's)."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name in METHODS:
            owner = frame.f_locals.get("self")
            what = FUNCTIONS.get(frame.f_code.co_name) if owner is None else None
            if what is not None and what in readers.values():
                return "custom_generate", what
            for cls in type(owner).__mro__:
                what = readers.get((cls.__name__, frame.f_code.co_name))
                if what is not None:
                    return cls.__name__, what
        frame = frame.f_back
    return None


def padding_cause(mask: Any, cached: bool = True) -> Optional[str]:
    """The cause a caller of this function's caller reads outputs at padding by (`ASIDE`), where `mask` (2D) has
    padding it reads; else None. A call with no cache (`cached` False: generate(use_cache=False), which passes
    neither a cache nor `logits_to_keep`) is told generate()'s by its frame, as before 4.38."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    legacy = transformers_before("4.38") or not cached
    found = padding_reader(sys._getframe(2), LEGACY_ASIDE if legacy else ASIDE)
    return found[1] if found is not None and READS[found[1]](mask) else None


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
