"""One handle for `apply_patch()` with no name: every family's class patch, reverted, checked and reported together."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch import nn

from patchkit.errors import PatchTargetError
from patchkit.hooks.forwards.lm_head import heads_line
from patchkit.hooks.install.model_walk import model_config
from patchkit.hooks.install.registry import spec_for_model
from patchkit.names import GROUP_NAME


class PatchGroup:
    """The class patches of every family that passed its gates, plus the families skipped and why.

    It reads like a `PatchHandle` (name, backend, revert, context manager, report, layers counts), so the
    launcher and the config flag treat one patch and every family alike.
    """

    def __init__(self, handles: list[Any], skipped: dict[str, str]) -> None:
        self.handles = handles
        self.skipped = skipped  # patch name -> the gate that kept it off

    name = GROUP_NAME

    @property
    def backend(self) -> str:
        return self.handles[0].backend

    @property
    def options(self) -> tuple:
        """(backend requested, strict, unpad), as every family was applied with."""
        return self.handles[0].options

    @property
    def active(self) -> bool:
        return any(h.active for h in self.handles)

    @property
    def origin(self) -> Optional[str]:
        return self.handles[0].origin

    @origin.setter
    def origin(self, value: Optional[str]) -> None:
        for handle in self.handles:
            handle.origin = value

    @property
    def model_types(self) -> list[str]:
        return [t for h in self.handles for t in h.spec.model_types]

    @property
    def layers_patched(self) -> int:
        return sum(h.layers_patched for h in self.handles)

    @property
    def layers_seen(self) -> int:
        return sum(h.layers_seen for h in self.handles)

    @property
    def calls(self) -> int:
        return sum(h.calls for h in self.handles)

    @property
    def stepped_aside(self) -> dict[str, int]:
        """Forwards every family ran on transformers' own attention instead, by cause."""
        return self._summed("stepped_aside")

    @property
    def heads(self) -> dict[str, int]:
        """Causal-LM forwards over unpadded batches, every family's, by where their head and loss ran."""
        return self._summed("heads")

    def _summed(self, counts: str) -> dict[str, int]:
        """Every family handle's `counts` (a dict of key -> count), added up by key."""
        out: dict[str, int] = {}
        for handle in self.handles:
            for key, n in getattr(handle, counts).items():
                out[key] = out.get(key, 0) + n
        return out

    def __iter__(self) -> Iterator[Any]:
        return iter(self.handles)

    def handle_for(self, model: nn.Module) -> Any:
        """The family handle serving `model`; a family outside the group raises `PatchTargetError`."""
        spec = spec_for_model(model)
        for handle in self.handles:
            if spec is not None and handle.spec.name == spec.name:
                return handle
        model_type = getattr(model_config(model, self.model_types), "model_type", None)
        why = next((r for n, r in self.skipped.items() if n == model_type), None)
        raise PatchTargetError(
            f"{type(model).__name__} (model_type {model_type!r}) is not served by this patch: "
            + (why if why else f"patchkit patched {', '.join(self.model_types)}")
        )

    def check(self, model: nn.Module) -> int:
        """The family handle's check: how many of `model`'s attention layers run through the patch."""
        return self.handle_for(model).check(model)

    def revert(self) -> None:
        """Revert every family's patch (newest first); a second call does nothing."""
        for handle in reversed(self.handles):
            handle.revert()

    def __enter__(self) -> PatchGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.revert()

    def report(self, detail: bool = False) -> str:
        """A summary first: the backend, the families that ran with their counts, the forwards stepped aside by
        cause, the families skipped and why; `detail=True` then adds each family's own report (gates, replacements,
        counts), those that ran first. The families patched that ran nothing yet end it, on one line."""
        requested, strict, unpad = self.options
        ran = [h for h in self.handles if h.calls or h.layers_seen or h.stepped_aside]
        idle = [h for h in self.handles if h not in ran]
        aside = self.stepped_aside
        lines = [
            f"patchkit patch {GROUP_NAME!r}: backend {self.backend!r} (requested {requested!r}, strict={strict}), "
            f"unpad {unpad!r}; {len(self.handles)} families patched, {len(self.skipped)} skipped",
            "  ran: " + (", ".join(f"{h.name} ({h.layers_patched} attention layers, {h.calls} calls)" for h in ran)
                         or "no forward through any family yet"),
            "  forwards stepped aside to transformers' attention: "
            + (", ".join(f"{n} {cause}" for cause, n in aside.items()) or "none"),
            *([heads_line(self.heads)] if self.heads else []),
            *(f"  skipped {name}: {why}" for name, why in self.skipped.items()),
        ]
        if detail:
            lines += [h.report() for h in ran + idle]
        else:
            lines.append("  (report(detail=True): each family's gates, replacements and counts)")
        if idle:
            lines.append(f"  patched, no forward through them yet: {', '.join(h.name for h in idle)}")
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return (f"PatchGroup(families={self.model_types!r}, backend={self.backend!r}, active={self.active}, "
                f"layers_patched={self.layers_patched})")
