"""Padded and packed training steps per model family: patchkit against HF sdpa, in real tokens per second.

HF's own attention for the baseline is sdpa, or eager for a family HF has no sdpa path for (Gemma2). The Qwen VL
families train on the same lengths with an image at the front of every row (64 image tokens each); their vision
tower runs as in transformers on both sides, and they have no packed row (TRL refuses packing for vision datasets).

The families served from data (GPT-OSS's sinks, DeepSeek-V3's latent attention, GLM-4-MoE) run by their model_type
like any other. Each family runs at the main benchmark's size (hidden 256, 4 layers, 8 heads, 2 K/V heads) on the
same padded batch of 8 lognormal lengths, with its special feature biting (a sliding window of 256 shorter than the
longest rows, Gemma2's softcap). Providers alternate step by step and the median is kept, so load on the machine
hits both alike. Prints a table and writes a CSV.

    python benchmarks/families.py [--families llama mistral qwen3] [--reps 5] [--csv out.csv] [--device cpu|cuda]
        [--budget-s SECONDS]

`--device cuda`: bf16 on the GPU, each family at bench.py's CUDA size (workloads.MODES["cuda"]: hidden 2048, 16
heads of head_dim 128, 2 K/V heads; the head dims a flash-attn build has) on a batch of 16; patchkit on its best
backend whose gates pass (flash_attn_4 where installed, flash_attn, else torch_varlen, else sdpa; the `backend`
column), and HF's flash_attention_2 and flash_attention_4 on the padded batch beside HF sdpa, each where it loads and
runs (bench.py's probe; else a `skipped` row with the reason): HF's best path for a family is the fastest HF row it
has (GPT-OSS: eager, flash_attention_4 with its sinks as `learnable_sink`). CUDA rows add device, dtype, backend, the
step's peak memory above what was allocated before it, vs_hf_fa2, vs_hf_fa4 and a note. `--budget-s` stops starting
families and rounds once spent (a family started keeps at least one timed round); the CSV is rewritten after every
family, so the rows measured are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from providers import (  # noqa: E402
    HF_KERNELS,
    HF_PROVIDERS,
    Budget,
    add_run_args,
    add_sweep_args,
    device_and_dtype,
    no_cuda,
    one_line,
    patch_on_best,
    probed,
    timed,
)
from report import write_rows  # noqa: E402
from workloads import MODES, hf_size, lognormal_lengths, make_tokens, packed_row, padded_batch, padding_fraction  # noqa: E402

TARGET = 1.4  # the padded training step of every family: at least 1.4x HF sdpa
WINDOW = 256
FA2, FA4 = HF_KERNELS  # "hf_flash_attention_2", "hf_flash_attention_4"


# The Qwen VL families: the language model at the size (on the CPU head_dim 32: 16 rotary frequencies in time,
# height, width rows), a 2-block vision tower of hidden 128, images of 16 x 16 patches merged 2 x 2 into 64 tokens.
VL = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
MROPE = [4, 6, 6]  # for head_dim 32; scaled with the head_dim
PATCHES = 16


def vl_tokens(size: dict) -> dict[str, int]:
    """The image, video and vision-start token ids: the vocabulary's last three."""
    vocab = size["vocab_size"]
    return dict(image_token_id=vocab - 3, video_token_id=vocab - 2, vision_start_token_id=vocab - 1)


def vl_config(family: str, size: dict) -> object:
    """The Qwen VL `family`'s config at `size` (the vision tower's heads of the text's head_dim: 32 on the CPU, 128
    on CUDA, the bucket the GPU run's flash-attn build keeps)."""
    import transformers as tf

    head = size["hidden_size"] // size["num_attention_heads"]
    mrope = [n * head // 32 for n in MROPE]
    tokens = vl_tokens(size)
    text = dict(size, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, hidden_size=128, num_heads=128 // head, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    if family == "qwen2_vl":
        return tf.Qwen2VLConfig(text_config=dict(rope_scaling={"type": "mrope", "mrope_section": mrope}, **text),
                                vision_config=dict(vision, hidden_size=size["hidden_size"], embed_dim=128, mlp_ratio=2),
                                **tokens)
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=dict(rope_scaling={"type": "mrope", "mrope_section": mrope}, **text), **tokens,
            vision_config=dict(vision, intermediate_size=256, out_hidden_size=size["hidden_size"], window_size=112,
                               fullatt_block_indexes=[1]))
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True, "mrope_section": mrope}
    vision = dict(vision, patch_size=16, intermediate_size=256, out_hidden_size=size["hidden_size"],
                  deepstack_visual_indexes=[0])
    text = dict(head_dim=head, rope_parameters=rope, **text)
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=size["intermediate_size"] // 2)
    return tf.Qwen3VLMoeConfig(text_config=dict(text, **moe), vision_config=vision, **tokens)


