"""attn_implementation="flash_attention_2" under the class patch, where transformers cannot load flash-attn: served.

GPU training scripts ask for "flash_attention_2". transformers checks that request when a model is built
(`PreTrainedModel._check_and_adjust_attn_implementation` from 4.56, the classmethod
`_check_and_enable_flash_attn_2` before) and refuses it on a machine without a usable flash-attn, even though
patchkit's class patch serves every model of its family whatever its config names. While any class patch is active
(transformers 4.48+), this wrapper lets such a request through for a model whose family an active class patch
serves, and only when transformers' own check refused it: the model loads with patchkit's registered name ("sdpa"
before transformers 4.53, which has none), runs through that patch, and one warning says which patchkit backend
serves it. Where flash-attn loads, transformers' check passes and nothing changes. Every other request, and every
family no active class patch serves, gets transformers' answer unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from patchkit.hooks.install.patching import Replacement, SharedInstall
from patchkit.hooks.install.state import PatchState
from patchkit.warn import warn_user

FLASH_REQUEST = "flash_attention_2"
Serving = Callable[[type], Optional[PatchState]]  # a model class -> the active class patch's state serving it

_hook = SharedInstall()


def served_name() -> str:
    """What the served model's config names: patchkit's registered route where it exists, else "sdpa"."""
    from patchkit.hooks.name import attention_interface

    try:
        return attention_interface.ATTENTION_NAME if attention_interface.register() else "sdpa"
    except Exception:  # noqa: BLE001 - a transformers without the interfaces: sdpa runs the non-attention code
        return "sdpa"


def _serve(state: PatchState, model_class: str, refusal: BaseException, towers: bool = False) -> str:
    name = served_name()
    tower = " (its vision or audio tower: transformers' 'sdpa')" if towers else ""
    warn_user(
        f"patchkit: attn_implementation={FLASH_REQUEST!r} for {model_class} is served by patchkit's "
        f"{state.backend.name!r} backend, exact (flash-attn unusable here: {refusal_reason(refusal)}); it loads as "
        f"{name!r}{tower}.",
    )
    return name


def refusal_reason(refusal: BaseException) -> str:
    """transformers' refusal in a few words: the cause its first line gives after "the following error:", up to its
    first sentence's end (the rest points at its docs), at most 100 characters."""
    text = str(refusal).strip().splitlines()[0] if str(refusal).strip() else type(refusal).__name__
    text = text.split("the following error:", 1)[-1].strip()
    text = text.split(". ", 1)[0].rstrip(".")
    return text if len(text) <= 100 else text[:99] + "…"


def tower_of(model: Any) -> str:
    """A multimodal model's non-language part (its config's `base_config_key`: "vision_config", ...), else ''."""
    key = getattr(type(getattr(model, "config", None)), "base_config_key", "")
    return key if isinstance(key, str) and key not in ("", "text_config") else ""


def has_towers(model: Any) -> bool:
    """A multimodal model whose config has a vision or audio sub-config (those towers get transformers' sdpa)."""
    config = getattr(model, "config", None)
    return any(getattr(config, key, None) is not None for key in ("vision_config", "audio_config"))


def make_check_and_adjust(original: Callable, serving: Serving) -> Callable:
    """Wrap `PreTrainedModel._check_and_adjust_attn_implementation` (transformers >= 4.56). A vision (or audio)
    tower of a served family's model gets transformers' sdpa, which serves its bidirectional attention exactly:
    the request for the whole model reaches each part, and patchkit serves the language model alone."""

    @functools.wraps(original)
    def _check_and_adjust_attn_implementation(self: Any, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, attn_implementation, *args, **kwargs)
        except (ImportError, ValueError) as exc:
            state = serving(type(self)) if attn_implementation == FLASH_REQUEST else None
            if state is None:
                raise
            if tower_of(self):
                return original(self, "sdpa", *args, **kwargs)  # said once, with the language model's warning
            return _serve(state, type(self).__name__, exc, towers=has_towers(self))

    return _check_and_adjust_attn_implementation


def make_check_and_enable(original: classmethod, serving: Serving) -> classmethod:
    """Wrap the classmethod `PreTrainedModel._check_and_enable_flash_attn_2` (transformers 4.48 to 4.55)."""
    func = original.__func__

    @functools.wraps(func)
    def _check_and_enable_flash_attn_2(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(cls, config, *args, **kwargs)
        except (ImportError, ValueError) as exc:
            state = serving(cls)
            if state is None:
                raise
            config._attn_implementation = _serve(state, cls.__name__, exc)
            return config

    return classmethod(_check_and_enable_flash_attn_2)


def replacements(serving: Serving) -> list[Replacement]:
    """The wrapper on transformers' PreTrainedModel check (the caller attaches it from 4.48, the newest era)."""
    from transformers.modeling_utils import PreTrainedModel

    if "_check_and_adjust_attn_implementation" in vars(PreTrainedModel):
        original = vars(PreTrainedModel)["_check_and_adjust_attn_implementation"]
        new: Any = make_check_and_adjust(original, serving)
        attr = "_check_and_adjust_attn_implementation"
    elif "_check_and_enable_flash_attn_2" in vars(PreTrainedModel):
        attr = "_check_and_enable_flash_attn_2"
        new = make_check_and_enable(vars(PreTrainedModel)[attr], serving)
    else:
        return []  # a transformers without either check: nothing refuses the request to wrap
    return [Replacement(PreTrainedModel, attr, new, f"PreTrainedModel.{attr} (serves {FLASH_REQUEST!r})")]


def attach(serving: Serving) -> None:
    """While any class patch is active, a refused flash_attention_2 request is served for its families (idempotent)."""
    _hook.attach(lambda: replacements(serving))


def detach() -> None:
    """The last class patch is gone: transformers' own check again (identity)."""
    _hook.detach()


def installed() -> list[str]:
    """What the wrapper replaced, for reports (empty when no class patch is active)."""
    return [r.label for r in _hook.replacements or []]
