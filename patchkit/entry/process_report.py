"""What one process says about its patch: which rank it is, and at exit how much ran through the patch.

Shared by the launcher and the PATCHKIT_FLASH_ATTN startup patch, each naming itself in the line.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from typing import Any, Optional


def rank_label() -> str:
    """'rank R/W (local L)' from torchrun/accelerate variables, or 'single process'."""
    rank, world, local = (os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if rank is None and local is None:
        return "rank 0/1 (single process)"
    return f"rank {rank if rank is not None else local}/{world or '?'} (local {local if local is not None else '?'})"


def report_at_exit(handle: Optional[Any], stream: Any = None, who: str = "patchkit.launch",
                   ended_by: Optional[BaseException] = None, handed_down: bool = False) -> None:
    """At exit, one line per process, named for the way in that applied the patch (`who`): how many attention
    layers ran through it and how many forwards stepped aside; loud when none ran through it, and then why: the
    exception the process ended with (`ended_by`, else an uncaught one), or that the processes it started inherited
    the patch (`handed_down`: the launcher's PATCHKIT_* variables) and report for themselves."""
    if handle is None:
        return
    stream = stream or sys.stderr
    aside = ", ".join(f"{n} {cause}" for cause, n in handle.stepped_aside.items())
    ended_by = ended_by if ended_by is not None else getattr(sys, "last_value", None)  # uncaught, at interpreter exit
    if isinstance(ended_by, SystemExit) and ended_by.code in (None, 0):
        ended_by = None
    if handle.layers_seen:
        print(
            f"{who}: {rank_label()}: {handle.layers_seen} attention layers ran through patch "
            f"{handle.name!r} ({handle.calls} calls{'; compiled calls are not counted' if compiled(handle) else ''}, "
            f"backend {handle.backend!r}"
            + (f"; forwards stepped aside to transformers' attention: {aside})" if aside else ")"),
            file=stream,
        )
    elif ended_by is not None:
        print(f"{who}: {rank_label()}: the process ended with {type(ended_by).__name__}: {str(ended_by)[:200]} "
              f"before any attention layer ran through patch {handle.name!r}.", file=stream)
    elif multiprocessing.parent_process() is not None:
        pass  # a worker (a DataLoader's, a pool's) that ran no model: nothing to warn about
    else:
        print(
            f"{who}: {rank_label()}: WARNING: no attention layer ran through patch {handle.name!r} in this process. "
            + ("Processes it started inherited the patch (PATCHKIT_* variables) and report for themselves; if it "
               "started none, the " if handed_down else "The ")
            + "script ran no forward of a model patchkit serves (patchkit.available_patches() lists them), or its "
            "model's attention was replaced by other code; it ran without patchkit"
            + (f" (forwards stepped aside to transformers' attention: {aside})." if aside else "."),
            file=stream,
        )
    stream.flush()


def compiled(handle: Any) -> bool:
    """A torch.compile'd call ran through the patch (or one of a group's): its calls are not counted (counting inside
    a graph would recompile it), so the count alone would read as "0 calls"."""
    handles = getattr(handle, "handles", None) or [handle]
    return any(getattr(getattr(h, "state", None), "compiled", False) for h in handles)
