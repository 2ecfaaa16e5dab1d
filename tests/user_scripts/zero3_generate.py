"""ZeRO-3 inference as transformers' DeepSpeed docs show it: generate() with synced_gpus on partitioned weights.

    torchrun --nproc_per_node 2 zero3_generate.py WAY MODEL_DIR OUT.json

WAY: `none` (unpatched) or `class` (patchkit.apply_patch() first). `HfDeepSpeedConfig` (ZeRO-3) before
`from_pretrained` partitions the model as it loads; `deepspeed.initialize` wraps it. Rank 0 decodes a left-padded
batch of three prompts for 12 tokens, rank 1 an unpadded batch of two for 4: with `synced_gpus=True` rank 1 keeps
running forwards until rank 0 is done, since every forward gathers each layer's weights from both ranks. Each rank
writes its tokens and patchkit's counters to OUT-RANK.json.
"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import transformers as tf
from common import checked_way, end_process_group, patchkit_calls, write_result
from transformers.integrations import HfDeepSpeedConfig

way = checked_way(sys.argv[1], ("none", "class"))
model_dir, out = sys.argv[2:4]
if way == "class":
    import patchkit

    patchkit.apply_patch()

rank = int(os.environ["RANK"])
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
keep = HfDeepSpeedConfig(config)  # must stay alive while the model loads: transformers reads it through a weakref
model = tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
partitioned = hasattr(model.model.layers[0].self_attn.q_proj.weight, "ds_shape")
engine = deepspeed.initialize(model=model, config_params=config)[0]
engine.module.eval()

lengths, new_tokens = [((5, 11, 8), 12), ((3, 3), 4)][rank]
g = torch.Generator().manual_seed(10 + rank)
n = max(lengths)
mask = torch.stack([(torch.arange(n) >= n - k).long() for k in lengths])  # left padded
ids = torch.randint(3, 97, (len(lengths), n), generator=g).masked_fill(mask == 0, 0)
with torch.no_grad():
    tokens = engine.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                    synced_gpus=True, pad_token_id=0)
write_result("ZERO3_GENERATE", out.replace(".json", f"-{rank}.json"),
             {"rank": rank, "partitioned": partitioned, "tokens": tokens.tolist(), "patchkit_calls": patchkit_calls()})
end_process_group()
