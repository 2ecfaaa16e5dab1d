"""What the distributed test user scripts share: the way in, checked; the result written; the process group ended."""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn, Optional

import torch


def checked_way(way: str, allowed: tuple[str, ...]) -> str:
    """`way` if it is one of `allowed` and PATCHKIT_FLASH_ATTN is on for way 'env' and only for it (the launcher
    sets it itself, for the processes its command starts), else exit."""
    if way not in allowed:
        sys.exit(f"unknown way {way!r} (one of {', '.join(allowed)})")
    if way == "env" and os.environ.get("PATCHKIT_FLASH_ATTN") != "1":
        sys.exit("way 'env' needs PATCHKIT_FLASH_ATTN=1 in the environment (the startup hook applies the patch)")
    if way == "launcher" and not ("patchkit" in sys.modules and sys.modules["patchkit"].active_patches()):
        sys.exit("way 'launcher' must run under python -m patchkit.launch (nothing was patched before the script)")
    if way not in ("env", "launcher") and os.environ.get("PATCHKIT_FLASH_ATTN", "0") not in ("", "0"):
        sys.exit(f"way {way!r} must run without PATCHKIT_FLASH_ATTN")
    return way


def flash_attention_2_stand_in() -> None:
    """transformers' own "flash_attention_2" in this process over the CPU stand-in of flash-attn (tests/fakes.py), as
    the tests install it; kept for the process's life."""
    import pytest

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fakes

    fakes.install_transformers_flash_attention_2(pytest.MonkeyPatch())


def patchkit_calls() -> int:
    """Attention calls through every active patch, 0 where the script never imported patchkit."""
    patchkit = sys.modules.get("patchkit")
    return sum(h.calls for h in patchkit.active_patches()) if patchkit else 0


def patchkit_heads() -> dict:
    """Where the LM head and loss ran, over every active patch (a handle's `heads`), {} without patchkit."""
    patchkit, heads = sys.modules.get("patchkit"), {}
    for handle in patchkit.active_patches() if patchkit else ():
        for why, n in handle.heads.items():
            heads[why] = heads.get(why, 0) + n
    return heads


def write_result(tag: str, out: str, result: dict, tensors: Optional[dict] = None) -> None:
    """OUT gets the JSON result (and OUT.pt the tensors); stdout a `TAG {json}` line."""
    if tensors is not None:
        torch.save(tensors, out.replace(".json", ".pt"))
    with open(out, "w") as f:
        json.dump(result, f)
    print(tag, json.dumps(result), flush=True)


def end_process_group() -> NoReturn:
    """A well-behaved distributed script ends its process group, then the process, without interpreter teardown.

    Left to interpreter exit, gloo's threads were torn down under a live peer and one rank aborted ("terminate called
    without an active exception") after a passing run; the barrier keeps a rank from tearing gloo down while its peer
    is still in flight. `destroy_process_group` only forgets the groups: DeepSpeed's engine and accelerate hold
    subgroups (the sequence-parallel and ZeRO data-parallel ones), whose gloo threads then died in the interpreter's
    teardown in whatever order it took (once in CI: the unpatched ZeRO-3 Ulysses script's rank 1, at its end).
    Everything the script owes is written by now, so it exits at once."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
