"""patchkit: FlashAttention varlen kernels with 2D key-padding masks for HuggingFace LLaMA, by gated patches."""

from .api import PatchHandle, active_patches, apply_patch, available_patches, revert_patch
from .attn_interface import ATTENTION_NAME
from .attn_interface import register as register_attention
from .errors import PatchGateError, PatchInputError, PatchkitError, PatchTargetError

__version__ = "0.1.0"

try:  # attn_implementation="patchkit" works as soon as patchkit is imported (transformers >= 4.53)
    register_attention()
except Exception:  # noqa: BLE001 - a broken transformers must not make `import patchkit` fail
    pass

__all__ = [
    "ATTENTION_NAME",
    "PatchGateError",
    "PatchHandle",
    "PatchInputError",
    "PatchTargetError",
    "PatchkitError",
    "active_patches",
    "apply_patch",
    "available_patches",
    "register_attention",
    "revert_patch",
]
