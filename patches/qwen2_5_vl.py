"""Qwen2.5-VL: Qwen2-VL's language model (q/k/v bias, multimodal RoPE rows) behind a windowed vision tower.

The language model is Qwen2-VL's, so is its patch: the position rows are unpadded with the batch and documents
come from the text row (see `qwen2_vl`). The vision tower (windowed and full attention over image patches) keeps
transformers' attention.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen2_5_vl", "qwen2_5_vl", "Qwen2_5_VL", "Qwen2.5-VL language model: bias, multimodal RoPE",
                   base="TextModel", lm="ForConditionalGeneration", transformers=">=4.54,<6")
