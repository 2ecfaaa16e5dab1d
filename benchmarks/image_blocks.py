"""A vision-language training step with images: Gemma 3's image tokens see each other both ways, served patched.

Gemma 3's multimodal model builds its language model's masks itself, each image a block its tokens see both ways
(`token_type_ids`). patchkit reads the blocks off those masks and gives each a non-causal pass of its own
(`patchkit/forward/metadata.py`'s `BlockQueries`, `hooks/attention/attend.attend_blocks`); before 2026-12-04 every
forward with an image stepped aside to transformers' attention on the padded batch. This times one training step
(forward and backward, the SigLIP tower's included) of a Gemma 3 VLM at the families' CPU size (hidden 256, 4 layers:
3 sliding of window 512, 1 full) on the lognormal batch of 8 rows, an image of 64 tokens in each at its 9th token,
right-padded, labels -100 at images and padding: HF sdpa and eager on the padded batch, patchkit stepping aside
(`patchkit_aside`: what ran before) and patchkit with the image blocks, providers alternating step by step, medians
kept. Real tokens per second (images included); prints a table and writes a CSV.

    python benchmarks/image_blocks.py [--reps 3] [--scale 1.0] [--csv benchmarks/results/image_blocks.csv]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import timed_step  # noqa: E402
from providers import add_sweep_args  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import HF_SIZE, lognormal_lengths, padding_fraction  # noqa: E402

IMAGE_TOKENS, IMAGE_AT, IMAGE, BOI, EOI = 64, 8, 1021, 1022, 1023
PROVIDERS = ("hf_sdpa", "hf_eager", "patchkit_aside", "patchkit")


def build() -> torch.nn.Module:
    """The Gemma 3 VLM: HF_SIZE's language model (3 sliding layers, 1 full), a one-layer SigLIP of 8 x 8 patches."""
    import transformers as tf

    size = {k: v for k, v in HF_SIZE.items() if k != "max_position_embeddings"}
    text = tf.Gemma3TextConfig(**size, head_dim=32, sliding_window=512, max_position_embeddings=4096,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=112, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
                             image_token_index=IMAGE)
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").float().train()


def batch(lengths: list[int]) -> dict:
    """Right-padded rows of `lengths` tokens, an image's tokens in each from IMAGE_AT; its pixels, token types and
    labels (-100 at padding and at the image)."""
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, IMAGE - 1, (n,), generator=g)
        ids[row, IMAGE_AT : IMAGE_AT + IMAGE_TOKENS] = IMAGE
        mask[row, :n] = 1
    types = (ids == IMAGE).long()
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, pixel_values=torch.randn(
        len(lengths), 3, 112, 112, generator=g), labels=ids.masked_fill((mask == 0) | (types == 1), -100))


def providers(reference: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, object]]:
    """Each provider's model and its patch handle (None unpatched)."""
    import patchkit

    out: dict[str, tuple[torch.nn.Module, object]] = {}
    for name in PROVIDERS:
        model = copy.deepcopy(reference)
        if name == "hf_sdpa":
            model.set_attn_implementation("sdpa")
        out[name] = (model, patchkit.apply_patch(model=model, backend="sdpa") if name.startswith("patchkit") else None)
    return out


def no_blocks(*_: object) -> None:
    """`block_queries` for `patchkit_aside`: no blocks read, so a forward with images steps aside, as before."""
    return None


def measure(lengths: list[int], reps: int) -> list[dict]:
    from patchkit.hooks.decide import model_masks

    data = batch(lengths)
    built = providers(build())
    times: dict[str, list[float]] = {name: [] for name in PROVIDERS}
    aside: dict[str, dict] = {}
    blocks = model_masks.block_queries
    for rep in range(reps + 1):  # the first round warms up
        for name in PROVIDERS:
            model, handle = built[name]
            model_masks.block_queries = no_blocks if name == "patchkit_aside" else blocks
            try:
                seconds, _ = timed_step(model, data)
            finally:
                model_masks.block_queries = blocks
            if rep:
                times[name].append(seconds)
            if handle is not None:
                aside[name] = dict(handle.stepped_aside)
    real_tokens = int(data["attention_mask"].sum())
    base = statistics.median(times["hf_sdpa"])
    rows = []
    for name in PROVIDERS:
        med = statistics.median(times[name])
        rows.append(dict(provider=name, rows=len(lengths), real_tokens=real_tokens, image_tokens=IMAGE_TOKENS,
                         padding=round(padding_fraction(lengths), 3), median_s=round(med, 4),
                         real_tokens_per_s=round(real_tokens / med, 1), vs_hf_sdpa=round(base / med, 2),
                         stepped_aside=sum(aside.get(name, {}).values()), reps=len(times[name])))
        print(f"{name:<16}{med:>10.3f}{real_tokens / med:>12.1f}{base / med:>9.2f}x"
              f"{sum(aside.get(name, {}).values()):>8}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/image_blocks.py", description=__doc__.split("\n\n")[0])
    add_sweep_args(parser, reps=3)
    args = parser.parse_args(argv)
    lengths = [max(IMAGE_AT + IMAGE_TOKENS + 8, n) for n in lognormal_lengths(8, args.scale)]
    print(f"Gemma 3 VLM, rows {lengths}, an image of {IMAGE_TOKENS} tokens each; {args.reps} alternating reps, medians")
    print(f"{'provider':<16}{'median s':>10}{'real tok/s':>12}{'vs sdpa':>10}{'aside':>8}")
    rows = measure(lengths, args.reps)
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
