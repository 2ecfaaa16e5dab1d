"""The path of one forward through patchkit, module by module: what docs/architecture.md draws, measured.

Runs a tiny LLaMA under `apply_patch("llama2", backend="sdpa")` on CPU (a padded training step with labels, then
a decode step behind a left-padded prefill) and prints, for each, the patchkit modules its calls enter in order
(consecutive calls in one module counted once) and the packages in order. `--json` prints them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def walk(run: Callable[[], object]) -> list[str]:
    """The patchkit modules `run` enters, in order, consecutive repeats collapsed."""
    seen: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if (name.startswith("patchkit") or name.startswith("patches")) and (not seen or seen[-1] != name):
            seen.append(name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def packages(modules: list[str]) -> list[str]:
    """The packages of `modules` in order (patchkit.hooks.varlen -> hooks), consecutive repeats collapsed."""
    out: list[str] = []
    for m in modules:
        parts = m.split(".")
        subpackage = len(parts) > 1 and (ROOT / "patchkit" / parts[1]).is_dir()
        pkg = "patches" if m.startswith(("patches", "patchkit.patches")) else parts[1] if subpackage else m
        if not out or out[-1] != pkg:
            out.append(pkg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
        model.eval()
        left, lmask = padded_batch("left")
        with torch.no_grad():
            out = model(input_ids=left, attention_mask=lmask, use_cache=True)
            step_mask = torch.cat([lmask, torch.ones_like(lmask[:, :1])], 1)
            decode = walk(lambda: model(input_ids=left[:, :1], attention_mask=step_mask,
                                        past_key_values=out.past_key_values, use_cache=True))
    result = {"padded training step": train, "decode step": decode}
    if args.json:
        print(json.dumps({k: {"modules": v, "packages": packages(v)} for k, v in result.items()}, indent=1))
        return
    for what, modules in result.items():
        print(f"{what}: {len(modules)} module entries, {len(set(modules))} modules")
        print("  modules:  " + " -> ".join(m.removeprefix("patchkit.") for m in modules))
        print("  packages: " + " -> ".join(packages(modules)))


if __name__ == "__main__":
    main()
