"""FastChat-style supervised fine-tuning of a small LLaMA with the HF Trainer, patchkit opted in by `--flash_attn`.

    python examples/train.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none            # unpatched
    python examples/train.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none --flash_attn
    python examples/train_mem.py --output_dir /tmp/run --use_cpu --max_steps 20 --report_to none  # patched launcher
    python examples/train.py ... --packing    # DataCollatorWithFlattening: one row, position_ids restart per example

The model is a tiny random LLaMA built from `LlamaConfig` (or `--model_name_or_path` if it is a local directory).
The data (`examples/data/instructions.jsonl`) ships with the repo, and a byte-level BPE tokenizer is trained on it
at startup (deterministic, no hub). Prompt tokens are masked to -100 in the labels, as in FastChat's train.py;
batches are padded per batch (right padding by default) or packed with `--packing`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    set_seed,
)

import patchkit

DATA = Path(__file__).resolve().parent / "data" / "instructions.jsonl"
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PAD, BOS, EOS = "<pad>", "<s>", "</s>"


@dataclass
class ModelArguments:
    """The model: a local checkpoint directory, or the shape of a tiny random LLaMA."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "A local checkpoint directory (no hub). Default: a tiny random LLaMA."}
    )
    hidden_size: int = field(default=64, metadata={"help": "Random model: hidden size."})
    intermediate_size: int = field(default=128, metadata={"help": "Random model: MLP size."})
    num_hidden_layers: int = field(default=2, metadata={"help": "Random model: decoder layers."})
    num_attention_heads: int = field(default=4, metadata={"help": "Random model: query heads."})
    num_key_value_heads: int = field(default=2, metadata={"help": "Random model: key/value heads (GQA)."})
    initializer_range: float = field(default=0.02, metadata={"help": "Random model: init std (larger: sharper)."})


@dataclass
class DataArguments:
    """The data: the instruction file, the tokenizer trained on it, and how batches are formed."""

    data_path: str = field(default=str(DATA), metadata={"help": "JSON lines with 'instruction' and 'response'."})
    vocab_size: int = field(default=512, metadata={"help": "Byte-level BPE vocabulary trained on the data."})
    model_max_length: int = field(default=128, metadata={"help": "Truncate examples to this many tokens."})
    padding_side: str = field(default="right", metadata={"help": "Batch padding side.", "choices": ["right", "left"]})
    packing: bool = field(
        default=False,
        metadata={"help": "Pack each batch into one row (DataCollatorWithFlattening, position_ids restart), "
                          "no padding. The examples never attend to each other."},
    )


def load_records(path: str) -> list[dict[str, str]]:
    """The instruction/response pairs, one JSON object per line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def train_tokenizer(records: list[dict[str, str]], vocab_size: int, padding_side: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the prompts and responses (deterministic), with <pad>, <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([PROMPT.format(**r) + r["response"] for r in records], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side=padding_side,
    )


def load_tokenizer(model_args: ModelArguments, data_args: DataArguments, records: list[dict[str, str]]) -> Any:
    """The checkpoint's tokenizer if it has one, else a BPE trained on the data; pad token always set."""
    path = model_args.model_name_or_path
    if path and any((Path(path) / name).exists() for name in ("tokenizer.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side=data_args.padding_side)
        if tokenizer.pad_token is None:  # LLaMA tokenizers ship without one (FastChat uses unk)
            tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
        return tokenizer
    return train_tokenizer(records, data_args.vocab_size, data_args.padding_side)


def tokenize(records: list[dict[str, str]], tokenizer: Any, max_length: int) -> list[dict[str, list[int]]]:
    """BOS + prompt + response + EOS; the prompt (and BOS) masked to -100 in the labels, as FastChat does."""
    examples = []
    for r in records:
        prompt = [tokenizer.bos_token_id, *tokenizer(PROMPT.format(**r), add_special_tokens=False)["input_ids"]]
        answer = [*tokenizer(r["response"], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        ids = (prompt + answer)[:max_length]
        labels = ([-100] * len(prompt) + answer)[:max_length]
        examples.append({"input_ids": ids, "labels": labels})
    return examples


class ListDataset(torch.utils.data.Dataset):
    """Tokenized examples in memory."""

    def __init__(self, examples: list[dict[str, list[int]]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


class CountingCollator:
    """Wraps a collator and counts the padding tokens (attention_mask == 0) among all tokens it produced."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.pad_tokens = 0
        self.tokens = 0

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collate(features)
        self.tokens += batch["input_ids"].numel()
        if "attention_mask" in batch:
            self.pad_tokens += int((batch["attention_mask"] == 0).sum())
        return batch

    @property
    def fraction(self) -> float:
        return self.pad_tokens / self.tokens if self.tokens else 0.0


def build_model(model_args: ModelArguments, tokenizer: Any) -> torch.nn.Module:
    """The local checkpoint, or a tiny random LLaMA sized to the tokenizer."""
    path = model_args.model_name_or_path
    if path:
        if not Path(path).is_dir():
            raise SystemExit(f"--model_name_or_path {path!r}: not a local directory (this example never uses the hub)")
        return AutoModelForCausalLM.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=model_args.hidden_size, intermediate_size=model_args.intermediate_size,
        num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=model_args.num_attention_heads,
        num_key_value_heads=model_args.num_key_value_heads, initializer_range=model_args.initializer_range,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Parse arguments, patch if `--flash_attn`, train, save, print the summary; returns it."""
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, patchkit.PatchArguments))
    model_args, data_args, training_args, patch_args = parser.parse_args_into_dataclasses(args=argv)

    # Before the model is built: every LLaMA built afterwards runs through the patch. A launcher (train_mem.py,
    # `python -m patchkit.launch`) may have patched already: its patch is kept, --flash_attn then changes nothing.
    active = patchkit.active_patches()
    handle = active[0] if active else patchkit.apply_from_args(patch_args)
    if active and patch_args.flash_attn:
        print(f"--flash_attn: already patched by the launcher ({handle!r}); keeping that patch")

    records = load_records(data_args.data_path)
    tokenizer = load_tokenizer(model_args, data_args, records)
    dataset = ListDataset(tokenize(records, tokenizer, data_args.model_max_length))
    if data_args.packing:
        collator = CountingCollator(DataCollatorWithFlattening(return_tensors="pt"))
    else:
        collator = CountingCollator(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))

    set_seed(training_args.seed)
    model = build_model(model_args, tokenizer)
    model.config.use_cache = False
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator, processing_class=tokenizer,
    )
    result = trainer.train()
    trainer.save_state()
    trainer.save_model(training_args.output_dir)

    loss = result.training_loss
    summary = {
        "final_train_loss": loss,
        "patched": handle is not None,
        "backend": handle.backend if handle is not None else None,
        "layers_patched": handle.layers_patched if handle is not None else 0,
        "pad_fraction": collator.fraction,
        "packing": data_args.packing,
    }
    prefix = f"[rank {training_args.process_index}] " if training_args.world_size > 1 else ""
    print(f"{prefix}final train loss: {loss:.6f}" + ("" if math.isfinite(loss) else " (NOT FINITE)"))
    if handle is not None:
        print(prefix + handle.report().replace("\n", "\n" + prefix))
    else:
        print(f"{prefix}patchkit: not patched (pass --flash_attn, or run examples/train_mem.py)")
    print(
        f"{prefix}padding tokens seen: {collator.pad_tokens} of {collator.tokens} "
        f"({collator.fraction:.1%}, {'packed' if data_args.packing else data_args.padding_side + ' padding'})"
    )
    if training_args.process_index == 0:
        with open(os.path.join(training_args.output_dir, "patchkit_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
