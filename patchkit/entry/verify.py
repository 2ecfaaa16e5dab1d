"""`patchkit verify`: patched vs unpatched attention on padded batches and generation, against stated tolerances."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from typing import Any, Callable, Optional

import torch
from packaging.version import Version
from torch import nn

from patchkit.api import active_patches, apply_patch
from patchkit.errors import PatchkitError
from patchkit.forward.inputs.arguments import cache_parameter
from patchkit.hooks.install.registry import PatchSpec, resolve

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_RTOL = 1e-4
HALF_FACTOR = 2.0
HALF_FLOOR = 1e-3  # x the reference scale (see `scale`)
GRAD_SCALE_FLOOR = 1e-6
BATCH, SEQ, NEW_TOKENS = 4, 24, 12
PAD = 0


@dataclasses.dataclass
class Check:
    """One comparison: the largest difference found and the tolerance it must stay within."""

    name: str
    diff: float
    tol: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.diff <= self.tol

    def row(self) -> str:
        status = "ok" if self.passed else "FAIL"
        return f"  {self.name:<28}{self.diff:>12.3e}{self.tol:>12.3e}  {status:<5}{self.detail}"


@dataclasses.dataclass
class VerifyResult:
    """Every check of one `verify` run, with what was compared."""

    patch: str
    backend: str
    dtype: str
    model: str
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def table(self) -> str:
        """The printed report: one row per check, the largest difference against its tolerance."""
        rule = (
            f"tolerance: {FP32_RTOL:g} x reference scale" if self.dtype == "fp32"
            else f"tolerance: {HALF_FACTOR:g} x eager {self.dtype} error vs fp32 + {HALF_FLOOR:g} x reference scale"
        )
        lines = [
            f"patchkit verify: patch {self.patch!r}, backend {self.backend!r}, dtype {self.dtype}, model {self.model}",
            "  patched vs unpatched (attn_implementation='eager', same weights); real tokens only",
            f"  {rule} (scale: max(1, |logits|max); |grad|max over all parameters)",
            f"  {'check':<28}{'max |diff|':>12}{'tolerance':>12}  result",
            *(c.row() for c in self.checks),
            f"  => {'PASS' if self.passed else 'FAIL'} ({sum(c.passed for c in self.checks)}/{len(self.checks)})",
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        checks = [dict(dataclasses.asdict(c), passed=c.passed) for c in self.checks]
        return {"patch": self.patch, "backend": self.backend, "dtype": self.dtype, "model": self.model,
                "passed": self.passed, "checks": checks}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def tiny_llama(patch: str, seed: int = 0) -> nn.Module:
    """A tiny random LlamaForCausalLM (GQA for llama2, plain MHA for llama1), fp32, eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 4
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads if patch == "llama1" else 2, max_position_embeddings=256,
        pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


TINY = ("llama2", "llama1")  # the patches verify's tiny random LLaMA serves


def spec_to_verify(patch: Optional[str], model_path: Optional[str]) -> PatchSpec:
    """The one patch verify runs: `patch`, else the checkpoint's model_type, else llama2; refused by name where it is
    every family at once (`all`) or a family other than LLaMA's without a checkpoint of it."""
    if patch is None:
        if model_path is None:
            return resolve("llama2")
        from transformers import AutoConfig

        return resolve(AutoConfig.from_pretrained(model_path).model_type)
    if patch.lower() == "all":
        raise ValueError("verify checks one family: name it (--patch llama2, or a model_type such as qwen3), or give "
                         "--model alone to verify the checkpoint's own family")
    spec = resolve(patch)
    if model_path is None and spec.name not in TINY:
        raise ValueError(f"verify of {patch!r} runs on a checkpoint of that family: give --model PATH (without one, "
                         f"verify's tiny model is a LLaMA: --patch {' or '.join(TINY)})")
    return spec


