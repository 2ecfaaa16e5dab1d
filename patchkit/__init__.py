"""patchkit: FlashAttention varlen kernels with 2D key-padding masks for HuggingFace LLaMA, by gated patches."""

from .api import PatchHandle, active_patches, apply_patch, available_patches, revert_patch
from .errors import PatchGateError, PatchInputError, PatchkitError, PatchTargetError

__version__ = "0.1.0"

__all__ = [
    "PatchGateError",
    "PatchHandle",
    "PatchInputError",
    "PatchTargetError",
    "PatchkitError",
    "active_patches",
    "apply_patch",
    "available_patches",
    "revert_patch",
]
