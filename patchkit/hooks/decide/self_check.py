"""On a transformers newer than CI has passed, each family checks itself on a tiny model before its first forward.

transformers releases every two weeks and changes what patchkit relies on (5.24 renamed `past_key_values` to
`cache`); a release CI has not seen may break the patched path loudly or, worse, silently. So on such a release
patchkit says so once, and before a family's first forward it builds a tiny model of that family from the user's
config and runs a padded training step (rows padded on the right and on the left, no position_ids) and a left-padded
cached decode twice, in float32: through the patch and on transformers' own attention (the one the user's model
runs: eager or sdpa). Where they differ, or the patched run raises, that family steps aside for the process (cause
`untested_transformers`, one warning naming the version and what differed; strict mode refuses). The verdict is kept
per base model class and config (what of it the tiny copy takes); the causal LM's head and loss check themselves
apart (`self_check_lm.py`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from packaging.version import InvalidVersion, Version
from torch import nn

from patchkit.forward.inputs.arguments import cache_parameter
from patchkit.hooks.decide.tiny_model import BATCH, check_batch, config_key, tiny_config
from patchkit.hooks.generation.filled_cache import empty_cache
from patchkit.hooks.install.patching import unpatched
from patchkit.hooks.install.routing import named_before
from patchkit.warn import warn_user

# The newest transformers release the whole suite passed on (CI's pinned version; `.ci/run`'s newest-release leg
# says when the package index has a newer one that passes, and this moves with the pin). PATCHKIT_TESTED_TRANSFORMERS
# names a newer one that you (or that CI leg) verified, which then runs without the check.
TESTED_TRANSFORMERS = "5.25.0"
TESTED_ENV = "PATCHKIT_TESTED_TRANSFORMERS"
CAUSE = "untested_transformers"
UNVERIFIED = "unverified_family"  # a family served from data that the census has not seen, whose check differed
CAUSES = (CAUSE, UNVERIFIED)
UNCHECKED = "unchecked_in_graph"  # a family whose check had not run when its compiled graph was traced

STEPS = 3  # the decode's steps after its prefill
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}  # max abs difference, relative past 1; half: HALF_TOLERANCE
HALF_TOLERANCE = 5e-2  # a backend that runs half precision alone (flash-attn) is checked in the user's dtype
# the tiny model's depth, tried in turn until one builds and runs unpatched: 2 layers; the first two of each layer type
# (Zamba's shared block, tied across its hybrid layers); every layer (a config whose other fields fix its depth)
SHAPES = ({}, {"each_twice": True}, {"keep_depth": True})

unverified: set[str] = set()  # model types served from data that the census has not seen: checked on any transformers
_verdicts: dict[type, Optional[str]] = {}  # base model class -> None (every config checked exact) or what differed
_by_key: dict[tuple[type, str], Optional[str]] = {}  # (base model class, `check_key`) -> None or what differed
heads: dict[tuple[type, str], Optional[str]] = {}  # (causal LM class, `check_key`) -> its head and loss check's
_by_config: dict[type, type] = {}  # config class -> the base model class checked for it (registered name)
_checking: set[type] = set()  # classes whose check is running (its own forwards must not check again)
_patcher: Optional[Callable[[nn.Module, Any], Callable[[], None]]] = None  # instance patch of a tiny model
seconds: dict[type, float] = {}  # what each class's checks cost, for the report and the tests


def attach(patcher: Callable[[nn.Module, Any], Callable[[], None]]) -> None:
    """How to patch a tiny model like the state it checks for (set by the api: no import of it from here)."""
    global _patcher
    _patcher = patcher


@functools.cache
def untested(version: Optional[str] = None) -> Optional[str]:
    """The installed transformers when it is newer than `TESTED_TRANSFORMERS` (announced once), else None.

    Called where patchkit starts to serve the user (a patch applied, a family's first check), so the announcement
    names that line; `trusted()`, which runs when patchkit's attention is registered (an import of a modeling
    module), asks `newer()`, which says nothing."""
    version = newer(version)
    if version is not None:
        warn_user(
            f"patchkit: transformers {version} is newer than the newest release patchkit was tested with "
            f"({newest_tested()}); each family checks itself on a tiny model before its first forward and steps "
            "aside to transformers' own attention where it differs."
        )
    return version


def newer(version: Optional[str] = None) -> Optional[str]:
    """`version` (default: the installed transformers) when it is newer than the newest tested, else None; silent."""
    if version is None:
        import transformers

        version = transformers.__version__
    try:
        return version if Version(version).release > Version(newest_tested()).release else None
    except InvalidVersion:
        return version


def newest_tested() -> str:
    """The newest transformers patchkit's suite passed on, or a newer one named in PATCHKIT_TESTED_TRANSFORMERS."""
    named = os.environ.get(TESTED_ENV, "").strip()
    try:
        return max(TESTED_TRANSFORMERS, named, key=Version) if named else TESTED_TRANSFORMERS
    except InvalidVersion:
        return TESTED_TRANSFORMERS


