"""The path of one forward through patchkit, module by module: what docs/architecture.md draws, measured.

Runs a tiny LLaMA under `apply_patch("llama2", backend="sdpa")` on CPU (a padded training step with labels, then
a decode step behind a left-padded prefill) and prints, for each, the patchkit modules its calls enter in order
(consecutive calls in one module counted once), the packages in order, how often each room (hooks/ by its
sub-packages) is entered, and every upward call: a call from a
package into one above it in the layer table (tests/test_layers.py), which only a callback handed down can make.
`--json` prints them as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


ENTRIES_OF: dict[str, dict[str, dict[str, int]]] = {}  # `walks()`'s ENTRIES, by walk
ENTRIES: dict[str, dict[str, int]] = {}  # the last walk's calls into each room from another, by "caller -> callee"


def walk(run: Callable[[], object]) -> tuple[list[str], dict[str, int]]:
    """The patchkit modules `run` enters, in order, consecutive repeats collapsed; and its upward calls, counted by
    "caller -> callee" (a generator resumed is no call). The calls into each room from another room (hooks/ by its
    sub-packages; from transformers too) are left in `ENTRIES`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_layers import LAYERS, node_of

    rank = {node: i for i, layer in enumerate(LAYERS) for node in layer}
    seen: list[str] = []
    upward: dict[str, int] = {}
    ENTRIES.clear()

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if (name.startswith("patchkit") or name.startswith("patches")) and (not seen or seen[-1] != name):
            seen.append(name)
        caller = frame.f_back
        while caller is not None and caller.f_globals.get("__name__", "").startswith("torch._dynamo"):
            caller = caller.f_back  # torch.compiler.disable's wrapper: the call is its caller's
        callee_node = node_of(name)
        caller_node = None if caller is None else node_of(caller.f_globals.get("__name__", ""))
        resumed = frame.f_code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > 0
        if callee_node is not None and callee_node != caller_node and not resumed:
            where = "transformers" if caller is None else caller.f_globals.get("__name__", "?").split(".")[-1]
            what = "" if caller is None else caller.f_code.co_name
            key = f"{where}.{what} -> {name.split('.')[-1]}.{frame.f_code.co_name}"
            room = ENTRIES.setdefault(callee_node, {})
            room[key] = room.get(key, 0) + 1
        if callee_node is None or caller_node is None or resumed:
            return
        if rank[callee_node] > rank[caller_node]:
            key = (f"{caller.f_globals['__name__']}.{caller.f_code.co_name} -> "
                   f"{name}.{frame.f_code.co_name}")
            upward[key] = upward.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen, upward


def packages(modules: list[str]) -> list[str]:
    """The packages of `modules` in order (patchkit.hooks.attention.varlen -> hooks), consecutive repeats collapsed."""
    out: list[str] = []
    for m in modules:
        parts = m.split(".")
        subpackage = len(parts) > 1 and (ROOT / "patchkit" / parts[1]).is_dir()
        pkg = "patches" if m.startswith(("patches", "patchkit.patches")) else parts[1] if subpackage else m
        if not out or out[-1] != pkg:
            out.append(pkg)
    return out


def rooms(entries: dict[str, dict[str, int]]) -> dict[str, int]:
    """How many calls enter each room from another (`ENTRIES` of a walk), busiest first."""
    counts = {room: sum(calls.values()) for room, calls in entries.items()}
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def walks() -> dict[str, tuple[list[str], dict[str, int]]]:
    """The walk of a padded training step and of a decode step of a tiny LLaMA, patched on the sdpa backend."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from models import labels_for, padded_batch, tiny_model

    import patchkit

    model = tiny_model()
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        model(input_ids=ids, attention_mask=mask, labels=labels)  # warm: lazy imports and first-call checks
        train = walk(lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward())
        train_entries = {room: dict(calls) for room, calls in ENTRIES.items()}
        model.eval()
        left, lmask = padded_batch("left")
        with torch.no_grad():
            out = model(input_ids=left, attention_mask=lmask, use_cache=True)
            step_mask = torch.cat([lmask, torch.ones_like(lmask[:, :1])], 1)
            decode = walk(lambda: model(input_ids=left[:, :1], attention_mask=step_mask,
                                        past_key_values=out.past_key_values, use_cache=True))
    ENTRIES_OF.update({"padded training step": train_entries, "decode step": dict(ENTRIES)})
    return {"padded training step": train, "decode step": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = walks()
    if args.json:
        print(json.dumps({k: {"modules": v, "packages": packages(v), "entries": ENTRIES_OF[k], "upward": up}
                          for k, (v, up) in result.items()}, indent=1))
        return
    for what, (modules, upward) in result.items():
        ups = sum(upward.values())
        print(f"{what}: {len(modules)} module entries, {len(set(modules))} modules, {ups} upward calls")
        print("  modules:  " + " -> ".join(m.removeprefix("patchkit.") for m in modules))
        print("  packages: " + " -> ".join(packages(modules)))
        print("  calls into each room: " + ", ".join(f"{room} {n}" for room, n in rooms(ENTRIES_OF[what]).items()))
        for call, count in ENTRIES_OF[what].get("hooks.decide", {}).items():
            print(f"  into hooks.decide: {call} ({count}x)")
        for call, count in upward.items():
            print(f"  upward:   {call} ({count}x)")


if __name__ == "__main__":
    main()
