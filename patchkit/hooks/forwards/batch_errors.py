"""transformers' continuous batching logs what its worker thread raises: patchkit's refusals reach the caller.

`generate(cache_implementation="paged")` and `generate_batch()` run the model in a background thread whose
generation loop catches every exception, logs it and fails the requests, so a refusal (`strict=True`, or an input
no path can run) came back as the prompts with no new tokens. While a patch is active, the manager's critical-error
handler notes a `PatchkitError` against its model and `generate_batch` raises it in the caller's thread once the
batch has stopped. Other errors keep transformers' handling; a caller polling a manager itself reads them from
each result's `error`, as transformers documents.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any, Callable

from patchkit.errors import PatchkitError
from patchkit.hooks.install.patching import Replacement, SharedInstall

_hook = SharedInstall()
_lock = threading.Lock()
_refused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the refusal its batch thread met


def _classes() -> tuple[Any, Any]:
    """(ContinuousMixin, ContinuousBatchingManager), or Nones where this transformers has no continuous batching."""
    try:
        api = importlib.import_module("transformers.generation.continuous_batching.continuous_api")
        mixin = importlib.import_module("transformers.generation.continuous_batching").ContinuousMixin
    except (ImportError, AttributeError):
        return None, None
    return mixin, getattr(api, "ContinuousBatchingManager", None)


def _note_refusal(original: Callable) -> Callable:
    def _handle_critical_error(self: Any, error: BaseException, *args: Any, **kwargs: Any) -> Any:
        model = getattr(self, "model", None)
        if isinstance(error, PatchkitError) and model is not None:
            with _lock:  # its type and message: its traceback holds the worker's frames, and through them the model,
                # which as a weak key's value would keep that key (and the model) alive where no generate_batch pops it
                _refused.setdefault(model, type(error)(*error.args))
        return original(self, error, *args, **kwargs)

    return _handle_critical_error


def _raise_refusal(original: Callable) -> Callable:
    def generate_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            _refused.pop(self, None)
        out = original(self, *args, **kwargs)
        with _lock:
            error = _refused.pop(self, None)
        if error is not None:
            raise error
        return out

    return generate_batch


def attach() -> None:
    """While any patch is active, continuous batching's refusals reach the caller (idempotent)."""

    def build() -> list[Replacement]:
        mixin, manager = _classes()
        if mixin is None or manager is None or not hasattr(manager, "_handle_critical_error") \
                or not hasattr(mixin, "generate_batch"):
            return []
        return [
            Replacement(manager, "_handle_critical_error", _note_refusal(manager._handle_critical_error),
                        "ContinuousBatchingManager._handle_critical_error (notes patchkit's refusals)"),
            Replacement(mixin, "generate_batch", _raise_refusal(mixin.generate_batch),
                        "ContinuousMixin.generate_batch (raises them in the caller's thread)"),
        ]

    _hook.attach(build)


def detach() -> None:
    """The last patch is gone: continuous batching handles errors as transformers does."""
    _hook.detach()
