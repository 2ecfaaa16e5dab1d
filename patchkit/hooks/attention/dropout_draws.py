"""Dropout under patchkit draws its random masks over real tokens only: a seeded run's are not the unpatched run's.

The layers of an unpadded forward see (1, real tokens, ...) where transformers' see (batch, length, ...), and the varlen
kernels draw attention dropout per document: the same distribution, other numbers. Most fine-tuning recipes set every
dropout to 0; LoRA's `lora_dropout` (0.05 in many recipes) and GPT-2's defaults do not. So too for an MoE router's
training noise (Mixtral's jitter, PhiMoE's Gumbel sampling of experts, on by default). Said once per process.
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn

from patchkit.warn import warn_user

DRAWS = ("patchkit: dropout or a router's noise is on ({what}) and draws its random numbers over the real tokens only, "
         "where transformers draws them over the padded batch: a seeded run gets other draws of the same "
         "distribution, so its numbers are not an unpatched run's. Set it to 0 (a router's: eval mode) to compare "
         "numbers with an unpatched run.")
# MoE routers' training noise on their inputs, by attribute (Mixtral's, MiniMax's `jitter_noise`, PhiMoE's
# `input_jitter_noise`, DBRX's `moe_jitter_eps`), and routers that sample their experts in training (PhiMoE's Gumbel
# sampling)
JITTER = ("jitter_noise", "input_jitter_noise", "moe_jitter_eps")
SAMPLING_ROUTERS = frozenset({"PhimoeTopKRouter"})

_said = [False]
_dropouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a base model -> its (name, module) that draw


def active_dropout(model: nn.Module) -> Optional[str]:
    """The first of `model`'s dropout modules or routers that draws now (training; p, or the jitter, > 0), by name
    and rate, or None."""
    found = _dropouts.get(model)
    if found is None:
        found = _dropouts[model] = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Dropout) or (
            type(m).__name__ in SAMPLING_ROUTERS or any(hasattr(m, k) for k in JITTER))]
    for name, module in found:
        if module.training:
            what = _draws(module)
            if what is not None:
                return f"{name} {what}"
    return None


def _draws(module: nn.Module) -> Optional[str]:
    """What a training `module` draws at random, or None."""
    if isinstance(module, nn.Dropout):
        return f"p={module.p:g}" if module.p > 0 else None
    if type(module).__name__ in SAMPLING_ROUTERS:
        return "samples its experts"
    jitter = next(((k, v) for k in JITTER if isinstance(v := getattr(module, k, None), (int, float)) and v > 0), None)
    return None if jitter is None else f"{jitter[0]}={jitter[1]:g}"


def say_dropout(model: nn.Module, unpadded: bool) -> None:
    """An unpadded training forward whose dropout modules drop (`active_dropout`)."""
    if not _said[0] and unpadded and model.training:
        _say(active_dropout(model))


def say_attention_dropout(dropout: float) -> None:
    """A served attention call with dropout: the kernels draw it per document."""
    if dropout and not _said[0]:
        _say(f"attention_dropout={dropout:g}")


def _say(what: Optional[str]) -> None:
    """Once per process, whichever dropout is met first."""
    if what is not None:
        _said[0] = True
        warn_user(DRAWS.format(what=what))
