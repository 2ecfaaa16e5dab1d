"""Attention-only micro-benchmark that picks the sdpa backend's CPU technique by measurement, not by guess."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from patchkit.backends import sdpa

DOC_LENGTHS = [340, 263, 569, 333, 176, 431, 1105, 773]  # a fixed lognormal-like draw: 55% padding at batch 8


def per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], gqa: str, four_d: bool = True
) -> torch.Tensor:
    """One SDPA call per sequence; GQA by enable_gqa or by repeating K/V heads; 3D or 4D (batch of 1) inputs."""
    outs, start = [], 0
    h = q.shape[1]
    for n in lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        if gqa == "repeat" and ks.shape[0] != h:
            ks, vs = ks.repeat_interleave(h // ks.shape[0], 0), vs.repeat_interleave(h // vs.shape[0], 0)
        gq = ks.shape[0] != h
        if four_d:
            o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True, enable_gqa=gq)[0]
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gq)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], slack: float) -> torch.Tensor:
    """Sort by length, batch sequences whose lengths are within `slack` of the group's longest, right-pad.

    Exact for causal self-attention: a real query never sees a right-padding key.
    """
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    pieces: list[tuple[list[int], torch.Tensor]] = []
    i = 0
    while i < len(order):
        top = lens[order[i]]
        group = [order[i]]
        i += 1
        while i < len(order) and lens[order[i]] >= top * (1 - slack):
            group.append(order[i])
            i += 1
        idx = torch.cat([torch.arange(starts[g], starts[g] + top).clamp(max=q.shape[0] - 1) for g in group])

        def pad(t: torch.Tensor, idx: torch.Tensor = idx, m: int = len(group), top: int = top) -> torch.Tensor:
            return t.index_select(0, idx).view(m, top, t.shape[1], -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        pieces.append((group, o.transpose(1, 2)))
    rows, srcs = [], []
    for group, o in pieces:
        for j, g in enumerate(group):
            rows.append(torch.arange(starts[g], starts[g] + lens[g]))
            srcs.append(o[j, : lens[g]])
    return out.index_copy(0, torch.cat(rows), torch.cat(srcs)) if rows else out


def padded_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """What HF sdpa does: a padded batch with a (B,1,N,N) bool mask (reference for the table)."""
    b, n = len(lens), max(lens)
    idx = torch.cat([torch.arange(s, s + n).clamp(max=q.shape[0] - 1) for s in torch.tensor([0, *lens[:-1]]).cumsum(0)])
    pq, pk, pv = (t.index_select(0, idx).view(b, n, t.shape[1], -1).transpose(1, 2) for t in (q, k, v))
    real = torch.arange(n)[None] < torch.tensor(lens)[:, None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None] & real[:, None, :]
    o = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask[:, None], enable_gqa=k.shape[1] != q.shape[1])
    return o.transpose(1, 2)[real]


def time_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], reps: int) -> list[float]:
    times = []
    for i in range(reps + 1):
        xs = [t.detach().requires_grad_() for t in inputs]
        t0 = time.perf_counter()
        fn(*xs).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def run(lens: list[int], heads: int, kv_heads: int, head_dim: int, reps: int, seed: int = 0) -> list[tuple[str, float]]:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, heads, head_dim, generator=g)
    k = torch.randn(t, kv_heads, head_dim, generator=g)
    v = torch.randn(t, kv_heads, head_dim, generator=g)
    cands: dict[str, Callable[..., torch.Tensor]] = {
        "per-seq loop, 3D (H,S,D) inputs: math path": lambda q, k, v: per_sequence(q, k, v, lens, "enable_gqa", False),
        "per-seq loop, 4D, enable_gqa": lambda q, k, v: per_sequence(q, k, v, lens, "enable_gqa"),
        "per-seq loop, 4D, repeat K/V": lambda q, k, v: per_sequence(q, k, v, lens, "repeat"),
        "grouped (slack 0.25)": lambda q, k, v: grouped(q, k, v, lens, 0.25),
        "grouped (slack 0.5)": lambda q, k, v: grouped(q, k, v, lens, 0.5),
        "one padded batch, is_causal (right pad, exact)": lambda q, k, v: grouped(q, k, v, lens, 1.0),
        "padded + (B,1,N,N) mask (HF sdpa)": lambda q, k, v: padded_masked(q, k, v, lens),
        "patchkit sdpa backend (as installed)": lambda q, k, v: sdpa.varlen_attention(
            q, k, v, lens, lens, causal=True
        )[0],
    }
    if kv_heads == heads:
        del cands["per-seq loop, 4D, repeat K/V"]
    ref: Optional[torch.Tensor] = None
    rows = []
    for name, fn in cands.items():
        out = fn(q, k, v)
        if ref is None:
            ref = out
        elif not torch.allclose(out, ref, atol=1e-5, rtol=1e-4):
            name += " [MISMATCH]"
        rows.append((name, statistics.median(time_fwd_bwd(fn, (q, k, v), reps))))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; lengths {DOC_LENGTHS}")
    for kv_heads in (8, 2):
        print(f"\n8 heads, {kv_heads} K/V heads, head_dim 32: attention fwd+bwd, median s of {args.reps}")
        for name, sec in run(DOC_LENGTHS, 8, kv_heads, 32, args.reps):
            print(f"  {name:50s} {sec:.3f}")


if __name__ == "__main__":
    main()
