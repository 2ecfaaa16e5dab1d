"""patchkit: FlashAttention varlen kernels with 2D key-padding masks for LLaMA-class transformers families."""

__version__ = "0.1.0"

import importlib
import sys
from typing import Any

from patchkit.env import check_env

# Each public name and the module it lives in: loaded on first use, so `import patchkit` costs neither torch's dynamo
# nor transformers' modeling code until a patch is applied (or one of these names is read).
_LAZY = {
    "PatchHandle": "patchkit.api", "active_patches": "patchkit.api", "apply_patch": "patchkit.api",
    "available_patches": "patchkit.api", "revert_patch": "patchkit.api",
    "cast_for_training": "patchkit.dtypes", "default_dtype": "patchkit.dtypes",
    "PatchArguments": "patchkit.entry.config", "PatchOptions": "patchkit.entry.config",
    "apply_from_args": "patchkit.entry.config", "apply_from_env": "patchkit.entry.config",
    "doctor": "patchkit.entry.doctor",
    "PatchGateError": "patchkit.errors", "PatchInputError": "patchkit.errors",
    "PatchTargetError": "patchkit.errors", "PatchkitError": "patchkit.errors", "PatchNameError": "patchkit.errors",
    "register_attention": "patchkit.hooks.name.attention_interface",  # its `register`
    "report": "patchkit.entry.report",
    "shape_free": "patchkit.forward.inputs.module_hooks",
}
ATTENTION_NAME = "patchkit"  # patchkit.hooks.install.routing.ROUTE_NAME: attn_implementation="patchkit"

check_env()  # a typo fails at `import patchkit`, whether or not the startup hook is on


def _register_when_transformers_loads() -> None:
    """attn_implementation="patchkit" works as soon as patchkit is imported (transformers >= 4.53): now when
    transformers' modeling code is already loaded, else by the startup hook right after it loads (patchkit's own
    functions, since patchkit is imported). Without the hook active here, now, as before."""
    hook = sys.modules.get("_patchkit_startup")
    watching = hook is not None and getattr(hook, "PostImportFinder", None) in sys.meta_path
    loaded = "transformers.modeling_utils" in sys.modules and "transformers.masking_utils" in sys.modules
    if watching and not loaded:
        return
    try:
        importlib.import_module("patchkit.hooks.name.attention_interface")  # registers the name as it loads
    except Exception:  # noqa: BLE001 - a broken transformers must not make `import patchkit` fail
        pass


_register_when_transformers_loads()


def __getattr__(name: str) -> Any:
    """The public names above, and `patchkit.nn`, loaded on first use."""
    if name == "nn":
        return importlib.import_module(".nn", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), "register" if name == "register_attention" else name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "nn"})


__all__ = [
    "ATTENTION_NAME",
    "PatchArguments",
    "PatchGateError",
    "PatchHandle",
    "PatchInputError",
    "PatchNameError",
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
    "report",
    "revert_patch",
]
