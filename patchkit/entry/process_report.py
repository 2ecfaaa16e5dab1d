"""What one process says about its patch: which rank it is, and at exit how much ran through the patch.

Shared by the launcher and the PATCHKIT_FLASH_ATTN startup patch, each naming itself in the line.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional


def rank_label() -> str:
    """'rank R/W (local L)' from torchrun/accelerate variables, or 'single process'."""
    rank, world, local = (os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if rank is None and local is None:
        return "rank 0/1 (single process)"
    return f"rank {rank if rank is not None else local}/{world or '?'} (local {local if local is not None else '?'})"


def report_at_exit(handle: Optional[Any], stream: Any = None, who: str = "patchkit.launch") -> None:
    """At exit, one line per process, named for the way in that applied the patch (`who`): how many attention
    layers ran through it and how many forwards stepped aside; loud when none ran through it."""
    if handle is None:
        return
    stream = stream or sys.stderr
    aside = ", ".join(f"{n} {cause}" for cause, n in handle.stepped_aside.items())
    if handle.layers_seen:
        print(
            f"{who}: {rank_label()}: {handle.layers_seen} attention layers ran through patch "
            f"{handle.name!r} ({handle.calls} calls, backend {handle.backend!r}"
            + (f"; forwards stepped aside to transformers' attention: {aside})" if aside else ")"),
            file=stream,
        )
    else:
        print(
            f"{who}: {rank_label()}: WARNING: no attention layer ran through patch {handle.name!r}. "
            "The script ran no forward of a model patchkit serves (patchkit.available_patches() lists them), or its "
            "model's attention was replaced by other code; it ran without patchkit"
            + (f" (forwards stepped aside to transformers' attention: {aside})." if aside else "."),
            file=stream,
        )
    stream.flush()
