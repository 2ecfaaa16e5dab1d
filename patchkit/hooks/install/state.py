"""What one applied patch holds at runtime (`PatchState`): its backend and strictness, the backend each layer's
needs get, and what ran through it (calls, layers, forwards stepped aside) for the report and the revert."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

from torch import nn

from patchkit.backends import Backend, SdpaBackend
from patchkit.backends.choice import serving_backend
from patchkit.gates import head_dim_gate
from patchkit.hooks.install.patching import BoundPatch
from patchkit.warn import warn_user


@dataclasses.dataclass(eq=False)
class PatchState:
    """Per-application runtime state: the chosen backend, strictness, and what ran through the patch."""

    patch: str
    packing: str
    backend: Backend
    strict: bool
    unpad: str = "model"
    calls: int = 0
    layers: weakref.WeakSet[nn.Module] = dataclasses.field(default_factory=weakref.WeakSet)  # seen by eager calls
    layers_seen: int = 0  # distinct layers eager calls ever saw, collected ones included (the launcher's exit report)
    mark: object = dataclasses.field(default_factory=object, repr=False)  # identity only: see liveness.record_call
    compiled: bool = False  # a torch.compile'd call ran: count the layers by their mark (liveness.live_layers)
    warned: set = dataclasses.field(default_factory=set)
    stepped_aside: dict = dataclasses.field(default_factory=dict)  # cause -> forwards run on transformers' attention
    heads: dict = dataclasses.field(default_factory=dict)  # LM forwards over an unpadded batch: where the head ran
    copies: list = dataclasses.field(default_factory=list)  # (weakref to a deepcopied module, attribute)
    route_function: Optional[Callable] = None  # the attention function on this state, for routed families
    serving: dict = dataclasses.field(default_factory=dict)  # (head_dim, window, softcap, dropout, ...) -> backend
    fallback = SdpaBackend()

    def track_copy(self, module: nn.Module, attr: str) -> None:
        """A deepcopy of an instance-patched module carries the patch: remember it so revert reaches it."""
        self.copies.append((weakref.ref(module), attr))

    def revert_copies(self) -> None:
        """Take this state's patched methods (every BoundPatch that reports its copies here) off each live deepcopy."""
        for ref, attr in self.copies:
            module = ref()
            patched = None if module is None else vars(module).get(attr)
            if isinstance(patched, BoundPatch) and getattr(patched.on_copy, "__self__", None) is self:
                delattr(module, attr)
        self.copies.clear()

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn_user(message)

    def backend_for(
        self, head_dim: int, window: tuple[int, int] = (-1, -1), softcap: float = 0.0, dropout: float = 0.0,
        backward: bool = False, sinks: bool = False,
    ) -> Backend:
        """The backend for a layer whose kernel call has heads of `head_dim` (the widest of its queries, keys and
        values, as `attend.one_head_size` hands them; multi-head latent attention has no single `head_dim`): the
        kernel backend unless its head_dim gate fails or it lacks the window, softcap or dropout the layer needs, or
        (flash_attn_4) a backward or the sinks' backward on this GPU (then the exact fallback with one warning, or
        raise in strict mode). Decided once per head_dim and need: the decode path is host-bound."""
        if not self.backend.half_only:
            return self.backend  # the exact backend serves everything
        ambient = getattr(self.backend, "ambient", None)  # state outside the layer the kernel hangs on (sdpa_kernel)
        key = (head_dim, window, softcap, dropout, backward, sinks, ambient() if ambient else None)
        chosen = self.serving.get(key)
        if chosen is None:
            chosen = self.serving[key] = serving_backend(
                self.backend, self.fallback, lambda: head_dim_gate(head_dim, self.backend.name),
                (window, softcap, dropout, head_dim, backward, sinks), strict=self.strict,
                who=f"patch {self.patch!r}",
                uses="these layers use", warn_once=self.warn_once,
            )
        return chosen
