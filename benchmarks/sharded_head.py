"""The LM head and loss under ZeRO-3 or FSDP2: a step's peak memory per rank with the head fused or not.

Under DeepSpeed ZeRO-3 each rank holds a shard of the head's weight; DeepSpeed's hooks gather it around the head's
forward. Under FSDP2 as accelerate (1.15+) prepares a model, the final norm and the head are a unit of their own, kept
gathered from the norm's forward to the backward. With `unpad="loss"` patchkit runs the fused head and loss as the
holder's forward (`hooks/head/weight_holders.held`), so no (L, V) logits exist. This benchmark trains the LLaMA of
`vocab.py` (hidden 256, 4 layers) at Llama 3's vocabulary (128256) on two gloo ranks, each rank a right-padded half of
vocab.py's lognormal batch of 8 (1809 real tokens), and reports per provider the second step's peak resident set
above the set before it (VmHWM, the larger of the two ranks), the step's seconds and its loss (equal across
providers): HF sdpa unpatched, patchkit with its logits (`unpad="model"`), patchkit's loss alone with the family's
own head on the labelled rows (what ran before the fused head served the sharding) and the fused loss alone. ZeRO-3
needs DeepSpeed (`make sp-test` installs it into .sp/); FSDP2 runs accelerate's own `prepare`, its state told FSDP
as on GPUs (on CPUs accelerate would wrap the model in DDP).

    PYTHONPATH=.sp python benchmarks/sharded_head.py [--sharding zero3|fsdp2] [--vocab 128256] [--scale 1.0]
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
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
PROVIDERS = {  # name: (patched, unpad, fused)
    "hf_sdpa": (False, "model", False),
    "patchkit": (True, "model", False),
    "patchkit_loss_unfused": (True, "loss", False),
    "patchkit_loss": (True, "loss", True),
}


def worker(provider: str, vocab: int, scale: float = 1.0, sharding: str = "zero3") -> None:
    """One rank: build and shard the model, two training steps on this rank's half of the batch; rank 0 prints one
    JSON line with the larger rank's peak."""
    import torch
    import torch.distributed as dist
    import transformers as tf
    from workers import step_peak_mib
    from workloads import MODEL, lognormal_lengths, make_tokens, padded_batch

    patched, unpad, fused = PROVIDERS[provider]
    if patched:
        import patchkit
        from patchkit.hooks.forwards import lm_forward

        patchkit.apply_patch(backend="sdpa", unpad=unpad)
        if not fused:  # the family's own head on the labelled rows, as before the sharded head was served fused
            lm_forward.fused_head = lambda lm: None
    torch.manual_seed(0)
    llama = tf.LlamaConfig(vocab_size=vocab, hidden_size=MODEL["hidden"], intermediate_size=MODEL["intermediate"],
                           num_hidden_layers=MODEL["layers"], num_attention_heads=MODEL["heads"], pad_token_id=0,
                           attn_implementation="sdpa")
    train = zero3_step(llama) if sharding == "zero3" else fsdp2_step(llama)
    rank, world = dist.get_rank(), dist.get_world_size()
    # vocab.py's batch: 1809 real tokens at --scale 1
    docs = make_tokens(lognormal_lengths(8, 0.56 * scale), vocab)[rank::world]
    ids, mask, _ = padded_batch(docs)
    labels = ids.masked_fill(mask == 0, -100)

    def step() -> float:
        return train(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)

    step()
    start = time.perf_counter()
    peak_mib, loss = step_peak_mib(step)
    seconds = time.perf_counter() - start
    peak = torch.tensor([peak_mib, seconds, loss, float(mask.sum())])
    gathered = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(gathered, peak)
    heads: dict[str, int] = {}  # where patchkit's head and loss ran, over its two steps on this rank
    for handle in sys.modules["patchkit"].active_patches() if patched else ():
        for why, n in handle.heads.items():
            heads[why] = heads.get(why, 0) + n
    if rank == 0:
        rows = torch.stack(gathered)
        print("SHARDED_HEAD " + json.dumps({
            "provider": provider, "sharding": sharding, "vocab": vocab, "peak_mib": round(float(rows[:, 0].max()), 1),
            "seconds": round(float(rows[:, 1].max()), 3), "loss": round(float(rows[:, 2].mean()), 6),
            "real_tokens": int(rows[:, 3].sum()), "heads": " ".join(f"{k}:{v}" for k, v in sorted(heads.items()))}),
            flush=True)
    dist.barrier()


def end_process_group() -> None:
    """A rank ends its process groups, then the process, without interpreter teardown: left to it, gloo's threads
    (DeepSpeed's and accelerate's subgroups' too) died under a live peer and one rank aborted ("terminate called
    without an active exception") after its row was printed, twice in CI under load (as the test scripts' own
    `end_process_group`, tests/user_scripts/common.py, found before)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def zero3_step(llama: Any) -> Callable[..., float]:
    """The model built inside zero.Init under a DeepSpeed engine (every weight partitioned): its training step."""
    import deepspeed
    import transformers as tf
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed("gloo")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while it lives, transformers builds models inside zero.Init
    model = tf.LlamaForCausalLM._from_config(llama)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(**batch: Any) -> float:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def fsdp2_step(llama: Any) -> Callable[..., float]:
    """The model as accelerate's FSDP2 preparation shards it (each decoder layer a unit; the final norm and the head
    one, kept gathered to the backward; the root the rest): its training step."""
    import torch
    import transformers as tf
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP  # as on GPUs: on CPUs accelerate would use DDP
    accelerator.state.fsdp_plugin = plugin
    model = tf.LlamaForCausalLM._from_config(llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step(**batch: Any) -> float:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return step


def run(provider: str, vocab: int, scale: float = 1.0, sharding: str = "zero3") -> dict:
    """`provider` on two ranks, each a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", provider, "--vocab", str(vocab), "--scale", str(scale), "--sharding", sharding]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SHARDED_HEAD ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{provider}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sharding", choices=("zero3", "fsdp2"), default="zero3")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scale", type=float, default=1.0, help="every row's length times this (a smoke run)")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.vocab, args.scale, args.sharding)
        end_process_group()
    rows = [run(p, args.vocab, args.scale, args.sharding) for p in args.providers]
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
