"""Generation: prefill of a left-padded batch plus greedy decode, patchkit against HF sdpa and eager.

The main benchmark's tiny LLaMA (hidden 256, 4 layers, 8 heads) and its batch of 8 lognormal lengths, left-padded,
fp32 on CPU; `generate()` with 64 new tokens (min_new_tokens, so every run decodes all of them). Providers run
round-robin, one warm-up round first, medians kept; every provider must produce the same tokens as HF sdpa.
Throughput counts real tokens: the prompts' plus batch x new tokens. A `generate()` of one new token is timed too,
so the table also splits prefill from decode (decode tok/s: new tokens after the first per second of the rest).

    python benchmarks/decode.py [--new-tokens 64] [--reps 5] [--kv-heads 8] [--scale 1.0] [--csv FILE]
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import MODEL, lognormal_lengths, make_tokens, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

TARGET = 1.2  # prefill + 64-token decode: at least 1.2x HF sdpa
CSV = Path(__file__).resolve().parent / "results" / "decode.csv"
PROVIDERS = ("hf_eager", "hf_sdpa", "patchkit_sdpa")


def build(kv_heads: int) -> dict[str, torch.nn.Module]:
    """One random model (bench.MODEL, fp32, seed 0) per provider, the same weights; patchkit's is instance-patched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=MODEL["vocab"], hidden_size=MODEL["hidden"], intermediate_size=MODEL["intermediate"],
        num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    models = {}
    for name in PROVIDERS:
        model = copy.deepcopy(base)
        model.set_attn_implementation("eager" if name == "hf_eager" else "sdpa")
        models[name] = model
    patchkit.apply_patch("llama2", model=models["patchkit_sdpa"], backend="sdpa", strict=True)
    return models


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> tuple[float, Any]:
    """Seconds for a greedy generate() of exactly `new` tokens, and the sequences."""
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out


def measure(lengths: list[int], new: int, reps: int, kv_heads: int) -> list[dict]:
    """Round-robin medians of prefill + decode and of prefill + one token, per provider; tokens checked equal."""
    ids, mask, _ = padded_batch(make_tokens(lengths, MODEL["vocab"]), left=True)
    models = build(kv_heads)
    total: dict[str, list[float]] = {name: [] for name in PROVIDERS}
    prefill: dict[str, list[float]] = {name: [] for name in PROVIDERS}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(reps + 1):  # the first round warms up
        for name, model in models.items():
            seconds, out = timed_generate(model, ids, mask, new)
            first, _ = timed_generate(model, ids, mask, 1)
            tokens[name] = out
            if rep:
                total[name].append(seconds)
                prefill[name].append(first)
    for name in PROVIDERS:
        if not torch.equal(tokens[name], tokens["hf_sdpa"]):
            raise SystemExit(f"{name} generated other tokens than hf_sdpa: the comparison would be meaningless")
    real = sum(lengths) + len(lengths) * new
    base = statistics.median(total["hf_sdpa"])
    rows = []
    for name in PROVIDERS:
        med, first = statistics.median(total[name]), statistics.median(prefill[name])
        rows.append(dict(
            provider=name, kv_heads=kv_heads, new_tokens=new, median_s=round(med, 4), min_s=round(min(total[name]), 4),
            max_s=round(max(total[name]), 4), prefill_s=round(first, 4),
            real_tokens_per_s=round(real / med, 1),
            decode_tokens_per_s=round(len(lengths) * (new - 1) / max(med - first, 1e-9), 1),
            vs_hf_sdpa=round(base / med, 2), reps=reps, threads=torch.get_num_threads(), torch=torch.__version__,
        ))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[MODEL["heads"]],
                        help="key/value heads, one run each (8: MHA as in bench.py; 2: GQA)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the prompt lengths (0.1 for a smoke run)")
    parser.add_argument("--csv", type=Path, default=CSV, help=f"where to write the rows (default {CSV})")
    args = parser.parse_args(argv)
    lengths = lognormal_lengths(8, args.scale)
    print(f"left-padded batch of 8, lengths {lengths}, {padding_fraction(lengths):.1%} padding; {args.new_tokens} "
          f"greedy tokens; fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.reps} "
          "round-robin reps, medians")
    print(f"{'provider':<15}{'kv':>4}{'median s':>10}{'prefill s':>11}{'real tok/s':>12}{'decode tok/s':>14}"
          f"{'vs HF sdpa':>12}")
    rows = []
    for kv_heads in args.kv_heads:
        for row in measure(lengths, args.new_tokens, args.reps, kv_heads):
            rows.append(row)
            print(f"{row['provider']:<15}{kv_heads:>4}{row['median_s']:>10.3f}{row['prefill_s']:>11.3f}"
                  f"{row['real_tokens_per_s']:>12.1f}{row['decode_tokens_per_s']:>14.1f}{row['vs_hf_sdpa']:>11.2f}x",
                  flush=True)
    judged = args.scale == 1.0 and args.new_tokens == 64
    for row in (r for r in rows if r["provider"] == "patchkit_sdpa"):
        verdict = ("ok" if row["vs_hf_sdpa"] >= TARGET else "MISS") if judged else "not judged (not the stated run)"
        print(f"target prefill + 64-token decode >= {TARGET}x HF sdpa, kv_heads {row['kv_heads']}: "
              f"{row['vs_hf_sdpa']}x {verdict}")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
