"""Launcher: patch first, then run any training script as `__main__` on every rank (a train_mem.py for any script)."""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from patchkit.entry.autostart import stand_down
from patchkit.entry.process_report import (
    close_channel,
    open_channel,
    rank_label,
    received,
    record,
    report_at_exit,
    send,
)
from patchkit.env import ENV_FLASH_ATTN
from patchkit.errors import PatchkitError, PatchNameError
from patchkit.names import BACKEND_NAMES, UNPAD_MODES, patch_names
from patchkit.warn import attributed_to

if TYPE_CHECKING:  # torch is imported once the options parse: `patchkit run --help` answers without it
    from patchkit.api import PatchHandle
    from patchkit.entry.config import PatchArguments

# Usage:
#   python -m patchkit.launch [--patch all|llama2|mistral|...] [--backend auto|flash_attn|torch_varlen|sdpa] \
#       [--strict] SCRIPT.py [args...]
#   python -m patchkit.launch [options] -m package.module [args...]
#   torchrun --nproc_per_node 2 -m patchkit.launch --backend sdpa train.py --lr 1e-4
#   accelerate launch --num_processes 2 -m patchkit.launch train.py --lr 1e-4
# Options come before the script; everything after it reaches the script untouched. Defaults come from
# PATCHKIT_PATCH, PATCHKIT_BACKEND, PATCHKIT_UNPAD and PATCHKIT_STRICT; PATCHKIT_FLASH_ATTN=0 (or --no-patch) runs
# the script unpatched with the same command line.

VALUE_OPTIONS = ("--patch", "--backend", "--unpad")
FLAG_OPTIONS = ("--strict", "--no-strict", "--no-patch", "-h", "--help")


