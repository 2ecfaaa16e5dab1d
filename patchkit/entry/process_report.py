"""What one process says about its patch: which rank it is, and at exit how much ran through the patch.

Shared by the launcher and the PATCHKIT_FLASH_ATTN startup patch, each naming itself in the line. The processes a
launched command starts (torchrun's ranks, a re-launch) also write their count to the launcher's report file
(PATCHKIT_REPORT_TO), so the launcher's own last line can say that they ran patched instead of "ran without patchkit".
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
from typing import Any, Optional

ENV_REPORT_TO = "PATCHKIT_REPORT_TO"  # the launcher's report file: each process it starts appends one line at exit
CHANNEL_PREFIX = "patchkit-report-"  # then the launcher's pid: a command that exec'd itself in its place has it too


def rank_label() -> str:
    """'rank R/W (local L)' from torchrun/accelerate variables, or 'single process'."""
    rank, world, local = (os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if rank is None and local is None:
        return "rank 0/1 (single process)"
    return f"rank {rank if rank is not None else local}/{world or '?'} (local {local if local is not None else '?'})"


def record(handle: Any) -> dict[str, Any]:
    """What this process tells the launcher's report file: its rank, its patch, its layers and calls."""
    return {"pid": os.getpid(), "rank": rank_label(), "patch": handle.name, "layers": handle.layers_seen,
            "calls": handle.calls}


def send(records: list[dict[str, Any]], path: Optional[str]) -> None:
    """Append `records` to the report file at `path` (one JSON line each, one small append: ranks exit together);
    nothing when there is none or it cannot be written (the process's own line still says it all)."""
    if not path or not records:
        return
    if os.path.basename(path).startswith(f"{CHANNEL_PREFIX}{os.getpid()}-"):  # the launcher's own pid: this process
        with contextlib.suppress(OSError):  # exec'd itself in the launcher's place, which will never read the file
            os.unlink(path)
        return
    try:
        with open(path, "a", encoding="utf-8") as file:
            file.write("".join(json.dumps(r) + "\n" for r in records))
    except OSError:
        pass


def received(path: Optional[str]) -> list[dict[str, Any]]:
    """The records the processes a launcher started appended to its report file (none where it is unreadable)."""
    if not path:
        return []
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            found = json.loads(line)
        except ValueError:
            continue  # a line cut short by a process killed while writing it
        if isinstance(found, dict) and found.get("pid") != os.getpid():
            records.append(found)
    return records


def open_channel() -> tuple[Optional[str], Optional[str]]:
    """A new report file for the processes this launcher starts, named in their environment (PATCHKIT_REPORT_TO);
    returns it and the one this process inherited (a launcher in front of this one), or None where none can be made."""
    parent = os.environ.get(ENV_REPORT_TO)
    sweep_stale(tempfile.gettempdir(), keep=parent)
    try:
        fd, path = tempfile.mkstemp(prefix=f"{CHANNEL_PREFIX}{os.getpid()}-", suffix=".jsonl")
    except OSError:
        return None, parent
    os.close(fd)
    os.environ[ENV_REPORT_TO] = path
    return path, parent


def sweep_stale(directory: str, keep: Optional[str] = None) -> None:
    """Remove the report files of launchers that are gone: one killed (torchrun's SIGTERM when another rank fails) or
    ending in os._exit never reached its `close_channel`, and its file stayed in the temp dir. A file's launcher is
    the pid in its name; one still running (or not ours to signal) keeps its file, and so does `keep`."""
    if os.name == "nt":  # os.kill there terminates the process it names; nothing to check with
        return
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(CHANNEL_PREFIX) and e.name.endswith(".jsonl")]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(CHANNEL_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) <= 0 or entry.path == keep or launcher_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)


