"""A vision-language training step with images: tokens that see each other both ways, served patched.

Gemma 3's multimodal model builds its language model's masks itself, each image a block its tokens see both ways
(`token_type_ids`); PaliGemma's, its image and prompt prefix one such block (its Gemma is not causal by its config and
attends as that mask says). patchkit reads the blocks off those masks and gives each a non-causal pass of its own
(`patchkit/forward/metadata.py`'s `BlockQueries`, `hooks/attention/attend.attend_blocks`); before 2026-12-04 every
such forward stepped aside to transformers' attention on the padded batch. This times one training step (forward and
backward, the SigLIP tower's included) of each at the families' CPU size (hidden 256, 4 layers; Gemma 3's: 3 sliding
of window 512, 1 full) on the lognormal batch of 8 rows, an image of 64 tokens in each: Gemma 3's at its 9th token,
right-padded, labels -100 at images and padding; PaliGemma's first, left-padded (its processor's), the prompt half
the text, labels on the suffix. HF sdpa and eager on the padded batch, patchkit stepping aside (`patchkit_aside`:
what ran before) and patchkit, providers alternating step by step, medians kept. Real tokens per second (images
included); prints a table and writes a CSV.

    python benchmarks/image_blocks.py [--reps 3] [--scale 1.0] [--models gemma3 paligemma] [--csv ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from pathlib import Path
from typing import Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import alternating_times  # noqa: E402
from providers import add_sweep_args  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import HF_SIZE, lognormal_lengths, padding_fraction  # noqa: E402

IMAGE_TOKENS, IMAGE_AT, IMAGE, BOI, EOI = 64, 8, 1021, 1022, 1023
PROVIDERS = ("hf_sdpa", "hf_eager", "patchkit_aside", "patchkit")
MODELS = ("gemma3", "paligemma")


def build(model: str) -> torch.nn.Module:
    """The VLM: HF_SIZE's language model (Gemma 3's: 3 sliding layers, 1 full), a one-layer SigLIP of 8 x 8 patches."""
    import transformers as tf

    size = {k: v for k, v in HF_SIZE.items() if k != "max_position_embeddings"}
    vision = tf.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=112, patch_size=14)
    torch.manual_seed(0)
    if model == "paligemma":
        text = tf.GemmaConfig(**size, head_dim=32, max_position_embeddings=4096)
        config = tf.PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    projection_dim=size["hidden_size"], image_token_index=IMAGE)
        return tf.PaliGemmaForConditionalGeneration._from_config(config, attn_implementation="eager").train()
    text = tf.Gemma3TextConfig(**size, head_dim=32, sliding_window=512, max_position_embeddings=4096,
                               layer_types=["sliding_attention"] * 3 + ["full_attention"])
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=BOI, eoi_token_index=EOI,
                             image_token_index=IMAGE)
    return tf.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="eager").float().train()


def batch(model: str, lengths: list[int]) -> dict:
    """Rows of `lengths` tokens with an image's tokens each, their pixels, token types and labels. Gemma 3's:
    right-padded, the image from IMAGE_AT (type 1), labels -100 at padding and at the image. PaliGemma's:
    left-padded, the image first and the prompt half the text (type 0), labels on the rest (the suffix, type 1)."""
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask, types = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        real = slice(width - n, width) if model == "paligemma" else slice(0, n)
        ids[row, real] = torch.randint(3, IMAGE - 1, (n,), generator=g)
        mask[row, real] = 1
        if model == "paligemma":
            ids[row, real.start : real.start + IMAGE_TOKENS] = IMAGE
            types[row, real.start + IMAGE_TOKENS + (n - IMAGE_TOKENS) // 2 :] = 1
        else:
            ids[row, IMAGE_AT : IMAGE_AT + IMAGE_TOKENS] = IMAGE
            types[row] = (ids[row] == IMAGE).long()
    unlabelled = (types == 0) if model == "paligemma" else (types == 1)
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types, pixel_values=torch.randn(
        len(lengths), 3, 112, 112, generator=g), labels=ids.masked_fill((mask == 0) | unlabelled, -100))


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


@contextlib.contextmanager
def before(model: str) -> Iterator[None]:
    """The code before 2026-12-04 for `patchkit_aside`: no blocks read (Gemma 3), no non-causal layer served by its
    mask (PaliGemma), so each forward with images steps aside."""
    from patchkit.hooks.decide import model_masks, step_aside

    where, name = (step_aside, "mask_decides") if model == "paligemma" else (model_masks, "block_queries")
    kept = getattr(where, name)
    setattr(where, name, lambda *_: False if model == "paligemma" else None)
    try:
        yield
    finally:
        setattr(where, name, kept)


def measure(model_name: str, lengths: list[int], reps: int) -> list[dict]:
    data = batch(model_name, lengths)
    built = providers(build(model_name))
    times = alternating_times({name: model for name, (model, _) in built.items()}, data, reps,
                              lambda name: before(model_name) if name == "patchkit_aside" else contextlib.nullcontext())
    aside = {name: sum(handle.stepped_aside.values()) for name, (_, handle) in built.items() if handle is not None}
    real_tokens = int(data["attention_mask"].sum())
    base = statistics.median(times["hf_sdpa"])
    rows = []
    for name in PROVIDERS:
        med = statistics.median(times[name])
        rows.append(dict(model=model_name, provider=name, rows=len(lengths), real_tokens=real_tokens,
                         image_tokens=IMAGE_TOKENS, padding=round(padding_fraction(lengths), 3), median_s=round(med, 4),
                         real_tokens_per_s=round(real_tokens / med, 1), vs_hf_sdpa=round(base / med, 2),
                         stepped_aside=aside.get(name, 0), reps=len(times[name])))
        print(f"{model_name:<11}{name:<16}{med:>10.3f}{real_tokens / med:>12.1f}{base / med:>9.2f}x"
              f"{aside.get(name, 0):>8}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/image_blocks.py", description=__doc__.split("\n\n")[0])
    add_sweep_args(parser, reps=3)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args(argv)
    lengths = [max(IMAGE_AT + IMAGE_TOKENS + 8, n) for n in lognormal_lengths(8, args.scale)]
    print(f"rows {lengths}, an image of {IMAGE_TOKENS} tokens each; {args.reps} alternating reps, medians")
    print(f"{'model':<11}{'provider':<16}{'median s':>10}{'real tok/s':>12}{'vs sdpa':>10}{'aside':>8}")
    rows = [row for model in args.models for row in measure(model, lengths, args.reps)]
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
