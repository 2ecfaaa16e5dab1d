"""GLM-4.1V: GLM-4's attention (partial rotary, q/k/v bias) in the language model, multimodal RoPE rows.

The language model's `position_ids` are (3, B, S) rows (time, height, width), 4 where the caller packs (the text row
first, which marks the documents), as in Qwen2-VL (`qwen2_vl`); the `glm46v` and `glmga` models hold the same
language model. The vision tower keeps transformers' attention. From transformers 5.16, the first release its
tests ran on here (4.57's text model hands its 3 RoPE rows to the mask builder as positions, which fails there without
a mask; 5.0, 5.3 and 5.10 could not be run here: they do not import beside the installed `kernels` package).
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("glm4v", "glm4v", "Glm4v", "GLM-4.1V language model: partial rotary, bias, multimodal RoPE",
                   attention="TextAttention", base="TextModel", lm="ForConditionalGeneration",
                   transformers=">=5.16,<6")
