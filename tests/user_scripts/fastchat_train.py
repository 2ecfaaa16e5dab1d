"""A FastChat-style supervised fine-tune (fschat 0.2.36 `fastchat/train/train.py`, reduced), as written for 4.31.

Its dataclasses, its tokenizer handling (pad = unk, right padding to `model_max_length`), its label masking of
the user turn and a plain `transformers.Trainer`: nothing here knows patchkit. The test runs it unpatched and
under `python -m patchkit.launch` and compares the losses. `--make_model DIR` writes the tiny model and its
tokenizer (built from the instruction data with the installed `tokenizers`) instead of training.
"""

import json
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import transformers
from torch.utils.data import Dataset

IGNORE_TOKEN_ID = -100  # transformers.trainer_pt_utils.LabelSmoother.ignore_index


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(default="facebook/opt-125m")
    padding_side: str = field(default="right", metadata={"help": "The padding side in tokenizer"})


@dataclass
class DataArguments:
    data_path: str = field(default=None, metadata={"help": "Path to the training data."})


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    cache_dir: Optional[str] = field(default=None)
    optim: str = field(default="adamw_torch")
    model_max_length: int = field(default=512, metadata={"help": "Maximum sequence length."})


def preprocess(sources, tokenizer: transformers.PreTrainedTokenizer) -> Dict:
    prompts = [f"USER: {s['instruction']} ASSISTANT:" for s in sources]
    conversations = [f"{p} {s['response']}" for p, s in zip(prompts, sources)]
    input_ids = tokenizer(conversations, return_tensors="pt", padding="max_length",
                          max_length=tokenizer.model_max_length, truncation=True).input_ids
    targets = input_ids.clone()
    for target, prompt in zip(targets, prompts):
        target[: len(tokenizer(prompt).input_ids)] = IGNORE_TOKEN_ID  # train on the assistant's turn only
        target[target == tokenizer.pad_token_id] = IGNORE_TOKEN_ID
    return dict(input_ids=input_ids, labels=targets, attention_mask=input_ids.ne(tokenizer.pad_token_id))


class SupervisedDataset(Dataset):
    def __init__(self, raw_data, tokenizer: transformers.PreTrainedTokenizer):
        super().__init__()
        data_dict = preprocess(raw_data, tokenizer)
        self.input_ids = data_dict["input_ids"]
        self.labels = data_dict["labels"]
        self.attention_mask = data_dict["attention_mask"]

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i) -> Dict[str, torch.Tensor]:
        return dict(input_ids=self.input_ids[i], labels=self.labels[i], attention_mask=self.attention_mask[i])


def make_model(out: str, data_path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = set()
    for line in open(data_path):
        row = json.loads(line)
        words.update(f"USER: {row['instruction']} ASSISTANT: {row['response']}".split())
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *sorted(words)])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>")
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(out)


def train():
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    config = transformers.AutoConfig.from_pretrained(model_args.model_name_or_path, cache_dir=training_args.cache_dir)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config,
                                                              cache_dir=training_args.cache_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, cache_dir=training_args.cache_dir,
        model_max_length=training_args.model_max_length, padding_side=model_args.padding_side, use_fast=True)
    if tokenizer.pad_token != tokenizer.unk_token:
        tokenizer.pad_token = tokenizer.unk_token
    raw_data = [json.loads(line) for line in open(data_args.data_path)]
    trainer = transformers.Trainer(model=model, tokenizer=tokenizer, args=training_args,
                                   train_dataset=SupervisedDataset(raw_data, tokenizer))
    trainer.train()
    print("LOSSES " + json.dumps([h["loss"] for h in trainer.state.log_history if "loss" in h]), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make_model"]:
        make_model(sys.argv[2], sys.argv[3])
    else:
        train()
