"""Every causal-LM model type of the installed transformers, a tiny random model of each (no hub, CPU, seconds)."""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from models import VOCAB

# Small sizes under every name the configs use; a key is set only where the config has it (or maps it).
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, expert_interval=1, moe_layer_freq=1, decoder_sparse_step=1, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, ffn_hidden_size=64, n_embd=32,
    n_layer=2, n_head=4, ffn_dim=64, word_embed_proj_dim=32, n_positions=256, rotary_dim=4, partial_rotary_factor=0.5,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
    # chunks and NoPE layers that bite at these lengths (Llama 4's chunked attention and temperature; SmolLM3's NoPE)
    attention_chunk_size=8, floor_scale=4, no_rope_layer_interval=2,
    # hybrids and MoE sizes only some configs have: Mamba heads that divide the tiny width, Bamba's attention layer
    # (by index), LongCat's experts, Gemma3n's KV-sharing layers (more than the tiny model has), LFM2-MoE's dense ones
    mamba_n_heads=4, attn_layer_indices=[1], expert_ffn_hidden_size=16, zero_expert_num=2, num_kv_shared_layers=0,
    num_dense_layers=1,
    # logit scales that are not the identity, as checkpoints have them (Granite's 8-16 divides, HyperCLOVA X's
    # multiplies, Falcon-H1's multiplier): the fused head's check must find the family's own arithmetic
    logits_scaling=4.0, lm_head_multiplier=0.5,
)
MAX_PARAMETERS = 3_000_000  # a family whose tiny model is bigger keeps sizes SMALL does not know: not built


def causal_lm_types() -> list[str]:
    """The auto mapping's causal LMs, and the language models it lists under their composite (Mllama's)."""
    from patchkit.patches.table import TEXT_MODELS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted({*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *TEXT_MODELS})


def causal_lm_name(model_type: str) -> Optional[str]:
    """The class name of `model_type`'s causal LM (a language model's own where the mapping lists it under its
    composite: Mllama's text model's MllamaForCausalLM)."""
    from patchkit.patches.table import class_names

    return class_names(model_type)[0]


def base_model_name(model_type: str) -> Optional[str]:
    """The class name of `model_type`'s base model (the language model's own where the mapping lists it under its
    composite: Mllama's MllamaTextModel)."""
    from patchkit.patches.table import class_names

    return class_names(model_type)[1]


