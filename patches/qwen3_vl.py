"""Qwen3-VL: Qwen3's attention (q/k norms) in the language model, interleaved multimodal RoPE, deepstack features.

The language model adds the vision tower's deepstack features to the image tokens' hidden states after its first
layers, at `visual_pos_masks`: a packed forward unpads that (B, S) mask with the batch, so the same tokens in the
same order get them. Its `position_ids` are RoPE rows as in Qwen2-VL (`qwen2_vl`), but 2D ones become the text row
(so they pack). The 3-row case hands the time row on as text positions before transformers 5.3
(`patchkit.forward.inputs.rope_rows.text_positions`).
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen3_vl", "qwen3_vl", "Qwen3VL", "Qwen3-VL language model: q/k norm, multimodal RoPE, deepstack",
                   attention="TextAttention", base="TextModel", lm="ForConditionalGeneration", transformers=">=4.57,<6")
