"""Qwen3-VL-MoE: Qwen3-VL's language model (see `qwen3_vl`) with sparse experts in its layers.

A packed forward routes only the real tokens; the router logits come back repadded for the load-balancing loss,
as in the other mixtures of experts. Before transformers 5.2 the models around the text model (`Model`,
`ForConditionalGeneration`) record the router logits with hooks of their own, unpadded in a packed forward: they
return the repadded ones instead (`records`, `patchkit.hooks.forwards.recorded_router`).
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen3_vl_moe", "qwen3_vl_moe", "Qwen3VLMoe",
                   "Qwen3-VL-MoE language model: q/k norm, multimodal RoPE, deepstack, sparse experts",
                   attention="TextAttention", base="TextModel", lm="ForConditionalGeneration",
                   records=("Model", "ForConditionalGeneration"), transformers=">=4.57,<6")
