"""A DeepSpeed ZeRO-3 engine's steps in which the ranks' forwards take other paths through patchkit.

    torchrun --nproc_per_node 2 zero3_diverge.py WAY UNPAD OUT_DIR

WAY: `none` (unpatched) or `class` (patchkit.apply_patch(unpad=UNPAD) before the model is built). Every weight is
partitioned (persistence 0) and DeepSpeed gathers each module's weights around its forward, on every rank in the
same order. Rank 0 labels its rows as the README says, so its forwards run patched and its loss fused; rank 1 labels
a token predicted from left padding on step 0 (its forward steps aside) and no token on step 1. Each rank writes
OUT_DIR/rank-R.json: its losses and patchkit's counters.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import transformers as tf
from common import checked_way, end_process_group, patchkit_heads, write_result

parser = argparse.ArgumentParser()
parser.add_argument("way")
parser.add_argument("unpad")
parser.add_argument("out", type=Path)
opts = parser.parse_args()
way = checked_way(opts.way, ("none", "class"))
if way == "class":
    import patchkit

    handle = patchkit.apply_patch(backend="sdpa", unpad=opts.unpad)

import deepspeed  # noqa: E402  (after the patch, as a user's script imports it)

deepspeed.init_distributed("gloo")
rank = int(os.environ["RANK"])
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
torch.manual_seed(0)
model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
losses = []
for step in range(3):
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(rank * 10 + step))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    if not (rank == 1 and step == 0):
        labels[0, 5] = -100  # the first real token, predicted from padding, unlabelled
    if rank == 1 and step == 1:
        labels[:] = -100
    loss = engine(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(20)).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
opts.out.mkdir(parents=True, exist_ok=True)
result = {"rank": rank, "losses": losses, "heads": patchkit_heads(),
          "stepped_aside": dict(handle.stepped_aside) if way == "class" else {}}
write_result("ZERO3_DIVERGE", str(opts.out / f"rank-{rank}.json"), result)
end_process_group()
