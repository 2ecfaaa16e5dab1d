"""LLaMA-2 patch: the varlen kernel with a KV cache (generation on the padded cache) and grouped-query attention."""

from __future__ import annotations

from patchkit import eras
from patchkit.hooks.attention.varlen import KV_PACKED
from patchkit.hooks.install.registry import PatchSpec

SPEC = PatchSpec(
    name="llama2",
    description="LLaMA-2 family: KV cache and generation, GQA/MQA",
    packing=KV_PACKED,
    transformers=eras.LLAMA_TRANSFORMERS,
    flash_attn_min="2.1",
    flash_attn_why="bottom-right causal alignment for the KV cache",
    build_class=eras.class_replacements,
    build_instance=eras.instance_replacements,
    attention_class=eras.attention_class,
    live_layers=eras.live_layers,
    aliases=("llama",),
    outer_heads=eras.outer_head_replacements,
)