def tiny_config(model_type: str):
    """`model_type`'s config at SMALL sizes, no dropout, eager attention, with at least one attention layer."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    present = default.to_dict()  # not hasattr: a per-layer config (Gemma4's) raises for a per-layer attribute
    kw = {k: v for k, v in SMALL.items() if k in present or k in getattr(cls, "attribute_map", {})}
    if "qk_rope_head_dim" in kw:  # multi-head latent attention: head_dim is its rotary size (LongCat's a field)
        kw.pop("head_dim", None)
        if "head_dim" in present:
            kw["head_dim"] = kw["qk_rope_head_dim"]
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # its keys have every head
    for key, value in present.items():  # dropout, router jitter: training steps must be deterministic
        if isinstance(value, float) and any(w in key for w in ("dropout", "pdrop", "jitter")):
            kw[key] = 0.0
    kw.update(OVERRIDES.get(model_type, {}))
    config, kw = first_built(cls, kw, default)
    kinds = layer_kinds(config)
    if kinds and not any(map(attends, kinds)):  # a hybrid's first layers: give it an attention one
        try:
            config = cls(**kw, layer_types=[kinds[0], "full_attention"])
        except Exception:  # layer_types computed from other fields: the defaults' layers, as they are
            pass
    if kinds and not any(map(attends, layer_kinds(config))):  # or as many layers as reach its first attention one
        try:
            config = grown(cls, kw, default)
        except Exception:  # none among the default's layers either: the config as it is
            pass
    return config


def first_built(cls, kw: dict, default) -> tuple:
    """(config, its keywords): `kw`; else grown to its first attention layer (a layer pattern longer than SMALL's
    layers, Zamba2's); else either with the defaults a validator wants over SMALL's larger sizes (ZAYA's one expert
    a token)."""
    present = default.to_dict()
    lower = {k: v for k, v in kw.items() if not (type(v) is int and type(present.get(k)) is int and v > present[k])}
    error = None
    for keywords in (kw, lower):
        for build in (cls, lambda **k: grown(cls, k, default)):
            try:
                return build(**keywords), keywords
            except Exception as exc:
                error = error or exc
    raise error


# A hybrid layer (Zamba's, ZAYA's) runs attention beside its state-space mixer; a layer of any other kind mixes alone.
ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention", "hybrid", "indexed_attention")
# What SMALL and the general rules cannot say, per family (each a transformers default that cannot build tiny)
OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # no default layer_types: the model reads them
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its default's full_attn_idxs name no layer of two conv
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not define; d_model by its own name
    # (the FFN sub-config copies it before hidden_size is mapped onto it)
    "dbrx": dict(d_model=SMALL["hidden_size"], attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    # one attention block shared by every hybrid layer: transformers ties it from the first to the others, two at least
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # Gemma 4's KV sharing (Gemma 3n's): the last layer reuses the first's keys and values, and transformers slices its
    # queries to `logits_to_keep` before it (this pattern keeps TRL's 3-step Adam drift against eager under 1e-3)
    "gemma4_text": dict(num_hidden_layers=3, num_kv_shared_layers=1,
                        layer_types=["full_attention", "sliding_attention", "full_attention"]),
    # Dory's loop (5.25): input, recurrent and output sections of one layer each, the recurrent one run twice, each
    # loop on its own cache layers (its defaults' 8 input and 8 output layers overrun the tiny model's layers)
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2),
    # Cohere Compass's text model (5.25) reads RoPE parameters per layer type, which its default config leaves empty;
    # its M-RoPE sections must fill the tiny heads' 4 frequencies (5.20 pre-rotates them: [22, 22, 20] overruns them)
    "cohere_compass_text": dict(rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0,
                                                        "mrope_section": [2, 1, 1]}
                                                 for kind in ("full_attention", "sliding_attention")},
                                layer_types=["sliding_attention", "full_attention"]),
    # Kolibri-1.1: NVFP4 keys need heads of 16; its indexer's heads share key head 0; its second sparse layer reads the
    # first's keys and values and selects from the first's pool, as its checkpoint's do
    "kolibri1_1": dict(head_dim=16, index_num_heads=2, num_hidden_layers=3,
                       layer_types=["sliding_attention", "indexed_attention", "indexed_attention"]),
    # Qwen4-Exp's text model: its defaults leave QSA's indexer unset, which its attention cannot build without; its
    # per-layer n-gram embeddings (PLE: hashed n-grams of the ids, a convolution over them) on both layers
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=2048,
                           indexer_compress_ratio=16, ple_layer_ids=[1, 2], ple_embed_dim=16, heads_per_ngram=2,
                           ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1),
    # DeepSeek-V4: a sliding, a compressed sparse (CSA: entries of 2 tokens, its indexer keeping 3 a query) and a
    # heavily compressed (HCA: entries of 4) layer, a window of 4, hash-routed and routed experts, as its checkpoints
    # mix them; heads of 16 (a rotary slice of 2), its grouped output projection at the tiny width
    "deepseek_v4": dict(head_dim=16, num_hidden_layers=3, sliding_window=4, index_topk=3, index_n_heads=2,
                        index_head_dim=8, o_groups=2, o_lora_rank=8, mlp_layer_types=["hash_moe", "moe", "moe"],
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}),
    # Gemma 3n's own (E2B: the last 10 of 30 layers), which it brought first
    "gemma3n_text": dict(num_hidden_layers=3, num_kv_shared_layers=1,
                         layer_types=["full_attention", "sliding_attention", "full_attention"]),
}


def attends(kind) -> bool:
    return isinstance(kind, str) and kind.startswith(ATTENTION_KINDS)


def layer_kinds(config) -> list:
    """The kinds of `config`'s layers, by the names configs use (a property some compute from other fields)."""
    for name in ("layer_types", "layers_block_type"):
        try:
            kinds = getattr(config, name, None)
        except Exception:  # a per-layer config (Gemma4's) answers per layer only
            kinds = None
        if isinstance(kinds, (list, tuple)) and kinds:
            return list(kinds)
    return []


def grown(cls, kw: dict, default):
    """`cls` at `kw` with as many layers as the default's layer pattern takes to reach its first attention layer
    (Jamba's fifth, RecurrentGemma's third, Zamba2's seventh), per-layer lists cut to those layers."""
    kinds = layer_kinds(default)
    first = next((i for i, k in enumerate(kinds) if attends(k)), None)
    if first is None:
        raise ValueError("no attention layer among the default config's layers")
    layers = max(first + 1, SMALL["num_hidden_layers"])
    cut = {k: v[:layers] for k, v in default.to_dict().items()
           if k not in kw and isinstance(v, list) and len(v) == len(kinds)}
    return cls(**{**kw, **cut, "num_hidden_layers": layers})


def tiny_lm(model_type: str, seed: int = 0) -> tuple[Optional[torch.nn.Module], str]:
    """(the tiny causal LM of `model_type` in fp32, eager attention, train mode; '') or (None, why not)."""
    import transformers

    try:
        lm = getattr(transformers, causal_lm_name(model_type))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(model_type)
            with torch.device("meta"):
                size = sum(p.numel() for p in lm._from_config(config, attn_implementation="eager").parameters())
            if size > MAX_PARAMETERS:
                return None, f"no tiny model: {size / 1e6:.0f}M parameters at the census's sizes"
            torch.manual_seed(seed)
            model = lm._from_config(config, attn_implementation="eager").float()
    except Exception as exc:  # a config that needs what the census does not set (sub-configs, timm, ...)
        return None, f"no tiny model: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return model.train(), ""


# A multimodal model's other towers (vision, audio, projector) at sizes their configs take: built, not run, on a batch
# of text; a key is set only where the sub-config has it
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             image_size=28, patch_size=14, depth=1, embed_dim=32, out_hidden_size=32, num_heads=2, d_model=32,
             encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_layers=1, width=32, head_dim=16,
             projection_dim=32, vision_output_dim=32)
