"""Exception types, so callers can catch patchkit's refusals precisely."""

from __future__ import annotations


class PatchkitError(RuntimeError):
    """Base class of every error patchkit raises on purpose."""


class PatchGateError(PatchkitError):
    """A gate failed: the patch (or the requested backend) cannot run here; nothing was patched."""


class PatchTargetError(PatchkitError):
    """The objects a patch replaces are missing, or the patch is not live in a model."""


class PatchNameError(PatchkitError, ValueError):
    """A patch or family name patchkit does not know (a ValueError too, as it was)."""


class PatchInputError(PatchkitError, ValueError):
    """An input the patched attention cannot serve exactly (a 4D mask, a mask of the wrong length, ...)."""


class PatchStateError(PatchkitError, AttributeError):
    """patchkit's objects met code patchkit does not own: the patch changed while a forward was in flight."""
