"""`patchkit doctor`: what this machine has and which patch would apply with which backend, without patching."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
import sys
import time
from typing import Any, Optional

import torch

from patchkit import gates as _gates
from patchkit.backends.choice import Choice, pick
from patchkit.hooks.install.registry import registered

PACKAGES = ("torch", "transformers", "flash-attn", "accelerate", "peft")


def package_version(name: str) -> Optional[str]:
    """The installed distribution's version from its metadata (no import), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gate_dict(gate: _gates.GateResult) -> dict[str, Any]:
    return dataclasses.asdict(gate)


def _why(choice: Choice) -> str:
    """Why backend='auto' lands where it does: each better backend's failed gates, and what strict would do."""
    if not choice.passed_over:
        return f"every {choice.backend} gate passed"
    failed = "; ".join(
        f"{name} gates failed ({', '.join(g.name for g in choice.gates if g.backend == name and not g.passed)})"
        for name in dict.fromkeys(g.backend for g in choice.passed_over)
    )
    strict = "strict=True would raise" if choice.backend == "sdpa" else "strict=True accepts it"
    return f"{failed}: backend='auto' falls back to {choice.backend} with a warning; {strict}"


def evaluate_patch(spec: Any, env: _gates.Environment) -> dict[str, Any]:
    """Would this patch apply here, and with which backend under backend='auto'? The same gates apply_patch runs."""
    tf_gate = _gates.transformers_gate(env, spec.supported, spec.name)
    choice = pick("auto", env, spec.flash_attn_min, spec.flash_attn_why)
    if not tf_gate.passed:  # the gate itself, with its fix, is listed once below
        applies, backend, why = False, None, "the transformers_version gate failed: no backend can help"
    else:
        applies, backend, why = True, choice.backend, _why(choice)
    return {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "description": spec.description,
        "transformers": spec.transformers,
        "applies": applies,
        "backend": backend,
        "why": why,
        "gates": [_gate_dict(tf_gate)] + [_gate_dict(g) for g in choice.gates],
        "runtime_gates": "dtype (fp16/bf16 q/k/v, else cast with a warning) and head_dim <= "
        f"{_gates.MAX_FLASH_HEAD_DIM} (torch_varlen: a multiple of 8) are checked per model/call; a window, softcap "
        "or attention dropout the kernel lacks falls back per call (torch_varlen has no softcap and no dropout; "
        "flash_attn_4 no dropout, and no backward before compute capability 9.0), as "
        "does a head dim or feature a flash-attn built by tools/build_flash_attn.py was built without"
        + (f"; model_config ({spec.model_gate}) when a model is patched" if spec.check_model else ""),
    }


def doctor() -> dict[str, Any]:
    """Versions, hardware, the flash-attn import result and each patch's verdict, as a JSON-ready dict."""
    from patchkit.entry.autostart import startup_hook

    start = time.perf_counter()
    env = _gates.probe_environment()
    versions = {"python": platform.python_version(), "patchkit": importlib.metadata.version("patchkit")}
    versions.update({name: package_version(name) for name in PACKAGES})
    versions["torch"] = env.torch_version
    versions["cuda"] = torch.version.cuda
    return {
        "versions": versions,
        "platform": platform.platform(),
        "python_executable": sys.executable,
        "hardware": {
            "cuda_available": env.cuda_available,
            "device_count": torch.cuda.device_count() if env.cuda_available else 0,
            "gpu": env.device_name,
            "compute_capability": ".".join(map(str, env.compute_capability)) if env.compute_capability else None,
            "bf16_supported": env.bf16_supported,
        },
        "flash_attn": {
            "installed": env.flash_attn_version is not None or not (env.flash_attn_error or "").startswith("not inst"),
            "version": env.flash_attn_version,
            "cuda_extension_imports": env.flash_attn_error is None and env.flash_attn_version is not None,
            "error": env.flash_attn_error,
            "build": _gates.build_config() if env.flash_attn_error is None and env.flash_attn_version else {},
        },
        "flash_attn_4": {"version": env.flash_attn_4_version, "error": env.flash_attn_4_error},
        "patches": [evaluate_patch(spec, env) for spec in registered()],
        "startup_hook": startup_hook(),
        "seconds": round(time.perf_counter() - start, 3),
    }


def _row(label: str, value: Any) -> str:
    return f"  {label:<20}{'-' if value is None else value}"


