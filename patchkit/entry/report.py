"""`patchkit.report()`: every patch active in this process in one text, where the step-aside warnings point, for a
user who holds no handle (`attn_implementation="patchkit"` alone, PATCHKIT_FLASH_ATTN, the launcher) or several."""

from __future__ import annotations

import sys
from typing import Any

from patchkit import api
from patchkit.forward.liveness import live_layers
from patchkit.hooks.install.routing import ROUTE_NAME

NAME_ROUTE = "patchkit.hooks.name.attention_interface"  # its `_state`: the registered name's, made at its first use


def report(detail: bool = False) -> str:
    """Each active patch's report (`apply_patch()` of every family as one, then each other handle: a family's class
    patch, an instance patch), then what ran under `attn_implementation="patchkit"` alone (no class patch wraps
    those models; their forwards count here). `detail=True`: the group's per-family reports too."""
    group = api._GROUP if api._GROUP is not None and api._GROUP.active else None
    parts = [group.report(detail)] if group is not None else []
    parts += [h.report() for h in api.active_patches() if group is None or h not in group.handles]
    named = named_route_report()
    if named:
        parts.append(named)
    if not parts:
        return ("patchkit: no patch is active in this process, and no forward ran under "
                f"attn_implementation={ROUTE_NAME!r}: apply_patch(), PATCHKIT_FLASH_ATTN=1 or "
                f"attn_implementation={ROUTE_NAME!r} turn patchkit on.")
    return "\n".join(parts)


def named_route_report() -> str:
    """The registered name's counts, where a forward ran under it (its state is made at the first one), else ''."""
    state: Any = getattr(sys.modules.get(NAME_ROUTE), "_state", None)
    if state is None:
        return ""
    aside = ", ".join(f"{n} {cause}" for cause, n in state.stepped_aside.items()) or "none"
    layers = max(state.layers_seen, live_layers(state))
    return "\n".join([
        f"patchkit attn_implementation={ROUTE_NAME!r} (the registered name alone, no class patch): backend "
        f"{state.backend.name!r}, strict={state.strict}",
        f"  attention layers through it: {layers} ({state.calls} calls"
        + ("; compiled calls are not counted)" if state.compiled else ")"),
        f"  attention calls stepped aside to transformers' attention: {aside}",  # counted per layer here
    ])