@dataclass
class Target:
    """What to run after patching: a script path or a module name, and its own argv (untouched)."""

    script: Optional[str] = None
    module: Optional[str] = None
    args: list[str] = field(default_factory=list)


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The launcher's own options (parsed from the part of argv before the script)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [--patch NAME] [--backend {{{','.join(BACKEND_NAMES)}}}] [--unpad {{{','.join(UNPAD_MODES)}}}] "
        "[--strict] [--no-patch] "
        "(SCRIPT.py | -m MODULE) [args ...]",
        description="Apply a patchkit patch, then run SCRIPT.py (or -m MODULE) as __main__ with its arguments "
        "untouched. Defaults come from PATCHKIT_PATCH, PATCHKIT_BACKEND, PATCHKIT_UNPAD, PATCHKIT_STRICT; "
        "PATCHKIT_FLASH_ATTN=0 "
        "runs unpatched.",
    )
    parser.add_argument("--patch", metavar="NAME",
                        help="patch to apply: all (every family patchkit serves; the default, or $PATCHKIT_PATCH), a "
                        f"family's model_type (gpt_oss, ...), or one of {', '.join(patch_names()[1:])}")
    parser.add_argument("--backend", choices=BACKEND_NAMES, help="backend (default auto or $PATCHKIT_BACKEND)")
    parser.add_argument("--unpad", choices=UNPAD_MODES,
                        help="remove padding once per model forward (model), in each attention layer (attention), or "
                        "as model with training losses returned alone, no logits (loss); default model or "
                        "$PATCHKIT_UNPAD")
    parser.add_argument("--strict", dest="strict", action="store_true", default=None,
                        help="raise instead of falling back to sdpa when a flash_attn gate fails")
    parser.add_argument("--no-strict", dest="strict", action="store_false", help="override PATCHKIT_STRICT=1")
    parser.add_argument("--no-patch", action="store_true", help="run the script unpatched (like PATCHKIT_FLASH_ATTN=0)")
    return parser


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], Target]:
    """Split argv at the script (or -m MODULE): launcher options before it, the script's own argv after it."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            i += 1
            break
        if tok == "-m" or (tok.startswith("-m") and len(tok) > 2 and not tok.startswith("--")):
            module = argv[i + 1] if tok == "-m" and i + 1 < len(argv) else tok[2:]
            if not module:
                parser.error("-m needs a module name")
            return argv[:i], Target(module=module, args=argv[i + (2 if tok == "-m" else 1):])
        if tok in VALUE_OPTIONS:
            i += 2
        elif tok in FLAG_OPTIONS or any(tok.startswith(o + "=") for o in VALUE_OPTIONS):
            i += 1
        elif tok.startswith("-"):
            parser.error(f"unknown launcher option {tok!r}; launcher options go before the script, the script's own "
                         "options after it")
        else:
            break
    options = [t for t in argv[:i] if t != "--"]
    if i >= len(argv):
        parser.parse_args(options)  # --help exits here
        parser.error("no script given: pass SCRIPT.py or -m MODULE after the launcher options")
    return options, Target(script=argv[i], args=argv[i + 1:])


def resolve_options(ns: argparse.Namespace) -> PatchArguments:
    """Flags over PATCHKIT_* variables over defaults; the launcher itself opts in unless told not to."""
    from patchkit.entry.config import PatchArguments

    defaults = {"flash_attn": True}
    args = PatchArguments.from_env(**defaults)
    if ns.no_patch:
        args.flash_attn = False
    if ns.patch is not None:
        args.patch = ns.patch
    if ns.backend is not None:
        args.attn_backend = ns.backend
    if ns.strict is not None:
        args.patch_strict = ns.strict
    if ns.unpad is not None:
        args.patch_unpad = ns.unpad
    return args


def announce(handle: Optional[PatchHandle], args: PatchArguments, stream=None) -> None:
    """One line per process on stderr: which rank, which patch, which backend (or that nothing was patched)."""
    stream = stream or sys.stderr
    if handle is None:
        print(f"patchkit.launch: {rank_label()}: not patched (PATCHKIT_FLASH_ATTN=0 or --no-patch)", file=stream)
    else:
        print(
            f"patchkit.launch: {rank_label()}: patch {handle.name!r} applied, backend {handle.backend!r} "
            f"(requested {args.attn_backend!r}, strict={args.patch_strict})",
            file=stream,
        )
    stream.flush()


def run_target(target: Target) -> None:
    """Run the script or module as `__main__`, with sys.argv and sys.path[0] set as `python` itself would."""
    if target.module is not None:
        sys.argv = [target.module, *target.args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        return
    script = target.script or ""
    sys.argv = [script, *target.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def resolve_script(script: str) -> str:
    """The file to run: `script` where it exists, else a command on PATH (`axolotl`, `llamafactory-cli`) whose file
    is a Python script (a console script pip wrote), as `python -m`'s runpy would run it. Checked before any heavy
    import, so a typo fails at once."""
    if os.path.exists(script):
        return script
    command = shutil.which(script) if os.sep not in script else None
    if command is None:
        raise SystemExit(f"patchkit.launch: script not found: {script!r} is neither a file nor a command on PATH")
    try:
        with open(command, "rb") as file:
            first = file.readline(256)
    except OSError as exc:
        raise SystemExit(f"patchkit.launch: cannot read the command {script!r} ({command}): {exc}") from None
    if not (first.startswith(b"#!") and b"python" in first):
        raise SystemExit(
            f"patchkit.launch: the command {script!r} ({command}) is not a Python script, so the launcher cannot run "
            f"it in its own process; run it with {ENV_FLASH_ATTN}=1 set instead (every Python process it starts "
            "patches itself)"
        )
    return command


def main(argv: Optional[list[str]] = None, prog: str = "python -m patchkit.launch") -> int:
    """Parse launcher options, patch (every rank), then run the target; returns the exit code."""
    stand_down("the launcher")  # it reads PATCHKIT_FLASH_ATTN itself: the startup hook must not apply a second patch
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    options, target = split_argv(argv, parser)
    ns = parser.parse_args(options)
    if target.script is not None:
        target.script = resolve_script(target.script)
    try:
        args = resolve_options(ns)
    except ValueError as exc:
        parser.error(str(exc))
    from patchkit.entry.config import apply_from_args

    try:
        with attributed_to(target.script or target.module or "<launcher>"):
            handle = apply_from_args(args)  # its warnings name the user's script, not the launcher's lines
    except PatchNameError as exc:  # a --patch (or PATCHKIT_PATCH) that names no family this transformers serves
        parser.error(str(exc))
    except PatchkitError as exc:
        print(f"patchkit.launch: {rank_label()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    announce(handle, args)
    os.environ.update(args.to_env())  # a command that re-executes itself or starts workers: they patch the same way
    channel, parent = open_channel() if handle is not None else (None, None)  # and they report back to this process
    ended_by: Optional[BaseException] = None
    try:
        run_target(target)
    except BaseException as exc:
        ended_by = exc
        raise
    finally:
        children = received(channel)
        report_at_exit(handle, ended_by=ended_by, handed_down=True, children=children)
        if handle is not None:  # a launcher in front of this one counts this process and the ones it started
            send([record(handle), *children], parent)
        close_channel(channel, parent)
    return 0
