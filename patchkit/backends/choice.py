"""Which backend runs: the first GPU kernel backend whose gates all pass, else sdpa, said in one short warning."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

from patchkit import gates as _gates
from patchkit.errors import PatchGateError
from patchkit.gates import Environment, GateResult
from patchkit.warn import warn_user

AUTO_ORDER = ("flash_attn", "torch_varlen")  # backend="auto" tries these in turn, then the exact sdpa backend
# flash-attn 4 is an optional accelerator: "auto" considers it only where it is installed (no warning for its absence),
# first on Hopper and datacenter Blackwell (sm90, sm100, sm110: its CuTe kernels target them, and it has the backward
# and the sinks' backward there), last elsewhere (Ampere: no backward; sm120: no sinks' backward, flash-attn 2 proven
# there). An expectation from flash-attn 4's design, to be confirmed by `make gpu-truth` on each GPU generation.
FLASH4_FIRST_MAJORS = (9, 10, 11)
MAX_WARNING_CHARS = 200  # the fallback warning is one line a person reads; the full list is in report() and doctor


def candidates(requested: str, env: Optional[Environment] = None) -> tuple[str, ...]:
    """The kernel backends a request tries, best first; sdpa needs no gate and ends every list."""
    if requested == "auto":
        if env is None or env.flash_attn_4_version is None:
            return AUTO_ORDER
        first = env.compute_capability is not None and env.compute_capability[0] in FLASH4_FIRST_MAJORS
        return ("flash_attn_4", *AUTO_ORDER) if first else (*AUTO_ORDER, "flash_attn_4")
    return () if requested == "sdpa" else (requested,)


def backend_gates(
    backend: str, env: Environment, flash_min: str, why: str, head_dim: Optional[int] = None
) -> list[GateResult]:
    """Every gate `backend` must pass on this machine, each tagged with the backend's name."""
    if backend == "flash_attn":
        results = _gates.flash_backend_gates(env, flash_min, why)
    elif backend == "torch_varlen":
        results = _gates.torch_varlen_backend_gates(env)
    elif backend == "flash_attn_4":
        results = _gates.flash4_backend_gates(env)
    else:
        raise ValueError(f"no gates for backend {backend!r}")
    if head_dim is not None:
        results.append(_gates.head_dim_gate(head_dim, backend))
    return [dataclasses.replace(g, backend=backend) for g in results]


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend chosen, every gate evaluated, and the first failed gate of each better backend passed over."""

    backend: str
    gates: list[GateResult]
    passed_over: list[GateResult]


def pick(
    requested: str, env: Environment, flash_min: str, why: str, head_dim: Optional[int] = None
) -> Choice:
    """Evaluate every candidate's gates (all of them, for the report) and take the first that passes them all."""
    evaluated = [(name, backend_gates(name, env, flash_min, why, head_dim)) for name in candidates(requested, env)]
    chosen = next((name for name, results in evaluated if all(g.passed for g in results)), "sdpa")
    passed_over = []
    for name, results in evaluated:
        if name == chosen:
            break
        passed_over.append(next(g for g in results if not g.passed))
    return Choice(chosen, [g for _, results in evaluated for g in results], passed_over)


def fallback_message(who: str, choice: Choice, silence: str = "backend='sdpa'") -> str:
    """One line of at most MAX_WARNING_CHARS: the backend that runs, the first failed gate of each better backend
    (what was found, cut to fit), and the fix; every gate is in report() and `patchkit doctor`. `silence`: the call
    that asks for sdpa where `who` is configured."""
    kind = "the exact sdpa backend" if choice.backend == "sdpa" else f"the {choice.backend} backend"
    fix = f"Fix: `patchkit doctor`; {silence} silences it" if choice.backend == "sdpa" else \
        "`patchkit doctor` explains"
    for width in (40, 24, 16, 0):
        reasons = "; ".join(f"not {g.backend}: {g.name}: FAILED" + (f", {_cut(g.found, width)}" if width else "")
                            for g in choice.passed_over)
        text = f"patchkit: {who} runs on {kind} ({reasons}). {fix}."
        if len(text) <= MAX_WARNING_CHARS:
            break
    return text