def launcher_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending; another user's process refuses it: alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def close_channel(path: Optional[str], parent: Optional[str]) -> None:
    """Remove this launcher's report file and name the inherited one again."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    if parent is None:
        os.environ.pop(ENV_REPORT_TO, None)
    else:
        os.environ[ENV_REPORT_TO] = parent


def children_line(handle: Any, children: list[dict[str, Any]]) -> Optional[str]:
    """What the processes this one started ran through the patch, as the end of its own exit line; None where none
    of them ran an attention layer through it."""
    ran = [c for c in children if c.get("layers")]
    if not ran:
        return None
    calls = sum(int(c.get("calls") or 0) for c in ran)
    return (f"{len(ran)} process{'es' if len(ran) > 1 else ''} it started ran attention layers through patch "
            f"{handle.name!r} ({calls} calls; each says so in its own line)")


def heads_clause(handle: Any) -> str:
    """Where the causal LM's head and loss ran, as the handle's report says it (`lm_head.heads_line`)."""
    from patchkit.hooks.head.lm_head import heads_line  # at exit, after a model ran: already imported

    return heads_line(handle.heads).strip()


def report_at_exit(handle: Optional[Any], stream: Any = None, who: str = "patchkit.launch",
                   ended_by: Optional[BaseException] = None, handed_down: bool = False,
                   children: Optional[list[dict[str, Any]]] = None) -> None:
    """At exit, one line per process, named for the way in that applied the patch (`who`): how many attention
    layers ran through it and how many forwards stepped aside; loud when none ran through it nor in the processes it
    started (`children`: the records they sent the launcher, `handed_down`: they inherited the launcher's PATCHKIT_*
    variables), and then why: the exception the process ended with (`ended_by`, else an uncaught one). Without
    `children` the record goes to the launcher's report file, where a launcher started this process."""
    if handle is None:
        return
    if children is None:
        send([record(handle)], os.environ.get(ENV_REPORT_TO))
    stream = stream or sys.stderr
    started = children_line(handle, children or [])
    aside = ", ".join(f"{n} {cause}" for cause, n in handle.stepped_aside.items())
    ended_by = ended_by if ended_by is not None else getattr(sys, "last_value", None)  # uncaught, at interpreter exit
    if isinstance(ended_by, SystemExit) and ended_by.code in (None, 0):
        ended_by = None
    if handle.layers_seen:
        print(
            f"{who}: {rank_label()}: {handle.layers_seen} attention layers ran through patch "
            f"{handle.name!r} ({handle.calls} calls{'; compiled calls are not counted' if compiled(handle) else ''}, "
            f"backend {handle.backend!r}"
            + (f"; forwards stepped aside to transformers' attention: {aside})" if aside else ")")
            + (f"; {heads_clause(handle)}" if getattr(handle, "heads", None) else "")
            + (f"; {started}" if started else ""),
            file=stream,
        )
    elif started is not None:
        ended = f"; it ended with {type(ended_by).__name__}: {str(ended_by)[:200]}" if ended_by is not None else ""
        print(f"{who}: {rank_label()}: no attention layer ran in this process; {started}{ended}.", file=stream)
    elif ended_by is not None:
        print(f"{who}: {rank_label()}: the process ended with {type(ended_by).__name__}: {str(ended_by)[:200]} "
              f"before any attention layer ran through patch {handle.name!r}.", file=stream)
    elif multiprocessing.parent_process() is not None:
        pass  # a worker (a DataLoader's, a pool's) that ran no model: nothing to warn about
    elif others := others_that_ran(handle):
        print(f"{who}: {rank_label()}: no attention layer ran through patch {handle.name!r}; the script's own "
              f"patches ran {others}.", file=stream)
    elif aside:  # the script's forwards reached the patch, and each stepped aside, warned by its cause
        print(f"{who}: {rank_label()}: WARNING: every forward through patch {handle.name!r} in this process stepped "
              f"aside to transformers' attention ({aside}), so none ran patched; each cause's warning names its fix.",
              file=stream)
    else:
        print(
            f"{who}: {rank_label()}: WARNING: no attention layer ran through patch {handle.name!r} in this process. "
            + ("No process it started ran one either (they inherit the patch through PATCHKIT_* variables and "
               "report to it at exit). The " if handed_down else "The ")
            + "script ran no forward of a model patchkit serves (patchkit.available_patches() lists them), or its "
            "model's attention was replaced by other code; it ran without patchkit.",
            file=stream,
        )
    stream.flush()


def others_that_ran(handle: Any) -> str:
    """The patches other than `handle` (and its group's) that attention layers ran through in this process, active
    or reverted: a script's own `apply_patch(model=...)`; '' where none."""
    from patchkit.handles import ACTIVE, REVERTED, add_ran

    mine = {id(h) for h in [handle, *(getattr(handle, "handles", None) or [])]}
    counts: dict[str, list[int]] = {name: list(c) for name, c in REVERTED.items()}
    for other in ACTIVE.values():
        if id(other) not in mine:
            add_ran(counts, other)
    ran = {name: c for name, c in counts.items() if c[0]}
    return ", ".join(f"{name!r}: {layers} attention layers ({calls} calls)" for name, (layers, calls) in ran.items())


def compiled(handle: Any) -> bool:
    """A torch.compile'd call ran through the patch (or one of a group's): its calls are not counted (counting inside
    a graph would recompile it), so the count alone would read as "0 calls"."""
    handles = getattr(handle, "handles", None) or [handle]
    return any(getattr(getattr(h, "state", None), "compiled", False) for h in handles)
