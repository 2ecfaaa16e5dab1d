"""The public entry points: apply_patch, revert_patch, available_patches, and the PatchHandle they return."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from packaging.version import Version
from torch import nn

from patchkit import eras
from patchkit import gates as _gates
from patchkit.backends import BACKEND_NAMES, make_backend
from patchkit.backends.choice import choose_backend
from patchkit.errors import PatchGateError, PatchkitError, PatchTargetError
from patchkit.gates import GateResult
from patchkit.handles import ACTIVE, PatchGroup, PatchHandle, detach_when_idle
from patchkit.hooks.attention.varlen import UNPAD_MODES
from patchkit.hooks.decide import self_check
from patchkit.hooks.forwards import batch_errors, unserved
from patchkit.hooks.head import lm_head
from patchkit.hooks.install.model_walk import head_dim, modeling_files
from patchkit.hooks.install.patching import Replacement, apply_replacements
from patchkit.hooks.install.registry import (
    PatchSpec,
    config_gates,
    for_model,
    imported_table_types,
    registered,
    resolve,
    table_spec,
)
from patchkit.hooks.install.state import PatchState
from patchkit.hooks.name import flash_request
from patchkit.names import GROUP_NAME
from patchkit.warn import warn_user

_GROUP: Optional[PatchGroup] = None  # the last `apply_patch()` of every family
_GROUP_CHOSEN: Optional[tuple] = None  # its backend and gates, for the families it adopts as their models are built
_applying = 0  # class patches being built now: building one imports transformers' LLaMA, which fires the startup hook


def applying() -> bool:
    """True while apply_patch builds a class patch (the PATCHKIT_FLASH_ATTN startup hook then leaves it to it)."""
    return _applying > 0


def apply_patch(
    name: Optional[str] = None, *, backend: str = "auto", strict: bool = False, model: Optional[nn.Module] = None,
    unpad: str = "model",
) -> PatchHandle | PatchGroup:
    """Patch a model family's attention to run FlashAttention-style varlen kernels on 2D key-padding masks.

    Args:
        name: "llama2" (alias "llama") or "llama1", or a family by `model_type` ("mistral", "qwen2", "qwen3",
            "gemma", "gemma2", "gemma3_text", "phi3"; see `available_patches()`). Default None: the patch for
            `model.config.model_type` when `model` is given, else every registered family whose transformers
            gate passes (returns a `PatchGroup`; the families skipped are named in its report). "all" means
            the same.
        backend: "auto" (flash_attn when every gate passes, else torch_varlen, else sdpa, with one warning
            naming the first failed gate of each; flash_attn_4 where installed, first on sm90/sm100), "flash_attn"
            (the flash-attn package), "flash_attn_4" (flash-attn 4's CuTe kernels), "torch_varlen" (torch's
            own FlashAttention-2 varlen kernel, torch >= 2.10 on CUDA) or "sdpa" (torch-native, exact, CPU or GPU).
        strict: raise `PatchGateError` instead of falling back when a gate fails (with "auto": when neither
            flash_attn nor torch_varlen passes).
        model: patch this loaded instance only (PEFT/DDP/FSDP wrappers are looked through); default None
            patches the classes, so every model of the family built afterwards runs through the patch.
        unpad: "model" (default) unpads a padded batch once per model forward, so embeddings, projections, MLP
            and norms run on real tokens only (one packed row) and the outputs are repadded; it applies when no
            KV cache is kept (use_cache=False, or training). "attention" unpads inside each attention layer
            only, so the decoder layers and their hooks see the padded (B, S, H) shape. "loss": as "model", and
            a training forward given labels returns its loss alone (`logits=None`), computed chunked over the
            real tokens: no (B, N, V) logits and no float32 copy of them (the loss and gradients as unpatched).

    Returns:
        A `PatchHandle`: `.revert()`, a context manager, and `.report()`. Applying the same patch with the same
        options twice returns the same handle.
    """
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if unpad not in UNPAD_MODES:
        raise ValueError(f"unknown unpad mode {unpad!r}; choose one of {', '.join(UNPAD_MODES)}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model= must be a loaded torch.nn.Module (e.g. LlamaForCausalLM), got {type(model).__name__}")
    if isinstance(name, str) and name.lower() == GROUP_NAME:
        name = None  # "all" (the config and launcher default): every family, or the family of `model`
    if name is None and model is None:
        return _apply_every_family(backend, strict, unpad).hold()
    if name is None:
        spec = for_model(model)
    else:
        spec = resolve(name)
    return _apply(spec, backend, strict, model, unpad).hold()


def _apply(
    spec: PatchSpec, backend: str, strict: bool, model: Optional[nn.Module], unpad: str,
    env: Optional[_gates.Environment] = None, chosen: Optional[tuple[str, list[GateResult]]] = None,
) -> PatchHandle:
    """Apply one patch (`chosen`: the backend a group already decided on, with its gates, so it warns once)."""
    key = ("class", spec.family) if model is None else ("model", id(model))
    options = (backend, strict, unpad)
    existing = ACTIVE.get(key) if model is None else (ACTIVE.get(key) or _holding(model))
    if existing is not None:
        if existing.spec.name == spec.name and existing.options == options:
            return existing  # idempotent: twice == once
        raise PatchkitError(
            f"patch {existing.name!r} (backend={existing.options[0]!r}, strict={existing.options[1]}, "
            f"unpad={existing.options[2]!r}) is already "
            f"applied to {'the ' + spec.family + ' classes' if model is None else 'this model'}"
            + (f" ({existing.origin})" if existing.origin else "")
            + "; call its handle's revert() (or patchkit.revert_patch()) before applying another."
        )

    env = env or _gates.probe_environment()
    tf_gate = _gates.transformers_gate(env, spec.supported, spec.name)
    if not tf_gate.passed:
        raise PatchGateError(tf_gate.describe())
    self_check.untested()  # a transformers newer than CI's: said once
    model_gates = [] if model is None else config_gates(model, spec.model_types) + (
        spec.check_model(model) if spec.check_model else [])
    failed = _gates.first_failure(model_gates)
    if failed is not None:
        raise PatchGateError(f"patch {spec.name!r}: {failed.describe()}. Nothing was patched.")
    chosen_name, backend_gates = chosen or choose_backend(
        spec.name, spec.flash_attn_min, spec.flash_attn_why, backend, strict, env,
        None if model is None or backend == "sdpa" else head_dim(model, spec.model_types),
    )

    state = PatchState(spec.name, spec.packing, make_backend(chosen_name), strict, unpad)
    replacements = spec.build_instance(state, model) if model is not None else _build_class(spec, state)
    apply_replacements(replacements)
    handle = PatchHandle(spec, state, [tf_gate, *model_gates, *backend_gates], replacements, key, options, model)
    ACTIVE[key] = handle
    batch_errors.attach()
    lm_head.attach()
    if model is not None:
        try:
            handle.check(model)
        except PatchTargetError:
            handle.revert()
            raise
        weakref.finalize(model, _forget, key, weakref.ref(handle))  # a collected model leaves no handle behind
    else:
        unserved.attach(_served, _adopt)
        if not eras.legacy_installed():  # before 4.48 no era of ours serves a flash_attention_2 request
            flash_request.attach(_serving)
    return handle


def _holding(model: nn.Module) -> Optional[PatchHandle]:
    """The live instance patch of a model inside `model`, or around it (PEFT's wrapper of a model patched before, or
    the model inside a wrapper patched before), else None: one model, one instance patch."""
    for key, handle in list(ACTIVE.items()):
        other = handle._model() if key[0] == "model" and handle._model is not None else None
        if other is not None and (any(m is other for m in model.modules()) or any(
                m is model for m in other.modules())):
            return handle
    return None


def _apply_every_family(backend: str, strict: bool, unpad: str) -> PatchGroup:
    """`apply_patch()` before load: every registered family whose transformers gate passes, one backend warning.

    A family the installed transformers is outside of is skipped and named in the report (its models then say so
    once when built); a conflict with a patch already applied reverts what this call applied, then raises.
    """
    global _applying
    env = _gates.probe_environment()
    specs, skipped = [], {}
    for spec in registered():
        if spec.name == "llama1":
            continue  # LLaMA's default is llama2 (KV cache, GQA); llama1 is asked for by name
        gate = _gates.transformers_gate(env, spec.supported, spec.name)
        if gate.passed:
            specs.append(spec)
        else:
            skipped[spec.name] = gate.describe()
    if not specs:
        raise PatchGateError(f"no patchkit patch serves the installed transformers: {'; '.join(skipped.values())}")
    flash_min = max((s.flash_attn_min for s in specs), key=Version)
    chosen = choose_backend(
        GROUP_NAME, flash_min, specs[0].flash_attn_why, backend, strict,
        env,
    )
    handles, fresh = [], []
    _applying += 1
    try:
        for spec in specs:
            new = ("class", spec.family) not in ACTIVE
            handles.append(_apply(spec, backend, strict, None, unpad, env, chosen))
            if new:
                fresh.append(handles[-1].hold())  # held by the group
    except BaseException:
        for handle in reversed(fresh):
            handle.revert()
        raise
    finally:
        _applying -= 1
    global _GROUP, _GROUP_CHOSEN
    _GROUP_CHOSEN = chosen
    if _GROUP is None or list(_GROUP)[: len(handles)] != handles:
        _GROUP = PatchGroup(handles, skipped)
    for model_type in imported_table_types():  # a model of these may be built already: its post_init has run
        _adopt_type(model_type, f"model_type {model_type!r}")
    return _GROUP  # the same families with the same options: the same group (twice == once)


def _adopt(model: nn.Module) -> bool:
    """Under `apply_patch()` with no name: a model of a family the table serves (no module of its own, so not applied
    up front: that would import every modeling module) gets its family's class patch as it is built, with the
    group's options, before its first forward. True when it was patched now. (The families whose module was imported
    before `apply_patch()`, whose models may be built already, get theirs then.)"""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    adopted = _adopt_type(model_type, f"{type(model).__name__} (model_type {model_type!r})")
    _wrap_outer_heads(model)
    return adopted


def _wrap_outer_heads(model: nn.Module) -> None:
    """A whole model built under a class patch: its generative heads of other modeling modules around a served
    language model (LLaVA's around LLaMA's) are wrapped on the instance like the family's causal LM, under the patch
    that serves it (its revert unwraps them)."""
    if unserved.built_inside_another(model):
        return  # the whole model's own post_init comes last
    for key, handle in list(ACTIVE.items()):
        if key[0] == "class":
            replacements = handle.spec.outer_heads(handle.state, model)
            apply_replacements(replacements)
            handle.replacements.extend(replacements)


def _adopt_type(model_type: Any, what: str) -> bool:
    """The group's class patch of the table's family `model_type`, unless it has one; `what` names it in the warning
    when it cannot be applied."""
    group = _GROUP
    if group is None or not group.active or model_type in group.skipped or not isinstance(model_type, str):
        return False
    if any(key[0] == "class" and model_type in h.spec.model_types for key, h in list(ACTIVE.items())):
        return False
    try:
        spec = table_spec(model_type)
    except PatchTargetError:
        return False
    if not _gates.transformers_gate(_gates.probe_environment(), spec.supported, spec.name).passed:
        return False
    backend, strict, unpad = group.options
    try:
        group.handles.append(_apply(spec, backend, strict, None, unpad, chosen=_GROUP_CHOSEN).hold())
    except PatchkitError as exc:  # never a failed model build: the model runs on transformers' attention, said once
        warn_user(f"patchkit: {what} runs unpatched: {exc}")
        return False
    return True


def _served() -> dict[type, str]:
    """The attention classes the active class patches serve, with their model type (for `unserved`'s warning)."""
    return {h.spec.attention_class(): h.spec.family for key, h in list(ACTIVE.items()) if key[0] == "class"}


def _serving(model_class: type) -> Optional[PatchState]:
    """The state of the active class patch whose family `model_class` belongs to: by its config's model_type, else
    by a class of the family's modeling module among its bases (LLaVA's `llava_llama` LlamaForCausalLM)."""
    model_type = getattr(getattr(model_class, "config_class", None), "model_type", None)
    handles = [h for key, h in list(ACTIVE.items()) if key[0] == "class"]
    by_type = next((h.state for h in handles if model_type in h.spec.model_types), None)
    if by_type is not None:
        return by_type
    files = modeling_files(model_class)
    return next((h.state for h in handles if modeling_files(h.spec.attention_class()) & files), None)


def _build_class(spec: PatchSpec, state: PatchState) -> list[Replacement]:
    global _applying
    _applying += 1
    try:
        return spec.build_class(state)
    finally:
        _applying -= 1


def _forget(key: tuple, handle_ref: weakref.ref) -> None:
    handle = handle_ref()
    if handle is not None and ACTIVE.get(key) is handle:
        del ACTIVE[key]
        detach_when_idle()


def _patch_tiny(tiny: nn.Module, state: PatchState) -> Any:
    """An instance patch of the self-check's tiny model like `state` (its backend and unpad mode); its revert."""
    return _apply(for_model(tiny), state.backend.name, False, tiny, state.unpad).revert


self_check.attach(_patch_tiny)


def revert_patch() -> int:
    """Revert every patch patchkit applied, newest first; returns how many were reverted."""
    handles = list(ACTIVE.values())
    for handle in reversed(handles):
        handle.revert()
    return len(handles)


def active_patches() -> list[PatchHandle]:
    return list(ACTIVE.values())


def available_patches() -> list[dict]:
    """The registry: each patch, its aliases, the transformers range it supports, and its gates."""
    return [
        {
            "name": spec.name,
            "aliases": list(spec.aliases),
            "model_types": list(spec.model_types),
            "description": spec.description,
            "transformers": spec.transformers,
            "flash_attn": f">={spec.flash_attn_min} ({spec.flash_attn_why})",
            "gates": spec.gate_names(),
        }
        for spec in registered()
    ]
