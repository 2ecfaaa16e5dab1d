"""attn_implementation="flash_attention_2" under the class patch, where transformers cannot load flash-attn: served.

GPU training scripts ask for "flash_attention_2". transformers checks that request when a model is built
(`PreTrainedModel._check_and_adjust_attn_implementation` from 4.56, the classmethod
`_check_and_enable_flash_attn_2` before) and refuses it on a machine without a usable flash-attn, even though
patchkit's class patch serves every LLaMA model whatever its config names. While the class patch is active, this
wrapper lets such a request through for LLaMA models only, and only when transformers' own check refused it: the
model loads with patchkit's registered name ("sdpa" before transformers 4.53, which has none), runs through the
patch, and one warning says which patchkit backend serves it. Where flash-attn loads, transformers' check passes
and nothing changes. Every other request, and every other model family, gets transformers' answer unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .attention import PatchState
from .patching import Replacement
from .warn import warn_user

FLASH_REQUEST = "flash_attention_2"


def served_name() -> str:
    """What the served model's config names: patchkit's registered route where it exists, else "sdpa"."""
    from . import attn_interface

    try:
        return attn_interface.ATTENTION_NAME if attn_interface.register() else "sdpa"
    except Exception:  # noqa: BLE001 - a transformers without the interfaces: sdpa runs the non-attention code
        return "sdpa"


def _serve(state: PatchState, model_class: str, refusal: BaseException) -> str:
    name = served_name()
    reason = str(refusal).strip().splitlines()[0] if str(refusal).strip() else type(refusal).__name__
    warn_user(
        f"patchkit: attn_implementation={FLASH_REQUEST!r} for {model_class} is served by patchkit's "
        f"{state.backend.name!r} backend (the class patch serves every LLaMA model; exact varlen attention, no "
        f"(B, 1, N, N) mask): transformers cannot use flash-attn here ({reason}). The model loads with "
        f"attn_implementation={name!r}.",
    )
    return name


def make_check_and_adjust(original: Callable, state: PatchState, served: type) -> Callable:
    """Wrap `PreTrainedModel._check_and_adjust_attn_implementation` (transformers >= 4.56)."""

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, attn_implementation, *args, **kwargs)
        except (ImportError, ValueError) as exc:
            if attn_implementation != FLASH_REQUEST or not isinstance(self, served):
                raise
            return _serve(state, type(self).__name__, exc)

    return _check_and_adjust_attn_implementation


def make_check_and_enable(original: classmethod, state: PatchState, served: type) -> classmethod:
    """Wrap the classmethod `PreTrainedModel._check_and_enable_flash_attn_2` (transformers 4.48 to 4.55)."""
    func = original.__func__

    @functools.wraps(func)
    def _check_and_enable_flash_attn_2(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(cls, config, *args, **kwargs)
        except (ImportError, ValueError) as exc:
            if not issubclass(cls, served):
                raise
            config._attn_implementation = _serve(state, cls.__name__, exc)
            return config

    return classmethod(_check_and_enable_flash_attn_2)


def class_replacements(state: PatchState, served: type) -> list[Replacement]:
    """The wrapper on transformers' PreTrainedModel, part of the class patch (reverted with it)."""
    from transformers.modeling_utils import PreTrainedModel

    if "_check_and_adjust_attn_implementation" in vars(PreTrainedModel):
        original = vars(PreTrainedModel)["_check_and_adjust_attn_implementation"]
        new: Any = make_check_and_adjust(original, state, served)
        attr = "_check_and_adjust_attn_implementation"
    elif "_check_and_enable_flash_attn_2" in vars(PreTrainedModel):
        attr = "_check_and_enable_flash_attn_2"
        new = make_check_and_enable(vars(PreTrainedModel)[attr], state, served)
    else:
        return []  # a transformers without either check: nothing refuses the request to wrap
    return [Replacement(PreTrainedModel, attr, new, f"PreTrainedModel.{attr} (serves {FLASH_REQUEST!r})")]