WRAPPER_PARAMETERS = 20_000_000  # a multimodal model whose towers stay bigger at TOWER's sizes: not built
WRAPPER_MAPPINGS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
                    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


def wrapper_types() -> dict[str, str]:
    """model_type -> class name of every multimodal model with a language model inside (`text_config`) that
    transformers' auto mappings name: image-, video- and audio-text-to-text, and the causal LMs that are one."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = {}
    for mapping in WRAPPER_MAPPINGS:
        for model_type, name in getattr(modeling_auto, mapping, {}).items():
            name = name if isinstance(name, str) else name[0]
            if "ForConditionalGeneration" in name and model_type in CONFIG_MAPPING:
                found.setdefault(model_type, name)
    return {t: n for t, n in sorted(found.items()) if "text_config" in getattr(CONFIG_MAPPING[t], "sub_configs", {})}


def tower(config, fields: Optional[dict] = None):
    """A sub-config (vision, audio, projector) at TOWER's sizes (and `fields`, where it has them), else as it is where
    those do not build."""
    present = config.to_dict()
    try:
        return type(config)(**{**present, **{k: v for k, v in {**TOWER, **(fields or {})}.items() if k in present}})
    except Exception:
        return config


def rope_sections_fit(model, text) -> None:
    """Multimodal RoPE's sections (time, height, width) as `model`'s rotary embeddings read them (the family's default
    where the config has none), rescaled in `text`'s config to the tiny head: they must sum to the number of rotary
    frequencies, which SMALL shrank."""
    for module in model.modules():
        sections, inv_freq = getattr(module, "mrope_section", None), getattr(module, "inv_freq", None)
        if not isinstance(sections, (list, tuple)) or inv_freq is None:
            continue
        half = inv_freq.shape[-1]
        fit = [max(1, round(s * half / sum(sections))) for s in sections]
        fit[-1] = half - sum(fit[:-1])
        text.rope_parameters = {**(text.rope_parameters or {}), "mrope_section": fit}
        return


# Fields a real checkpoint's config has and the config class's defaults lack, which the model reads on any forward
# (Qwen2.5-Omni's and Qwen3-Omni's thinkers find their RoPE rows by the vision-start token)
CHECKPOINT_FIELDS = {"qwen2_5_omni_thinker": {"vision_start_token_id": VOCAB - 1},
                     "qwen3_omni_moe_thinker": {"vision_start_token_id": VOCAB - 1}}

# Tower fields that must follow TOWER's sizes for a family's validators to pass (dots3's adapters into the tiny text
# width; its vision tower's MoE layers, set per layer at full depth, one dense layer here)
TOWER_FIELDS = {"dots3_note": dict(adapter_in_dim=32, adapter_input_size=32, adapter_out_dim=32,
                                   mlp_layer_types=["dense"], per_layer_config=None, downsample_hidden_size=32,
                                   conv_output_size=32 * 16)}

# RoPE fields of a real checkpoint's text config that the defaults lack (HunyuanOCR's four position axes, 16 each)
CHECKPOINT_ROPE = {"hunyuan_vl": {"mrope_section": [1, 1, 1, 1]}}  # the tiny head's 4 frequencies


def tiny_wrapper(model_type: str, seed: int = 0) -> tuple[Optional[torch.nn.Module], str]:
    """(the tiny multimodal model of `model_type`, its language model `tiny_config`'s, its towers at TOWER's sizes,
    fp32, eager attention, train mode; '') or (None, why not)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            default = cls()
            text = tiny_config(default.text_config.model_type)
            kw = {"text_config": text.to_dict()}
            if model_type in CHECKPOINT_ROPE:
                kw["text_config"]["rope_parameters"] = {**(kw["text_config"].get("rope_parameters") or {}),
                                                        **CHECKPOINT_ROPE[model_type]}
            for key in cls.sub_configs:
                part = getattr(default, key, None)
                if key != "text_config" and hasattr(part, "to_dict"):
                    kw[key] = tower(part, TOWER_FIELDS.get(model_type)).to_dict()
            config = cls(**kw)
            for key, value in CHECKPOINT_FIELDS.get(model_type, {}).items():
                setattr(config, key, value)
            lm = getattr(transformers, wrapper_types()[model_type])
            with torch.device("meta"):
                built = lm._from_config(config, attn_implementation="eager")
            size = sum(p.numel() for p in built.parameters())
            rope_sections_fit(built, config.text_config)
            if size > WRAPPER_PARAMETERS:
                return None, f"no tiny model: {size / 1e6:.0f}M parameters at the census's sizes"
            torch.manual_seed(seed)
            model = lm._from_config(config, attn_implementation="eager").float()
    except Exception as exc:  # a sub-config the census cannot shrink (timm towers, validators across sub-configs)
        return None, f"no tiny model: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return model.train(), ""