def untrusted_cause(module: nn.Module, state: Any) -> Optional[str]:
    """`untested_transformers` when this model's family failed its check on this transformers, else None.

    The check runs once per process and class, at the class's first forward outside a compiled graph."""
    if trusted(model_type(module)):
        return None
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    return verdict_cause(type(module), module.config, device, dtype, state)


def check_key(config: Any) -> str:
    """What a verdict is kept by beside the class: what of `config` the tiny copy takes, and the attention its
    reference runs (`reference_attention`)."""
    return f"{config_key(config)}|{reference_attention(config)}"


def reference_attention(config: Any, cls: Optional[type] = None) -> str:
    """transformers' attention the check compares against: the one a forward of the user's model runs when it steps
    aside, its own eager or sdpa (or the one it had before it was named "patchkit"), else its family's default (sdpa
    where `cls`, the checked class, supports it)."""
    for name in (getattr(config, "_attn_implementation", None), named_before(config)):
        if name in ("eager", "sdpa"):
            return name
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def verdict_cause(cls: type, config: Any, device: torch.device, dtype: torch.dtype, state: Any) -> Optional[str]:
    """`untested_transformers` when `cls` failed its check on `config` (run now, on `device`, if it has no verdict
    yet and nothing is traced or checked), else None."""
    key = (cls, check_key(config))
    if key not in _by_key:
        from patchkit.forward.liveness import is_compiling

        if _checking or is_compiling():  # a check's own forwards (its tiny model's config is not the user's)
            return None
        untested()  # the check runs because this transformers is newer (else the family is unverified): said once
        _checking.add(cls)
        try:
            start = time.perf_counter()
            _by_key[key] = what = check_family(cls, config, device, dtype, state)
            if _verdicts.get(cls) is None:  # the class's: the first config that differed
                _verdicts[cls] = what
            seconds[cls] = seconds.get(cls, 0.0) + time.perf_counter() - start
        finally:
            _checking.discard(cls)
    return None if _by_key[key] is None else failed_cause()


_installed: list[Optional[str]] = []  # newer() of the installed transformers: trusted() runs in traced forwards,
# where dynamo warns of "silent incorrectness" at a functools.cache call


def trusted(family: Optional[str]) -> bool:
    """A family served without a self-check: a transformers CI has tested, and a family the census has verified.
    Silent: it first runs where patchkit's attention is registered, inside an import of transformers."""
    if not _installed:
        _installed.append(newer())
    return _installed[0] is None and family not in unverified


def _untrusted_in_graph(module_name: str, class_name: str, family: Optional[str]) -> str:
    """`untrusted_cause` for a forward dynamo traces, run then (its result a constant of the graph): a family that
    must check itself and has no verdict yet steps aside as `unchecked_in_graph`, as the check cannot run inside a
    trace ("" : trusted)."""
    if trusted(family):
        return ""
    cls = getattr(sys.modules.get(module_name), class_name.rpartition(".")[2], None)
    if cls not in _verdicts:
        return UNCHECKED
    return "" if _verdicts[cls] is None else failed_cause()


untrusted_in_graph = torch._dynamo.assume_constant_result(_untrusted_in_graph)


def failed_cause() -> str:
    return CAUSE if untested() is not None else UNVERIFIED


