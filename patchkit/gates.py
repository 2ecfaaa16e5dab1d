"""Gates: the version and capability checks a patch must pass before it is applied or a backend chosen."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

MIN_COMPUTE_CAPABILITY = (8, 0)
MAX_FLASH_HEAD_DIM = 256
TORCH_VARLEN_MIN = (2, 10)  # torch.nn.attention.varlen.varlen_attn: FlashAttention-2's varlen kernel inside torch
# The keyword arguments patchkit passes to varlen_attn (torch 2.13's signature, where causal is window_size (-1, 0))
TORCH_VARLEN_ARGS = ("scale", "window_size")  # enable_gqa (2.13) is used where present, see torch_varlen.py
# flash-attn 4 (`flash-attn-4`, the CuTe DSL kernels in `flash_attn.cute`): the keyword arguments patchkit passes to its
# flash_attn_varlen_func (read from 4.0.0b36's interface.py) and the compute capabilities it runs (forward 8.x-12.x)
FLASH_ATTN_4_DIST = "flash-attn-4"
FLASH_ATTN_4_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
                     "window_size", "learnable_sink", "softcap")
FLASH_ATTN_4_MAJORS = (8, 9, 10, 11, 12)
BUILD_FILE = "_patchkit_build.py"  # beside flash_attn/__init__.py in a wheel tools/build_flash_attn.py built
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Environment:
    """What this process can run: versions, the flash-attn import result and the GPU."""

    torch_version: str
    transformers_version: Optional[str]
    flash_attn_version: Optional[str]
    flash_attn_error: Optional[str]
    cuda_available: bool
    device_name: Optional[str]
    compute_capability: Optional[tuple[int, int]]
    bf16_supported: bool
    torch_varlen_error: Optional[str] = None  # why torch's varlen_attn cannot be called as patchkit calls it
    flash_attn_archs: Optional[tuple[str, ...]] = None  # a flash-attn built by tools/build_flash_attn.py: its archs
    flash_attn_4_version: Optional[str] = None  # the flash-attn-4 distribution's version, None: not installed
    flash_attn_4_error: Optional[str] = None  # why `flash_attn.cute` cannot be called as patchkit calls it


@dataclasses.dataclass(frozen=True)
class GateResult:
    """One gate's verdict: what was required, what was found, and the fix when it failed."""

    name: str
    passed: bool
    required: str
    found: str
    fix: str = ""
    backend: str = ""  # the backend this gate is for ("" for the patch's own gates)

    def describe(self) -> str:
        status = "ok" if self.passed else "FAILED"
        text = f"{self.name}: {status} (required {self.required}; found {self.found})"
        return text if self.passed or not self.fix else f"{text}. Fix: {self.fix}"

    def brief(self, width: int = 44) -> str:
        """'name: FAILED (found ...)', what was found cut to `width` characters: one reason in a one-line warning."""
        found = self.found if len(self.found) <= width else self.found[: width - 3].rstrip() + "..."
        return f"{self.name}: {'ok' if self.passed else 'FAILED'} (found {found})"


def _package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get(name.replace("-", "_"))
        return getattr(module, "__version__", None)


def explain_flash_import_error(exc: BaseException) -> str:
    """Turn a failed `import flash_attn` into a sentence that says what it means and how to fix it."""
    text = f"{type(exc).__name__}: {exc}"
    if "undefined symbol" in str(exc):
        return (
            f"{text}. flash-attn's CUDA extension was built against another torch/CUDA ABI than the torch "
            f"installed ({torch.__version__}); reinstall a flash-attn wheel built for this torch and CUDA, e.g. "
            "`pip install --force-reinstall --no-build-isolation flash-attn`"
        )
    return text


def probe_flash_attn() -> tuple[Optional[str], Optional[str]]:
    """Import flash-attn and its CUDA extension for real; return (version, error)."""
    try:
        module = importlib.import_module("flash_attn")
        importlib.import_module("flash_attn_2_cuda")
    except ModuleNotFoundError as exc:
        return None, f"not installed ({exc})"
    except (ImportError, OSError) as exc:  # e.g. "undefined symbol": an ABI mismatch with torch
        return _package_version("flash-attn"), explain_flash_import_error(exc)
    return getattr(module, "__version__", None) or _package_version("flash-attn"), None