PACKED = [[7, 9, 8], [11, 13]]  # document lengths of two packed rows


def packed_rows(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of documents packed as TRL's padding-free collator packs them: input_ids and position_ids restarting
    at 0 at each document, no mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 24), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED])
    return ids, positions


@torch.no_grad()
def document_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The packed rows' logits as each document gives them run alone (what flash_attention_2 gives packed rows)."""
    rows = []
    for row, lengths in zip(ids, PACKED):
        starts = torch.tensor([0, *lengths]).cumsum(0)
        rows.append(torch.cat([model(input_ids=row[a:b][None], use_cache=False).logits[0]
                               for a, b in zip(starts[:-1], starts[1:])]))
    return torch.stack(rows)


OWN_HEAD = "unpad='loss' runs its own LM head, not the fused one"  # a served family's note: not fused

PAGE_HEAD = """# Model families

Every causal LM of transformers {version}, built tiny from its config and run through patchkit (`make census`,
`tests/test_census.py`): **{exact} exact** against transformers' own eager attention every way in (class patch,
instance patch, `attn_implementation="patchkit"`: logits, loss and every gradient on a mixed-padded batch, packed
rows (and their logits behind an eval forward's own cache), left-padded greedy generation), {refused} refused by
name with the feature that stops them, {self_checked} stepped aside by their own self-check (their tiny model fails
unpatched too), {untested} without a tiny model the census can build or run. Families with a module of their own
live in `patches/`; every other one is served from data (`patches/table.py`). A family transformers adds later and
patchkit has not seen checks itself on a tiny model before its first forward (`unverified_family`). Under
`unpad="loss"`, {fused} of the exact families run their LM head fused with the loss from their first training step
(their own logits checked there on a few rows); the others are noted. Written by `python tests/census.py --markdown
docs/families.md`; a test keeps it equal to the census.

| model_type | outcome | why / note |
|---|---|---|
"""


def census_rows() -> list[dict]:
    """Run the census (`tests/test_census.py`) in a subprocess: its rows, by model type."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "census.jsonl"
        env = dict(os.environ, PATCHKIT_CENSUS_OUT=str(out))
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", str(Path(__file__).parent / "test_census.py"),
                        "-k", "test_census"], env=env, check=False)
        return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["model_type"])


def short(detail: str) -> str:
    """A refusal's own clause (what stops the family), not the list of every served family around it."""
    import re

    found = re.search(r"this one: (.*?)\. Nothing was patched", detail)
    return (found.group(1) if found else detail).replace("|", "/")


def page(rows: list[dict], version: str) -> str:
    """The families page: the head with its counts, then one table row per model type."""
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("exact", "refused", "untested", "self-checked")}
    counts["fused"] = sum(r["outcome"] == "exact" and OWN_HEAD not in r["detail"] for r in rows)
    body = "".join(f"| `{r['model_type']}` | {r['outcome']} | {short(r['detail'])} |\n" for r in rows)
    return PAGE_HEAD.format(version=version, **{k.replace("-", "_"): v for k, v in counts.items()}) + body


def main() -> None:
    """Run the census and print its table (`--markdown PATH`: write the families page there instead)."""
    import argparse
    from pathlib import Path

    import transformers

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    text = page(census_rows(), transformers.__version__)
    if args.markdown is None:
        print(text)
    else:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