def untrusted_mask_cause(config: Any, device: Optional[torch.device] = None,
                         dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Under the registered name alone (no patch wraps the model): `untested_transformers` for a model whose family
    failed its check, found by its config's class (`base_model_class`); the check runs on the mask call's device in
    its dtype."""
    if config is None or trusted(getattr(config, "model_type", None)):
        return None
    cls = _by_config.get(type(config))
    if cls is None:
        cls = base_model_class(type(config))
        if cls is None:
            return None
        _by_config[type(config)] = cls
    floating = dtype is not None and dtype.is_floating_point
    return verdict_cause(cls, config, device or torch.device("cpu"), dtype if floating else torch.float32, None)


def base_model_class(config_class: type) -> Optional[type]:
    """The base model class built from `config_class` (LlamaConfig -> LlamaModel): transformers' AutoModel table,
    else a loaded class of that config named `*Model` (a model of remote code, which the table does not hold)."""
    from transformers.modeling_utils import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = MODEL_MAPPING.get(config_class, None)
    if cls is not None:
        return cls
    found, todo = [], list(PreTrainedModel.__subclasses__())
    while todo:
        sub = todo.pop()
        todo.extend(sub.__subclasses__())
        if getattr(sub, "config_class", None) is config_class and sub.__name__.endswith("Model") and not (
                sub.__name__.endswith("PreTrainedModel")):
            found.append(sub)
    return min(found, key=lambda c: len(c.__name__)) if found else None


def untrusted_what(module: Any) -> str:
    """The step-aside warning's words for a family whose check failed: the version, the tested one, what differed."""
    import transformers

    cls = module if isinstance(module, type) else _by_config.get(type(module), type(module))  # a module or config
    config = None if isinstance(module, type) else getattr(module, "config", module)
    found = _verdicts.get(cls) if config is None else _by_key.get((cls, check_key(config)), _verdicts.get(cls))
    if untested() is None:  # a family the census has not seen, on a tested transformers
        return f"{cls.__name__} is a family patchkit's census has not verified, and its self-check found: {found}"
    return (
        f"transformers {transformers.__version__} is newer than patchkit was tested with ({newest_tested()}), "
        f"and {cls.__name__}'s self-check there found: {found}"
    )


def model_type(module: nn.Module) -> Optional[str]:
    return getattr(getattr(module, "config", None), "model_type", None)


def forget() -> None:
    """Every verdict dropped (tests; a process that changed its transformers)."""
    _verdicts.clear()
    _by_key.clear()
    heads.clear()
    _by_config.clear()
    seconds.clear()
    untested.cache_clear()
    _installed.clear()


def check_family(cls: type, config: Any, device: torch.device, dtype: torch.dtype, state: Any,
                 run: Optional[Callable[[nn.Module, bool], list]] = None) -> Optional[str]:
    """Run a tiny model of `cls` (from a tiny copy of `config`) both ways (`run`, default `run_both_checks`), in
    float32 unless the patch's backend runs half precision alone; what differed, or None."""
    run = run or run_both_checks
    dtype = check_dtype(dtype, state)
    with quiet_forward(device):
        failed, attention = None, reference_attention(config, cls)
        for depth in SHAPES:
            try:
                torch.manual_seed(0)
                tiny = cls(tiny_config(config, attention=attention, **depth)).to(device=device, dtype=dtype)
                want = run(tiny, True)
                break
            except Exception as exc:  # no verdict without a reference: transformers' own attention serves, exact
                failed = failed or f"the check's tiny model failed unpatched ({type(exc).__name__}: {exc})"
        else:
            return failed
        try:
            got = run_patched(tiny, state, run)
        except Exception as exc:
            return f"the patched run raised {type(exc).__name__}: {exc}"
    return differed(want, got, TOLERANCE.get(dtype, HALF_TOLERANCE))


def check_dtype(dtype: torch.dtype, state: Any) -> torch.dtype:
    """The check's dtype: float32 (float64 stays), where a half-precision model's tolerance would hide a change; the
    user's own where the patch's backend runs half precision alone (flash-attn's kernels)."""
    backend = getattr(state if state is not None else named_state(), "backend", None)
    if getattr(backend, "half_only", False):
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def differed(want: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]], tolerance: float,
             ) -> Optional[str]:
    """What of the patched run's results (`got`) differs from unpatched (`want`) past `tolerance`, or None (a result
    the patched run has not, as the logits a forward served the loss alone returns, is not compared)."""
    for name, a in want:
        b = dict(got).get(name)
        if b is None:
            continue
        if a.shape != b.shape:
            return f"{name}: shape {tuple(b.shape)} patched, {tuple(a.shape)} unpatched"
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        allowed = tolerance * max(1.0, a.float().abs().max().item() if a.numel() else 0.0)  # relative past 1
        if not diff <= allowed:
            return f"{name} differ by {diff:.3g} (allowed {allowed:.3g})"
    return None