def _cut(text: str, width: int) -> str:
    """`text` within `width` characters (a parenthesised detail goes first)."""
    text = text.split(" (")[0] if len(text) > width else text
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def refusal_message(who: str, requested: str, choice: Choice, refusal: str = "") -> str:
    """The strict-mode error: what was refused, the simplest way out, then every failed gate of every backend tried,
    one per line, the gates a pip install fixes before those that need another torch or other hardware."""
    failed = [g for g in choice.gates if not g.passed]
    ordered = sorted(failed, key=lambda g: (_effort(g), choice.gates.index(g)))
    return "\n".join([
        f"{who[:1].upper()}{who[1:]}, backend {requested!r}: {len(failed)} gate(s) failed.{refusal}",
        "  simplest: backend='sdpa' (exact, torch-native, CPU or GPU, no gate), or strict=False to fall back to it",
        *(f"  - {g.backend}: {_without_sdpa(g.describe())}" for g in ordered),
    ])


def _without_sdpa(text: str) -> str:
    """A gate's text without its own "or use backend='sdpa'" tail, said once above the list."""
    return re.sub(r",? or (?:use )?backend='sdpa'(?: \(torch-native, runs on CPU\))?$", "", text)


def _effort(gate: GateResult) -> int:
    """How much a gate's fix asks: 0 a pip install, 1 another torch or a rebuild, 2 other hardware."""
    fix = (gate.fix or "").lower()
    if "pip install" in fix:
        return 0
    return 2 if "gpu" in fix else 1


def resolve(
    requested: str, strict: bool, env: Environment, flash_min: str, why: str, who: str,
    head_dim: Optional[int] = None, refusal: str = "", silence: str = "backend='sdpa'",
) -> Choice:
    """Choose the backend; a fallback warns once at the user's line, or raises `PatchGateError` when strict.

    Strict refuses what the request cannot get: a named backend whose gates fail, or "auto" with no kernel
    backend left (a later kernel backend in AUTO_ORDER is accepted, with the warning).
    """
    choice = pick(requested, env, flash_min, why, head_dim)
    if choice.passed_over and strict and (requested != "auto" or choice.backend == "sdpa"):
        raise PatchGateError(refusal_message(who, requested, choice, refusal))
    if choice.passed_over:
        warn_user(fallback_message(who, choice, silence))
    return choice


def choose_backend(
    patch: str, flash_min: str, why: str, backend: str, strict: bool, env: Environment,
    head_dim: Optional[int] = None, who: Optional[str] = None, silence: str = "backend='sdpa'",
) -> tuple[str, list[GateResult]]:
    """A patch's backend: resolve "auto" or a backend's name against the gates (warn, or raise). `who`: what the
    warning names (the patch, by default); `silence`: how its user asks for sdpa."""
    choice = resolve(backend, strict, env, flash_min, why, who or f"patch {patch!r}", head_dim,
                     " Nothing was patched.", silence)
    return choice.backend, choice.gates


def serving_backend(
    backend: Any, fallback: Any, gate: Callable[[], GateResult],
    needs: tuple[Any, ...], *,
    strict: bool, who: str, uses: str, warn_once: Callable[[str, str], None],
) -> Any:
    """The kernel `backend` for one call, unless `gate()` fails or it lacks the window, softcap, dropout or head_dim
    in `needs` (and, where given, a backward and sinks): then the exact `fallback`, with one warning (`uses` says
    what moves to it), or refused in strict mode."""
    if not backend.half_only:
        return backend
    checked = gate()
    reason = None if checked.passed else checked.describe()
    reason = reason or backend.missing_feature(*needs)
    if reason is None:
        return backend
    if strict:
        raise PatchGateError(f"{who}: {reason}")
    warn_once(reason, f"patchkit: {reason}; {uses} the sdpa backend instead")
    return fallback
