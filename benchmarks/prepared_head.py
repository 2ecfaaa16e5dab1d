"""The LM head and loss of a model prepared by accelerate, then instance-patched: a step's peak memory.

A custom accelerate loop calls `accelerator.prepare(model)`; with mixed precision that sets `model.forward` to
accelerate's float32-outputs wrapper around torch's autocast decorator around the class forward. An instance patch
after it (`apply_patch(model=model, unpad="loss")`) reads through those wrappers to the family's forward and fuses
the head with the loss (`hooks/head/lm_head.py`, `innermost`). This benchmark trains the LLaMA of `vocab.py`
(hidden 256, 4 layers, every weight trained) at Llama 3's vocabulary (128256) on vocab.py's right-padded lognormal
batch of 8, prepared with `Accelerator(mixed_precision="bf16", cpu=True)`, and reports per provider the second step's
peak resident set above the set before it (VmHWM, a fresh process per row) and its loss: HF sdpa unpatched,
patchkit with the wrappers left unread (`patchkit_loss_wrapped`: the head and loss on the padded batch, as such a
patch ran before 2026-11-30), and patchkit as it is.

    python benchmarks/prepared_head.py [--vocab 128256] [--csv benchmarks/results/prepared_head.csv]
"""

from __future__ import annotations

import json
from typing import Any

PROVIDERS = ("hf_sdpa", "patchkit_loss_wrapped", "patchkit_loss")


def worker(provider: str, vocab: int, scale: float) -> dict[str, Any]:
    """In a fresh process: the prepared model, two steps; the second's peak above the resident set before it."""
    import vocab as vb
    from accelerate import Accelerator
    from workers import step_peak_mib

    vb.RESCALE["by"] = scale
    dev, dtype = vb.device_and_dtype("cpu")
    model = vb.build_model(dict(vb.MODEL, vocab=vocab), vb.KV_HEADS, "sdpa", dev, dtype).train()
    model = Accelerator(mixed_precision="bf16", cpu=True).prepare(model)
    handle = None
    if provider != "hf_sdpa":
        import patchkit
        from patchkit.hooks.install import forward_source

        if provider == "patchkit_loss_wrapped":  # accelerate's wrappers not looked through: the padded exit
            forward_source._mixed_precision = lambda forward: False
        handle = patchkit.apply_patch(model=model, backend="sdpa", unpad="loss")
    batch = vb.inputs("right", vocab)
    vb.step(model, batch)
    peak, loss = step_peak_mib(lambda: vb.step(model, batch))
    return {"provider": provider, "vocab": vocab, "real_tokens": int(batch["attention_mask"].sum()),
            "peak_mib": round(peak, 1), "loss": round(loss, 4),
            "heads": json.dumps(handle.heads if handle is not None else {})}


def main() -> None:
    from workers import fresh_cli, fresh_rows

    args = fresh_cli(__doc__, worker)
    if args is not None:
        fresh_rows(__file__, ([p, args.vocab, args.scale] for p in PROVIDERS),
                   lambda r: f"{r['provider']}: {r['peak_mib']} MiB, loss {r['loss']}", args.csv)


if __name__ == "__main__":
    main()
