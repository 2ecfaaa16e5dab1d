"""The handles apply_patch returns: one patch's (PatchHandle: revert, check, report) and every family's
(PatchGroup), and the table of the active patches."""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Optional

from torch import nn

from patchkit import eras
from patchkit import gates as _gates
from patchkit.errors import PatchStateError, PatchTargetError
from patchkit.forward.liveness import live_layers
from patchkit.gates import GateResult
from patchkit.hooks.forwards import batch_errors, unserved
from patchkit.hooks.head import liger_rows, lm_head
from patchkit.hooks.head.lm_head import heads_line
from patchkit.hooks.install.model_walk import model_config
from patchkit.hooks.install.patching import Replacement, restore_replacements
from patchkit.hooks.install.registry import PatchSpec, spec_for_model
from patchkit.hooks.install.state import PatchState
from patchkit.hooks.name import flash_request
from patchkit.names import GROUP_NAME, UNPAD_MEANING

ACTIVE: dict[tuple, PatchHandle] = {}  # every applied patch by its key: ("class", family) or ("model", id(model))
# per patch name, the attention layers and calls of the patches reverted in this process (a script's own
# `with apply_patch(model=...)`): what the launcher's exit line counts beside its own patch
REVERTED: dict[str, list[int]] = {}


def add_ran(counts: dict[str, list[int]], handle: PatchHandle) -> None:
    """Add `handle`'s attention layers and calls to `counts`' entry for its patch name."""
    ran = counts.setdefault(handle.name, [0, 0])
    ran[0], ran[1] = ran[0] + handle.layers_seen, ran[1] + handle.calls


def detach_when_idle() -> None:
    """Where no patch is applied any more, take out what patchkit hooks into other code while one is (the batch
    errors' note, the head's, Liger's fused loss on scored rows)."""
    if not ACTIVE:
        batch_errors.detach()
        lm_head.detach()
        liger_rows.remove()


def unpad_line(asked: str, own: Optional[str]) -> str:
    """The report's unpad line: the mode asked for, or the family's own where it always runs in one (its layers read
    the padded batch: OPT's positions, Mllama's cross-attention), with what was asked."""
    if own is None or own == asked:
        return f"  unpad:   {asked} ({UNPAD_MEANING[asked]})"
    return (f"  unpad:   {own} ({UNPAD_MEANING[own]}; the family's own mode, where {asked!r} was asked: its layers "
            "read the padded batch)")


class Held:
    """What apply_patch() returns, as a context manager: each apply_patch() that returned it holds it (`hold`), and a
    `with` block's exit reverts it only at the last (`with apply_patch():` nested in another, or inside a script's
    own `apply_patch()`, returns the same patch: the inner exit reverted the outer block's, whose forwards then ran
    unpatched without a word); a block under a reverted one raises (it would run unpatched, without a word)."""

    holds = 0
    name: str
    active: bool

    def revert(self) -> None:
        raise NotImplementedError

    def reverted(self) -> bool:
        return not self.active

    def hold(self) -> Any:
        """Count one more apply_patch() that returned this patch."""
        self.holds += 1
        return self

    def __enter__(self) -> Any:
        if self.reverted():
            raise PatchStateError(f"patch {self.name!r} was reverted; `with patchkit.apply_patch(...):` applies it "
                                  "again")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.holds -= 1
        if self.holds <= 0:
            self.revert()


