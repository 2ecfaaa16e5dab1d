"""Distributed: every rank of torchrun / accelerate launch patches, and DDP losses match a single process."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from entrypoints import clean_env, free_port, run, tagged

pytestmark = pytest.mark.heavy  # torchrun and accelerate launch: make test-heavy

# The user's training script: one process, or DDP under torchrun / accelerate launch (gloo on CPU).
TRAIN_SCRIPT = '''"""A tiny padded-batch training run, single process or DDP, for patchkit's tests."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import patchkit

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--expect-backend", default=None, help="the patch backend every rank must run; none: unpatched")
parser.add_argument("--accelerate", action="store_true")
parser.add_argument("--compile", default=None, help="torch.compile backend for the (wrapped) model; default: eager")
opts = parser.parse_args()


def batch(seed: int):
    """The full global batch, the same on every rank: right and left padded rows."""
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(3, 97, (4, 16), generator=g)
    mask = torch.zeros(4, 16, dtype=torch.long)
    for row, n in enumerate([16, 11, 7, 13]):
        if row % 2:
            mask[row, 16 - n:] = 1
        else:
            mask[row, :n] = 1
    labels = ids.masked_fill((mask == 0) | F.pad(mask[:, :-1] == 0, (1, 0)), -100)
    return ids, mask, labels


torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, pad_token_id=0, attn_implementation="eager")
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

if opts.accelerate:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    rank, world = accelerator.process_index, accelerator.num_processes
    print(f"ACCELERATE rank={rank} type={accelerator.state.distributed_type.value} backend={accelerator.state.backend}",
          flush=True)
    backward = accelerator.backward
    total = lambda x: accelerator.reduce(x, "sum")  # noqa: E731
elif "WORLD_SIZE" in os.environ:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    backward = torch.Tensor.backward

    def total(x):
        dist.all_reduce(x)
        return x
else:
    rank, world, wrapped = 0, 1, model
    backward = torch.Tensor.backward
    total = lambda x: x  # noqa: E731

if opts.compile:
    wrapped = torch.compile(wrapped, backend=opts.compile)

handles = [h for h in patchkit.active_patches() if h.spec.family == "llama"]  # the launcher patched every family
if opts.expect_backend:
    assert len(handles) == 1 and handles[0].backend == opts.expect_backend, handles
    print(f"PATCHED rank={rank} world={world} backend={handles[0].backend} layers={handles[0].check(wrapped)}",
          flush=True)
else:
    assert not handles, handles
    print(f"UNPATCHED rank={rank} world={world}", flush=True)

losses = []
for step in range(opts.steps):
    ids, mask, labels = batch(0)  # one batch, memorised: the loss must fall
    n_targets = (labels[:, 1:] != -100).sum()
    mine = slice(rank, None, world)
    logits = wrapped(input_ids=ids[mine], attention_mask=mask[mine], use_cache=False).logits
    local_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[mine, 1:].flatten(), ignore_index=-100,
                                reduction="sum")
    # DDP averages gradients over ranks: scale so the update equals the full-batch mean loss's.
    backward(local_sum * world / n_targets)
    optimizer.step()
    optimizer.zero_grad()
    losses.append((total(local_sum.detach().clone()) / n_targets).item())

if opts.expect_backend:
    assert handles[0].layers_patched == config.num_hidden_layers, handles[0].layers_patched
if rank == 0:
    print("LOSSES " + json.dumps(losses), flush=True)
if dist.is_initialized():
    dist.barrier()  # no rank tears gloo down while its peer is still in flight (a gloo SIGABRT otherwise)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # under load torch's gloo threads can abort the interpreter's exit after all of the above
    # ('terminate called without an active exception', SIGABRT; plain torchrun without patchkit too): torch's teardown
'''

STEPS = 3


@pytest.fixture(scope="module")
def train_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "train_tiny.py"
    path.write_text(TRAIN_SCRIPT)
    return path


@pytest.fixture(scope="module")
def single_process_losses(train_script):
    """The reference: one process, the full batch, no patch (eager attention)."""
    proc = run([sys.executable, train_script, "--steps", str(STEPS)], cwd=train_script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "UNPATCHED rank=0 world=1" in proc.stdout
    return losses_of(proc.stdout)


def losses_of(stdout: str) -> list[float]:
    return tagged(stdout, "LOSSES")


def check_ranks_and_losses(proc, reference: list[float]) -> None:
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    line = r"patchkit.launch: rank (\d)/2 \(local \d\): patch 'all' applied, backend 'sdpa'"
    launched = re.findall(line, proc.stderr)
    assert sorted(launched) == ["0", "1"], proc.stderr[-3000:]
    patched = re.findall(r"PATCHED rank=(\d) world=2 backend=sdpa layers=2", proc.stdout)
    assert sorted(patched) == ["0", "1"], proc.stdout
    losses = losses_of(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3  # it trained
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_single_process_reference_trains(single_process_losses):
    assert len(single_process_losses) == STEPS and single_process_losses[-1] < single_process_losses[0] - 0.3


def test_torchrun_two_ranks_ddp_gloo(train_script, single_process_losses):
    proc = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "patchkit.launch", "--backend", "sdpa", train_script, "--expect-backend", "sdpa", "--steps", str(STEPS)],
        cwd=train_script.parent, env=clean_env(), timeout=240,
    )
    check_ranks_and_losses(proc, single_process_losses)


def test_torchrun_two_ranks_ddp_compiled_counts_every_layer(train_script, single_process_losses):
    # Regression: with per-layer unpadding, DDP + torch.compile runs one compiled attention frame for both layers,
    # and the script's final `layers_patched == num_hidden_layers` check failed (the report said 1 layer).
    proc = run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "patchkit.launch", "--backend", "sdpa", "--unpad", "attention", train_script, "--expect-backend", "sdpa",
         "--steps", str(STEPS), "--compile", "eager"],
        cwd=train_script.parent, env=clean_env(), timeout=240,
    )
    check_ranks_and_losses(proc, single_process_losses)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed")
def test_accelerate_launch_two_cpu_processes(train_script, single_process_losses, tmp_path):
    # `--cpu` alone runs ONE process in accelerate (multi-CPU needs an MPI hostfile); `--multi_gpu` is the
    # torchrun-based launcher, and Accelerator(cpu=True) in the script makes it MULTI_CPU with gloo.
    proc = run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
         "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", str(free_port()),
         "-m", "patchkit.launch", "--backend", "sdpa", train_script, "--expect-backend", "sdpa", "--accelerate",
         "--steps", str(STEPS)],
        cwd=train_script.parent, env=clean_env(HF_HOME=str(tmp_path / "hf")), timeout=240,
    )
    check_ranks_and_losses(proc, single_process_losses)
    assert sorted(re.findall(r"ACCELERATE rank=(\d) type=MULTI_CPU backend=gloo", proc.stdout)) == ["0", "1"]
