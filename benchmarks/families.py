"""Padded and packed training steps per model family: patchkit against HF sdpa, in real tokens per second.

HF's own attention for the baseline is sdpa, or eager for a family HF has no sdpa path for (Gemma2). The Qwen VL
families train on the same lengths with an image at the front of every row (64 image tokens each); their vision
tower runs as in transformers on both sides, and they have no packed row (TRL refuses packing for vision datasets).

The families served from data (GPT-OSS's sinks, DeepSeek-V3's latent attention, GLM-4-MoE) run by their model_type
like any other. Each family runs at the main benchmark's size (hidden 256, 4 layers, 8 heads, 2 K/V heads) on the
same padded batch of 8 lognormal lengths, with its special feature biting (a sliding window of 256 shorter than the
longest rows, Gemma2's softcap). Providers alternate step by step and the median is kept, so load on the machine
hits both alike. Prints a table and writes a CSV.

    python benchmarks/families.py [--families llama mistral qwen3] [--reps 5] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_rows  # noqa: E402
from workloads import lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402

import patchkit  # noqa: E402

TARGET = 1.4  # the padded training step of every family: at least 1.4x HF sdpa
WINDOW = 256
SIZE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)


# The Qwen VL families: the language model at SIZE (head_dim 32: 16 rotary frequencies in time, height, width rows),
# a 2-block vision tower of hidden 128, images of 16 x 16 patches merged 2 x 2 into 64 tokens.
VL = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
MROPE = [4, 6, 6]
VL_TOKENS = dict(image_token_id=SIZE["vocab_size"] - 3, video_token_id=SIZE["vocab_size"] - 2,
                 vision_start_token_id=SIZE["vocab_size"] - 1)
PATCHES = 16


def vl_config(family: str) -> object:
    """The Qwen VL `family`'s config at the benchmark size."""
    import transformers as tf

    size = dict(SIZE, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, hidden_size=128, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        return tf.Qwen2VLConfig(text_config=dict(rope_scaling={"type": "mrope", "mrope_section": MROPE}, **size),
                                vision_config=dict(vision, hidden_size=SIZE["hidden_size"], embed_dim=128, mlp_ratio=2),
                                **VL_TOKENS)
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=dict(rope_scaling={"type": "mrope", "mrope_section": MROPE}, **size), **VL_TOKENS,
            vision_config=dict(vision, intermediate_size=256, out_hidden_size=SIZE["hidden_size"], window_size=112,
                               fullatt_block_indexes=[1]))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True, "mrope_section": MROPE}
    vision = dict(vision, patch_size=16, intermediate_size=256, out_hidden_size=SIZE["hidden_size"],
                  deepstack_visual_indexes=[0])
    text = dict(head_dim=32, rope_parameters=rope, **size)
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **VL_TOKENS)
    return tf.Qwen3VLMoeConfig(text_config=dict(text, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
                               vision_config=vision, **VL_TOKENS)


def image_batch(model: torch.nn.Module, docs: list[torch.Tensor]) -> dict:
    """The padded batch of `docs` with an image after each row's first token (vision start, 64 image tokens, the next
    token): the images' random patches and grids, labels -100 at padding and at image tokens."""
    ids, mask, _ = padded_batch(docs)
    image = VL_TOKENS["image_token_id"]
    span = (PATCHES // 2) ** 2
    ids[:, 1], ids[:, 2:2 + span] = VL_TOKENS["vision_start_token_id"], image
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    g = torch.Generator().manual_seed(0)
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill((mask == 0) | (ids == image), -100),
                 pixel_values=torch.randn(len(docs) * PATCHES ** 2, patch, generator=g),
                 image_grid_thw=torch.tensor([[1, PATCHES, PATCHES]]).repeat(len(docs), 1))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        batch["mm_token_type_ids"] = (ids == image).long()
    return batch


def build(family: str) -> tuple[torch.nn.Module, str]:
    """A random model of `family` at the benchmark size, fp32, and its HF attention: sdpa, else eager (Gemma2)."""
    import transformers as tf

    if family in VL:
        torch.manual_seed(0)
        model = tf.AutoModelForImageTextToText.from_config(vl_config(family), attn_implementation="sdpa")
        return model.float().train(), "sdpa"

    configs = {
        "llama": lambda: tf.LlamaConfig(**SIZE),
        "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **SIZE),
        "qwen2": lambda: tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **SIZE),
        "qwen3": lambda: tf.Qwen3Config(head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=2, **SIZE),
        "gemma": lambda: tf.GemmaConfig(head_dim=32, **SIZE),
        "gemma2": lambda: tf.Gemma2Config(head_dim=32, sliding_window=WINDOW, **SIZE),
        "gemma3_text": lambda: tf.Gemma3TextConfig(head_dim=32, sliding_window=WINDOW, **SIZE),
        "phi3": lambda: tf.Phi3Config(sliding_window=WINDOW, **SIZE),
        "mixtral": lambda: tf.MixtralConfig(sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
                                            **{**SIZE, "intermediate_size": 256}),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(head_dim=32, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=256, use_sliding_window=True,
                                               sliding_window=WINDOW, max_window_layers=2, **SIZE),
        "phi": lambda: tf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **SIZE),
        # served from data (patches/table.py): attention sinks, multi-head latent attention, a routed MoE
        "gpt_oss": lambda: tf.GptOssConfig(head_dim=32, num_local_experts=8, num_experts_per_tok=2,
                                           sliding_window=WINDOW, **{**SIZE, "intermediate_size": 256}),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, **{**SIZE, "num_key_value_heads": SIZE["num_attention_heads"]}),
        "glm4_moe": lambda: tf.Glm4MoeConfig(head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=256, first_k_dense_replace=1, n_group=1,
                                             topk_group=1, **SIZE),
        # served from data, their layers not handed position_ids (GPT-BigCode's multi-query attention, learned
        # positions); Llama 4's chunks (a chunk of 256, shorter than the longest rows) and NoPE layers
        "gpt_bigcode": lambda: tf.GPTBigCodeConfig(n_embd=256, n_layer=4, n_head=8, n_inner=512, vocab_size=1024,
                                                   n_positions=4096, multi_query=True),
        "persimmon": lambda: tf.PersimmonConfig(**{k: v for k, v in SIZE.items() if k != "num_key_value_heads"}),
        "llama4_text": lambda: tf.Llama4TextConfig(
            head_dim=32, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=512,
            attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0], **{**SIZE, "intermediate_size": 256}),
    }
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            model = tf.AutoModelForCausalLM.from_config(configs[family](), attn_implementation=implementation)
        except ValueError:  # transformers has no sdpa path for this family (Gemma2's softcap)
            continue
        return model.float().train(), implementation
    raise RuntimeError(f"{family}: no HF attention implementation loads")


