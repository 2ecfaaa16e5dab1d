"""A FastChat-style HF Trainer run under DeepSpeed ZeRO-3: the model partitioned as it loads, trained, evaluated.

    torchrun --nproc_per_node 2 [-m patchkit.launch] zero3_trainer.py WAY OUT_DIR --case NAME MODEL_DIR FLAGS
        [--case NAME MODEL_DIR FLAGS ...]

FLAGS: `-`, or a comma-separated choice of lora, bf16, train-head (PEFT trains a copy of the head), head-lora (LoRA on
the head too), own-head. Each case in turn is one run, in one process (a process start costs more than a tiny run): a
Trainer of its own (TrainingArguments reset accelerate's state), the model loaded afresh. Rank 0 writes
OUT_DIR/NAME.json and OUT_DIR/NAME.pt; the counters are the case's.

WAY: `none` (unpatched), `class` (patchkit.apply_patch() before loading), `instance` (apply_patch(model=...) on the
loaded, already partitioned model), `env` (PATCHKIT_FLASH_ATTN=1 set by the caller) or `launcher` (run under
`patchkit.launch`, loading with attn_implementation="flash_attention_2" as FastChat's train_mem.py does).
The TrainingArguments carry a ZeRO-3 config before `from_pretrained`, so transformers loads the model inside
`deepspeed.zero.Init`: every rank holds a shard of each weight and the layers' parameters are gathered by DeepSpeed's
module hooks around each forward. Gradient checkpointing on, right-padded rows, two per rank and step, fp32 on gloo
(`--bf16`: DeepSpeed's bf16 mixed precision). The Trainer's steps read the loss alone, so under patchkit the loss is
the fused head's, the head's weight gathered by its ZeRO-3 hooks (`--own-head`: a forward hook of the user's on the
head, marked `patchkit.shape_free`, which the fused loss does not serve: the family's own head runs on the labelled
rows). Rank 0 writes the
logged losses, an eval-mode loss on held-out rows, patchkit's counters and the parameters (gathered from every rank).
bf16 and fp32 runs go in processes of their own (DeepSpeed's and accelerate's precision state is per process).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import transformers as tf
from common import checked_way, end_process_group, patchkit_calls, patchkit_heads, write_result

parser = argparse.ArgumentParser()
parser.add_argument("way")
parser.add_argument("out", type=Path)
parser.add_argument("--case", nargs=3, action="append", required=True, metavar=("NAME", "MODEL_DIR", "FLAGS"))
opts = parser.parse_args()
way = checked_way(opts.way, ("none", "class", "instance", "env", "launcher"))
FLAGS = {"lora", "bf16", "train-head", "head-lora", "own-head"}
if way == "class":
    import patchkit

    patchkit.apply_patch(unpad=os.environ.get("PATCHKIT_UNPAD", "model"))

VOCAB, SEQ, IGNORE = 97, 24, -100


def run(name: str, model_dir: str, flags: set[str]) -> None:
    lora, bf16, train_head, head_lora, own_head = (
        flag in flags for flag in ("lora", "bf16", "train-head", "head-lora", "own-head"))
    calls, heads = patchkit_calls(), patchkit_heads()
    # No train_batch_size: transformers fills "auto" from its world size before the CPU process group exists (1).
    deepspeed = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": "auto",
                 # every weight partitioned, however small (DeepSpeed keeps those under 1e5 elements whole by default)
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                 **({"bf16": {"enabled": True}} if bf16 else {})}
    args = tf.TrainingArguments(output_dir=str(opts.out), per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                max_steps=3, learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1,
                                deepspeed=deepspeed, gradient_checkpointing=True, bf16=bf16,
                                use_cpu=bf16)  # transformers takes bf16 without a GPU only with use_cpu
    model = tf.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="flash_attention_2" if way == "launcher" else "sdpa", dtype=torch.float32)
    partitioned = hasattr(model.model.layers[0].self_attn.q_proj.weight, "ds_shape")  # sharded by zero.Init at load
    if own_head:  # marked as reading no layout: the head runs on the labelled rows (unmarked, on the padded batch)
        import patchkit

        model.get_output_embeddings().register_forward_hook(patchkit.shape_free(lambda module, args, output: None))
    if way == "instance":
        import patchkit

        patchkit.apply_patch(model=model, unpad=os.environ.get("PATCHKIT_UNPAD", "model"))
    if lora:
        import peft

        torch.manual_seed(1)  # the adapters' initialisation
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
                                                           + (["lm_head"] if head_lora else []),
                                                           modules_to_save=["lm_head"] if train_head else None))
        model.enable_input_require_grads()

    g = torch.Generator().manual_seed(100)
    rows = []
    for n in (24, 9, 17, 5, 20, 12, 24, 3, 14, 19, 8, 22, 16, 11, 6, 23):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < n).long()
        ids = ids.masked_fill(mask == 0, 0)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)})
    trainer = tf.Trainer(model=model, args=args, train_dataset=rows[:12])
    trainer.train()
    head_shard = model.get_output_embeddings().weight.numel()  # outside a forward: this rank's shard, 0 elements
    # An eval forward as the Trainer's prediction step runs it (eval mode, the config's use_cache), on every rank
    # since each forward gathers the weights; trainer.evaluate() itself cannot run here: accelerate sizes its gather
    # by the same world size of 1 and gloo refuses the list.
    model.eval()
    held_out = {k: torch.stack([r[k] for r in rows[12:]]) for k in rows[0]}
    with torch.no_grad():
        eval_loss = model(**held_out).loss.item()

    import deepspeed as ds  # transformers loaded it above; imported here for GatheredParameters only

    with ds.zero.GatheredParameters(list(model.parameters())):  # a collective: every rank enters it
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if int(os.environ.get("RANK", "0")) == 0:
        now = patchkit_heads()
        result = {
            "way": way, "case": name, "lora": lora, "partitioned": partitioned and head_shard == 0,
            "eval_loss": eval_loss, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "patchkit_calls": patchkit_calls() - calls,
            "heads": {why: n - heads.get(why, 0) for why, n in now.items() if n - heads.get(why, 0)},
        }
        write_result("ZERO3_TRAINER", str(opts.out / f"{name}.json"), result, params)


opts.out.mkdir(parents=True, exist_ok=True)
for name, model_dir, flags in opts.case:
    chosen = set() if flags == "-" else set(flags.split(","))
    if not chosen <= FLAGS:
        sys.exit(f"unknown flags {sorted(chosen - FLAGS)} (of {sorted(FLAGS)})")
    run(name, model_dir, chosen)
end_process_group()
