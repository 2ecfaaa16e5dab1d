"""Compiled training steps: patchkit against the unpatched model compiled the same way, in real tokens per second.

Two ways users compile: `torch.compile(model)` (the Trainer's `torch_compile=True`; graph breaks allowed) on a
right-padded batch and on the same documents packed into one row (position_ids restarting), and
`torch.compile(model, fullgraph=True)` on the packed row. patchkit runs twice where graphs may break: `patchkit`
(unpad="model", the logits back) and `patchkit_loss` (unpad="loss": the loss alone, the head fused with it). Packed
rows run patchkit's in-graph varlen path both ways (`patchkit/forward/in_graph.py`, one graph); the padded batch its
eager path's unpadding (host reads, graph breaks).
The unpatched packed row runs with `use_cache=False`, so transformers finds the documents from position_ids too
(same work, same numbers). LLaMA at the main benchmark's size, a batch of 8 lognormal lengths scaled down for the
CPU; providers alternate step by step, the median is kept; the compile itself (first steps) is not timed. Prints a
table and writes a CSV.

    python benchmarks/compiled.py [--reps 5] [--scale 0.25] [--backend inductor] [--csv out.csv] [--device cpu|cuda]
        [--budget-s SECONDS]

`--device cuda`: bf16 on the GPU at bench.py's CUDA size (workloads.hf_size: hidden 2048, 16 heads of head_dim 128, 2
K/V heads), a batch of 16 at full length (scale 1.0 unless given); patchkit on its best backend whose gates pass
(flash_attn, else torch_varlen, else sdpa), and HF's flash_attention_2 compiled alike beside HF sdpa where it loads
(a case that fails to compile or run is a `skipped` row with the reason). CUDA rows add vs_hf_fa2, the backend, the
step's peak memory, reps, device, dtype and a note. `--budget-s` stops compiling further cases and starting further
rounds once spent (each compiled case gets one timed round); the rows measured are written either way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from providers import (  # noqa: E402
    HF_PROVIDERS,
    Budget,
    add_run_args,
    device_and_dtype,
    no_cuda,
    one_line,
    patch_on_best,
    probed,
    timed,
)
from report import write_rows  # noqa: E402
from workloads import MODES, hf_size, lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402,E501

WARMUP = 2
FA2 = "hf_flash_attention_2"
LAYOUTS = ("compile padded", "compile packed", "fullgraph packed")
LOSS = "patchkit_loss"  # unpad="loss"; not under fullgraph=True, where the loss comes with its logits


def model(device: torch.device, attn: str = "sdpa") -> torch.nn.Module:
    """The LLaMA at the device's size (hf_size), random weights (seed 0), in training mode, in the device's dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        net = LlamaForCausalLM(LlamaConfig(**hf_size(device.type), attn_implementation=attn))
    return net.to(device_and_dtype(device.type)[1]).train()


def stepper(provider: str, fullgraph: bool, backend: str, data: dict, device: torch.device) -> Callable[[], float]:
    """A function running one timed training step (forward, backward) of its own compiled model; the loss.
    `provider`: hf_sdpa, hf_flash_attention_2, patchkit, or patchkit_loss (unpad="loss": the loss alone, the head
    fused with it, no logits)."""
    net = model(device, HF_PROVIDERS.get(provider, "sdpa"))
    # not flash_attn_4: its CuTe DSL kernels under torch.compile are untried, and this part's one GPU run keeps the
    # backend it measured before (flash_attn_4 is timed uncompiled by bench.py)
    unpad = {"patchkit": "model", LOSS: "loss"}.get(provider)
    handle, patched_on, refused = (patch_on_best("llama", net, device, strict=False, exclude=("flash_attn_4",),
                                                 unpad=unpad)
                                   if unpad else (None, HF_PROVIDERS[provider], ""))
    compiled = torch.compile(net, backend=backend, fullgraph=fullgraph)

    def step() -> float:
        net.zero_grad(set_to_none=True)
        loss = compiled(**data).loss
        loss.backward()
        return float(loss)

    step.handle, step.backend, step.refused = handle, patched_on, refused  # type: ignore[attr-defined]
    return step


