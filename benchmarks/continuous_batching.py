"""Continuous batching (`generate_batch()`, what `transformers serve` runs): patchkit's varlen path against HF's.

transformers' continuous batching packs every scheduled request into one row of queries over a paged cache. Under
sdpa and eager it builds a 4D mask over the whole step (queries x every request's keys) and attends through it, so
a step's attention grows with the square of the step's tokens, not with each request's. patchkit reads the
requests' lengths off the step and runs its varlen kernels per request (`patchkit/forward/inputs/paged.py`); before
2026-12-05 every such step stepped aside to transformers' attention (`patchkit_aside` stands in for that code).
HF_SIZE's LLaMA (hidden 256, 4 layers, 8 heads, 2 K/V heads), fp32 on CPU; 16 requests of the lognormal lengths
(median ~300), then the same twice as long (`--scale` scales both), 32 new tokens each, greedy; steps of at most 512
tokens. Providers alternate run by run after one warm-up run, medians kept. Throughput counts real tokens: the
prompts' and the generated ones (there is no padding in continuous batching) over generate_batch's wall time;
`forward_s` is the time inside the model's forward calls alone (the steps, without the manager's scheduling, start
and stop). Every provider's tokens must be HF sdpa's.

    python benchmarks/continuous_batching.py [--reps 3] [--scale 1.0] [--requests 16] [--new-tokens 32] [--csv ...]
        [--device cpu|cuda]

`--device cuda`: the same model in bf16 on the GPU, patchkit on its best backend whose gates pass, and HF's
`flash_attention_2` beside HF sdpa where it loads (continuous batching then reads its cache through block tables,
in CUDA graphs by default: HF's fastest continuous batching); a provider that does not load is a `skipped` row.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from providers import add_sweep_args, no_cuda  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import HF_SIZE, hf_size, lognormal_lengths  # noqa: E402

PROVIDERS = ("hf_sdpa", "hf_eager", "patchkit_aside", "patchkit")
CUDA_PROVIDERS = ("hf_sdpa", "hf_flash_attention_2", "patchkit_aside", "patchkit")
BUDGET = 512  # tokens per step (ContinuousBatchingConfig.max_batch_tokens)


def build(device: torch.device) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(tf.LlamaConfig(**hf_size(device.type)), attn_implementation="sdpa")
    return model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, HF_SIZE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def providers(reference: torch.nn.Module, skipped: dict[str, str]) -> dict[str, tuple[torch.nn.Module, Any]]:
    """Each provider's model and its patch handle (None unpatched); one that does not load goes to `skipped`."""
    import patchkit

    cuda = reference.device.type == "cuda"
    out: dict[str, tuple[torch.nn.Module, Any]] = {}
    for name in CUDA_PROVIDERS if cuda else PROVIDERS:
        model = copy.deepcopy(reference)
        try:
            if name.startswith("hf_") and name != "hf_sdpa":
                model.set_attn_implementation(name[3:])  # eager: continuous batching runs it as "paged|eager"
        except (ValueError, ImportError) as exc:
            skipped[name] = str(exc).splitlines()[0][:160]
            continue
        patched = name.startswith("patchkit")
        out[name] = (model, patchkit.apply_patch(model=model, backend="auto" if cuda else "sdpa") if patched else None)
    return out


@contextlib.contextmanager
def before(name: str) -> Iterator[None]:
    """The code before 2026-12-05 for `patchkit_aside`: every continuous-batching step stepped aside."""
    from patchkit.hooks.decide import step_aside

    if name != "patchkit_aside":
        yield
        return
    kept = step_aside.paged_servable
    step_aside.paged_servable = lambda *_: False
    try:
        yield
    finally:
        step_aside.paged_servable = kept


@contextlib.contextmanager
def forward_seconds(model: torch.nn.Module) -> Iterator[list[float]]:
    """The seconds spent inside the model's forward calls (continuous batching's steps, without its scheduling and
    its manager's start and stop), summed into the list yielded: by forward hooks, which leave the forward as it is
    (marked shape-free: they read no tensor)."""
    import patchkit

    spent, started = [0.0], [0.0]
    cuda = model.device.type == "cuda"

    def before_forward(*_: Any) -> None:
        started[0] = time.perf_counter()

    def after_forward(*_: Any) -> None:
        if cuda:
            torch.cuda.synchronize()
        spent[0] += time.perf_counter() - started[0]

    hooks = [model.register_forward_pre_hook(patchkit.shape_free(before_forward)),
             model.register_forward_hook(patchkit.shape_free(after_forward))]
    try:
        yield spent
    finally:
        for hook in hooks:
            hook.remove()


