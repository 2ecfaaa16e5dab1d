"""Tiny random models of each family patchkit serves, with the family's special feature biting (no hub, CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from models import VOCAB, tiny_model
from packaging.version import Version

FAMILIES_FROM = "4.53"  # the family patches need transformers' mask interface

ATOL = 3e-5  # two layers of a family's features (windows, softcap, norms) against eager
WINDOW = 5  # shorter than every test batch, so sliding windows change the numbers

WINDOWED = {"mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "starcoder2", "smollm3", "mixtral",
            "qwen2_moe", "qwen3_moe"}  # WINDOW bites
FAMILIES = ["mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "starcoder2", "olmo2",
            "smollm3", "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "phi", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
            "qwen3_vl_moe", "glm4v", "glm4v_moe"]
# sparse experts: router logits, a load-balancing loss
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "glm4v_moe"}
# RoPE rows (time, height, width), text row
MULTIMODAL_ROPE = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe"}
TEXT_PATCH = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}  # multimodal, served by its language model
MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}  # of head_dim 8's 4 rotary frequencies
QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
                 "mrope_section": MROPE["mrope_section"]}
QWEN3_VL_VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
# Qwen3.5: Qwen3-VL's interleaved RoPE rows on a quarter of head_dim 16 in real checkpoints, half here (4 frequencies);
# a Gated DeltaNet layer before a full-attention one, the vision tower without deepstack
QWEN3_5_TEXT = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
QWEN3_5_VISION = {k: v for k, v in QWEN3_VL_VISION.items() if k != "deepstack_visual_indexes"}
GLM4V_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE["mrope_section"]}
GLM4V_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=14,
                    image_size=28, spatial_merge_size=2, temporal_patch_size=2)
ROPE_KEY = "rope_parameters" if Version(tf.__version__) >= Version("5.0") else "rope_scaling"  # its name in 4.x
VL_TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, image_token_id=VOCAB - 3, video_token_id=VOCAB - 2,
                 vision_start_token_id=VOCAB - 1)  # vocab_size at the top too: the loss reads it there before 4.56


def family_model(model_type: str, seed: int = 0, layers: int = 2) -> torch.nn.Module:
    """A 2-layer, hidden-32, GQA model of `model_type` in eval mode, eager attention, fp32."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager", pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    windowed = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # layer 1 slides
    builders = {
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(sliding_window=WINDOW, **common)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(attention_bias=True, **windowed, **common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=8, **windowed, **common)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=8, **common)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
            head_dim=8, attn_logit_softcapping=3.0, sliding_window=WINDOW, query_pre_attn_scalar=6, **common)),
        "gemma3_text": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"][:layers],
            **common)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(sliding_window=WINDOW, partial_rotary_factor=0.5, **common)),
        "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(
            attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0, **common)),
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(sliding_window=WINDOW, **common)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)),
        "smollm3": lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(
            no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common)),
        "glm4": lambda: tf.Glm4ForCausalLM(tf.Glm4Config(partial_rotary_factor=0.5, **common)),
        # 4 experts, 2 per token, the load-balancing loss weighted in (output_router_logits adds it to the loss)
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, **common)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
            router_aux_loss_coef=0.5, **windowed, **common)),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.5,
            **windowed, **common)),
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(partial_rotary_factor=0.5, qk_layernorm=True, **common)),
        # text-only batches: the vision tower (one block) waits unused; multimodal RoPE over 3 rows (1 + 1 + 2 of 4)
        "qwen2_vl": lambda: tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
            text_config=dict(rope_scaling=MROPE, **common),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2),
            attn_implementation="eager", **VL_TOKENS)),
        # its vision tower: windowed attention over 2 x 2 merged patches, full attention in block 0
        "qwen2_5_vl": lambda: tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(
            text_config=dict(rope_scaling=MROPE, **common),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[0]),
            attn_implementation="eager", **VL_TOKENS)),
        # deepstack: the vision tower's block-0 features are added to the image tokens after language layer 0
        "qwen3_vl": lambda: tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config=dict(head_dim=8, **{ROPE_KEY: QWEN3_VL_ROPE}, **common), vision_config=QWEN3_VL_VISION,
            attn_implementation="eager", **VL_TOKENS)),
        "qwen3_vl_moe": lambda: tf.Qwen3VLMoeForConditionalGeneration(tf.Qwen3VLMoeConfig(
            text_config=dict(head_dim=8, **{ROPE_KEY: QWEN3_VL_ROPE}, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, router_aux_loss_coef=0.5, **common),
            vision_config=QWEN3_VL_VISION, attn_implementation="eager", **VL_TOKENS)),
        "qwen3_5": lambda: tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=dict(**{ROPE_KEY: {**QWEN3_VL_ROPE, "partial_rotary_factor": 0.5}}, **QWEN3_5_TEXT, **common),
            vision_config=QWEN3_5_VISION, attn_implementation="eager", **VL_TOKENS)),
        "qwen3_5_moe": lambda: tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(
            text_config=dict(**{ROPE_KEY: {**QWEN3_VL_ROPE, "partial_rotary_factor": 0.5}}, **QWEN3_5_TEXT,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, router_aux_loss_coef=0.5, **common),
            vision_config=QWEN3_5_VISION, attn_implementation="eager", **VL_TOKENS)),
        # GLM-4.1V: GLM-4's partial rotary (half of head_dim 16: 4 frequencies, 1 + 1 + 2 for time, height, width)
        "glm4v": lambda: tf.Glm4vForConditionalGeneration(tf.Glm4vConfig(
            text_config=dict(**{ROPE_KEY: GLM4V_ROPE}, partial_rotary_factor=0.5, attention_bias=True,
                             **{**common, "hidden_size": 64}),
            vision_config=GLM4V_VISION, attn_implementation="eager", image_start_token_id=VOCAB - 1, **VL_TOKENS)),
        # GLM-4.5V: the same with GLM-4.5's experts (sigmoid router, a shared expert, layer 0 dense)
        "glm4v_moe": lambda: tf.Glm4vMoeForConditionalGeneration(tf.Glm4vMoeConfig(
            text_config=dict(**{ROPE_KEY: GLM4V_ROPE}, partial_rotary_factor=0.5, attention_bias=True,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             first_k_dense_replace=1, router_aux_loss_coef=0.5, **{**common, "hidden_size": 64}),
            vision_config=GLM4V_VISION, attn_implementation="eager", image_start_token_id=VOCAB - 1, **VL_TOKENS)),
    }
    if Version(tf.__version__) >= Version(FAMILIES_FROM) and not served_here(model_type):  # before it: refusal tests
        from patchkit.hooks.install.registry import resolve

        pytest.skip(f"patchkit's {model_type} patch serves transformers {resolve(model_type).supported}")
    torch.manual_seed(seed)
    return builders[model_type]().float().eval()


