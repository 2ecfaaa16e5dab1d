"""Replace attributes all or nothing, and put the exact original objects back on revert."""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import PatchTargetError

_MISSING = object()


@dataclasses.dataclass
class Replacement:
    """One attribute to replace: `owner.attr = new`, remembering what was there."""

    owner: Any
    attr: str
    new: Any
    label: str = ""
    original: Any = dataclasses.field(default=_MISSING, repr=False)
    had_own: bool = dataclasses.field(default=False, repr=False)

    def describe(self) -> str:
        if self.label:
            return self.label
        owner = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", None)
        return f"{owner or type(self.owner).__name__}.{self.attr}"


def _is_data_descriptor(owner: Any, attr: str) -> bool:
    cls_attr = getattr(type(owner), attr, None)
    return hasattr(cls_attr, "__set__")


def apply_replacements(replacements: list[Replacement]) -> None:
    """Check every target exists, then set them all; on any failure undo what was set and re-raise."""
    missing = [r.describe() for r in replacements if not hasattr(r.owner, r.attr)]
    if missing:
        raise PatchTargetError(
            f"patch targets not found: {', '.join(missing)}. This transformers build does not have them; "
            "nothing was patched. Check `patchkit.available_patches()` for the supported versions."
        )
    done: list[Replacement] = []
    try:
        for r in replacements:
            own = vars(r.owner) if hasattr(r.owner, "__dict__") else {}
            r.had_own = r.attr in own
            r.original = own[r.attr] if r.had_own else getattr(r.owner, r.attr)
            setattr(r.owner, r.attr, r.new)
            done.append(r)
    except BaseException:
        restore_replacements(done)
        raise


def restore_replacements(replacements: list[Replacement]) -> None:
    """Undo in reverse order: the original object goes back (identity), or the instance attribute goes away."""
    for r in reversed(replacements):
        if r.original is _MISSING:
            continue
        if r.had_own or _is_data_descriptor(r.owner, r.attr):
            setattr(r.owner, r.attr, r.original)
        else:
            delattr(r.owner, r.attr)
        r.original = _MISSING
