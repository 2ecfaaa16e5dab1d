"""A user's HF Trainer run with DeepSpeed Ulysses through accelerate's ParallelismConfig (what TRL's SFT docs show).

    torchrun --nproc_per_node 2 ulysses_trainer.py WAY OUT.json [ZERO_STAGE [ATTENTION]]

WAY: `none` (unpatched), `class` (patchkit.apply_patch() before the model is built) or `env` (PATCHKIT_FLASH_ATTN=1
set by the caller). `ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=
DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))` and a DeepSpeed config (ZeRO stage 0 unless
ZERO_STAGE says otherwise; 3 is ALST's recipe: the model partitioned by zero.Init as it is built, after the
TrainingArguments; torch AdamW) on gloo: the Trainer registers Ulysses under "sdpa", shards each batch with its
data-loader adapter and aggregates the loss over the SP ranks. One row per step (on CPU the adapter's sequence
slices of a larger batch stay non-contiguous, and transformers' loss `.view(-1)`s them: that fails unpatched too), a
full row then a right-padded one. Rank 0 writes the logged losses, every parameter after the steps (OUT.pt; gathered
under ZeRO-3) and patchkit's counters. ATTENTION (`sdpa` unless named) is the model's attention and
`sp_attn_implementation`; `flash_attention_2` is transformers' own on the CPU stand-in of flash-attn (tests/fakes.py).
"""

from __future__ import annotations

import os
import sys

import torch
import transformers as tf
from accelerate import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from common import (
    checked_way,
    end_process_group,
    flash_attention_2_stand_in,
    patchkit_calls,
    patchkit_heads,
    write_result,
)

import patchkit
from patchkit.hooks.parallel.sequence_parallel import ulysses_wrapper

way, out = checked_way(sys.argv[1], ("none", "class", "env")), sys.argv[2]
stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0
attention = sys.argv[4] if len(sys.argv) > 4 else "sdpa"
if attention == "flash_attention_2":
    flash_attention_2_stand_in()
if way == "class":
    patchkit.apply_patch(unpad=os.environ.get("PATCHKIT_UNPAD", "model"))

VOCAB, SEQ, IGNORE = 97, 16, -100

g = torch.Generator().manual_seed(100)
rows = []
for n in (16, 9):  # a full row, then one right padded (rank 1's half: 1 real token, 7 padding)
    ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
    mask = (torch.arange(SEQ) < n).long()
    ids = ids.masked_fill(mask == 0, 0)
    rows.append({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(SEQ),
                 "labels": ids.masked_fill(mask == 0, IGNORE)})

parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=2,
                                sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation=attention))
# no train_batch_size: TrainingArguments fills "auto" from the data-parallel world (1: both ranks hold one sequence),
# and zero.Init checks it against the whole world (2) as it builds the model
# (under ZeRO-3 every weight partitioned, however small: DeepSpeed keeps those under 1e5 elements whole by default)
zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
             "gradient_clipping": "auto", "zero_optimization": zero,
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
args = tf.TrainingArguments(output_dir=os.path.dirname(os.path.abspath(out)), per_device_train_batch_size=1,
                            max_steps=len(rows), learning_rate=1e-2, report_to=[], save_strategy="no",
                            logging_steps=1, deepspeed=deepspeed, parallelism_config=parallelism)
torch.manual_seed(0)  # the arguments first: under ZeRO-3 they make transformers build the model inside zero.Init
config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()
model.config._attn_implementation = attention  # as from_pretrained(attn_implementation=...) leaves it
partitioned = hasattr(model.model.layers[0].self_attn.q_proj.weight, "ds_shape")
trainer = tf.Trainer(model=model, args=args, train_dataset=rows)
trainer.train()
# outside a forward a partitioned head is this rank's shard: 0 elements
partitioned = partitioned and model.get_output_embeddings().weight.numel() == 0
params = {n: p.detach().clone() for n, p in model.named_parameters()}
if partitioned:
    import deepspeed as ds

    with ds.zero.GatheredParameters(list(model.parameters())):  # a collective: every rank enters it
        params = {n: p.detach().clone() for n, p in model.named_parameters()}

if int(os.environ.get("RANK", "0")) == 0:
    result = {
        "way": way, "stage": stage, "partitioned": partitioned,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "ulysses_wrapped": ulysses_wrapper(attention) is not None,
        "patchkit_calls": patchkit_calls(), "heads": patchkit_heads(),
        "config_attn_implementation": model.config._attn_implementation,
    }
    write_result("ULYSSES_TRAINER", out, result, params)
end_process_group()
