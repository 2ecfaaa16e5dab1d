"""Llama 3.2 Vision's training step with images: a language model of self-attention and cross-attention layers.

Mllama's cross-attention layers (text to the image tiles) read the padded batch: their masks are the batch's own.
patchkit runs the model on the packed row of real tokens, its self-attention layers varlen, and scatters each
cross-attention layer's input back to the padded batch and gathers its output (`hooks/forwards/padded_layers.py`);
`unpad="attention"` keeps the whole model padded and unpads inside the self-attention layers alone (what patchkit
first served, 2026-12-05). Before that, patchkit refused the model: it ran as HF's. This times one training step
(forward and backward, the vision tower's included) at the families' CPU size (hidden 256; 5 layers, the 4th
cross-attention, 1 in 5 as in the 11B) on the lognormal batch of 8 rows, right-padded as Mllama's processor pads,
one image of 2 tiles of 65 patches each at the 2nd token, labels -100 at the image token and padding. HF sdpa and
eager on the padded batch, patchkit's two modes, providers alternating step by step, medians kept. Real tokens per
second; prints a table and writes a CSV.

    python benchmarks/cross_attention.py [--reps 3] [--scale 1.0] [--csv ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import alternating_times  # noqa: E402
from providers import add_sweep_args  # noqa: E402
from report import write_rows  # noqa: E402
from workloads import HF_SIZE, lognormal_lengths, padding_fraction  # noqa: E402

IMAGE, TILES = 1023, 2
PROVIDERS = ("hf_sdpa", "hf_eager", "patchkit_attention", "patchkit")


def build() -> torch.nn.Module:
    """Mllama at HF_SIZE's text sizes, 5 layers with the 4th cross-attention; a vision tower of 112-pixel tiles."""
    import transformers as tf

    size = {k: v for k, v in HF_SIZE.items() if k not in ("num_hidden_layers", "pad_token_id")}
    text = dict(size, num_hidden_layers=5, cross_attention_layers=[3], pad_token_id=0, bos_token_id=1,
                eos_token_id=2, rope_scaling=None)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
                  num_attention_heads=2, image_size=112, patch_size=14, max_num_tiles=TILES, vision_output_dim=128,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2]])
    torch.manual_seed(0)
    config = tf.MllamaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE)
    return tf.MllamaForConditionalGeneration._from_config(config, attn_implementation="eager").train()


def batch(lengths: list[int]) -> dict:
    """Right-padded rows of `lengths` tokens, <bos> then the image token then text; each token from the image token
    on sees the image's two tiles (the processor's cross-attention mask, through the padding)."""
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    cross = torch.zeros(len(lengths), width, 1, TILES, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, IMAGE, (n,), generator=g)
        ids[row, 0], ids[row, 1] = 1, IMAGE
        mask[row, :n] = 1
        cross[row, 1:] = 1
    return dict(input_ids=ids, attention_mask=mask, cross_attention_mask=cross,
                pixel_values=torch.randn(len(lengths), 1, TILES, 3, 112, 112, generator=g),
                aspect_ratio_ids=torch.full((len(lengths), 1), 2), aspect_ratio_mask=torch.ones(len(lengths), 1, TILES),
                labels=ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == 1), -100))


def providers(reference: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, object]]:
    """Each provider's model and its patch handle (None unpatched)."""
    import patchkit

    out: dict[str, tuple[torch.nn.Module, object]] = {}
    for name in PROVIDERS:
        model = copy.deepcopy(reference)
        if name != "hf_eager":
            model.set_attn_implementation("sdpa")
        unpad = "attention" if name == "patchkit_attention" else "model"
        out[name] = (model, patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad)
                     if name.startswith("patchkit") else None)
    return out


def measure(lengths: list[int], reps: int) -> list[dict]:
    data = batch(lengths)
    built = providers(build())
    times = alternating_times({name: model for name, (model, _) in built.items()}, data, reps)
    real_tokens = int(data["attention_mask"].sum())
    base = statistics.median(times["hf_sdpa"])
    rows = []
    for name in PROVIDERS:
        med = statistics.median(times[name])
        handle = built[name][1]
        aside = sum(handle.stepped_aside.values()) if handle is not None else 0
        rows.append(dict(model="mllama", provider=name, rows=len(lengths), real_tokens=real_tokens,
                         padding=round(padding_fraction(lengths), 3), median_s=round(med, 4),
                         real_tokens_per_s=round(real_tokens / med, 1), vs_hf_sdpa=round(base / med, 2),
                         stepped_aside=aside, reps=len(times[name])))
        print(f"{name:<20}{med:>10.3f}{real_tokens / med:>12.1f}{base / med:>9.2f}x{aside:>8}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/cross_attention.py", description=__doc__.split("\n\n")[0])
    add_sweep_args(parser, reps=3)
    args = parser.parse_args(argv)
    lengths = [max(8, n) for n in lognormal_lengths(8, args.scale)]
    print(f"rows {lengths}, one image of {TILES} tiles each; {args.reps} alternating reps, medians")
    print(f"{'provider':<20}{'median s':>10}{'real tok/s':>12}{'vs sdpa':>10}{'aside':>8}")
    rows = measure(lengths, args.reps)
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
