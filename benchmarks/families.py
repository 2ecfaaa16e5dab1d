"""Padded and packed training steps per model family: patchkit against HF sdpa, in real tokens per second.

HF's own attention for the baseline is sdpa, or eager for a family HF has no sdpa path for (Gemma2).

Each family runs at the main benchmark's size (hidden 256, 4 layers, 8 heads, 2 K/V heads) on the same padded
batch of 8 lognormal lengths, with its special feature biting (a sliding window of 256 shorter than the longest
rows, Gemma2's softcap). Providers alternate step by step and the median is kept, so load on the machine hits
both alike. Prints a table and writes a CSV.

    python benchmarks/families.py [--families llama mistral qwen3] [--reps 5] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workloads import lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

TARGET = 1.4  # the padded training step of every family: at least 1.4x HF sdpa
WINDOW = 256
SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)


def build(family: str) -> tuple[torch.nn.Module, str]:
    """A random model of `family` at the benchmark size, fp32, and its HF attention: sdpa, else eager (Gemma2)."""
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaConfig(**SIZE),
        "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **SIZE),
        "qwen2": lambda: tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **SIZE),
        "qwen3": lambda: tf.Qwen3Config(head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=2, **SIZE),
        "gemma": lambda: tf.GemmaConfig(head_dim=32, **SIZE),
        "gemma2": lambda: tf.Gemma2Config(head_dim=32, sliding_window=WINDOW, **SIZE),
        "gemma3_text": lambda: tf.Gemma3TextConfig(head_dim=32, sliding_window=WINDOW, **SIZE),
        "phi3": lambda: tf.Phi3Config(sliding_window=WINDOW, **SIZE),
        "mixtral": lambda: tf.MixtralConfig(sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
                                            **{**SIZE, "intermediate_size": 256}),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(head_dim=32, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=256, use_sliding_window=True,
                                               sliding_window=WINDOW, max_window_layers=2, **SIZE),
        "phi": lambda: tf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **SIZE),
    }
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            model = tf.AutoModelForCausalLM.from_config(configs[family](), attn_implementation=implementation)
        except ValueError:  # transformers has no sdpa path for this family (Gemma2's softcap)
            continue
        return model.float().train(), implementation
    raise RuntimeError(f"{family}: no HF attention implementation loads")


def timed_step(model: torch.nn.Module, batch: dict) -> float:
    """Seconds for one forward + backward of the batch (loss over real tokens)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


def measure(family: str, lengths: list[int], reps: int) -> list[dict]:
    """Median step time of HF sdpa on the padded batch and of patchkit on the padded and packed batches."""
    docs = make_tokens(lengths, SIZE["vocab_size"])
    ids, mask, labels = padded_batch(docs)
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    packed = {k: v for k, v in packed_row(docs).items() if k in ("input_ids", "position_ids", "labels")}
    reference, implementation = build(family)
    model = copy.deepcopy(reference)
    patch = "llama2" if family == "llama" else family
    hf = f"hf_{implementation} padded"
    times: dict[str, list[float]] = {hf: [], "patchkit padded": [], "patchkit packed": []}
    handle = patchkit.apply_patch(patch, model=model, backend="sdpa")
    try:
        for rep in range(reps + 1):  # the first round warms up
            got = {
                hf: timed_step(reference, padded),
                "patchkit padded": timed_step(model, padded),
                "patchkit packed": timed_step(model, packed),
            }
            if rep:
                for key, value in got.items():
                    times[key].append(value)
    finally:
        handle.revert()
    real = sum(lengths)
    base = statistics.median(times[hf])
    rows = [
        dict(family=family, provider=key, median_s=round(statistics.median(v), 4),
             real_tokens_per_s=round(real / statistics.median(v), 1), vs_hf=round(base / statistics.median(v), 2))
        for key, v in times.items()
    ]
    for row in rows:
        print(f"{row['family']:<12}{row['provider']:<18}{row['median_s']:>10.3f}{row['real_tokens_per_s']:>12.1f}"
              f"{row['vs_hf']:>11.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/families.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "mistral", "qwen3"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the sequence lengths (0.25 for a smoke run)")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lengths = lognormal_lengths(8, args.scale)
    print(f"batch of 8, lengths {lengths}, {padding_fraction(lengths):.1%} padding; fp32, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {args.reps} alternating reps, medians")
    print(f"{'family':<12}{'provider':<18}{'median s':>10}{'real tok/s':>12}{'vs HF':>12}")
    rows = [row for family in args.families for row in measure(family, lengths, args.reps)]
    for row in (r for r in rows if r["provider"] == "patchkit padded"):
        if args.scale != 1.0:
            print(f"{row['family']}: {row['vs_hf']}x HF (target {TARGET}x stated for the full-size run: not judged)")
            continue
        status = "ok" if row["vs_hf"] >= TARGET else "MISS"
        print(f"target padded step >= {TARGET}x HF (sdpa, or eager where HF has no sdpa): {row['family']}: "
              f"{row['vs_hf']}x {status}")
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
