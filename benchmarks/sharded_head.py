"""The LM head and loss under DeepSpeed ZeRO-3: a step's peak memory per rank with the head fused or not.

Under ZeRO-3 each rank holds a shard of the head's weight; DeepSpeed's hooks gather it around the head's forward. With
`unpad="loss"` patchkit runs the fused head and loss as the head's forward (`hooks/head/weight_holders.held`), so no
(L, V) logits exist. This benchmark trains the LLaMA of `vocab.py` (hidden 256, 4 layers) at Llama 3's vocabulary
(128256) under ZeRO-3 on two gloo ranks, each rank a right-padded half of vocab.py's lognormal batch of 8 (1809 real
tokens), and reports per provider the second step's peak resident set above the set before it (VmHWM, the larger
of the two ranks), the step's seconds and its loss (equal across providers): HF sdpa unpatched, patchkit with its
logits (`unpad="model"`), patchkit's loss alone with the family's own head on the labelled rows (what ZeRO-3 ran
before the fused head served it there) and the fused loss alone. Needs DeepSpeed (`make sp-test` installs it into
.sp/).

    PYTHONPATH=.sp python benchmarks/sharded_head.py [--vocab 128256] [--scale 1.0]
        [--csv benchmarks/results/zero3_head.csv]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROVIDERS = {  # name: (patched, unpad, fused)
    "hf_sdpa": (False, "model", False),
    "patchkit": (True, "model", False),
    "patchkit_loss_unfused": (True, "loss", False),
    "patchkit_loss": (True, "loss", True),
}


def worker(provider: str, vocab: int, scale: float = 1.0) -> None:
    """One rank: build the model inside zero.Init, two training steps on this rank's half of the batch; rank 0
    prints one JSON line with the larger rank's peak."""
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers as tf
    from transformers.integrations import HfDeepSpeedConfig
    from workers import step_peak_mib
    from workloads import MODEL, lognormal_lengths, make_tokens, padded_batch

    patched, unpad, fused = PROVIDERS[provider]
    if patched:
        import patchkit
        from patchkit.hooks.forwards import lm_forward

        patchkit.apply_patch(backend="sdpa", unpad=unpad)
        if not fused:  # the family's own head on the labelled rows, as before ZeRO-3's head was served fused
            lm_forward.fused_head = lambda lm: None
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    torch.manual_seed(0)
    llama = tf.LlamaConfig(vocab_size=vocab, hidden_size=MODEL["hidden"], intermediate_size=MODEL["intermediate"],
                           num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"], pad_token_id=0,
                           attn_implementation="sdpa")
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while it lives, transformers builds models inside zero.Init
    model = tf.LlamaForCausalLM._from_config(llama)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # vocab.py's batch: 1809 real tokens at --scale 1
    docs = make_tokens(lognormal_lengths(8, 0.56 * scale), vocab)[rank::world]
    ids, mask, _ = padded_batch(docs)
    labels = ids.masked_fill(mask == 0, -100)

    def step() -> float:
        loss = engine(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    step()
    start = time.perf_counter()
    peak_mib, loss = step_peak_mib(step)
    seconds = time.perf_counter() - start
    peak = torch.tensor([peak_mib, seconds, loss, float(mask.sum())])
    gathered = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(gathered, peak)
    if rank == 0:
        rows = torch.stack(gathered)
        print("ZERO3_HEAD " + json.dumps({
            "provider": provider, "vocab": vocab, "peak_mib": round(float(rows[:, 0].max()), 1),
            "seconds": round(float(rows[:, 1].max()), 3), "loss": round(float(rows[:, 2].mean()), 6),
            "real_tokens": int(rows[:, 3].sum())}), flush=True)
    dist.barrier()


def run(provider: str, vocab: int, scale: float = 1.0) -> dict:
    """`provider` on two ranks, each a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", provider, "--vocab", str(vocab), "--scale", str(scale)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ZERO3_HEAD ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{provider}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scale", type=float, default=1.0, help="every row's length times this (a smoke run)")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.vocab, args.scale)
        return
    rows = [run(p, args.vocab, args.scale) for p in args.providers]
    base = next((r for r in rows if r["provider"] == "hf_sdpa"), rows[0])
    print("| provider | real tokens | step s | peak MiB (per rank) | x HF sdpa | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['provider']} | {r['real_tokens']} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | "
              f"{r['peak_mib'] / base['peak_mib']:.2f}x | {r['loss']:.4f} |")
    if args.csv:
        from report import write_rows

        write_rows(Path(args.csv), rows)


if __name__ == "__main__":
    main()
