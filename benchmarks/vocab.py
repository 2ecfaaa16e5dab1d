"""The LM head and loss at large vocabularies: a padded training step where the head, not attention, dominates.

At a 32k-262k vocabulary the head (B·N·H -> B·N·V) is the step's largest matmul and its float32 logits its memory
peak; patchkit runs both on real tokens only (`patchkit/hooks/head/lm_head.py`). This benchmark trains a LLaMA
of hidden 256 x 4 layers (the toy where the head dominates) at the vocabularies of LLaMA-2 (32000), Llama 3
(128256), Qwen2.5 (151936) and Gemma 3 (262144) on the lognormal batch of 8 at about 512 tokens (55.6% padding; half
the rows' length at 262144, where HF's step needs more memory than this machine has beside its own), right-padded,
left-padded (the label recipe: -100 at padding and at each row's first token), packed into one row (position_ids
restarting) and right-padded with completion-only labels (SFT's prompt-completion default: each row's first half a
prompt, labelled -100), against HF sdpa (and HF eager at 32000). `patchkit_loss` is patchkit with unpad="loss": the
step returns its loss alone, the head fused with the loss on the labelled tokens alone, and no (B, N, V) logits. The
head's share of a step at bench.py's vocabulary of 4096 is the 0.5B-1B models' (20-30% of the matmul FLOPs); here it
is 70-95%.

Reported per row: real (non-padding) tokens per second, the median of `--reps` steps with the providers interleaved
step by step (load on the machine hits all alike) after one untimed step, the loss (equal across providers), and a
step's peak memory: the second step's peak resident set above the resident set before it, measured alone in a fresh
process per provider (`--memory-only --first-step`: the first step's, where unpad="loss" checks the family's logits
on a few rows and runs the fused head and loss already: `patchkit/hooks/head/fused_head.py`).

`--device cuda` (`make gpu-truth`): bf16 at bench.py's CUDA layers (hidden 2048, 16 heads of 128, 4 layers: the
0.5B-3B models' hidden/vocabulary ratio) on the same lognormal mix at a longest row of about 2048, patchkit on its best
kernel backend against HF sdpa, flash_attention_2 and flash_attention_4 (each where it loads), the peak memory
`torch.cuda.max_memory_allocated` above what was allocated before the step, in the same process.

    python benchmarks/vocab.py [--vocabs 32000 151936] [--layouts right left packed] [--reps 3] [--csv out.csv]
        [--no-memory] [--device cpu|cuda] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from providers import (  # noqa: E402
    HF_KERNELS,
    HF_PROVIDERS,
    Budget,
    add_run_args,
    build_model,
    device_and_dtype,
    no_cuda,
    patch_on_best,
    probed,
    timed,
)
from report import write_rows  # noqa: E402
from workers import step_peak_mib, worker_json  # noqa: E402
from workloads import (  # noqa: E402
    MODEL,
    MODES,
    lognormal_lengths,
    make_tokens,
    packed_row,
    padded_batch,
    padding_fraction,
)

VOCABS = (32000, 128256, 151936, 262144)
LAYOUTS = ("right", "left", "packed", "completion")
MEASURED = ("right", "completion")  # the layouts whose step's peak memory is measured
PROVIDERS = ("patchkit", "patchkit_loss", "hf_sdpa", "hf_eager")  # patchkit_loss: unpad="loss" (the loss alone)
BASELINES = ("hf_sdpa", "hf_eager", *HF_KERNELS)  # the table's columns, where the run has them
SCALE = 0.56  # the lognormal batch of 8 at a longest row of 511 tokens
BIG = 200_000  # from this vocabulary on, rows at half that length (HF's step would not fit in 24 GiB)
EAGER_UP_TO = 32000  # HF eager beside sdpa at the smallest vocabulary only (it differs from sdpa in attention alone)
KV_HEADS = 2


CUDA_SCALE = 4 * SCALE  # a longest row of about 2048 tokens
RESCALE = {"by": 1.0}  # --scale: every length times this (the rehearsal's tiny run)


def lengths_for(vocab: int, device: str = "cpu") -> list[int]:
    scale = CUDA_SCALE if device == "cuda" else SCALE / (2 if vocab >= BIG else 1)
    return lognormal_lengths(8, scale * RESCALE["by"])


def inputs(layout: str, vocab: int, device: str = "cpu") -> dict[str, Any]:
    """The step's model inputs: padded (right or left, with the label recipe) or one packed row, on `device`."""
    docs = make_tokens(lengths_for(vocab, device), vocab, seed=1)
    return {k: v.to(device) for k, v in _inputs(layout, docs).items()}