def packed_positions(family: str, positions: torch.Tensor) -> torch.Tensor:
    """The `position_ids` by which a caller packs documents for `family`: positions restarting at 0 (B, S); for the
    Qwen VL families, whose RoPE takes 3 rows (time, height, width), those as the text row in front of them
    (4, B, S), which every one of them packs by (Qwen2-VL's 2D position_ids are RoPE positions alone from 4.57)."""
    if family in MULTIMODAL_ROPE or family in TEXT_PATCH:
        return torch.cat([positions[None], positions[None].expand(3, *positions.shape)])
    return positions


def served_here(patch: str) -> bool:
    """Whether this transformers is in `patch`'s own range (before 4.53 only LLaMA's; Qwen2-MoE's from 5.0, the Qwen
    VL families' from 4.54 or 4.57; Qwen3.5's where transformers has it)."""
    from patchkit.hooks.install.registry import resolve

    try:
        return tf.__version__ in resolve(TEXT_PATCH.get(patch, patch)).supported
    except ValueError:  # a family from data this transformers does not have
        return False


def serves_model_type(model_type: str) -> bool:
    """Whether patchkit serves `model_type` on this transformers (a module's family, or the table's, not refused)."""
    from patchkit.errors import PatchTargetError
    from patchkit.hooks.install.registry import for_model_type

    try:
        for_model_type(model_type)
    except PatchTargetError:
        return False
    return True


def served_tiny(family: str) -> torch.nn.Module:
    """The census's tiny `family` in eval mode; the test skips where this transformers has no patch for it (the
    families served from data start at 5.0)."""
    from census import tiny_lm

    from patchkit.errors import PatchTargetError
    from patchkit.hooks.install.registry import for_model_type

    try:
        for_model_type(family)
    except PatchTargetError as why:
        pytest.skip(f"{family} is not served here: {why}")
    model, why = tiny_lm(family)
    assert model is not None, why
    return model.eval()


def static_cache_served(family: str) -> bool:
    """Whether this transformers' static-cache generation runs patched for `family` (generate()'s masks read back as
    the 2D mask): full-attention caches from 4.56 (cache layers), windowed ones from 4.57 (StaticSlidingWindowLayer)."""
    from transformers import cache_utils

    return hasattr(cache_utils, "StaticSlidingWindowLayer" if family in WINDOWED else "StaticLayer")


def set_attention(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    """`model.set_attn_implementation` (4.54+), else the config field the one attention class reads (4.48+)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(attn)
    else:
        model.config._attn_implementation = attn
    return model


def any_model(family: str, attn: str = "eager") -> torch.nn.Module:
    """LLaMA (2 K/V heads) or `family_model(family)` on `attn` (gemma2 has no sdpa: eager), in eval mode; a family
    this transformers has no patch for skips the test."""
    if family != "llama" and Version(tf.__version__) < Version(FAMILIES_FROM):
        pytest.skip(f"family patches need transformers >= {FAMILIES_FROM}")
    model = tiny_model(kv_heads=2) if family == "llama" else family_model(family)
    return set_attention(model, "eager" if family == "gemma2" else attn)
