"""Static-cache generation: prefill of a left-padded batch plus greedy decode, patchkit against HF sdpa and eager.

decode.py times the default dynamic cache; this times `generate(cache_implementation="static")`, which hands the
model a 4D mask before it runs, eager and with `model.forward` compiled the way HF users do it
(`torch.compile(model.forward, fullgraph=True)`; "reduce-overhead" is CUDA graphs, nothing on CPU), into one
StaticCache per provider sized prompt + new tokens. The main
benchmark's tiny LLaMA and its batch of 8 lognormal lengths, left-padded, fp32 on CPU; 64 new tokens. Providers
run round-robin after one warm-up round (which also compiles), medians kept. Throughput counts real tokens: the
prompts' plus batch x new tokens. Eager providers must produce HF sdpa's tokens; compiled ones print their share.

    python benchmarks/static_decode.py [--new-tokens 64] [--reps 3] [--kv-heads 8] [--scale 1.0] [--csv FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workloads import MODEL, lognormal_lengths, make_tokens, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

CSV = Path(__file__).resolve().parent / "results" / "static_decode.csv"
PROVIDERS = ("hf_eager", "hf_sdpa", "patchkit_sdpa", "hf_sdpa_compiled", "patchkit_sdpa_compiled")


def build(kv_heads: int, cfg: dict[str, int], compile_backend: str) -> dict[str, torch.nn.Module]:
    """One random model (seed 0) per provider, the same weights; patchkit's instance-patched, compiled ones with
    `model.forward` compiled (after the patch, as a user would)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    models = {}
    for name in PROVIDERS:
        model = copy.deepcopy(base)
        model.set_attn_implementation("eager" if name == "hf_eager" else "sdpa")
        if name.startswith("patchkit_"):
            patchkit.apply_patch("llama2", model=model, backend="sdpa", strict=True)
        if name.endswith("_compiled"):
            model.forward = torch.compile(model.forward, backend=compile_backend, fullgraph=True)
        models[name] = model
    return models


def timed_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int, cache: Any) -> tuple[
        float, Any]:
    """Seconds for a greedy generate() of exactly `new` tokens into `cache` (a StaticCache, emptied first: one size
    for every call, so a compiled forward keeps its two graphs, prefill and decode), and the sequences."""
    cache.reset()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, past_key_values=cache)
    return time.perf_counter() - start, out


def measure(lengths: list[int], new: int, reps: int, kv_heads: int, compile_backend: str) -> list[dict]:
    """Round-robin medians of prefill + decode and of prefill + one token, per provider; tokens compared."""
    ids, mask, _ = padded_batch(make_tokens(lengths, MODEL["vocab"]), left=True)
    from transformers import StaticCache

    models = build(kv_heads, MODEL, compile_backend)
    caches = {name: StaticCache(config=m.config, max_cache_len=ids.shape[1] + new) for name, m in models.items()}
    total: dict[str, list[float]] = {name: [] for name in models}
    prefill: dict[str, list[float]] = {name: [] for name in models}
    tokens: dict[str, torch.Tensor] = {}
    for rep in range(reps + 1):  # the first round warms up (and compiles)
        for name, model in models.items():
            seconds, tokens[name] = timed_generate(model, ids, mask, new, caches[name])
            first, _ = timed_generate(model, ids, mask, 1, caches[name])
            if rep:
                total[name].append(seconds)
                prefill[name].append(first)
    same = {name: (tokens[name] == tokens["hf_sdpa"]).float().mean().item() for name in models}
    for name in (n for n in models if not n.endswith("_compiled") and same[n] < 1):
        raise SystemExit(f"{name} generated other tokens than hf_sdpa: the comparison would be meaningless")
    real = sum(lengths) + len(lengths) * new
    base = statistics.median(total["hf_sdpa"])
    rows = []
    for name in models:
        med, first = statistics.median(total[name]), statistics.median(prefill[name])
        rows.append(dict(
            provider=name, kv_heads=kv_heads, new_tokens=new, median_s=round(med, 4), min_s=round(min(total[name]), 4),
            max_s=round(max(total[name]), 4), prefill_s=round(first, 4), real_tokens_per_s=round(real / med, 1),
            decode_tokens_per_s=round(len(lengths) * (new - 1) / (med - first), 1) if med > first else float("nan"),
            vs_hf_sdpa=round(base / med, 2), same_tokens=round(same[name], 4), reps=reps,
            compile_backend=compile_backend if name.endswith("_compiled") else "", threads=torch.get_num_threads(),
            torch=torch.__version__,
        ))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/static_decode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[MODEL["heads"]],
                        help="key/value heads, one run each (8: MHA as in bench.py; 2: GQA)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the prompt lengths (0.05 for a smoke run)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: a smoke run)")
    parser.add_argument("--csv", type=Path, default=CSV, help=f"where to write the rows (default {CSV})")
    args = parser.parse_args(argv)
    lengths = lognormal_lengths(8, args.scale)
    print(f"left-padded batch of 8, lengths {lengths}, {padding_fraction(lengths):.1%} padding; {args.new_tokens} "
          f"greedy tokens into a static cache; fp32, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.reps} round-robin reps, medians; compiled: {args.compile_backend}, fullgraph")
    print(f"{'provider':<24}{'kv':>4}{'median s':>10}{'prefill s':>11}{'real tok/s':>12}{'decode tok/s':>14}"
          f"{'vs HF sdpa':>12}{'same tokens':>13}")
    rows = []
    for kv_heads in args.kv_heads:
        for row in measure(lengths, args.new_tokens, args.reps, kv_heads, args.compile_backend):
            rows.append(row)
            print(f"{row['provider']:<24}{kv_heads:>4}{row['median_s']:>10.3f}{row['prefill_s']:>11.3f}"
                  f"{row['real_tokens_per_s']:>12.1f}{row['decode_tokens_per_s']:>14.1f}{row['vs_hf_sdpa']:>11.2f}x"
                  f"{row['same_tokens']:>12.1%}", flush=True)
    write_rows(args.csv, rows)
    print(f"rows written to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