def timed_step(model: torch.nn.Module, batch: dict) -> float:
    """Seconds for one forward + backward of the batch (loss over real tokens)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


def measure(family: str, lengths: list[int], reps: int) -> list[dict]:
    """Median step time of HF sdpa on the padded batch and of patchkit on the padded and packed batches."""
    if family in VL:  # room for the image in every row (the full-size mix's shortest row, 96, has it)
        lengths = [max(n, (PATCHES // 2) ** 2 + 3) for n in lengths]
    docs = make_tokens(lengths, SIZE["vocab_size"] - 3)  # the VL families' image and vision tokens stay out
    reference, implementation = build(family)
    if family in VL:
        padded = image_batch(reference, docs)
    else:
        ids, mask, labels = padded_batch(docs)
        padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
        packed = {k: v for k, v in packed_row(docs).items() if k in ("input_ids", "position_ids", "labels")}
    model = copy.deepcopy(reference)
    patch = "llama2" if family == "llama" else family
    hf = f"hf_{implementation} padded"
    times: dict[str, list[float]] = {hf: [], "patchkit padded": []} if family in VL else \
        {hf: [], "patchkit padded": [], "patchkit packed": []}
    handle = patchkit.apply_patch(patch, model=model, backend="sdpa", strict=True)
    try:
        for rep in range(reps + 1):  # the first round warms up
            got = {
                hf: timed_step(reference, padded),
                "patchkit padded": timed_step(model, padded),
            }
            if family not in VL:
                got["patchkit packed"] = timed_step(model, packed)
            if rep:
                for key, value in got.items():
                    times[key].append(value)
    finally:
        handle.revert()
    real = sum(lengths)
    base = statistics.median(times[hf])
    rows = [
        dict(family=family, provider=key, median_s=round(statistics.median(v), 4),
             real_tokens_per_s=round(real / statistics.median(v), 1), vs_hf=round(base / statistics.median(v), 2))
        for key, v in times.items()
    ]
    for row in rows:
        print(f"{row['family']:<14}{row['provider']:<18}{row['median_s']:>10.3f}{row['real_tokens_per_s']:>12.1f}"
              f"{row['vs_hf']:>11.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/families.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "mistral", "qwen3"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the sequence lengths (0.25 for a smoke run)")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    lengths = lognormal_lengths(8, args.scale)
    print(f"batch of 8, lengths {lengths}, {padding_fraction(lengths):.1%} padding; fp32, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {args.reps} alternating reps, medians")
    print(f"{'family':<14}{'provider':<18}{'median s':>10}{'real tok/s':>12}{'vs HF':>12}")
    rows = [row for family in args.families for row in measure(family, lengths, args.reps)]
    for row in (r for r in rows if r["provider"] == "patchkit padded"):
        if args.scale != 1.0:
            print(f"{row['family']}: {row['vs_hf']}x HF (target {TARGET}x stated for the full-size run: not judged)")
            continue
        status = "ok" if row["vs_hf"] >= TARGET else "MISS"
        print(f"target padded step >= {TARGET}x HF (sdpa, or eager where HF has no sdpa): {row['family']}: "
              f"{row['vs_hf']}x {status}")
    if args.csv:
        write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