def run_patched(tiny: nn.Module, state: Any, run: Callable[[nn.Module, bool], list],
                ) -> list[tuple[str, torch.Tensor]]:
    """The checks through the patch: the class's own (a class patch), else an instance patch like `state`'s."""
    from patchkit.hooks.install.routing import ROUTE_NAME, is_patched_forward

    if state is None:  # the registered name alone: the tiny model loaded with it
        loaded, tiny.config._attn_implementation = tiny.config._attn_implementation, ROUTE_NAME
        try:
            with unheard(named_state()):
                return run(tiny, False)
        finally:
            tiny.config._attn_implementation = loaded
    if is_patched_forward(type(tiny).forward) or _patcher is None:
        with unheard(state):
            return run(tiny, False)
    revert = _patcher(tiny, state)
    try:
        with unheard(state):
            return run(tiny, False)
    finally:
        revert()


def named_state() -> Any:
    """The registered name's state, whose mask call ran the check (None where it has none)."""
    route = sys.modules.get("patchkit.hooks.name.attention_interface")
    return route.route_state() if route is not None else None


@contextlib.contextmanager
def unheard(state: Any) -> Iterator[None]:
    """The check's patched forwards as the user never sees them: no warning (its decode is left-padded, which some
    families step aside for), and `state`'s counts and once-only warnings as they were, for the user's own forwards."""
    kept = None if state is None else (state.calls, state.layers_seen, dict(state.stepped_aside), set(state.warned),
                                       dict(getattr(state, "heads", {})))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if kept is not None:
            state.calls, state.layers_seen = kept[:2]
            state.stepped_aside.clear()
            state.stepped_aside.update(kept[2])
            state.warned.clear()
            state.warned.update(kept[3])
            if hasattr(state, "heads"):
                state.heads.clear()
                state.heads.update(kept[4])


@contextlib.contextmanager
def quiet_forward(device: torch.device) -> Iterator[None]:
    """Gradients on, autocast and TF32 off, the caller's random state kept, whatever the user's forward runs under."""
    devices = [device.index or 0] if device.type == "cuda" else []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
        with torch.autocast(device.type, enabled=False):
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def generation_cache(model: nn.Module) -> Any:
    """The cache generate() hands a model's prefill: an empty DynamicCache, or none where transformers lets the model
    make its own (MiniMax's, which refuses a DynamicCache)."""
    from transformers.generation.utils import GenerationMixin

    supports = getattr(GenerationMixin, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports.__func__(type(model)):
        return None
    return empty_cache(model.config)


def run_both_checks(tiny: nn.Module, reference: bool) -> list[tuple[str, torch.Tensor]]:
    """A padded training step (outputs at real tokens, every gradient) and a left-padded cached decode (the last
    position's output at the prefill and each step), on transformers' own forward or through the patch."""
    forward = unpatched(type(tiny).forward) if reference else None

    def call(**kwargs: Any) -> Any:
        return forward(tiny, **kwargs) if forward is not None else tiny(**kwargs)

    ids, right, left, generator = check_batch(next(tiny.parameters()).device)
    results = []
    tiny.train()
    tiny.zero_grad(set_to_none=True)
    try:
        out = call(input_ids=ids, attention_mask=right, use_cache=False).last_hidden_state
        real = out[right.bool()]
        weights = torch.randn(real.shape, generator=generator).to(real)
        (real * weights).sum().backward()
        results.append(("training step outputs", real.detach()))
        grads = [p.grad.flatten() for p in tiny.parameters() if p.grad is not None]
        results.append(("training step gradients", torch.cat(grads) if grads else real.new_zeros(0)))
    finally:
        tiny.zero_grad(set_to_none=True)
        tiny.eval()
    with torch.no_grad():
        name = cache_parameter(inspect.signature(type(tiny).forward).parameters)
        positions = (left.cumsum(-1) - 1).clamp(min=0)
        out = call(input_ids=ids, attention_mask=left, position_ids=positions, use_cache=True,
                   **{name: generation_cache(tiny)})  # generate()'s prefill: into the empty cache it made
        steps, cache, mask = [out.last_hidden_state[:, -1]], getattr(out, name, None), left
        for t in range(STEPS if cache is not None else 0):  # a model that keeps its state inside (RecurrentGemma)
            mask = torch.cat([mask, mask.new_ones(BATCH, 1)], -1)
            position = mask.sum(-1, keepdim=True) - 1
            out = call(input_ids=ids[:, t : t + 1], attention_mask=mask, position_ids=position, use_cache=True,
                       **{name: cache})
            cache = getattr(out, name)
            steps.append(out.last_hidden_state[:, -1])
    results.append(("left-padded decode outputs", torch.stack(steps, 1)))
    return results