def build_config(module: Optional[ModuleType] = None) -> dict:
    """What a flash-attn built by tools/build_flash_attn.py was built with: the literal in its package's
    `_patchkit_build.py`, read as text (not imported: patchkit imports no flash_attn submodule). Empty for any other
    build, which has every head dim and feature of its version. `module`: the imported flash_attn."""
    module = module if module is not None else sys.modules.get("flash_attn")
    origin = getattr(module, "__file__", None)
    if not origin:
        return {}
    try:
        tree = ast.parse(Path(origin).with_name(BUILD_FILE).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BUILD_CONFIG" for t in node.targets):
                value = ast.literal_eval(node.value)
                return dict(value) if isinstance(value, dict) else {}
    except (OSError, SyntaxError, ValueError):
        pass
    return {}


def probe_torch_varlen(cuda: bool) -> Optional[str]:
    """None when torch's `varlen_attn` takes the arguments patchkit passes (and, on CUDA, has its kernel built)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return f"no torch.nn.attention.varlen.varlen_attn ({exc})"
    params = inspect.signature(varlen_attn).parameters
    missing = [name for name in TORCH_VARLEN_ARGS if name not in params]
    if missing or "is_causal" in params:
        return (f"varlen_attn{inspect.signature(varlen_attn)} is not the signature patchkit calls (torch 2.11-2.13's: "
                f"{', '.join(TORCH_VARLEN_ARGS)}, causal as window_size=(-1, 0))")
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if cuda and not available():
        return "this torch build has no FlashAttention kernel (torch.backends.cuda.is_flash_attention_available())"
    return None


def probe_flash_attn_4(cuda: bool) -> tuple[Optional[str], Optional[str]]:
    """flash-attn 4's (version, error). Found by its distribution name: flash-attn 2 ships a `flash_attn/cute`
    folder too, and FA4's own `__version__` reads a distribution that does not exist ("0.0.0"). `flash_attn.cute`
    (which imports the CUTLASS DSL) is imported only where its kernels could run, on a CUDA machine."""
    try:
        version = importlib.metadata.version(FLASH_ATTN_4_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None, f"not installed (no {FLASH_ATTN_4_DIST} distribution)"
    if not cuda:
        return version, None  # the cuda gate names what is missing
    try:
        module = importlib.import_module("flash_attn.cute")
    except Exception as exc:  # noqa: BLE001 - any import failure (the DSL's, a missing dependency) is the finding
        return version, f"import flash_attn.cute failed: {type(exc).__name__}: {exc}"
    return version, flash4_signature_error(getattr(module, "flash_attn_varlen_func", None))


def flash4_signature_error(fn: object) -> Optional[str]:
    """None when `flash_attn.cute.flash_attn_varlen_func` takes every keyword patchkit passes."""
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "flash_attn.cute has no flash_attn_varlen_func"
    missing = [name for name in FLASH_ATTN_4_ARGS if name not in params]
    return f"flash_attn.cute.flash_attn_varlen_func lacks {', '.join(missing)}" if missing else None


def probe_environment() -> Environment:
    """Read the environment once; tests replace this function to simulate other machines."""
    flash_version, flash_error = probe_flash_attn()
    cuda = torch.cuda.is_available()
    flash4_version, flash4_error = probe_flash_attn_4(cuda)
    capability = tuple(torch.cuda.get_device_capability()) if cuda else None
    return Environment(
        torch_version=torch.__version__,
        transformers_version=_package_version("transformers"),
        flash_attn_version=flash_version,
        flash_attn_error=flash_error,
        cuda_available=cuda,
        device_name=torch.cuda.get_device_name() if cuda else None,
        compute_capability=capability,  # type: ignore[arg-type]
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()),
        torch_varlen_error=probe_torch_varlen(cuda),
        flash_attn_archs=tuple(build_config().get("archs", ())) or None if flash_version and not flash_error else None,
        flash_attn_4_version=flash4_version,
        flash_attn_4_error=flash4_error,
    )


def transformers_gate(env: Environment, supported: SpecifierSet, patch: str) -> GateResult:
    """The patch's own transformers range; a failure here cannot fall back to another backend."""
    found = env.transformers_version or "not installed"
    try:
        ok = env.transformers_version is not None and Version(env.transformers_version) in supported
    except InvalidVersion:
        ok = False
    return GateResult(
        "transformers_version",
        ok,
        f"transformers{supported}",
        found,
        f"patch {patch!r} supports transformers{supported}; install a version in that range "
        f"(e.g. `pip install 'transformers{supported}'`)",
    )


def flash_attn_installed_gate(env: Environment) -> GateResult:
    ok = env.flash_attn_error is None and env.flash_attn_version is not None
    return GateResult(
        "flash_attn_installed",
        ok,
        "flash-attn 2 importable with its CUDA extension",
        env.flash_attn_version if ok else (env.flash_attn_error or "not installed"),
        "install a flash-attn 2 wheel matching this torch/CUDA (`pip install flash-attn --no-build-isolation`), "
        "or use backend='sdpa'",
    )


def flash_attn_version_gate(env: Environment, minimum: str, why: str) -> GateResult:
    found = env.flash_attn_version
    try:
        ok = found is not None and Version(found) >= Version(minimum)
    except InvalidVersion:
        ok = False
    return GateResult(
        "flash_attn_version",
        ok,
        f"flash-attn>={minimum} ({why})",
        found or "not installed",
        f"`pip install 'flash-attn>={minimum}' --no-build-isolation`, or use backend='sdpa'",
    )


def cuda_gate(env: Environment) -> GateResult:
    return GateResult(
        "cuda_available",
        env.cuda_available,
        "a CUDA device",
        env.device_name or "no CUDA device",
        "run on a CUDA GPU, or use backend='sdpa' (torch-native, runs on CPU)",
    )


def compute_capability_gate(env: Environment) -> GateResult:
    cap = env.compute_capability
    ok = cap is not None and tuple(cap) >= MIN_COMPUTE_CAPABILITY
    need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
    return GateResult(
        "compute_capability",
        ok,
        f">= {need} (Ampere or newer)",
        "n/a (no CUDA device)" if cap is None else ".".join(map(str, cap)),
        "FlashAttention 2 does not run on Turing or older GPUs; use an Ampere/Hopper GPU or backend='sdpa'",
    )


def flash_attn_arch_gate(env: Environment) -> GateResult:
    """A flash-attn built for some archs only runs on a GPU one of them serves (an sm_XY cubin runs on X.Z, Z >= Y)."""
    archs, cap = env.flash_attn_archs or (), env.compute_capability
    built = [int(m.group()) for m in (re.match(r"\d+", a) for a in archs) if m]
    ok = cap is None or any(a // 10 == cap[0] and a % 10 <= cap[1] for a in built)
    here = "n/a (no CUDA device)" if cap is None else f"sm_{cap[0]}{cap[1]}"
    return GateResult(
        "flash_attn_build_arch",
        ok,
        "kernels for this GPU",
        f"a build for {', '.join(f'sm_{a}' for a in archs)} only (tools/build_flash_attn.py), this GPU {here}",
        "rebuild on this machine with tools/build_flash_attn.py (--archs defaults to the local GPU), or install a "
        "full flash-attn wheel",
    )


def flash_backend_gates(env: Environment, flash_min: str, why: str) -> list[GateResult]:
    """Every gate the flash_attn backend must pass on this machine."""
    results = [
        flash_attn_installed_gate(env),
        flash_attn_version_gate(env, flash_min, why),
        cuda_gate(env),
        compute_capability_gate(env),
    ]
    return results + ([flash_attn_arch_gate(env)] if env.flash_attn_archs else [])


def flash_attn_4_installed_gate(env: Environment) -> GateResult:
    ok = env.flash_attn_4_error is None and env.flash_attn_4_version is not None
    return GateResult(
        "flash_attn_4_installed",
        ok,
        f"{FLASH_ATTN_4_DIST} importable as flash_attn.cute, its flash_attn_varlen_func taking "
        f"{', '.join(FLASH_ATTN_4_ARGS[4:])}",
        env.flash_attn_4_version if ok else (env.flash_attn_4_error or "not installed"),
        f"`pip install {FLASH_ATTN_4_DIST}` (pure Python; kernels compile at first use; CUDA 13: "
        f"`pip install '{FLASH_ATTN_4_DIST}[cu13]'`), or use backend='flash_attn' or 'sdpa'",
    )


def flash_attn_4_capability_gate(env: Environment) -> GateResult:
    """flash-attn 4 runs its forward on compute capability 8.x-12.x (its interface asserts that range)."""
    cap = env.compute_capability
    ok = cap is not None and cap[0] in FLASH_ATTN_4_MAJORS
    return GateResult(
        "compute_capability",
        ok,
        "8.x-12.x (Ampere, Hopper, Blackwell; backward from 9.0)",
        "n/a (no CUDA device)" if cap is None else ".".join(map(str, cap)),
        "flash-attn 4 does not run on Turing or older GPUs; use backend='flash_attn' on other GPUs, or "
        "backend='sdpa'",
    )


def flash4_backend_gates(env: Environment) -> list[GateResult]:
    """Every gate the flash_attn_4 backend must pass on this machine (per call: `FlashAttn4Backend.missing_feature`:
    head dims by architecture, no dropout, backward from 9.0)."""
    return [flash_attn_4_installed_gate(env), cuda_gate(env), flash_attn_4_capability_gate(env)]


def torch_release_at_least(version: str, minimum: tuple[int, int]) -> bool:
    """Whether a torch version is at least (major, minor): a pre-release or a local build counts as its release."""
    try:
        return Version(version).release[:2] >= minimum
    except InvalidVersion:
        return False


def torch_version_gate(env: Environment) -> GateResult:
    """torch >= 2.10 ships varlen_attn (a pre-release of 2.10 counts as 2.10)."""
    ok = torch_release_at_least(env.torch_version, TORCH_VARLEN_MIN)
    need = ".".join(map(str, TORCH_VARLEN_MIN))
    return GateResult(
        "torch_version",
        ok,
        f"torch>={need} (torch.nn.attention.varlen)",
        env.torch_version,
        f"install torch>={need} with CUDA, or use backend='flash_attn' or 'sdpa'",
    )


def torch_varlen_api_gate(env: Environment) -> GateResult:
    return GateResult(
        "torch_varlen_api",
        env.torch_varlen_error is None,
        f"torch.nn.attention.varlen.varlen_attn({', '.join(TORCH_VARLEN_ARGS)}) with its FlashAttention kernel",
        env.torch_varlen_error or "ok",
        "install a CUDA build of a torch release whose varlen_attn has that signature (2.13 does), or use "
        "backend='flash_attn' or 'sdpa'",
    )


def torch_varlen_backend_gates(env: Environment) -> list[GateResult]:
    """Every gate the torch_varlen backend must pass on this machine (a failed cuda gate is named before the API's)."""
    return [torch_version_gate(env), cuda_gate(env), compute_capability_gate(env), torch_varlen_api_gate(env)]


def dtype_gate(dtype: torch.dtype) -> GateResult:
    """flash-attn kernels take fp16/bf16 only (checked per call, on the real q/k/v)."""
    return GateResult(
        "dtype",
        dtype in HALF_DTYPES,
        "float16 or bfloat16 q/k/v",
        str(dtype).replace("torch.", ""),
        "load the model in bf16/fp16 (torch_dtype=torch.bfloat16) or run under torch.autocast; "
        "non-strict mode casts to the compute dtype with one warning",
    )


# per kernel backend: the smallest head_dim, whether it must be a multiple of 8, what is required, and the fix
HEAD_DIMS = {
    "flash_attn_4": (8, True, f"8 <= head_dim <= {MAX_FLASH_HEAD_DIM}, a multiple of 8 (sm100: <= 128 or 256)",
                     "flash-attn 4 runs head_dim 8-256 in multiples of 8; use backend='flash_attn' or 'sdpa'"),
    "torch_varlen": (0, True, f"head_dim <= {MAX_FLASH_HEAD_DIM} and a multiple of 8",
                     "torch's varlen_attn runs head_dim up to 256 in multiples of 8; use backend='flash_attn' or "
                     "'sdpa'"),
    "flash_attn": (0, False, f"head_dim <= {MAX_FLASH_HEAD_DIM}",
                   "flash-attn kernels support head_dim up to 256; use backend='sdpa' for this model"),
}


def head_dim_gate(head_dim: int, backend: str = "flash_attn") -> GateResult:
    """flash-attn pads head_dim to a multiple of 8 itself; torch's varlen_attn gets only sizes it is known to take."""
    least, eights, required, fix = HEAD_DIMS.get(backend, HEAD_DIMS["flash_attn"])
    passed = least <= head_dim <= MAX_FLASH_HEAD_DIM and (not eights or head_dim % 8 == 0)
    return GateResult("head_dim", passed, required, str(head_dim), fix)


def gate_lines(results: list[GateResult], indent: str) -> list[str]:
    """Every gate, those of each backend under the backend's name (several backends share gate names)."""
    lines, backend = [], ""
    for g in results:
        if g.backend != backend:
            backend = g.backend
            lines.append(f"{indent}{backend} backend:")
        lines.append(f"{indent}{'  ' if backend else ''}- {g.describe()}")
    return lines


def first_failure(results: list[GateResult]) -> Optional[GateResult]:
    return next((r for r in results if not r.passed), None)
