"""A custom accelerate loop under FSDP2, prepared as accelerate prepares it: unpatched, then under patchkit.

    torchrun --nproc_per_node 2 accelerate_fsdp2.py OUT_JSON

accelerate shards a model with FSDP only on GPUs (on CPUs it wraps it in DDP); here its state is told FSDP, so that
its own FSDP2 preparation (`fsdp2_prepare_model`) runs as on GPUs: each decoder layer a unit, and, since accelerate
1.15, the final norm and the head a unit of their own, kept gathered from the norm's forward to the backward (tied:
the embedding in it too); the root the rest. Each case (a LLaMA; its head tied to its embedding, as Llama 3.2 1B's;
PEFT's LoRA on its attention, before accelerate prepares it; with PEFT's copy of the head trained, as adding tokens
needs; with LoRA on the head too) trains 3 steps on right-padded rows, its loss read
alone, as the Trainer reads it, unpatched and then under an instance patch. Rank 0 writes each case's losses and
patchkit's `heads`; the bf16 case unpatched under eager attention too, the size of transformers' own rounding.
"""

from __future__ import annotations

import argparse

import torch
import transformers as tf
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from common import end_process_group, patchkit_heads, write_result

import patchkit

parser = argparse.ArgumentParser()
parser.add_argument("out")
opts = parser.parse_args()

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
CASES = ("plain", "tied", "bf16", "lora", "lora training the head", "lora on the head")
# bf16: FSDP2's mixed precision as accelerate's `mixed_precision: bf16` sets it (bf16 weights gathered, fp32 kept)
BF16 = FullyShardedDataParallelPlugin(
    fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    mixed_precision_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32))


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(100)
    out = []
    for n in (16, 9, 12, 5, 14, 11, 16, 7, 10, 13, 4, 15):
        ids = torch.randint(3, 97, (16,), generator=g)
        mask = (torch.arange(16) < n).long()
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def train(case: str, patched: bool, attention: str = "sdpa") -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(attn_implementation=attention,
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=case == "tied"))
    if case.startswith("lora"):
        import peft

        targets = ["q_proj", "v_proj"] + (["lm_head"] if case == "lora on the head" else [])
        saved = ["lm_head"] if case == "lora training the head" else None
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, modules_to_save=saved))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # told before each prepare: accelerate's state says MULTI_CPU again after one
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = BF16 if case == "bf16" else plugin
    model, optimizer = accelerator.prepare(model, optimizer)
    head = model.get_output_embeddings()
    weight = next(p for name, p in head.named_parameters() if name.endswith("weight"))
    carved = type(head).__name__.startswith("FSDP") and type(weight).__name__ == "DTensor"  # a unit of its own
    handle = patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") if patched else None
    heads = patchkit_heads()
    mine = rows()[accelerator.process_index::accelerator.num_processes]
    losses = []
    for step in range(3):
        batch = {k: torch.stack([r[k] for r in mine[2 * step:2 * step + 2]]) for k in mine[0]}
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    done = {why: n - heads.get(why, 0) for why, n in patchkit_heads().items() if n - heads.get(why, 0)}
    if handle is not None:
        handle.revert()
    return losses, {"heads": done, "carved": carved}


result = {}
for case in CASES:
    unpatched, _ = train(case, False)
    patched, seen = train(case, True)
    result[case] = {"unpatched": unpatched, "patched": patched, **seen}
    if case == "bf16":
        result[case]["eager"] = train(case, False, "eager")[0]
if accelerator.is_main_process:
    write_result("ACCELERATE_FSDP2", opts.out, result)
end_process_group()
