"""The LM head and loss at large vocabularies: a padded training step where the head, not attention, dominates.

At a 32k-262k vocabulary the head (B·N·H -> B·N·V) is the step's largest matmul and its float32 logits its memory
peak; patchkit runs both on real tokens only (`patchkit/hooks/forwards/lm_head.py`). This benchmark trains a LLaMA
of hidden 256 x 4 layers (the toy where the head dominates) at the vocabularies of LLaMA-2 (32000), Llama 3
(128256), Qwen2.5 (151936) and Gemma 3 (262144) on the lognormal batch of 8 at about 512 tokens (55.6% padding; half
the rows' length at 262144, where HF's step needs more memory than this machine has beside its own), right-padded,
left-padded (the label recipe: -100 at padding and at each row's first token) and packed into one row (position_ids
restarting), against HF sdpa (and HF eager at 32000). The head's share of a step at bench.py's vocabulary of 4096 is
the 0.5B-1B models' (20-30% of the matmul FLOPs); here it is 70-95%.

Reported per row: real (non-padding) tokens per second, the median of `--reps` steps with the providers interleaved
step by step (load on the machine hits all alike), the loss (equal across providers), and the step's peak memory:
the peak resident set above the resident set before the step, measured alone in a fresh process per provider.

    python benchmarks/vocab.py [--vocabs 32000 151936] [--layouts right left packed] [--reps 3] [--csv out.csv]
        [--no-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workers import current_rss_mib  # noqa: E402
from workloads import MODEL, lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402

VOCABS = (32000, 128256, 151936, 262144)
LAYOUTS = ("right", "left", "packed")
PROVIDERS = ("patchkit", "hf_sdpa", "hf_eager")
SCALE = 0.56  # the lognormal batch of 8 at a longest row of 511 tokens
BIG = 200_000  # from this vocabulary on, rows at half that length (HF's step would not fit in 24 GiB)
EAGER_UP_TO = 32000  # HF eager beside sdpa at the smallest vocabulary only (it differs from sdpa in attention alone)
KV_HEADS = 2


def lengths_for(vocab: int) -> list[int]:
    return lognormal_lengths(8, SCALE / (2 if vocab >= BIG else 1))


def inputs(layout: str, vocab: int) -> dict[str, Any]:
    """The step's model inputs: padded (right or left, with the label recipe) or one packed row."""
    docs = make_tokens(lengths_for(vocab), vocab, seed=1)
    if layout == "packed":
        row = packed_row(docs)
        return {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "labels": row["labels"]}
    ids, mask, labels = padded_batch(docs, left=layout == "left")
    if layout == "left":
        labels = labels.masked_fill(mask.cumsum(-1) == 1, -100)  # the first real token is predicted from padding
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build(provider: str, vocab: int) -> Any:
    """The model for `provider`, same weights for every provider (seeded): patchkit is an instance patch on sdpa."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import patchkit

    config = LlamaConfig(vocab_size=vocab, hidden_size=MODEL["hidden"], intermediate_size=MODEL["intermediate"],
                         num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"],
                         num_key_value_heads=KV_HEADS, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         attn_implementation="eager" if provider == "hf_eager" else "sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if provider == "patchkit":
        patchkit.apply_patch(model=model, backend="sdpa")
    return model


def step(model: Any, batch: dict[str, Any]) -> float:
    """One training step's forward and backward; the loss."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return float(out.loss)


def time_vocab(vocab: int, layouts: list[str], providers: list[str], reps: int) -> list[dict[str, Any]]:
    """Every layout's steps at `vocab`, providers interleaved step by step: one row per (layout, provider)."""
    models = {p: build(p, vocab) for p in providers}
    rows = []
    for layout in layouts:
        batch = inputs(layout, vocab)
        real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        times: dict[str, list[float]] = {p: [] for p in providers}
        losses = {p: step(models[p], batch) for p in providers}  # warm-up, untimed
        for _ in range(reps):
            for p in providers:
                start = time.perf_counter()
                step(models[p], batch)
                times[p].append(time.perf_counter() - start)
        for p in providers:
            seconds = statistics.median(times[p])
            rows.append({"vocab": vocab, "layout": layout, "provider": p, "real_tokens": real,
                         "padding": round(padding_fraction(lengths_for(vocab)) if layout != "packed" else 0.0, 3),
                         "seconds": round(seconds, 4), "real_tok_per_s": round(real / seconds, 1),
                         "loss": round(losses[p], 5), "peak_mib": ""})
        print(f"vocab {vocab} {layout}: " + ", ".join(f"{p} {statistics.median(times[p]):.2f}s" for p in providers),
              flush=True)
    return rows


def memory_worker(spec: dict[str, Any]) -> dict[str, float]:
    """In a fresh process: one step's peak resident set above the resident set before it (MiB)."""
    model = build(spec["provider"], spec["vocab"])
    batch = inputs(spec["layout"], spec["vocab"])
    before = current_rss_mib()
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here: a forked child inherits its parent's
        f.write("5")
    step(model, batch)
    return {"peak_mib": round(peak_hwm_mib() - before, 1)}


def peak_hwm_mib() -> float:
    """The resident set's high-water mark since it was last reset (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def memory(vocab: int, layout: str, provider: str) -> float:
    spec = json.dumps({"vocab": vocab, "layout": layout, "provider": provider})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}
    env.update(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, __file__, "--memory-worker", spec], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (vocab, layout): patchkit's speed and memory against HF sdpa's."""
    lines = ["| vocab | layout | real tokens | padding | patchkit tok/s | x HF sdpa | x HF eager | peak MiB "
             "| x HF sdpa |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["vocab"], r["layout"], r["provider"]): r for r in rows}
    for vocab, layout in dict.fromkeys((r["vocab"], r["layout"]) for r in rows):
        ours, sdpa, eager = (by.get((vocab, layout, p)) for p in PROVIDERS)
        if ours is None:
            continue
        speed = [f"{ours['real_tok_per_s'] / o['real_tok_per_s']:.2f}x" if o else "-" for o in (sdpa, eager)]
        mem = ours.get("peak_mib")
        mem_ratio = f"{mem / sdpa['peak_mib']:.2f}x" if mem and sdpa and sdpa.get("peak_mib") else "-"
        lines.append(f"| {vocab:.0f} | {layout} | {ours['real_tokens']:.0f} | {ours['padding']:.1%} | "
                     f"{ours['real_tok_per_s']:.0f} | {speed[0]} | {speed[1]} | {f'{mem:.0f}' if mem else '-'} | "
                     f"{mem_ratio} |")
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
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return
    if args.memory_only:
        import csv

        with args.csv.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            right = row["layout"] == "right"
            row["peak_mib"] = memory(int(row["vocab"]), row["layout"], row["provider"]) if right else ""
        write_rows(args.csv, rows)
        return
    rows = []
    for vocab in args.vocabs:
        providers = [p for p in args.providers if not (p == "hf_eager" and vocab > EAGER_UP_TO)]
        found = time_vocab(vocab, args.layouts, providers, args.reps)
        if not args.no_memory:  # a fresh process per provider
            for row in found:
                if row["layout"] == "right":
                    row["peak_mib"] = memory(vocab, row["layout"], row["provider"])
        rows += found
        if args.csv:
            write_rows(args.csv, rows)
    print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