def image_batch(model: torch.nn.Module, docs: list[torch.Tensor]) -> dict:
    """The padded batch of `docs` with an image after each row's first token (vision start, 64 image tokens, the next
    token): the images' random patches and grids, labels -100 at padding and at image tokens."""
    ids, mask, _ = padded_batch(docs)
    tokens = vl_tokens(dict(vocab_size=model.config.get_text_config().vocab_size))
    image = tokens["image_token_id"]
    span = (PATCHES // 2) ** 2
    ids[:, 1], ids[:, 2:2 + span] = tokens["vision_start_token_id"], image
    vision = model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    g = torch.Generator().manual_seed(0)
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill((mask == 0) | (ids == image), -100),
                 pixel_values=torch.randn(len(docs) * PATCHES ** 2, patch, generator=g),
                 image_grid_thw=torch.tensor([[1, PATCHES, PATCHES]]).repeat(len(docs), 1))
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        batch["mm_token_type_ids"] = (ids == image).long()
    return batch


def text_config(family: str, size: dict) -> object:
    """The text `family`'s config at `size`, its special feature biting (window, softcap, chunks, sinks, latents)."""
    import transformers as tf

    head = size["hidden_size"] // size["num_attention_heads"]  # 32 on the CPU, 128 on CUDA
    expert = size["intermediate_size"] // 2
    # multi-head latent attention: q/k head dim rope + nope, 48 on the CPU; on CUDA 128, a head dim flash-attn has
    rope, nope, v = (16, 32, 32) if head == 32 else (head // 2, head // 2, head)
    linear = dict(linear_num_key_heads=size["num_attention_heads"] // 2, linear_num_value_heads=size[
        "num_attention_heads"], linear_key_head_dim=head, linear_value_head_dim=head)  # the hybrids' linear layers
    latent = dict(  # DeepSeek-V3's latent attention and routed MoE
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=expert, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=size["hidden_size"] // 4,
        q_lora_rank=size["hidden_size"] // 2, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v,
        **{**size, "num_key_value_heads": size["num_attention_heads"]})
    configs = {
        "llama": lambda: tf.LlamaConfig(**size),
        "mistral": lambda: tf.MistralConfig(sliding_window=WINDOW, **size),
        "qwen2": lambda: tf.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, **size),
        "qwen3": lambda: tf.Qwen3Config(head_dim=head, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=2, **size),
        "gemma": lambda: tf.GemmaConfig(head_dim=head, **size),
        "gemma2": lambda: tf.Gemma2Config(head_dim=head, sliding_window=WINDOW, **size),
        "gemma3_text": lambda: tf.Gemma3TextConfig(head_dim=head, sliding_window=WINDOW, **size),
        "phi3": lambda: tf.Phi3Config(sliding_window=WINDOW, **size),
        "mixtral": lambda: tf.MixtralConfig(sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2,
                                            **{**size, "intermediate_size": expert}),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(head_dim=head, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=expert, use_sliding_window=True,
                                               sliding_window=WINDOW, max_window_layers=2, **size),
        "phi": lambda: tf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **size),
        # served from data (patches/table.py): attention sinks, multi-head latent attention, a routed MoE
        "gpt_oss": lambda: tf.GptOssConfig(head_dim=head, num_local_experts=8, num_experts_per_tok=2,
                                           sliding_window=WINDOW, **{**size, "intermediate_size": expert}),
        "deepseek_v3": lambda: tf.DeepseekV3Config(**latent),
        # DeepSeek-V3.2's sparse attention: an indexer of half the heads, at twice the rotary size, on every layer;
        # its top-k (2048) keeps every key of these rows, so patchkit serves them and computes no index score
        "deepseek_v32": lambda: tf.DeepseekV32Config(
            index_n_heads=size["num_attention_heads"] // 2, index_head_dim=2 * rope,
            layer_types=["indexed_attention"] * size["num_hidden_layers"], **latent),
        # DeepSeek-V4 (eager-only in transformers): a sliding window of 128 on every layer, compressed entries of 4
        # tokens (CSA, its indexer's top 512 keeping every entry of these rows) and of 128 (HCA), sinks, a routed MoE
        "deepseek_v4": lambda: tf.DeepseekV4Config(
            head_dim=head, q_lora_rank=size["hidden_size"] // 2, o_lora_rank=head, index_n_heads=size[
                "num_attention_heads"] // 2, index_head_dim=head, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=expert, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                       "heavily_compressed_attention", "compressed_sparse_attention"],
            **{k: v for k, v in size.items() if k not in ("intermediate_size", "num_key_value_heads")}),
        "glm4_moe": lambda: tf.Glm4MoeConfig(head_dim=head, n_routed_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=expert, first_k_dense_replace=1, n_group=1,
                                             topk_group=1, **size),
        # served from data, their layers not handed position_ids (GPT-BigCode's multi-query attention, learned
        # positions); Llama 4's chunks (a chunk of 256, shorter than the longest rows) and NoPE layers
        "gpt_bigcode": lambda: tf.GPTBigCodeConfig(
            n_embd=size["hidden_size"], n_layer=size["num_hidden_layers"], n_head=size["num_attention_heads"],
            n_inner=size["intermediate_size"], vocab_size=size["vocab_size"], n_positions=4096, multi_query=True,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),  # no dropout, as every other family here
        "persimmon": lambda: tf.PersimmonConfig(**{k: v for k, v in size.items() if k != "num_key_value_heads"}),
        "llama4_text": lambda: tf.Llama4TextConfig(
            head_dim=head, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=size["intermediate_size"],
            attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0], **{**size, "intermediate_size": expert}),
        # hybrids: three linear-attention layers (the gated delta rule, transformers' torch path on the CPU) and a
        # full-attention one (Qwen3.5's and Qwen3-Next's pattern; Qwen3-Next's MoE), Jamba's Mamba layers around an
        # attention one
        "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(head_dim=head, **linear, **size),
        "qwen3_next": lambda: tf.Qwen3NextConfig(head_dim=head, num_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=expert, shared_expert_intermediate_size=expert,
                                                 decoder_sparse_step=1, **linear, **size),
        # Qwen4-Exp's text model: Qwen3.5's pattern with QSA's indexer on its full-attention layer (blocks of 16 pooled
        # keys, a budget of 2048 that keeps every key of these rows), hyper-connections, a routed MoE
        "qwen4_exp_text": lambda: tf.Qwen4ExpTextConfig(
            head_dim=head, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=expert,
            shared_expert_intermediate_size=expert, indexer_n_heads=size["num_attention_heads"] // 2,
            indexer_kv_heads=1, indexer_head_dim=head, indexer_budget=2048, indexer_compress_ratio=16, **linear,
            **size),
        "jamba": lambda: tf.JambaConfig(attn_layer_period=4, attn_layer_offset=3, expert_layer_period=4,
                                        expert_layer_offset=1, num_experts=1, use_mamba_kernels=False, **size),
        # ZAYA: every layer's attention takes its q/k from a causal convolution and half its values from the token
        # before (its CCA projection), beside a routed MoE
        "zaya": lambda: tf.ZayaConfig(head_dim=head, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=expert,
                                      router_hidden_size=64, **{k: v for k, v in size.items()
                                                                if k != "intermediate_size"}),
    }
    return configs[family]()


