"""The HF Trainer's and a custom loop's step and evaluation under patchkit's default unpad: peaks at a large vocabulary.

The Trainer's own steps read the loss alone (`patchkit/hooks/head/loss_reader.py`): its training step, and its
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
`--loop custom` runs the same steps as a training loop of the user's own instead (AdamW; `outputs = model(**batch)`,
then `outputs.loss` alone, as accelerate's examples write it; the evaluation `model(**batch).loss` under no_grad),
whose code patchkit reads (`hooks/head/caller_code.py`).

    python benchmarks/trainer_head.py [--vocab 128256] [--family llama] [--loop trainer custom]
        [--csv benchmarks/results/trainer_head.csv]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

PROVIDERS = ("hf_sdpa", "patchkit_logits", "patchkit")
FAMILIES = ("llama", "qwen3_5_text")
LOOPS = ("trainer", "custom")


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


def trainer_steps(model: Any, rows: list[dict]) -> tuple[float, float, float]:
    """The HF Trainer on the rows, one batch: a second evaluate()'s peak and eval loss, a second train()'s peak."""
    import transformers as tf
    from workers import step_peak_mib

    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(output_dir=out, per_device_train_batch_size=len(rows), max_steps=1,
                                    per_device_eval_batch_size=len(rows), use_cpu=True, report_to=[],
                                    save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
        trainer.evaluate()
        eval_peak, metrics = step_peak_mib(trainer.evaluate)
        trainer.train()
        train_peak, _ = step_peak_mib(trainer.train)
    return eval_peak, metrics["eval_loss"], train_peak


def custom_steps(model: Any, batch: dict) -> tuple[float, float, float]:
    """A loop of the user's own on the batch, AdamW as the Trainer's: the same peaks and eval loss."""
    import torch
    from workers import step_peak_mib

    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

    def train_step() -> None:
        model.train()
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            return model(**batch).loss.item()

    evaluate()
    eval_peak, eval_loss = step_peak_mib(evaluate)
    train_step()
    train_peak, _ = step_peak_mib(train_step)
    return eval_peak, eval_loss, train_peak


def worker(provider: str, vocab: int, scale: float, family: str = "llama", loop: str = "trainer") -> dict[str, Any]:
    """In a fresh process: the Trainer's (or the custom loop's) second evaluation and training step's peaks."""
    import vocab as vb

    vb.RESCALE["by"] = scale
    model = build(family, vocab).train()
    handle = None
    if provider != "hf_sdpa":
        import patchkit
        from patchkit.hooks.forwards import lm_forward

        if provider == "patchkit_logits":  # the caller's reading of the loss alone not known: the logits returned
            lm_forward.reads_loss_alone = lambda: False
        handle = patchkit.apply_patch(model=model, backend="sdpa")
    batch = vb.inputs("right", vocab)
    if loop == "trainer":
        eval_peak, eval_loss, train_peak = trainer_steps(model, [dict(zip(batch, v)) for v in zip(*batch.values())])
    else:
        eval_peak, eval_loss, train_peak = custom_steps(model, batch)
    heads = json.dumps(handle.heads if handle is not None else {})
    if handle is not None:
        handle.revert()
    return {"family": family, "loop": loop, "provider": provider, "vocab": vocab,
            "real_tokens": int(batch["attention_mask"].sum()), "eval_peak_mib": round(eval_peak, 1),
            "train_peak_mib": round(train_peak, 1), "eval_loss": round(eval_loss, 4), "heads": heads}


def main() -> None:
    from workers import fresh_cli, fresh_rows

    def choices(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
        parser.add_argument("--loop", nargs="+", choices=LOOPS, default=list(LOOPS))

    args = fresh_cli(__doc__, worker, choices)
    if args is not None:
        fresh_rows(__file__, ([p, args.vocab, args.scale, f, loop] for loop in args.loop for f in args.family
                              for p in PROVIDERS),
                   lambda r: f"{r['loop']}, {r['family']}, {r['provider']}: evaluate {r['eval_peak_mib']} MiB, "
                             f"train {r['train_peak_mib']} MiB, eval loss {r['eval_loss']}", args.csv)


if __name__ == "__main__":
    main()
