"""The LM head and its loss alone, three ways: unfused, fused with its gradients written in the forward, recomputed.

What `forward/loss/linear_cross_entropy.py` chooses between, measured apart from any model: one forward and backward
of `ForCausalLMLoss(hidden @ W.T)` over `--rows` labelled rows of width `--hidden` at each vocabulary, in float32
and bfloat16, with the head's weight trained:

- `unfused`: `nn.Linear`'s logits and transformers' `ForCausalLMLoss`, as a family's own forward runs them;
- `held`: the fused loss writing the gradients in the forward (its float32 weight gradient held until the backward;
  what it runs for a float32 head);
- `recomputed`: the fused loss computing the logits again in the backward (what it runs for a bfloat16 head).

With `--lora R` the head is frozen and LoRA of rank R on it trains (continued pretraining's recipe): `unfused` adds
`B(A(x)) * 2` to the logits as PEFT's lora.Linear does; the fused loss adds the same term a vocabulary slice at a
time (`LowRank`) and writes A's rows' and B's gradients beside the rows'. A frozen head's gradients are written in
the forward in every dtype, so `recomputed` is not a way there.

Each row: the median of `--reps` timed runs after one untimed (the ways interleaved run by run), the loss, and the
peak memory of a second run above its inputs, the gradients it writes included (on a CPU the peak resident set, in
a fresh process per way and dtype; on a GPU `torch.cuda.max_memory_allocated`, in this process). The CSV is written
after each vocabulary and dtype, so a run cut short by its budget keeps what it measured.

    python benchmarks/fused_loss.py [--vocabs 32000 128256] [--rows 2048] [--hidden 512] [--reps 3]
        [--lora R] [--device cpu|cuda] [--csv FILE]
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

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import write_rows  # noqa: E402
from workers import step_peak_mib  # noqa: E402

from patchkit.forward.loss import linear_cross_entropy as lce  # noqa: E402

CSV = Path(__file__).resolve().parent / "results" / "fused_loss.csv"
WAYS = ("unfused", "held", "recomputed")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


LORA_SCALE = 2.0  # lora_alpha / r, PEFT's usual 16 / 8


def inputs(rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: str, lora: int = 0) -> tuple:
    """The rows, the head's weight (frozen under LoRA), the labels and LoRA's (A, B) of rank `lora` (or None)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device, dtype).requires_grad_(not lora)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(device)
    adapter = None if not lora else tuple(  # B drawn, not PEFT's zeros: its term counts
        (torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(device, dtype).requires_grad_()
        for shape in ((lora, hidden), (vocab, lora)))
    return h, w, labels, adapter


def run(way: str, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, adapter: tuple | None = None) -> float:
    """One forward and backward of the head and loss `way`; the loss."""
    for t in (h, w, *(adapter or ())):
        t.grad = None
    rows = None if adapter is None else h @ adapter[0].t()  # A's rows, by autograd, as PEFT's A layer runs
    if way == "unfused":
        logits = torch.nn.functional.linear(h, w)
        if adapter is not None:
            logits = logits + (rows @ adapter[1].t()) * LORA_SCALE
        loss = ForCausalLMLoss(logits[None], None, w.shape[0], shift_labels=labels[None])
    else:
        lce.HOLD_DTYPES = (w.dtype,) if way == "held" else ()
        terms = () if adapter is None else [lce.LowRank(rows, adapter[1], None, LORA_SCALE)]
        loss = lce.linear_cross_entropy(h, w, None, labels, terms=terms)
    loss.backward()
    return float(loss.detach())


def ways(args: argparse.Namespace) -> tuple[str, ...]:
    return WAYS[:2] if args.lora else WAYS


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ways(args: argparse.Namespace, vocab: int, dtype: str) -> dict[str, tuple[float, float]]:
    """Median seconds and the loss of each way, interleaved run by run."""
    h, w, labels, adapter = inputs(args.rows, args.hidden, vocab, DTYPES[dtype], args.device, args.lora)
    times: dict[str, list[float]] = {way: [] for way in ways(args)}
    losses = {}
    for rep in range(args.reps + 1):
        for way in ways(args):
            sync(args.device)
            start = time.perf_counter()
            losses[way] = run(way, h, w, labels, adapter)
            sync(args.device)
            if rep:
                times[way].append(time.perf_counter() - start)
    return {way: (statistics.median(times[way]), losses[way]) for way in ways(args)}


def peak_mib(args: argparse.Namespace, vocab: int, dtype: str, way: str) -> float:
    """One run's peak above its inputs (the gradients it writes included): on a GPU from the allocator, in this
    process; on a CPU from the resident set, in a fresh process."""
    if args.device == "cuda":
        return measure_peak(args, way, dtype, vocab)
    # glibc's fixed mmap threshold: every large tensor is mapped on allocation and unmapped when freed, so the
    # resident set's high-water mark is the peak of what was live (a reused heap block would not count again)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, __file__, "--peak-of", way, dtype, str(vocab), "--rows", str(args.rows),
                          "--hidden", str(args.hidden), "--lora", str(args.lora), "--device", args.device],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def measure_peak(args: argparse.Namespace, way: str, dtype: str, vocab: int) -> float:
    h, w, labels, adapter = inputs(args.rows, args.hidden, vocab, DTYPES[dtype], args.device, args.lora)
    run(way, h, w, labels, adapter)  # the first touches the allocator's pages: the second is measured
    for t in (h, w, *(adapter or ())):
        t.grad = None
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(way, h, w, labels, adapter)
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return max(0.0, step_peak_mib(lambda: run(way, h, w, labels, adapter))[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA of rank R on a frozen head")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--csv", type=Path, default=CSV)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--peak-of", nargs=3, metavar=("WAY", "DTYPE", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fused_loss.py: no CUDA device here; nothing measured")
        return 0
    if args.peak_of:
        way, dtype, vocab = args.peak_of
        print(json.dumps({"peak_mib": measure_peak(args, way, dtype, int(vocab))}))
        return 0
    rows: list[dict[str, Any]] = []
    for vocab in args.vocabs:
        for dtype in args.dtypes:
            timed = time_ways(args, vocab, dtype)
            for way in ways(args):
                seconds, loss = timed[way]
                peak = "" if args.no_memory else round(peak_mib(args, vocab, dtype, way), 1)
                rows.append({"vocab": vocab, "dtype": dtype, "way": way, "rows": args.rows, "hidden": args.hidden,
                             "lora": args.lora,
                             "seconds": round(seconds, 4), "vs_unfused": round(timed["unfused"][0] / seconds, 3),
                             "loss": round(loss, 5), "peak_mib": peak, "device": args.device})
                print(", ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
            write_rows(args.csv, rows)  # each vocabulary and dtype as it is measured: a run cut short keeps them
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