def build(family: str, device: torch.device) -> tuple[torch.nn.Module, str]:
    """A random model of `family` at the device's size, in training mode on `device` in its dtype (fp32 on the CPU,
    bf16 on CUDA), and its HF attention: sdpa, else eager (Gemma2)."""
    import transformers as tf

    dtype = device_and_dtype(device.type)[1]
    for implementation in ("sdpa", "eager"):
        torch.manual_seed(0)
        with torch.device(device):  # made where it runs: no host-side init of a GPU-sized model
            try:
                if family in VL:
                    model = tf.AutoModelForImageTextToText.from_config(vl_config(family, hf_size(device.type)),
                                                                       attn_implementation=implementation)
                else:
                    model = tf.AutoModelForCausalLM.from_config(text_config(family, hf_size(device.type)),
                                                                attn_implementation=implementation)
            except ValueError:  # transformers has no sdpa path for this family (Gemma2's softcap)
                continue
        return model.to(dtype).train(), implementation
    raise RuntimeError(f"{family}: no HF attention implementation loads")


def timed_step(model: torch.nn.Module, batch: dict) -> tuple[float, float | None]:
    """Seconds for one forward + backward of the batch (loss over real tokens), and on CUDA its peak memory (MiB)."""
    model.zero_grad(set_to_none=True)
    seconds, peak, _ = timed(lambda: model(**batch).loss.backward(), model.device)
    return seconds, peak


