"""The HF Trainer's training step and evaluation under patchkit's default unpad: peak memory at a large vocabulary.

The Trainer's own steps read the loss alone (`patchkit/hooks/forwards/loss_reader.py`): its training step, and its
evaluation where no `compute_metrics` reads the logits. There the causal LM returns its loss alone from the head fused
with the loss, so no (n, V) logits are held. This benchmark trains and evaluates the LLaMA of `vocab.py` (hidden 256,
4 layers, every weight trained, float32), and a Qwen 3.5 of its sizes (three linear-attention layers and a
full-attention one: its base model runs padded, unpadded inside attention alone), at Llama 3's vocabulary (128256) on
vocab.py's right-padded lognormal batch of 8, with the HF Trainer's defaults (AdamW, unpad="model": no option set),
and reports per family and provider, in a fresh process per row, the peak resident set above the set before it of a
second `trainer.evaluate()` and of a second `trainer.train()` of one step (each after a first, so that nothing is
allocated for the first time), and the eval loss: HF sdpa unpatched, patchkit with the Trainer's reading of the loss
alone turned off (`patchkit_logits`: the logits returned, as before the Trainer's reading of the loss alone, and, for
a family whose base model runs padded, until its LM asked for the loss alone as well), and patchkit as it is.

    python benchmarks/trainer_head.py [--vocab 128256] [--family llama] [--csv benchmarks/results/trainer_head.csv]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

PROVIDERS = ("hf_sdpa", "patchkit_logits", "patchkit")
FAMILIES = ("llama", "qwen3_5_text")


def build(family: str, vocab: int) -> Any:
    """The family's model at vocab.py's sizes (hidden 256, 4 layers, 8 heads, 2 KV heads), float32, on the CPU."""
    import torch
    import vocab as vb

    dev, dtype = vb.device_and_dtype("cpu")
    if family == "llama":
        return vb.build_model(dict(vb.MODEL, vocab=vocab), vb.KV_HEADS, "sdpa", dev, dtype)
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    m = vb.MODEL
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=vb.KV_HEADS, head_dim=m["hidden"] // m["heads"],
        layer_types=["linear_attention"] * (m["layers"] - 1) + ["full_attention"], linear_num_key_heads=vb.KV_HEADS,
        linear_num_value_heads=m["heads"] // 2, linear_key_head_dim=32, linear_value_head_dim=32, pad_token_id=0,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def worker(provider: str, vocab: int, scale: float, family: str = "llama") -> dict[str, Any]:
    """In a fresh process: the Trainer on the batch's rows; a second evaluate() and train()'s peaks."""
    import transformers as tf
    import vocab as vb
    from workers import step_peak_mib

    vb.RESCALE["by"] = scale
    model = build(family, vocab).train()
    handle = None
    if provider != "hf_sdpa":
        import patchkit
        from patchkit.hooks.forwards import model_forward

        if provider == "patchkit_logits":  # the Trainer's reading of the loss alone not known: the logits returned
            model_forward.reads_loss_alone = lambda: False
        handle = patchkit.apply_patch(model=model, backend="sdpa")
    batch = vb.inputs("right", vocab)
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(output_dir=out, per_device_train_batch_size=len(rows), max_steps=1,
                                    per_device_eval_batch_size=len(rows), use_cpu=True, report_to=[],
                                    save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
        trainer.evaluate()
        eval_peak, metrics = step_peak_mib(trainer.evaluate)
        trainer.train()
        train_peak, _ = step_peak_mib(trainer.train)
    heads = json.dumps(handle.heads if handle is not None else {})
    if handle is not None:
        handle.revert()
    return {"family": family, "provider": provider, "vocab": vocab, "real_tokens": int(batch["attention_mask"].sum()),
            "eval_peak_mib": round(eval_peak, 1), "train_peak_mib": round(train_peak, 1),
            "eval_loss": round(metrics["eval_loss"], 4), "heads": heads}


def main() -> None:
    from workers import fresh_cli, fresh_rows

    def families(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))

    args = fresh_cli(__doc__, worker, families)
    if args is not None:
        fresh_rows(__file__, ([p, args.vocab, args.scale, f] for f in args.family for p in PROVIDERS),
                   lambda r: f"{r['family']}, {r['provider']}: evaluate {r['eval_peak_mib']} MiB, "
                             f"train {r['train_peak_mib']} MiB, eval loss {r['eval_loss']}", args.csv)


if __name__ == "__main__":
    main()