def build(layout: str, providers: list[str], data: dict, args: argparse.Namespace, device: torch.device,
          steps: dict[str, Any], losses: dict[str, float], skipped: dict[str, str], budget: Budget) -> None:
    """Each provider's compiled step of `layout` into `steps`, warmed up (compiled) with its loss, until `budget` is
    spent (HF sdpa first: what is compiled has its baseline); on CUDA a case that fails to compile or run is
    `skipped` with the reason (hf_sdpa's and on the CPU any failure is raised)."""
    for provider in providers:
        name = f"{provider} {layout}"
        if provider == LOSS and layout.startswith("fullgraph"):
            continue  # never run: not a case the budget left out
        if budget.spent(f"{name} (not compiled)") or f"hf_sdpa {layout}" not in steps and provider != "hf_sdpa":
            continue
        torch._dynamo.reset()
        try:
            steps[name] = stepper(provider, layout.startswith("fullgraph"), args.backend, data, device)
            for _ in range(WARMUP):
                losses[name] = steps[name]()
        except Exception as exc:  # noqa: BLE001 - a GPU case that cannot compile or run is recorded, not fatal
            if device.type != "cuda" or provider == "hf_sdpa":
                raise
            steps.pop(name, None)
            skipped[name] = one_line(exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/compiled.py", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=None,
                        help="document lengths times this (default 0.25 on the CPU: short; 1.0 on CUDA)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "compiled.csv")
    add_run_args(parser)
    args = parser.parse_args(argv)
    if no_cuda("compiled", args.device):
        return 0
    device, cuda = torch.device(args.device), args.device == "cuda"
    budget = Budget(args.budget_s)
    scale = args.scale if args.scale is not None else 1.0 if cuda else 0.25
    lengths = lognormal_lengths(MODES["cuda"]["batch"] if cuda else 8, scale)
    docs = make_tokens(lengths, hf_size(device.type)["vocab_size"])
    ids, mask, labels = padded_batch(docs)
    padded = {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
    packed: dict[str, Any] = {k: v.to(device) for k, v in packed_row(docs).items()
                              if k in ("input_ids", "position_ids", "labels")}
    packed["use_cache"] = False
    real = sum(lengths)
    fa2_why = dict(probed(device)[1]).get(FA2) if cuda else None
    providers = ["hf_sdpa"] + ([FA2] if cuda and not fa2_why else []) + ["patchkit", LOSS]
    steps: dict[str, Any] = {}
    losses: dict[str, float] = {}
    skipped = {f"{FA2} {layout}": fa2_why for layout in LAYOUTS} if fa2_why else {}
    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    try:
        for layout in LAYOUTS:  # each layout compiled and timed before the next: a budget keeps whole layouts
            built = dict(steps)
            build(layout, providers, packed if layout.endswith("packed") else padded, args, device, steps, losses,
                  skipped, budget)
            fresh = {name: step for name, step in steps.items() if name not in built}
            for step in fresh.values():  # untimed: the dynamo reset before each later case's compile dropped the
                step()  # earlier cases' graphs, which their next call compiles again
            times.update({name: [] for name in fresh})
            peaks.update(dict.fromkeys(fresh, 0.0))
            for rep in range(args.reps):
                if rep and budget.spent(f"{layout}: rounds {rep + 1}-{args.reps} of {args.reps}"):
                    break
                for name, step in fresh.items():
                    seconds, peak, _ = timed(step, device)
                    times[name].append(seconds)
                    peaks[name] = max(peaks[name], peak or 0.0)
    finally:
        rows = report(times, peaks, steps, losses, skipped, real, cuda)
        if rows:
            write_rows(args.csv, rows)
        budget.report("compiled")
    print(f"{len(lengths)} rows, {real} real tokens, {padding_fraction(lengths):.0%} padding, {args.backend}, "
          f"torch {torch.__version__}" + (f", bf16 on {torch.cuda.get_device_name()}" if cuda else ""))
    print(f"{'provider':28} {'median s':>9} {'tokens/s':>9} {'vs HF':>6}  " + ("vs fa2  peak MiB  backend  " if cuda
                                                                                 else "") + "loss")
    for row in rows:
        if row.get("note", "").startswith("skipped"):
            print(f"{row['provider']:28} {row['note']}")
            continue
        extra = f"{row['vs_hf_fa2'] or '':>6}  {row['peak_mib']:>8.0f}  {row['backend']:<8} " if cuda else ""
        print(f"{row['provider']:28} {row['median_s']:9.4f} {row['real_tokens_per_s']:9.1f} {row['vs_hf']:6.2f}  "
              f"{extra}{row['loss']} {row['stepped_aside']}")
    return 0


def report(times: dict[str, list[float]], peaks: dict[str, float], steps: dict[str, Any], losses: dict[str, float],
           skipped: dict[str, str], real: int, cuda: bool) -> list[dict]:
    """The CSV rows: each timed case against HF sdpa compiled alike (and on CUDA HF flash_attention_2), then on CUDA
    the skipped cases with their reasons."""
    rows = []
    for name in (n for n in steps if times.get(n)):
        median = statistics.median(times[name])
        provider, _, layout = name.partition(" ")
        base = statistics.median(times[f"hf_sdpa {layout}"])
        handle = steps[name].handle
        aside = handle.stepped_aside if handle is not None else {}
        row = dict(provider=name, median_s=round(median, 4), real_tokens_per_s=round(real / median, 1),
                   vs_hf=round(base / median, 2), loss=round(losses[name], 5), stepped_aside=str(aside or ""))
        if cuda:
            fa2 = times.get(f"{FA2} {layout}")
            row.update(vs_hf_fa2=round(statistics.median(fa2) / median, 2) if fa2 else "", backend=steps[name].backend,
                       peak_mib=round(peaks[name], 1), reps=len(times[name]), device="cuda", dtype="bfloat16",
                       note=f"better backends refused: {steps[name].refused}" if steps[name].refused else "")
        rows.append(row)
    for name, why in skipped.items() if cuda else ():
        rows.append(dict(provider=name, median_s="", real_tokens_per_s="", vs_hf="", loss="", stepped_aside="",
                         vs_hf_fa2="", backend="", peak_mib="", reps=0, device="cuda", dtype="bfloat16",
                         note=f"skipped: {why}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