def run(model: torch.nn.Module, inputs: list[list[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
    """generate_batch's seconds, those inside the model's forward, and each request's generated tokens, in request
    order."""
    import transformers as tf

    generation = tf.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = tf.ContinuousBatchingConfig(max_batch_tokens=BUDGET, num_blocks=64)
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with forward_seconds(model) as spent:
        out = model.generate_batch(inputs=inputs, generation_config=generation, continuous_batching_config=config,
                                   progress_bar=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ordered = sorted(out.values(), key=lambda o: int(o.request_id.split("_")[-1]))
    if any(o.error for o in ordered):
        raise RuntimeError(next(o.error for o in ordered if o.error))
    return seconds, spent[0], [o.generated_tokens for o in ordered]


def measure(lengths: list[int], new_tokens: int, reps: int, device: torch.device) -> list[dict]:
    inputs = prompts(lengths)
    skipped: dict[str, str] = {}
    built = providers(build(device), skipped)
    times: dict[str, list[float]] = {name: [] for name in built}
    forwards: dict[str, list[float]] = {name: [] for name in built}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(reps + 1):  # the first round warms up
        for name, (model, _) in built.items():
            with before(name):
                seconds, in_forward, tokens[name] = run(model, inputs, new_tokens)
            if rep:
                times[name].append(seconds)
                forwards[name].append(in_forward)
    aside = {name: sum(handle.stepped_aside.values()) for name, (_, handle) in built.items() if handle is not None}
    real_tokens = sum(lengths) + len(lengths) * new_tokens
    base, base_forward = statistics.median(times["hf_sdpa"]), statistics.median(forwards["hf_sdpa"])
    rows = [dict(provider=name, requests=len(lengths), longest_prompt=max(lengths), skipped=why)
            for name, why in skipped.items()]
    for name in skipped:
        print(f"{name:<16} skipped: {skipped[name]}", flush=True)
    for name in built:
        med, forward = statistics.median(times[name]), statistics.median(forwards[name])
        same = tokens[name] == tokens["hf_sdpa"]
        rows.append(dict(provider=name, requests=len(lengths), longest_prompt=max(lengths),
                         prompt_tokens=sum(lengths), new_tokens=new_tokens,
                         real_tokens=real_tokens, step_budget=BUDGET, median_s=round(med, 4),
                         real_tokens_per_s=round(real_tokens / med, 1), vs_hf_sdpa=round(base / med, 2),
                         forward_s=round(forward, 4), forward_vs_hf_sdpa=round(base_forward / forward, 2),
                         stepped_aside=aside.get(name, 0), same_tokens=same, reps=len(times[name]),
                         device=device.type, note=backend_of(built[name][1])))
        print(f"{name:<16}{med:>10.3f}{real_tokens / med:>12.1f}{base / med:>9.2f}x{forward:>11.3f}"
              f"{base_forward / forward:>9.2f}x{aside.get(name, 0):>8}{'  yes' if same else '  NO':>6}", flush=True)
    return rows


def backend_of(handle: Any) -> str:
    """The backend a patch runs on ("" unpatched)."""
    return "" if handle is None else f"backend {handle.backend}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/continuous_batching.py",
                                     description=__doc__.split("\n\n")[0])
    add_sweep_args(parser, reps=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if no_cuda(parser.prog, args.device):
        return 0
    rows = []
    for scale in (args.scale, 2 * args.scale):  # the lognormal prompts, then twice as long
        lengths = lognormal_lengths(args.requests, scale)
        print(f"{len(lengths)} requests of {sum(lengths)} prompt tokens ({min(lengths)}-{max(lengths)}), "
              f"{args.new_tokens} new tokens each, steps of <= {BUDGET} tokens; {args.reps} alternating reps, medians")
        print(f"{'provider':<16}{'median s':>10}{'real tok/s':>12}{'vs sdpa':>10}{'forward s':>11}{'vs sdpa':>10}"
              f"{'aside':>8}{'same':>6}")
        rows += measure(lengths, args.new_tokens, args.reps, torch.device(args.device))
    if args.csv:
        write_rows(args.csv, rows)
    # on the CPU every provider's tokens are HF sdpa's (fp32); bf16 kernels may differ by a rounding
    return 0 if args.device == "cuda" or all(r.get("same_tokens", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
