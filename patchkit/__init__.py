"""patchkit: FlashAttention varlen kernels with 2D key-padding masks for LLaMA-class transformers families."""

__version__ = "0.1.0"

import importlib
from typing import Any

from patchkit.api import PatchHandle, active_patches, apply_patch, available_patches, revert_patch
from patchkit.dtypes import cast_for_training, default_dtype
from patchkit.entry.config import PatchArguments, PatchOptions, apply_from_args, apply_from_env
from patchkit.entry.doctor import doctor
from patchkit.errors import PatchGateError, PatchInputError, PatchkitError, PatchTargetError
from patchkit.hooks.attention_interface import ATTENTION_NAME
from patchkit.hooks.attention_interface import register as register_attention

try:  # attn_implementation="patchkit" works as soon as patchkit is imported (transformers >= 4.53)
    register_attention()
except Exception:  # noqa: BLE001 - a broken transformers must not make `import patchkit` fail
    pass


def __getattr__(name: str) -> Any:
    """`patchkit.nn` after a plain `import patchkit`, loaded on first use (it is not needed to patch a model)."""
    if name == "nn":
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTENTION_NAME",
    "PatchArguments",
    "PatchGateError",
    "PatchHandle",
    "PatchInputError",
    "PatchOptions",
    "PatchTargetError",
    "PatchkitError",
    "active_patches",
    "apply_from_args",
    "apply_from_env",
    "apply_patch",
    "available_patches",
    "cast_for_training",
    "default_dtype",
    "doctor",
    "register_attention",
    "revert_patch",
]
