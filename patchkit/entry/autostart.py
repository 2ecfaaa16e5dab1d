"""PATCHKIT_FLASH_ATTN=1 alone: the class patch, applied when a served family's modeling module is imported.

Called by the startup hook (`_patchkit_startup`, run from patchkit-startup.pth) right after the modeling module of
a family patchkit serves (`transformers.models.<family>.modeling_<family>`) has executed; announced once.
patchkit's own entry points that decide about patching themselves (the launcher, `patchkit verify`,
`patchkit bench`) call `stand_down()` first.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import site
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from patchkit.entry.process_report import rank_label, report_at_exit
from patchkit.env import ENV_FLASH_ATTN, ENV_PATCH
from patchkit.errors import PatchkitError, PatchNameError

if TYPE_CHECKING:  # imported where used: `patchkit --help` and `stand_down` must not import torch
    from patchkit.api import PatchHandle
    from patchkit.entry.config import PatchArguments
    from patchkit.handles import PatchGroup

PTH_NAME = "patchkit-startup.pth"
ORIGIN = f"applied when a served family's modeling module was imported, because {ENV_FLASH_ATTN} is on"


def stand_down(owner: str) -> None:
    """`owner` decides about patching in this process: the startup hook will not apply anything."""
    hook = sys.modules.get("_patchkit_startup")
    if hook is not None:
        hook.stand_down(owner)


def announce(handle: PatchHandle | PatchGroup, args: PatchArguments, stream: Any = None) -> None:
    """The one line on stderr: which variable did it, which patch, which backend, which process."""
    from patchkit.handles import PatchGroup

    scope = "every family patchkit serves" if isinstance(handle, PatchGroup) else f"every {handle.spec.family} model"
    print(
        f"patchkit: {ENV_FLASH_ATTN}={os.environ.get(ENV_FLASH_ATTN, '')}, {rank_label()}: patch {handle.name!r} "
        f"applied to {scope} in this process, backend {handle.backend!r} (requested {args.attn_backend!r}, "
        f"strict={args.patch_strict}, unpad={args.patch_unpad!r})",
        file=stream or sys.stderr,
        flush=True,
    )


def apply_at_import() -> Optional[PatchHandle | PatchGroup]:
    """Apply the class patch PATCHKIT_* ask for, unless an explicit apply_patch in this process is doing it now; a
    value that is not one ends the process with one line naming it."""
    from patchkit.api import active_patches, applying
    from patchkit.entry.config import PatchArguments, apply_from_args

    if applying():
        return None  # apply_patch imported LLaMA itself: the explicit call decides, and applies once
    try:
        args = PatchArguments.from_env()
    except ValueError as exc:  # one line naming the variable, not a traceback through the user's import
        raise SystemExit(f"patchkit: {exc}. The startup hook reads it when a model family is imported; fix or "
                         "unset it.") from None
    if not args.flash_attn:
        return None
    if any(h.key[0] == "class" for h in active_patches()):
        return None  # already applied in this process (same options: the same handle; else apply_patch says so)
    try:
        handle = apply_from_args(args)
    except ValueError as exc:  # PATCHKIT_PATCH names no family this transformers serves: one line, as for a bad value
        if isinstance(exc, PatchkitError) and not isinstance(exc, PatchNameError):
            raise
        raise SystemExit(f"patchkit: {ENV_PATCH}: {exc}. Fix or unset it.") from None
    if handle is not None:
        handle.origin = ORIGIN
        announce(handle, args)
        # as the launcher does (loud if no layer ran through it), named for the variable that applied it
        atexit.register(report_at_exit, handle, None, f"patchkit ({ENV_FLASH_ATTN})")
    return handle


def startup_hook() -> dict[str, Any]:
    """Where the startup hook is installed and whether it runs in this process (for `patchkit doctor`)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, "getsitepackages") else sys.path
    pth = next((str(Path(d) / PTH_NAME) for d in dirs if (Path(d) / PTH_NAME).is_file()), None)
    hook = sys.modules.get("_patchkit_startup")
    return {
        "pth": pth,
        "module": importlib.util.find_spec("_patchkit_startup") is not None,
        "active": hook is not None and any(f is getattr(hook, "PostImportFinder", None) for f in sys.meta_path),
        ENV_FLASH_ATTN: os.environ.get(ENV_FLASH_ATTN),
    }