def load_model(patch: str, path: Optional[str], seed: int) -> tuple[nn.Module, str]:
    """The fp32 reference: a local checkpoint (from_pretrained, eager) or a tiny random LLaMA."""
    if path is None:
        return tiny_llama(patch, seed), "tiny random LLaMA (2 layers, hidden 64)"
    from transformers import AutoModelForCausalLM

    from patchkit.eras import installed_version

    # `dtype` from transformers 4.56; before, `torch_dtype` (an unknown keyword reaches the model's __init__)
    key = "dtype" if Version(installed_version()).release >= (4, 56) else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **{key: torch.float32})
    return model.eval(), path


def padded_batch(kind: str, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and a 2D mask: 'right', 'left' or 'mixed' (alternating sides, last row all padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for row, n in enumerate([SEQ, SEQ - 7, SEQ - 13, 5]):
        if kind == "left" or (kind == "mixed" and row % 2 == 1):
            mask[row, SEQ - n:] = 1
        else:
            mask[row, :n] = 1
    if kind == "mixed":
        mask[-1] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def labels_for(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Targets only where the token and the position predicting it are both real."""
    from_pad = torch.nn.functional.pad(mask[:, :-1] == 0, (1, 0))
    return ids.masked_fill((mask == 0) | from_pad, -100)


def forward_backward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """fp32 logits and parameter gradients of one padded batch."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach().float(), grads


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left padding, as generate computes them."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.no_grad()
def greedy(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=PAD)


@torch.no_grad()
def decode_logits(model: nn.Module, seq: torch.Tensor, mask: torch.Tensor, prompt: int) -> torch.Tensor:
    """Teacher-forced cached decoding along `seq`: prefill the prompt, then one token per step; (B, steps, V)."""
    pos = positions(mask)
    out = model(input_ids=seq[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt],
                use_cache=True)
    steps, name = [out.logits[:, -1]], cache_parameter(inspect.signature(model.forward).parameters)
    for t in range(prompt, seq.shape[1] - 1):
        out = model(input_ids=seq[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                    use_cache=True, **{name: out.past_key_values})
        steps.append(out.logits[:, -1])
    return torch.stack(steps, 1).float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def grad_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest gradient difference over all parameters, and the parameter where it occurs."""
    if a.keys() != b.keys():
        return float("inf"), f"different parameters got gradients: {sorted(a.keys() ^ b.keys())[:3]}"
    worst = max(a, key=lambda n: max_diff(a[n], b[n]))
    return max_diff(a[worst], b[worst]), f"worst: {worst}"


def scale(values: Any) -> float:
    """The reference's scale for relative tolerances: max(1, |logits|max), or |gradient|max over all parameters."""
    if isinstance(values, dict):
        return max([GRAD_SCALE_FLOOR] + [t.abs().max().item() for t in values.values() if t.numel()])
    return max([1.0] + ([values.abs().max().item()] if values.numel() else []))


def compare(name: str, ours: Any, eager: Any, truth: Any, half: bool, detail: str = "") -> Check:
    """fp32: ours vs eager within FP32_RTOL; half: ours' error vs truth within HALF_FACTOR x eager's error + floor."""
    diff_fn: Callable = (lambda x, y: grad_diff(x, y)[0]) if isinstance(ours, dict) else max_diff
    if not half:
        if isinstance(ours, dict):
            diff, detail = grad_diff(ours, eager)
        else:
            diff = diff_fn(ours, eager)
        return Check(name, diff, FP32_RTOL * scale(eager), detail)
    eager_err = diff_fn(eager, truth)
    return Check(name, diff_fn(ours, truth), HALF_FACTOR * eager_err + HALF_FLOOR * scale(truth),
                 f"eager error {eager_err:.3e}")


def run_side(model: nn.Module, batches: dict, gen: Optional[tuple]) -> dict[str, Any]:
    """Every measurement on one model: logits/grads per batch, greedy tokens and cached decode logits."""
    results: dict[str, Any] = {kind: forward_backward(model, ids, mask) for kind, (ids, mask) in batches.items()}
    if gen is not None:
        ids, mask, seq, full_mask = gen
        results["greedy"] = greedy(model, ids, mask)
        results["decode"] = decode_logits(model, seq, full_mask, ids.shape[1])
    return results


def verify(
    patch: Optional[str] = "llama2", dtype: str = "fp32", model_path: Optional[str] = None, backend: str = "auto",
    strict: bool = False, seed: int = 0,
) -> VerifyResult:
    """Run padded batches (right/left/mixed) and, for llama2, greedy generation through patched and eager attention.
    `patch`: a patch name or a model_type served from data (None: the checkpoint's model_type, else llama2); a
    family served from data is verified on a checkpoint of it (`model_path`), the tiny model being a LLaMA.

    The unpatched side is the same weights with attn_implementation="eager". The reference scale is
    max(1, |logits|max) for logits and |gradient|max over all parameters for gradients. fp32: the largest difference
    must stay within FP32_RTOL x that scale. fp16/bf16: both sides run in the half dtype and are compared to an fp32
    eager reference; the patched error may be at most HALF_FACTOR x the eager half-precision error plus HALF_FLOOR x
    the scale.

    Returns a `VerifyResult`; `.passed` is False when any difference exceeds its tolerance.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed values: {', '.join(DTYPES)}")
    spec = spec_to_verify(patch, model_path)
    half = dtype != "fp32"
    if any(h.key == ("class", spec.family) for h in active_patches()):
        raise PatchkitError(f"verify compares against unpatched attention, but a patch is already applied to the "
                            f"{spec.family} classes; call patchkit.revert_patch() first")
    if strict:  # fail on the gates before building anything
        apply_patch(spec.name, backend=backend, strict=True).revert()
    reference, label = load_model(spec.name, model_path, seed)
    if spec.check_model is not None:
        failed = [g for g in spec.check_model(reference) if not g.passed]
        if failed:
            raise ValueError(f"patch {spec.name!r} cannot run this model: {failed[0].describe()}")
    vocab = reference.config.vocab_size
    batches = {kind: padded_batch(kind, vocab, seed + 1) for kind in ("right", "left", "mixed")}
    gen = None
    if spec.name != "llama1":  # llama1 is training/prefill only: no KV cache, no generation
        ids, mask = batches["left"]
        ids, mask = ids[:3], mask[:3]
        seq = greedy(reference, ids, mask)
        gen = (ids, mask, seq, torch.cat([mask, torch.ones(3, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], 1))

    truth = run_side(reference, batches, gen) if half else None
    model = copy.deepcopy(reference).to(DTYPES[dtype]) if half else reference
    eager = run_side(model, batches, gen)
    with apply_patch(spec.name, backend=backend, strict=strict) as handle:
        handle.check(model)
        ours = run_side(model, batches, gen)
        used_backend = handle.backend

    return VerifyResult(spec.name, used_backend, dtype, label, build_checks(batches, ours, eager, truth))


def greedy_check(ours: torch.Tensor, eager: torch.Tensor, truth: Optional[torch.Tensor]) -> Check:
    """fp32: identical greedy tokens. Half: no more fp32-disagreeing tokens than HALF_FACTOR x eager's + 1 per row."""
    name = f"greedy {NEW_TOKENS} tokens: mismatches"
    if truth is None:
        return Check(name, float((ours != eager).sum().item()), 0.0, "tokens differing from eager")
    eager_miss = (eager != truth).sum().item()
    return Check(name, float((ours != truth).sum().item()), HALF_FACTOR * eager_miss + ours.shape[0],
                 f"vs fp32 greedy; eager {eager_miss}")


def build_checks(batches: dict, ours: dict, eager: dict, truth: Optional[dict]) -> list[Check]:
    """One check per batch for logits (real tokens only) and gradients, then the generation checks."""
    half = truth is not None
    checks: list[Check] = []
    for kind, (_, mask) in batches.items():
        real = mask.bool()
        checks.append(compare(f"{kind} padding: logits", ours[kind][0][real], eager[kind][0][real],
                              truth[kind][0][real] if half else None, half))
        checks.append(compare(f"{kind} padding: gradients", ours[kind][1], eager[kind][1],
                              truth[kind][1] if half else None, half))
    if "decode" in ours:
        checks.append(compare("cached decode: logits", ours["decode"], eager["decode"],
                              truth["decode"] if half else None, half))
        checks.append(greedy_check(ours["greedy"], eager["greedy"], truth["greedy"] if half else None))
    return checks
