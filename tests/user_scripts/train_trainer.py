"""A user's HF Trainer fine-tune of a tiny LLaMA on padded batches, as GPU scripts are written; no patchkit in it.

`--attn flash_attention_2` is the usual setting of such scripts (attention_spy is the tests' instrumentation).
"""

import argparse
import sys
import tempfile

import attention_spy
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--attn", default=None)
parser.add_argument("--output_dir", required=True)
args = parser.parse_args()

attention_spy.install()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, pad_token_id=0)
with tempfile.TemporaryDirectory() as path:
    LlamaForCausalLM(config).save_pretrained(path)
    kwargs = {} if args.attn is None else {"attn_implementation": args.attn}
    model = LlamaForCausalLM.from_pretrained(path, **kwargs)

g = torch.Generator().manual_seed(1)
examples = [{"input_ids": torch.randint(3, 97, (int(n),), generator=g).tolist()} for n in (5, 12, 8, 3, 10, 7, 12, 4)]


def collate(batch: list) -> dict:
    """Right-pad to the longest row; no loss on padding."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, b in enumerate(batch):
        ids[row, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
        mask[row, : len(b["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


training_args = TrainingArguments(output_dir=args.output_dir, max_steps=2, per_device_train_batch_size=4,
                                  learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=1,
                                  use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
trainer = Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collate)
result = trainer.train()
attention_spy.report(impl=model.config._attn_implementation, loss=result.training_loss, argv=sys.argv[1:])
