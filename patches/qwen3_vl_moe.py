"""Qwen3-VL-MoE: Qwen3-VL's language model (see `qwen3_vl`) with sparse experts in its layers.

A packed forward routes only the real tokens; the router logits come back repadded for the load-balancing loss,
as in the other mixtures of experts. Served from 5.3: before it the outer model's own hooks record the router
logits of the packed forward, unpadded (nnz, experts), and the load-balancing loss fails on their shape.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoe",
                   "Qwen3-VL-MoE language model: q/k norm, multimodal RoPE, deepstack, sparse experts",
                   attention="TextAttention", base="TextModel", lm="ForConditionalGeneration", transformers=">=5.3,<6")
