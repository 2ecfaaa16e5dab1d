"""Test instrumentation for the user scripts: counts every run of transformers' padded attention and mask builders.

A user script imports this, calls `install()` before it builds its model and `report()` at its end; it never
imports patchkit. `report()` prints one `SPY {json}` line: how often HF's eager/sdpa attention and its
(B, 1, N, N) mask builders ran (zero when patchkit served every layer), whether patchkit was imported (by the
startup hook or the registered name), and the calls of its active patches.
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any, Callable

COUNTS: collections.Counter = collections.Counter()
MARKS: dict[str, bool] = {}
MASKS_COUNTED = [True]


def _counting(name: str, fn: Callable) -> Callable:
    def spy(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return spy


def install() -> None:
    """Wrap HF's eager and sdpa attention functions and mask builders (the padded softmax path)."""
    import transformers.models.llama.modeling_llama as modeling_llama
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling_llama.eager_attention_forward = _counting("attention:eager", modeling_llama.eager_attention_forward)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _counting("attention:sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"])
    try:  # transformers >= 4.53 builds masks through this interface; older versions in LlamaModel (not counted)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:
        MASKS_COUNTED[0] = False
        return
    for name in ("eager", "sdpa"):
        ALL_MASK_ATTENTION_FUNCTIONS[name] = _counting(f"mask:{name}", ALL_MASK_ATTENTION_FUNCTIONS[name])


def mark(label: str) -> None:
    """Record whether patchkit is imported at this point of the script."""
    MARKS[label] = "patchkit" in sys.modules


def report(**extra: Any) -> None:
    patchkit = sys.modules.get("patchkit")
    handles = patchkit.active_patches() if patchkit is not None else []
    print("SPY " + json.dumps({
        "padded_attention": sum(v for k, v in COUNTS.items() if k.startswith("attention:")),
        "padded_masks": sum(v for k, v in COUNTS.items() if k.startswith("mask:")) if MASKS_COUNTED[0] else None,
        "patchkit_imported": patchkit is not None,
        "marks": MARKS,
        "patches": [[h.name, h.backend, h.calls] for h in handles if h.calls],  # the patches that served calls
        "active": sorted(h.name for h in handles),
        **extra,
    }), flush=True)
