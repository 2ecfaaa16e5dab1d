"""A pre-norm transformer block on patchkit.nn.VarlenSelfAttention: train on CPU, check it, compare memory.

    python examples/transformer_block.py            # 30 steps, memory comparison at N = 8192
    python examples/transformer_block.py --quick    # 5 steps, memory comparison at N = 1024

1. Trains a tiny causal LM (two blocks, GQA) on padded batches for a few steps and prints the losses.
2. Checks one block against the same block built on torch.nn.MultiheadAttention (same weights, key-padding
   and causal masks): outputs at real tokens and every gradient, with stated tolerances; exits 1 if exceeded.
3. Runs one attention layer forward + backward at a long sequence length in two fresh subprocesses, the
   standard way (a (B, 1, N, N) mask built from the padding mask, SDPA over padded tokens) and the varlen way,
   and prints the peak RSS growth of each.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from patchkit.nn import VarlenSelfAttention

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS = 64, 64, 4, 2, 2
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


class TorchAttention(nn.Module):
    """The standard implementation: nn.MultiheadAttention with a key-padding mask and a causal mask."""

    def __init__(self, width: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(width, heads, batch_first=True)
        self.causal = causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        return self.mha(x, x, x, key_padding_mask=~mask, attn_mask=causal, need_weights=False)[0]


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attention: nn.Module, width: int = WIDTH) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), attention
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, a stack of varlen blocks, a final norm and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            Block(VarlenSelfAttention(WIDTH, HEADS, KV_HEADS, causal=True, backend="sdpa")) for _ in range(LAYERS)
        )
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def padded_batch(gen: torch.Generator, batch: int = 8, seq: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that repeat a random 5-token motif, right-padded to random lengths (True = real token)."""
    motifs = torch.randint(1, VOCAB, (batch, 5), generator=gen)
    ids = motifs.repeat(1, seq // 5 + 1)[:, :seq]
    lengths = torch.randint(seq // 3, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None] < lengths[:, None]
    return ids.masked_fill(~mask, 0), mask


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token loss on real tokens only."""
    target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)


def train(steps: int) -> tuple[float, float]:
    """Train the tiny LM on a fixed set of padded batches; print and return the first and last loss."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = TinyLM().train()
    batches = [padded_batch(gen) for _ in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        ids, mask = batches[step % len(batches)]
        loss = lm_loss(model(ids, mask), ids, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0 or (step + 1) % max(1, steps // 6) == 0 or step == steps - 1:
            print(f"step {step + 1:3d}/{steps}  loss {loss.item():.4f}  real tokens {int(mask.sum())}/{mask.numel()}")
    return losses[0], losses[-1]


def twin_blocks(causal: bool) -> tuple[Block, Block]:
    """A varlen block and the same block (same weights) on torch.nn.MultiheadAttention."""
    torch.manual_seed(1)
    varlen = Block(VarlenSelfAttention(WIDTH, HEADS, causal=causal, backend="sdpa"))
    reference = copy.deepcopy(varlen)
    reference.attn = TorchAttention(WIDTH, HEADS, causal)
    with torch.no_grad():
        reference.attn.mha.in_proj_weight.copy_(varlen.attn.in_proj.weight)
        reference.attn.mha.in_proj_bias.copy_(varlen.attn.in_proj.bias)
        reference.attn.mha.out_proj.weight.copy_(varlen.attn.out_proj.weight)
        reference.attn.mha.out_proj.bias.copy_(varlen.attn.out_proj.bias)
    return varlen, reference


def grads_of(block: Block, x: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output at real tokens and the gradients of a fixed linear loss over real tokens."""
    x = x.clone().requires_grad_(True)
    out = block(x, mask)
    (out[mask] * weights).sum().backward()
    named = {"input": x.grad, **{name: p.grad for name, p in block.named_parameters()}}
    return out[mask].detach(), {_canonical(name): g for name, g in named.items()}


def _canonical(name: str) -> str:
    return name.replace("attn.mha.in_proj_", "attn.in_proj.").replace("attn.mha.", "attn.")


def check(causal: bool) -> bool:
    """Compare a varlen block with its MultiheadAttention twin; print the largest differences."""
    varlen, reference = twin_blocks(causal)
    gen = torch.Generator().manual_seed(2)
    _, mask = padded_batch(gen, batch=6, seq=40)
    x = torch.randn(6, 40, WIDTH, generator=gen)
    weights = torch.randn(int(mask.sum()), WIDTH, generator=gen)
    out, grads = grads_of(varlen, x, mask, weights)
    ref_out, ref_grads = grads_of(reference, x, mask, weights)
    assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())
    out_diff = (out - ref_out).abs().max().item()
    grad_name, grad_diff = max(((n, (grads[n] - ref_grads[n]).abs().max().item()) for n in grads), key=lambda t: t[1])
    ok = out_diff <= OUT_TOL and grad_diff <= GRAD_TOL
    label = "causal" if causal else "bidirectional"
    print(
        f"check {label:13s} vs torch.nn.MultiheadAttention: max |output diff| {out_diff:.2e} (tol {OUT_TOL:.0e}), "
        f"max |grad diff| {grad_diff:.2e} over {len(grads)} tensors, worst {grad_name} (tol {GRAD_TOL:.0e}) "
        + ("OK" if ok else "EXCEEDED")
    )
    return ok


class MaskedSdpaAttention(nn.Module):
    """The standard long-sequence path: a (B, 1, N, N) bool mask from the 2D mask, SDPA over padded tokens."""

    def __init__(self, varlen: VarlenSelfAttention) -> None:
        super().__init__()
        self.in_proj, self.out_proj, self.heads = varlen.in_proj, varlen.out_proj, varlen.num_heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask[:, None, None, :]  # (B, 1, N, N)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.in_proj(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1)) * mask[..., None]


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: current, VmHWM: peak) in MiB."""
    with open("/proc/self/status") as status:
        line = next(row for row in status if row.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0), so the peak measured is the step's own."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def memory_probe(path: str, seq: int) -> None:
    """Run in a fresh process: one attention layer, forward + backward; print peak RSS growth as JSON."""
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        varlen = VarlenSelfAttention(WIDTH, HEADS, causal=True, backend="sdpa")
    layer = varlen if path == "varlen" else MaskedSdpaAttention(varlen)
    x = torch.randn(2, seq, WIDTH, requires_grad=True)
    mask = torch.arange(seq)[None] < torch.tensor([[seq], [seq // 2]])  # lengths N and N/2
    before = _status_mib("VmRSS")
    exact = _reset_peak_rss()
    start = time.perf_counter()
    layer(x, mask).sum().backward()
    seconds = time.perf_counter() - start
    # Without the reset, ru_maxrss may still be the import-time peak: then the growth is a lower bound.
    peak = _status_mib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"path": path, "extra_mib": max(0.0, peak - before), "seconds": seconds, "exact": exact}))


def compare_memory(seq: int) -> None:
    """Run both paths in subprocesses and print the comparison."""
    mask_mib = 2 * seq * seq / 2**20
    print(f"memory at N={seq}, batch 2 (lengths {seq} and {seq // 2}), one attention layer, forward + backward:")
    results = {}
    for path in ("mask", "varlen"):
        cmd = [sys.executable, __file__, "--memory-probe", path, "--seq", str(seq)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[path] = json.loads(done.stdout.strip().splitlines()[-1])
    labels = {
        "mask": f"(B,1,N,N) bool mask + SDPA (mask alone {mask_mib:.0f} MiB)",
        "varlen": "VarlenSelfAttention (cu_seqlens, no mask)",
    }
    for path, row in results.items():
        bound = "" if row["exact"] else " (lower bound: peak RSS could not be reset)"
        print(f"  {labels[path]:52s} peak RSS +{row['extra_mib']:7.1f} MiB  {row['seconds']:.2f} s{bound}")
    ratio = results["mask"]["extra_mib"] / max(results["varlen"]["extra_mib"], 1.0)
    print(f"  varlen path uses {ratio:.1f}x less peak memory")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length of the memory comparison")
    parser.add_argument("--quick", action="store_true", help="5 steps and N = 1024 (for tests)")
    parser.add_argument("--memory-probe", choices=("mask", "varlen"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    if args.memory_probe:
        memory_probe(args.memory_probe, args.seq)
        return 0
    steps, seq = (5, 1024) if args.quick else (args.steps, args.seq)

    first, last = train(steps)
    trained = last < first
    print(f"training: loss {first:.4f} -> {last:.4f} " + ("(decreasing)" if trained else "(NOT decreasing)"))
    checks = [check(causal=True), check(causal=False)]
    compare_memory(seq)
    if not (trained and all(checks)):
        print("FAILED: see the lines above")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
