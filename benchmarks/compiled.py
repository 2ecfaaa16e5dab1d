"""Compiled training steps: patchkit against the unpatched model compiled the same way, in real tokens per second.

Two ways users compile: `torch.compile(model)` (the Trainer's `torch_compile=True`; graph breaks allowed) on a
right-padded batch and on the same documents packed into one row (position_ids restarting), and
`torch.compile(model, fullgraph=True)` on the packed row. Packed rows run patchkit's in-graph varlen path both ways
(`patchkit/forward/in_graph.py`, one graph); the padded batch its eager path's unpadding (host reads, graph breaks).
The unpatched packed row runs with `use_cache=False`, so transformers finds the documents from position_ids too
(same work, same numbers). LLaMA at the main benchmark's size, a batch of 8 lognormal lengths scaled down for the
CPU; providers alternate step by step, the median is kept; the compile itself (first steps) is not timed. Prints a
table and writes a CSV.

    python benchmarks/compiled.py [--reps 5] [--scale 0.25] [--backend inductor] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workloads import lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
WARMUP = 2


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZE, attn_implementation="sdpa")).train()


def stepper(patched: bool, fullgraph: bool, backend: str, data: dict) -> Callable[[], float]:
    """A function running one timed training step (forward, backward) of its own compiled model; the loss."""
    net = model()
    handle = patchkit.apply_patch("llama", model=net, backend="sdpa") if patched else None
    compiled = torch.compile(net, backend=backend, fullgraph=fullgraph)

    def step() -> float:
        net.zero_grad(set_to_none=True)
        loss = compiled(**data).loss
        loss.backward()
        return float(loss)

    step.handle = handle  # type: ignore[attr-defined]
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=0.25, help="document lengths times this (CPU: short)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "compiled.csv")
    args = parser.parse_args()
    lengths = lognormal_lengths(8, args.scale)
    docs = make_tokens(lengths, SIZE["vocab_size"])
    ids, mask, labels = padded_batch(docs)
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    packed = {k: v for k, v in packed_row(docs).items() if k in ("input_ids", "position_ids", "labels")}
    packed["use_cache"] = False
    real = sum(lengths)
    cases: dict[str, tuple[bool, bool, dict]] = {
        "hf_sdpa compile padded": (False, False, padded),
        "patchkit compile padded": (True, False, padded),
        "hf_sdpa compile packed": (False, False, packed),
        "patchkit compile packed": (True, False, packed),
        "hf_sdpa fullgraph packed": (False, True, packed),
        "patchkit fullgraph packed": (True, True, packed),
    }
    steps: dict[str, Any] = {}
    losses: dict[str, float] = {}
    for name, (patched, fullgraph, data) in cases.items():
        torch._dynamo.reset()
        steps[name] = stepper(patched, fullgraph, args.backend, data)
        for _ in range(WARMUP):
            losses[name] = steps[name]()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in cases:
        median = statistics.median(times[name])
        base = statistics.median(times[name.replace("patchkit", "hf_sdpa")])
        handle = steps[name].handle
        aside = handle.stepped_aside if handle is not None else {}
        rows.append(dict(provider=name, median_s=round(median, 4), real_tokens_per_s=round(real / median, 1),
                         vs_hf=round(base / median, 2), loss=round(losses[name], 5), stepped_aside=str(aside or "")))
    print(f"{len(lengths)} rows, {real} real tokens, {padding_fraction(lengths):.0%} padding, {args.backend}, "
          f"torch {torch.__version__}")
    print(f"{'provider':28} {'median s':>9} {'tokens/s':>9} {'vs HF':>6}  loss")
    for row in rows:
        print(f"{row['provider']:28} {row['median_s']:9.4f} {row['real_tokens_per_s']:9.1f} {row['vs_hf']:6.2f}  "
              f"{row['loss']} {row['stepped_aside']}")
    write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
