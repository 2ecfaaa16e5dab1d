"""Dropout under patchkit draws its random masks over real tokens only: a seeded run's are not the unpatched run's.

The layers of an unpadded forward see (1, real tokens, ...) where transformers' see (batch, length, ...), and the varlen
kernels draw attention dropout per document: the same distribution, other numbers. Most fine-tuning recipes set every
dropout to 0; LoRA's `lora_dropout` (0.05 in many recipes) and GPT-2's defaults do not. Said once per process.
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn

from patchkit.warn import warn_user

DRAWS = ("patchkit: dropout is on ({what}) and draws its random masks over the real tokens only, where transformers "
         "draws them over the padded batch: a seeded run gets other masks of the same distribution, so its numbers "
         "are not an unpatched run's. Set it to 0 to compare numbers with an unpatched run.")

_said = [False]
_dropouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a base model -> its (name, nn.Dropout) modules


def active_dropout(model: nn.Module) -> Optional[str]:
    """The first of `model`'s dropout modules that drops now (training, p > 0), by name and rate, or None."""
    found = _dropouts.get(model)
    if found is None:
        found = _dropouts[model] = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Dropout)]
    for name, module in found:
        if module.training and module.p > 0:
            return f"{name} p={module.p:g}"
    return None


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