def _inputs(layout: str, docs: list[Any]) -> dict[str, Any]:
    if layout == "packed":
        row = packed_row(docs)
        return {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "labels": row["labels"]}
    ids, mask, labels = padded_batch(docs, left=layout == "left")
    if layout == "left":
        labels = labels.masked_fill(mask.cumsum(-1) == 1, -100)  # the first real token is predicted from padding
    if layout == "completion":  # each row's first half is its prompt
        labels = labels.masked_fill(mask.cumsum(-1) <= mask.sum(-1, keepdim=True) // 2, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build(provider: str, vocab: int, device: str = "cpu") -> Any:
    """The model for `provider`, same weights for every provider (seeded): patchkit is an instance patch (on sdpa on
    the CPU, its best kernel backend on CUDA); `provider` "patchkit_loss" with unpad="loss"."""
    dev, dtype = device_and_dtype(device)
    size = MODES["cuda"]["model"] if dev.type == "cuda" else MODEL
    model = build_model(dict(size, vocab=vocab), KV_HEADS, HF_PROVIDERS.get(provider, "sdpa"), dev, dtype).train()
    if provider.startswith("patchkit"):
        unpad = "loss" if provider == "patchkit_loss" else "model"
        patch_on_best("llama2", model, dev, strict=False, unpad=unpad)
    return model


def step(model: Any, batch: dict[str, Any]) -> float:
    """One training step's forward and backward; the loss."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return float(out.loss)


def time_vocab(vocab: int, layouts: list[str], providers: list[str], reps: int, device: str = "cpu",
               budget: Optional[Budget] = None) -> list[dict[str, Any]]:
    """Every layout's steps at `vocab`, providers interleaved step by step: one row per (layout, provider). On CUDA
    each row also has its step's peak memory (the right-padded layouts'; the CPU measures it in fresh processes)."""
    dev = device_and_dtype(device)[0]
    models = {p: build(p, vocab, device) for p in providers}
    rows = []
    for layout in layouts:
        if budget is not None and budget.spent(f"vocab {vocab} {layout}"):
            break
        batch = inputs(layout, vocab, device)
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        times: dict[str, list[float]] = {p: [] for p in providers}
        losses = {p: step(models[p], batch) for p in providers}  # warm-up, untimed
        peaks = {p: timed(lambda p=p, b=batch: step(models[p], b), dev)[1] for p in providers} if (
            dev.type == "cuda" and layout in MEASURED) else {}
        for _ in range(reps):
            for p in providers:
                seconds = timed(lambda p=p, b=batch: step(models[p], b), dev)[0]
                times[p].append(seconds)
        for p in providers:
            seconds = statistics.median(times[p])
            pad = padding_fraction(lengths_for(vocab, device)) if layout != "packed" else 0.0
            rows.append({"vocab": vocab, "layout": layout, "provider": p, "real_tokens": real,
                         "padding": round(pad, 3), "seconds": round(seconds, 4),
                         "real_tok_per_s": round(real / seconds, 1), "loss": round(losses[p], 5),
                         "peak_mib": round(peaks[p], 1) if peaks.get(p) is not None else ""})
        print(f"vocab {vocab} {layout}: " + ", ".join(f"{p} {statistics.median(times[p]):.2f}s" for p in providers),
              flush=True)
    return rows


def memory_worker(spec: dict[str, Any]) -> dict[str, float]:  # the CPU's
    """In a fresh process: the second step's peak resident set above the resident set before it (MiB); the first
    warms up. `first`: the first step's instead (under unpad="loss" the one that checks the family's logits)."""
    model = build(spec["provider"], spec["vocab"])
    RESCALE["by"] = spec.get("scale", 1.0)
    batch = inputs(spec["layout"], spec["vocab"])
    if not spec.get("first"):
        step(model, batch)
    model.zero_grad(set_to_none=True)
    return {"peak_mib": round(step_peak_mib(lambda: step(model, batch))[0], 1)}


def memory(vocab: int, layout: str, provider: str, first: bool = False) -> float:
    spec = json.dumps({"vocab": vocab, "layout": layout, "provider": provider, "scale": RESCALE["by"], "first": first})
    return worker_json([__file__, "--memory-worker", spec])["peak_mib"]


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (vocab, layout, patchkit mode): its speed against each HF baseline the run has (sdpa, eager,
    flash_attention_2 and _4 on CUDA) and its memory against HF sdpa's."""
    present = {r["provider"] for r in rows}
    baselines = [b for b in BASELINES if b in present]
    names = {"hf_sdpa": "HF sdpa", "hf_eager": "HF eager", "hf_flash_attention_2": "HF FA2",
             "hf_flash_attention_4": "HF FA4"}
    lines = ["| vocab | layout | real tokens | padding | patchkit | tok/s | " + " | ".join(
        f"x {names[b]}" for b in baselines) + " | peak MiB | x HF sdpa |", "|---|" * (8 + len(baselines))]
    lines[1] = lines[1].replace("||", "|")
    by = {(r["vocab"], r["layout"], r["provider"]): r for r in rows}
    for vocab, layout in dict.fromkeys((r["vocab"], r["layout"]) for r in rows):
        sdpa = by.get((vocab, layout, "hf_sdpa"))
        for mode, ours in (("logits", by.get((vocab, layout, "patchkit"))),
                           ("loss alone", by.get((vocab, layout, "patchkit_loss")))):
            if ours is None:
                continue
            speed = [f"{ours['real_tok_per_s'] / o['real_tok_per_s']:.2f}x" if o else "-"
                     for o in (by.get((vocab, layout, b)) for b in baselines)]
            mem = ours.get("peak_mib")
            mem_ratio = f"{mem / sdpa['peak_mib']:.2f}x" if mem and sdpa and sdpa.get("peak_mib") else "-"
            lines.append(f"| {vocab:.0f} | {layout} | {ours['real_tokens']:.0f} | {ours['padding']:.1%} | {mode} | "
                         f"{ours['real_tok_per_s']:.0f} | " + " | ".join(speed) +
                         f" | {f'{mem:.0f}' if mem else '-'} | {mem_ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--no-memory", action="store_true", help="timings only")
    parser.add_argument("--memory-only", action="store_true", help="fill the peaks into the rows of --csv")
    parser.add_argument("--first-step", action="store_true", help="with --memory-only: the first step's peaks")
    parser.add_argument("--scale", type=float, default=1.0, help="every row's length times this")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    add_run_args(parser)
    args = parser.parse_args()
    if no_cuda("vocab", args.device):
        return
    RESCALE["by"] = args.scale
    if args.memory_worker:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return
    if args.memory_only:
        import csv

        with args.csv.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            row["peak_mib"] = (memory(int(row["vocab"]), row["layout"], row["provider"], args.first_step)
                               if row["layout"] in MEASURED else "")
        write_rows(args.csv, rows)
        return
    rows, budget, cuda = [], Budget(args.budget_s), args.device == "cuda"
    extra = [p for p in HF_KERNELS if p in probed(device_and_dtype("cuda")[0])[0]] if cuda else []
    for vocab in args.vocabs:
        if budget.spent(f"vocab {vocab}"):
            break
        providers = [p for p in args.providers if not (p == "hf_eager" and (cuda or vocab > EAGER_UP_TO))] + extra
        found = time_vocab(vocab, args.layouts, providers, args.reps, args.device, budget)
        if not args.no_memory and not cuda:  # a fresh process per provider
            for row in found:
                if row["layout"] in MEASURED:
                    row["peak_mib"] = memory(vocab, row["layout"], row["provider"])
        rows += found
        if args.csv:
            write_rows(args.csv, rows)
    budget.report("vocab")
    print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
