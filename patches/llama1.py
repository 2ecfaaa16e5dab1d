"""LLaMA-1 patch (FastChat's qkvpacked one): q, k, v with one head count, no past; training and prefill only."""

from __future__ import annotations

from torch import nn

from patchkit import eras
from patchkit.gates import GateResult
from patchkit.hooks.attention.varlen import QKV_PACKED
from patchkit.hooks.install.model_walk import model_config
from patchkit.hooks.install.registry import PatchSpec


def check_model(model: nn.Module) -> list[GateResult]:
    """FastChat's qkvpacked contract: as many K/V heads as query heads; a GQA config is refused by name."""
    config = model_config(model, ("llama",))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return [
        GateResult(
            "model_config",
            kv_heads == heads,
            "num_key_value_heads == num_attention_heads (no GQA)",
            f"{heads} query heads, {kv_heads} key/value heads",
            "this model uses grouped-query attention; use apply_patch('llama2'), which supports GQA",
        )
    ]


SPEC = PatchSpec(
    name="llama1",
    description="LLaMA-1 (FastChat's qkvpacked contract): training and prefill, no past, no GQA",
    packing=QKV_PACKED,
    transformers=eras.LLAMA_TRANSFORMERS,
    flash_attn_min="2.0",
    flash_attn_why="the varlen API",
    build_class=eras.class_replacements,
    build_instance=eras.instance_replacements,
    attention_class=eras.attention_class,
    live_layers=eras.live_layers,
    check_model=check_model,
    model_gate="no GQA",
)
