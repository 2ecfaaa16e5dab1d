"""Say once when a model that no active class patch serves is built: it runs unpatched, never silently."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Optional

from patchkit.hooks.install.patching import Replacement, SharedInstall
from patchkit.warn import warn_user

_hook = SharedInstall()
_warned: set[str] = set()  # model types already named in this process


def _pretrained_model() -> type:
    return importlib.import_module("transformers.modeling_utils").PreTrainedModel


def why_unserved(model_type: Optional[str], families: str) -> str:
    """Why `model_type` runs unpatched: no patch for it, the gate its patch fails, or its patch was not applied."""
    from patchkit import gates
    from patchkit.errors import PatchTargetError
    from patchkit.hooks.install.registry import for_model_type

    try:
        spec = for_model_type(model_type)
    except PatchTargetError:
        return f"patchkit has no patch for this family (the active patches serve {families})"
    gate = gates.transformers_gate(gates.probe_environment(), spec.supported, spec.name)
    if not gate.passed:
        return f"its patch {spec.name!r} is off here: {gate.describe()}"
    return (f"the active patches serve {families}; apply_patch({spec.name!r}) before loading, or "
            "apply_patch(model=m) on the loaded model, patches it")


def built_inside_another(model: Any) -> bool:
    """`model` is a part being built in another model's `__init__` (LLaVA's vision tower and language model): the
    whole model's own `post_init` comes last and judges it whole."""
    pretrained = _pretrained_model()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, pretrained):
                return True
        frame = frame.f_back
    return False


def note(model: Any, served: dict[type, str]) -> None:
    """Warn once per model type when `model` holds no attention layer of a served family (`served`: attention
    class -> its model type); a composite whose language model is served (LLaVA) is served, and its parts are not
    judged on their own (its vision tower runs transformers' attention by design)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _warned or built_inside_another(model):
        return
    if any(isinstance(m, tuple(served)) for m in model.modules()):
        return
    _warned.add(model_type)
    families = ", ".join(sorted(set(served.values()))) or "no family"
    warn_user(
        f"patchkit: {type(model).__name__} (model_type {model_type!r}) runs unpatched, on transformers' own "
        f"attention: {why_unserved(model_type, families)}."
    )


def attach(served: Callable[[], dict[type, str]], adopt: Callable[[Any], bool] = lambda model: False) -> None:
    """While a class patch is active, every model built is offered to `adopt` (every family's patch takes a family
    it serves from data as its first model is built), then checks its family against `served()` (idempotent)."""

    def build() -> list[Replacement]:
        cls = _pretrained_model()
        original = cls.post_init

        def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            adopt(self)
            note(self, served())
            return out

        return [Replacement(cls, "post_init", post_init, "PreTrainedModel.post_init (names unserved families)")]

    _hook.attach(build)


def detach() -> None:
    """The last class patch is gone: models are built as transformers builds them."""
    _hook.detach()