def _build_lines(build: dict[str, Any]) -> list[str]:
    """What a flash-attn built by tools/build_flash_attn.py lacks; nothing for any other build."""
    if not build:
        return []
    dims = ",".join(map(str, build.get("head_dims", ())))
    without = ", ".join(build.get("disabled", ())) or "nothing"
    archs = ",".join(f"sm_{a}" for a in build.get("archs", ()))
    return [f"  built by tools/build_flash_attn.py for {archs}: head-dim buckets {dims} only, without {without}; "
            "a call it lacks runs on the sdpa backend with a warning (strict: refused)"]


def _patch_line(p: dict[str, Any], common_why: Optional[str]) -> str:
    """One patch, one line: its name, its verdict (and why, unless it is the reason every patch shares)."""
    alias = f" (alias {', '.join(p['aliases'])})" if p["aliases"] else ""
    if not p["applies"]:
        failed = next((g for g in p["gates"] if not g["passed"]), None)
        why = f"{failed['name']}: found {failed['found']}" if failed else p["why"]
        return f"  {p['name']}{alias}: does NOT apply ({why}); needs transformers{p['transformers']}"
    why = "" if p["why"] == common_why else f" ({p['why']})"
    return f"  {p['name']}{alias}: applies, backend {p['backend']}{why}; transformers{p['transformers']}"


def patch_lines(patches: list[dict[str, Any]], verbose: bool = False) -> list[str]:
    """One line per patch and, once, why backend='auto' lands where it does; `verbose`: every gate, with its fix."""
    whys = [p["why"] for p in patches if p["applies"]]
    common = max(set(whys), key=whys.count) if whys else None
    lines = []
    for p in patches:
        lines.append(_patch_line(p, None if verbose else common))
        if verbose:
            lines += _gates.gate_lines([_gates.GateResult(**g) for g in p["gates"]], "    ")
    if common and not verbose:
        lines.append(f"  why: {common}")
        lines.append("  (`patchkit doctor --verbose`: every gate of every patch, with its fix)")
    return lines


def _flash4_row(fa4: dict[str, Any]) -> str:
    """flash-attn 4's version, and why its kernels cannot be called where they cannot."""
    if fa4.get("version") is None:
        return "not installed (optional; backend='flash_attn_4' on sm90/sm100: pip install flash-attn-4)"
    return fa4["version"] + (f" ({fa4['error']})" if fa4.get("error") else "")


def format_report(data: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable report of `doctor()`: one line per patch, or every gate with `verbose`."""
    v, hw, fa = data["versions"], data["hardware"], data["flash_attn"]
    cuda = v["cuda"] or "none (CPU build of torch)"
    lines = [
        f"patchkit doctor (patchkit {v['patchkit']}, {data['platform']})",
        "versions",
        _row("python", v["python"]),
        _row("torch", v["torch"]),
        _row("CUDA (torch build)", cuda),
        _row("transformers", v["transformers"] or "not installed"),
        _row("flash-attn", v["flash-attn"] or "not installed"),
        _row("flash-attn-4", _flash4_row(data.get("flash_attn_4") or {})),
        _row("accelerate", v["accelerate"] or "not installed"),
        _row("peft", v["peft"] or "not installed"),
        "hardware",
        _row("GPU", f"{hw['gpu']} (x{hw['device_count']})" if hw["cuda_available"] else "none (no CUDA device)"),
        _row("compute capability", hw["compute_capability"] or "n/a (FlashAttention 2 needs >= 8.0)"),
        _row("bf16 on GPU", "yes" if hw["bf16_supported"] else "no"),
        "flash-attn CUDA extension",
        "  " + ("imports: ok" if fa["cuda_extension_imports"] else f"does not import: {fa['error']}"),
        *_build_lines(fa.get("build") or {}),
        "patches (backend='auto')",
        *patch_lines(data["patches"], verbose),
    ]
    hook = data["startup_hook"]
    flag = hook["PATCHKIT_FLASH_ATTN"]
    lines += [
        "startup hook (PATCHKIT_FLASH_ATTN=1 and attn_implementation='patchkit' without `import patchkit`)",
        _row(".pth file", hook["pth"] or "not installed (reinstall patchkit: pip install patchkit, or -e .)"),
        _row("active here", "yes" if hook["active"] else "no"),
        _row("PATCHKIT_FLASH_ATTN", "unset (off)" if flag is None else flag),
    ]
    lines.append(f"(gates probed in {data['seconds']:.2f} s)")
    return "\n".join(lines)


def exit_code(data: dict[str, Any]) -> int:
    """0 when at least one patch applies here, else 1."""
    return 0 if any(p["applies"] for p in data["patches"]) else 1
