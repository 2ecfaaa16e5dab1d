"""GLM-4.5V: GLM-4.1V's language model (`glm4v`: partial rotary, multimodal RoPE rows) with GLM-4.5's sparse experts.

A packed forward routes only the real tokens (sigmoid router, shared experts, the first layers dense); the router
logits come back repadded for the load-balancing loss, as in the other mixtures of experts. The vision tower keeps
transformers' attention. From transformers 5.16, as `glm4v`.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("glm4v_moe", "glm4v_moe", "Glm4vMoe",
                   "GLM-4.5V language model: partial rotary, multimodal RoPE, sparse experts",
                   attention="TextAttention", base="TextModel", lm="ForConditionalGeneration",
                   transformers=">=5.16,<6")
