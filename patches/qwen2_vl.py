"""Qwen2-VL: Qwen2's attention in the language model, multimodal RoPE (3 position rows: time, height, width).

The vision tower keeps transformers' attention (bidirectional over each image's patches). The language model's
`position_ids` are (3, B, S) rows (4 where the caller packs, from transformers 4.54: text positions first, which
mark the documents); patchkit unpads every row and finds documents only where transformers does (the text row).
Before 4.57 the 3-row case hands the time row on as text positions (`patchkit.forward.inputs.rope_rows.text_positions`).
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen2_vl", "qwen2_vl", "Qwen2VL", "Qwen2-VL language model: bias, multimodal RoPE",
                   base="TextModel", lm="ForConditionalGeneration", transformers=">=4.54,<6")
