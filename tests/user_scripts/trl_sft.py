"""A user's TRL SFT script on a tiny random model, TRL's defaults (checkpointing on) but fp32 on CPU; no patchkit in it.

FAMILY names the class prefix (Llama, Mistral, Qwen2). Trains a fresh model twice: padded batches, then packed (TRL's
bfd, padding-free). Prints one RESULT line: the per-step losses of each and how many attention calls ran through
patchkit.
"""

import json
import os
import tempfile

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

family = os.environ.get("FAMILY", "Llama")
words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 97)]
core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w3"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
g = torch.Generator().manual_seed(1)
rows = [" ".join(f"w{int(t)}" for t in torch.randint(3, 97, (n,), generator=g)) for n in (6, 14, 9, 19, 7, 12)]
dataset = Dataset.from_dict({"text": rows * 2})


def train(packing: bool) -> list:
    torch.manual_seed(0)
    config = getattr(transformers, family + "Config")(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=5)
    model = getattr(transformers, family + "ForCausalLM")(config)
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, bf16=False,
                         use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
                         dataloader_num_workers=0, disable_tqdm=True, packing=packing,
                         max_length=32 if packing else 1024)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


losses = {"padded": train(packing=False), "packing": train(packing=True)}
try:
    import patchkit

    calls = sum(h.calls for h in patchkit.active_patches())
except ImportError:
    calls = 0
print("RESULT " + json.dumps({"losses": losses, "calls": calls}))