class PatchHandle(Held):
    """One applied patch: revert it (or use it as a context manager) and read its report."""

    def __init__(
        self, spec: PatchSpec, state: PatchState, gate_results: list[GateResult], replacements: list[Replacement],
        key: tuple, options: tuple, model: Optional[nn.Module],
    ) -> None:
        self.spec = spec
        self.state = state
        self.gates = gate_results
        self.replacements = replacements
        self.key = key
        self.options = options
        self._model = weakref.ref(model) if model is not None else None
        self.active = True
        self.origin: Optional[str] = None  # set when patchkit applied it on its own (PATCHKIT_FLASH_ATTN)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def backend(self) -> str:
        return self.state.backend.name

    @property
    def layers_patched(self) -> int:
        """Distinct attention layers that have run through this patch so far."""
        return live_layers(self.state)

    @property
    def layers_seen(self) -> int:
        """Distinct attention layers ever seen, also those since garbage collected (eager calls)."""
        return max(self.state.layers_seen, self.layers_patched)

    @property
    def stepped_aside(self) -> dict[str, int]:
        """Forwards run on transformers' own attention instead, by cause (see `patchkit.hooks.decide.causes.CAUSES`)."""
        return dict(self.state.stepped_aside)

    @property
    def heads(self) -> dict[str, int]:
        """Causal-LM forwards over a batch unpadded at the model, by where their head and loss ran: "real tokens",
        else why they ran on the padded batch (see `patchkit.hooks.head.lm_head`)."""
        return dict(self.state.heads)

    @property
    def calls(self) -> int:
        """Attention calls through this patch outside torch.compile'd graphs (counting inside would recompile)."""
        return self.state.calls

    def revert(self) -> None:
        """Put back every original object (identity); a second call does nothing."""
        if not self.active:
            return
        restore_replacements(self.replacements)
        self.state.revert_copies()
        self.active = False
        add_ran(REVERTED, self)
        if ACTIVE.get(self.key) is self:
            del ACTIVE[self.key]
        if not any(key[0] == "class" for key in ACTIVE):
            unserved.detach()
            flash_request.detach()
        detach_when_idle()

    def check(self, model: nn.Module) -> int:
        """Count `model`'s attention layers that run through this patch; zero (or some missed) is an error."""
        live, total = self.spec.live_layers(model, self.state)
        if total == 0:
            raise PatchTargetError(
                f"{type(model).__name__} has no {self.spec.attention_class().__name__} layers: patch {self.name!r} "
                f"serves model_type {', '.join(self.spec.model_types)}. apply_patch(model=...) picks the patch for "
                "a model's own family."
            )
        if not self.active or not live or live != total:
            raise PatchTargetError(
                f"patch {self.name!r} is live in {live} of {total} attention layers of "
                f"{type(model).__name__}"
                + ("" if self.active else " (the patch was reverted)")
                + ". Apply the patch before loading the model, or pass model= to patch this instance."
            )
        return live

    def report(self) -> str:
        """What was applied, on which backend and what ran through it (the first five lines), then the transformers
        version, the unpad mode, every gate with its result and what it replaced."""
        where = (f"class (every {self.spec.family} model)" if self._model is None
                 else f"instance {type(self._model()).__name__}")
        lines = [
            f"patchkit patch {self.name!r} ({self.spec.description})",
            f"  status:  {'active' if self.active else 'reverted'}; scope: {where}",
            f"  backend: {self.backend} (requested {self.options[0]!r}, strict={self.options[1]})",
            f"  attention layers through the patch: {self.layers_seen} ({self.calls} calls"
            + ("; compiled calls are not counted)" if self.state.compiled else ")"),
            "  forwards stepped aside to transformers' own attention: "
            + (", ".join(f"{n} ({cause})" for cause, n in self.state.stepped_aside.items()) or "none"),
            *([lm_head.heads_line(self.heads)] if self.heads else []),
            f"  transformers: {eras.installed_version()}"
            + (f" (era {eras.installed_era().name}: {eras.installed_era().changes})" if self.spec.family == "llama"
               else ""),
            unpad_line(self.options[2], self.spec.unpad),
            "  gates:",
            *_gates.gate_lines(self.gates, "    "),
            "  replaced:",
            *(f"    - {r.describe()}" for r in self.replacements),
            *(f"    - {label} (shared by the active class patches)" for label in
              (flash_request.installed() if self._model is None and self.active else [])),
        ]
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return (
            f"PatchHandle(name={self.name!r}, backend={self.backend!r}, active={self.active}, "
            f"layers_patched={self.layers_patched})"
        )


class PatchGroup(Held):
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

    def reverted(self) -> bool:
        return bool(self.handles) and not self.active  # (a group of no family has nothing to revert)

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
            "  ran: " + (", ".join(f"{h.name} ({h.layers_seen} attention layers, {h.calls} calls)" for h in ran)
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

