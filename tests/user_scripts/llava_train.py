"""A LLaVA-1.5-style visual instruction fine-tune (haotian-liu/LLaVA `llava/train/train.py`, reduced), as its users
run it: no patchkit in it.

The model is LLaVA's own (`llava_llama.py`: LlamaForCausalLM under model_type "llava_llama", registered with the
Auto classes as LLaVA does). Trained with the HF Trainer, gradient checkpointing on, the vision tower frozen; saved and
loaded back with `--attn` (LLaVA's train_mem.py asks for "flash_attention_2"). Prints one SPY line with the per-step
losses.
"""

import argparse
import sys
import tempfile

import attention_spy
import torch
import transformers
from llava_llama import IGNORE_INDEX, IMAGE_TOKEN_INDEX, LlavaConfig, LlavaLlamaForCausalLM, tiny_config
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--attn", default="sdpa")
parser.add_argument("--output_dir", required=True)
args = parser.parse_args()

AutoConfig.register("llava_llama", LlavaConfig)
AutoModelForCausalLM.register(LlavaConfig, LlavaLlamaForCausalLM)

attention_spy.install()
torch.manual_seed(0)
config = tiny_config()
with tempfile.TemporaryDirectory() as path:
    LlavaLlamaForCausalLM(config).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=args.attn)
model.config.use_cache = False
model.model.vision_tower.requires_grad_(False)
model.enable_input_require_grads()  # train.py, with gradient checkpointing

g = torch.Generator().manual_seed(1)


def example(n_before: int, n_after: int) -> dict:
    """One conversation: a prompt with the image, then the answer; loss on the answer only (LLaVA's preprocess)."""
    prompt = torch.randint(3, 97, (n_before,), generator=g).tolist() + [IMAGE_TOKEN_INDEX]
    answer = torch.randint(3, 97, (n_after,), generator=g).tolist()
    return {"input_ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer,
            "image": torch.randn(3, 28, 28, generator=g)}


examples = [example(b, a) for b, a in ((3, 9), (5, 2), (2, 14), (6, 4), (4, 7), (3, 3), (2, 11), (7, 5))]


def collate(batch: list) -> dict:
    """LLaVA's DataCollatorForSupervisedDataset: right padding, attention_mask = input_ids.ne(pad), stacked images."""
    ids = nn.utils.rnn.pad_sequence([torch.tensor(b["input_ids"]) for b in batch], batch_first=True,
                                    padding_value=config.pad_token_id)
    labels = nn.utils.rnn.pad_sequence([torch.tensor(b["labels"]) for b in batch], batch_first=True,
                                       padding_value=IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(config.pad_token_id),
            "images": torch.stack([b["image"] for b in batch])}


training_args = transformers.TrainingArguments(
    output_dir=args.output_dir, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
    save_strategy="no", logging_steps=1, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    gradient_checkpointing=True, remove_unused_columns=False, seed=0)
trainer = transformers.Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collate)
trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
attention_spy.report(impl=model.config._attn_implementation, losses=losses, argv=sys.argv[1:])