def alternating_times(models: dict[str, torch.nn.Module], batch: dict, reps: int,
                      around: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext(),
                      ) -> dict[str, list[float]]:
    """Each model's step seconds (`timed_step`) over `reps` rounds after one untimed warm-up round, the models
    alternating step by step in their order, each step inside `around(name)`."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(reps + 1):  # the first round warms up
        for name, model in models.items():
            with around(name):
                seconds, _ = timed_step(model, batch)
            if rep:
                times[name].append(seconds)
    return times


def hf_kernel_model(reference: torch.nn.Module, device: torch.device, name: str) -> tuple[torch.nn.Module | None, str]:
    """A copy of `reference` on HF's kernel `name` (hf_flash_attention_2 or _4), or None and why not (on the CPU:
    None, ""): skipped where bench.py's probe found it unusable, or where this family has no path to it."""
    if device.type != "cuda":
        return None, ""
    why = dict(probed(device)[1]).get(name)
    if why:
        return None, why
    model = copy.deepcopy(reference)
    try:
        model.set_attn_implementation(HF_PROVIDERS[name])
    except (ValueError, ImportError) as exc:  # this family has no path to that kernel in transformers
        return None, one_line(exc)
    return model, ""


def measure(family: str, lengths: list[int], reps: int, device: torch.device, budget: Budget) -> list[dict]:
    """Median step time of HF (sdpa, and on CUDA flash_attention_2 and _4) on the padded batch and of patchkit on the
    padded and packed batches; rounds stop early once `budget` is spent (one timed round at least)."""
    if family in VL:  # room for the image in every row (the full-size mix's shortest row, 96, has it)
        lengths = [max(n, (PATCHES // 2) ** 2 + 3) for n in lengths]
    docs = make_tokens(lengths, hf_size(device.type)["vocab_size"] - 3)  # the VL image and vision tokens stay out
    reference, implementation = build(family, device)
    if family in VL:
        padded = image_batch(reference, docs)
    else:
        ids, mask, labels = padded_batch(docs)
        padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
        packed = {k: v.to(device) for k, v in packed_row(docs).items() if k in ("input_ids", "position_ids", "labels")}
    padded = {k: v.to(device) for k, v in padded.items()}
    model = copy.deepcopy(reference)
    hf, fa2_key, fa4_key = f"hf_{implementation} padded", f"{FA2} padded", f"{FA4} padded"
    kernels = {f"{name} padded": hf_kernel_model(reference, device, name) for name in HF_KERNELS}
    steps = {hf: (reference, padded), **{key: (net, padded) for key, (net, _) in kernels.items() if net is not None},
             "patchkit padded": (model, padded), **({} if family in VL else {"patchkit packed": (model, packed)})}
    skipped = {key: why for key, (_, why) in kernels.items() if why}
    times: dict[str, list[float]] = {key: [] for key in steps}
    peaks = dict.fromkeys(steps, 0.0)
    handle, backend, refused = patch_on_best("llama2" if family == "llama" else family, model, device, strict=True)
    try:
        for rep in range(reps + 1):  # the first round warms up
            if rep > 1 and budget.spent(f"{family}: rounds {rep}-{reps} of {reps}"):
                break
            for key, (net, batch) in list(steps.items()):
                try:
                    seconds, peak = timed_step(net, batch)
                except Exception as exc:  # noqa: BLE001 - an HF kernel failing on its first step: a skip
                    if key not in kernels or rep:
                        raise
                    skipped[key] = one_line(exc)
                    del steps[key], times[key]
                    continue
                if rep:
                    times[key].append(seconds)
                    peaks[key] = max(peaks[key], peak or 0.0)
    finally:
        handle.revert()
    real = sum(lengths)
    base = statistics.median(times[hf])
    cuda = device.type == "cuda"
    rows = []
    for key, v in times.items():
        med = statistics.median(v)
        row = dict(family=family, provider=key, median_s=round(med, 4), real_tokens_per_s=round(real / med, 1),
                   vs_hf=round(base / med, 2))
        if cuda:
            row.update(vs_hf_fa2=round(statistics.median(times[fa2_key]) / med, 2) if fa2_key in times else "",
                       vs_hf_fa4=round(statistics.median(times[fa4_key]) / med, 2) if fa4_key in times else "",
                       backend=backend if key.startswith("patchkit") else HF_PROVIDERS[key.split()[0]],
                       peak_mib=round(peaks[key], 1), reps=len(v), device="cuda", dtype="bfloat16",
                       note=f"better backends refused: {refused}" if refused and key.startswith("patchkit") else "")
        rows.append(row)
        print(f"{family:<14}{key:<18}{med:>10.3f}{row['real_tokens_per_s']:>12.1f}{row['vs_hf']:>11.2f}x"
              + (f"{row['vs_hf_fa2'] or '':>10}{row['vs_hf_fa4'] or '':>10}{row['peak_mib']:>10.0f}  "
                 f"{backend if key.startswith('p') else ''}"
                 if cuda else ""), flush=True)
    for key, why in skipped.items():
        rows.append(dict(family=family, provider=key, median_s="", real_tokens_per_s="", vs_hf="", vs_hf_fa2="",
                         vs_hf_fa4="", backend=HF_PROVIDERS[key.split()[0]], peak_mib="", reps=0, device="cuda",
                         dtype="bfloat16", note=f"skipped: {why}"))
        print(f"{family:<14}{key:<18} skipped: {why}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/families.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "mistral", "qwen3"])
    add_sweep_args(parser, reps=5)
    add_run_args(parser)
    args = parser.parse_args(argv)
    if no_cuda("families", args.device):
        return 0
    budget = Budget(args.budget_s)
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    batch = MODES["cuda"]["batch"] if device.type == "cuda" else 8
    lengths = lognormal_lengths(batch, args.scale)
    where = (f"bf16 on {torch.cuda.get_device_name()}" if device.type == "cuda"
             else f"fp32, {torch.get_num_threads()} threads")
    print(f"batch of {batch}, lengths {lengths}, {padding_fraction(lengths):.1%} padding; {where}, torch "
          f"{torch.__version__}; {args.reps} alternating reps, medians")
    print(f"{'family':<14}{'provider':<18}{'median s':>10}{'real tok/s':>12}{'vs HF':>12}"
          + (f"{'vs fa2':>10}{'vs fa4':>10}{'peak MiB':>10}  backend" if device.type == "cuda" else ""))
    rows: list[dict] = []
    failed: dict[str, str] = {}
    try:
        for family in args.families:
            if budget.spent(f"family {family}"):
                continue
            try:
                rows += measure(family, lengths, args.reps, device, budget)
            except Exception as exc:  # noqa: BLE001 - one family failing must not cost the others' rows
                failed[family] = one_line(exc, 300)
                print(f"{family:<14}failed: {failed[family]}", flush=True)
            if args.csv and rows:
                write_rows(args.csv, rows)  # after every family: a budget or a failure keeps what was measured
    finally:
        budget.report("families")
    for row in (r for r in rows if r["provider"] == "patchkit padded"):
        if args.scale != 1.0 or device.type == "cuda":
            run = "the full-size run" if device.type == "cpu" else "the CPU run"
            print(f"{row['family']}: {row['vs_hf']}x HF (target {TARGET}x stated for {run}: not judged)")
            continue
        status = "ok" if row["vs_hf"] >= TARGET else "MISS"
        print(f"target padded step >= {TARGET}x HF (sdpa, or eager where HF has no sdpa): {row['family']}: "
              f"{row['vs_hf']}x {status}")
    if failed:
        print(f"families: {len(failed)} failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
