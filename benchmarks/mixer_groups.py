"""How many rows a hybrid's mixer runs per call (`mixer_rows.CALL_TOKENS`): each value timed on a padded step.

On the packed row, a hybrid's linear-attention, Mamba and convolution layers run the padded rows in groups of similar
length (`patchkit/hooks/forwards/mixer_rows.py`): `row_groups` weighs a call's fixed cost, in tokens of work, against
the padding a right-padded group computes. This times Qwen3.5's text model (families.py's config: three gated-delta-
rule layers and a full-attention one) on a padded training step, patched, at each fixed cost in `--calls` (0: every
row its own call; a value beyond the batch: all rows in one call), against HF sdpa on the padded batch, on two
batches: the lognormal mix, and many short rows (64 of 8-64 tokens), where a call's fixed cost weighs most. The
value that wins on a device is what CALL_TOKENS should say for it: the CPU's was chosen so; CUDA's is a guess until a
GPU runs this (a part of `make gpu-truth`). Providers alternate step by step, medians kept; prints a table and writes
a CSV.

    python benchmarks/mixer_groups.py [--device cpu|cuda] [--reps 3] [--scale 1.0] [--calls 0 128 2048 ...]
        [--csv out.csv] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import build, timed_step  # noqa: E402
from providers import Budget, add_run_args, add_sweep_args, no_cuda, patch_on_best  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import MODES, hf_size, lognormal_lengths, make_tokens, padded_batch, padding_fraction  # noqa: E402

from patchkit.hooks.forwards import mixer_rows  # noqa: E402

FAMILY = "qwen3_5_text"
CALLS = [0, 32, 128, 512, 2048, 8192, 10**9]
SHORT = 64  # rows of the short batch, 8 to 64 tokens each


def batches(device: torch.device, scale: float) -> dict[str, list[int]]:
    """The two batches' row lengths: the lognormal mix (16 rows on CUDA, 8 elsewhere) and the short rows."""
    lognormal = lognormal_lengths(MODES["cuda"]["batch"] if device.type == "cuda" else 8, scale)
    short = torch.randint(8, 65, (SHORT,), generator=torch.Generator().manual_seed(5)).tolist()
    return {"lognormal": lognormal, "short": [max(2, round(n * scale)) for n in short]}


def measure(name: str, lengths: list[int], calls: list[int], reps: int, device: torch.device,
            budget: Budget) -> list[dict]:
    """Median step times of HF sdpa and of patchkit at each fixed cost, on the padded batch of `lengths`."""
    reference, implementation = build(FAMILY, device)
    ids, mask, labels = padded_batch(make_tokens(lengths, hf_size(device.type)["vocab_size"]))
    batch = {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
    model = copy.deepcopy(reference)
    hf = f"hf_{implementation} padded"
    times: dict[str, list[float]] = {hf: [], **{f"patchkit call_tokens={c}": [] for c in calls}}
    handle, backend, _ = patch_on_best(FAMILY, model, device, strict=True)
    saved = dict(mixer_rows.CALL_TOKENS)
    try:
        for rep in range(reps + 1):  # the first round warms up
            if rep > 1 and budget.spent(f"{name}: rounds {rep}-{reps} of {reps}"):
                break
            for key, cost in [(hf, None), *((f"patchkit call_tokens={c}", c) for c in calls)]:
                if cost is not None:
                    mixer_rows.CALL_TOKENS[device.type] = cost
                seconds, _ = timed_step(reference if cost is None else model, batch)
                if rep:
                    times[key].append(seconds)
    finally:
        mixer_rows.CALL_TOKENS.clear()
        mixer_rows.CALL_TOKENS.update(saved)
        handle.revert()
    real, base = sum(lengths), statistics.median(times[hf])
    rows = []
    for (key, v), cost in zip(times.items(), [None, *calls]):
        med = statistics.median(v)
        groups = 1 if cost is None else len(mixer_rows.row_groups(tuple(lengths), cost))  # HF: the padded batch
        rows.append(dict(batch=name, rows=len(lengths), real_tokens=real, padding=round(padding_fraction(lengths), 3),
                         provider=key, calls_per_layer=groups, median_s=round(med, 4),
                         real_tokens_per_s=round(real / med, 1), vs_hf=round(base / med, 2), device=device.type,
                         backend=implementation if cost is None else backend, reps=len(v)))
        print(f"{name:<10}{key:<30}{groups:>7}{med:>10.3f}{real / med:>12.1f}{base / med:>9.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/mixer_groups.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", nargs="+", type=int, default=CALLS, help="the fixed costs to time, in tokens")
    add_sweep_args(parser, reps=3)
    add_run_args(parser)
    args = parser.parse_args(argv)
    if no_cuda("mixer_groups", args.device):
        return 0
    budget, device = Budget(args.budget_s), torch.device(args.device)
    print(f"{FAMILY} at {hf_size(device.type)['hidden_size']} wide; now CALL_TOKENS on {device.type}: "
          f"{mixer_rows.CALL_TOKENS.get(device.type, mixer_rows.CALL_TOKENS_ELSEWHERE)}; {args.reps} alternating "
          f"reps, medians")
    print(f"{'batch':<10}{'provider':<30}{'calls':>7}{'median s':>10}{'real tok/s':>12}{'vs HF':>10}")
    rows: list[dict] = []
    try:
        for name, lengths in batches(device, args.scale).items():
            if budget.spent(f"batch {name}"):
                continue
            rows += measure(name, lengths, args.calls, args.reps, device, budget)
            if args.csv:
                write_rows(args.csv, rows)
    finally:
        budget.report("mixer_groups")
    for name in dict.fromkeys(r["batch"] for r in rows):
        best = max((r for r in rows if r["batch"] == name and r["provider"].startswith("patchkit")),
                   key=lambda r: r["real_tokens_per_s"])
        print(f"{name}: fastest at {best['provider'].split('=')[1]} tokens a call ({best['vs_hf']}x HF)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
