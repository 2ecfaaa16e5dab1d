"""The LM head and loss of a PEFT fine-tune: a step's peak memory by how the head is tuned and where it ran.

A LoRA run leaves the head an nn.Linear (frozen), or trains it whole (`modules_to_save`: PEFT's copy of it), or trains
a few tokens' rows of it (`trainable_token_indices`: a chat template's new tokens, tied to the embeddings' rows where
those are), or puts LoRA on it too (`target_modules` naming it: continued pretraining's recipes). Under
`unpad="loss"` patchkit fuses each with the loss (`hooks/head/fused_head.py`), so no (L, V) logits exist. This
benchmark trains the LLaMA of `vocab.py` (hidden 256, 4 layers, LoRA r 8 on every linear layer) at
Llama 3's vocabulary (128256) on vocab.py's right-padded lognormal batch of 8 (1809 real tokens) and reports per
tuning and provider the second step's peak resident set above the set before it (VmHWM, a fresh process per row) and
its loss (equal across providers): HF sdpa unpatched, patchkit's loss alone with the family's own head on the
labelled rows (`patchkit_loss_unfused`: what trainable tokens, and LoRA on the head, ran before they were fused) and
the fused loss alone.

    python benchmarks/peft_head.py [--vocab 128256] [--tunings ...] [--csv benchmarks/results/peft_head.csv]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PROVIDERS = ("hf_sdpa", "patchkit_loss_unfused", "patchkit_loss")
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # PEFT's "all-linear" here
TUNINGS = {  # name: LoraConfig arguments beside r 8 on every linear layer
    "lora": {},
    "lora + modules_to_save head": {"modules_to_save": ["lm_head"]},
    "lora + trainable tokens": {"trainable_token_indices": {"embed_tokens": [3, 5, 8], "lm_head": [3, 5, 8]}},
    "lora on the head too": {"target_modules": [*LINEAR, "lm_head"]},
}


def worker(tuning: str, provider: str, vocab: int, scale: float) -> dict[str, Any]:
    """In a fresh process: the LoRA model, two steps; the second's peak above the resident set before it."""
    import peft
    import vocab as vb
    from workers import step_peak_mib

    vb.RESCALE["by"] = scale
    dev, dtype = vb.device_and_dtype("cpu")
    model = vb.build_model(dict(vb.MODEL, vocab=vocab), vb.KV_HEADS, "sdpa", dev, dtype).train()
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, **{"target_modules": "all-linear", **TUNINGS[tuning]}))
    handle = None
    if provider != "hf_sdpa":
        import patchkit
        from patchkit.hooks.forwards import lm_forward

        if provider == "patchkit_loss_unfused":  # the family's own head on the labelled rows
            lm_forward.fused_head = lambda lm: None
        handle = patchkit.apply_patch(model=model, backend="sdpa", unpad="loss")
    batch = vb.inputs("right", vocab)
    vb.step(model, batch)
    model.zero_grad(set_to_none=True)
    peak, loss = step_peak_mib(lambda: vb.step(model, batch))
    real = int(batch["attention_mask"].sum())
    return {"tuning": tuning, "provider": provider, "vocab": vocab, "real_tokens": real,
            "peak_mib": round(peak, 1), "loss": round(loss, 5),
            "heads": json.dumps(handle.heads if handle is not None else {})}


def main() -> None:
    from workers import fresh_cli, fresh_rows

    def tunings(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tunings", nargs="+", choices=list(TUNINGS), default=list(TUNINGS))

    args = fresh_cli(__doc__, worker, tunings)
    if args is not None:
        fresh_rows(__file__, ([t, p, args.vocab, args.scale] for t in args.tunings for p in PROVIDERS),
                   lambda r: f"{r['tuning']}, {r['provider']}: {r['peak_mib']} MiB, loss {r['loss']}", args.csv)


if __name__ == "__main__":
    main()
