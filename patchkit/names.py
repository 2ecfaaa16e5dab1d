"""The names patchkit's options accept (patches, backends, unpad modes), importable without torch or transformers."""

from __future__ import annotations

GROUP_NAME = "all"  # the patch name that means "every family" (config, launcher, PATCHKIT_PATCH)
BACKEND_NAMES = ("auto", "flash_attn", "flash_attn_4", "torch_varlen", "sdpa")
UNPAD_MODES = ("model", "attention", "loss")  # once per model forward (default), in each attention layer, or through
# the loss: as "model", and a training forward with labels returns its loss alone (no (B, N, V) logits)
WHOLE_MODEL = ("model", "loss")  # the unpad modes that unpad once per model forward
UNPAD_MEANING = {  # what each mode does, in the report's words
    "model": "once per model forward; the decoder runs on real tokens only",
    "attention": "in each attention layer; hidden states keep their padded shape",
    "loss": "once per model forward, as 'model'; a training forward with labels returns its loss alone (logits=None)",
}


# name -> module holding its SPEC; modules are imported on first use.
PATCH_MODULES = {
    "llama1": "patchkit.patches.llama1",
    "llama2": "patchkit.patches.llama2",
    "mistral": "patchkit.patches.mistral",
    "qwen2": "patchkit.patches.qwen2",
    "qwen3": "patchkit.patches.qwen3",
    "gemma": "patchkit.patches.gemma",
    "gemma2": "patchkit.patches.gemma2",
    "gemma3_text": "patchkit.patches.gemma3",
    "phi3": "patchkit.patches.phi3",
    "granite": "patchkit.patches.granite",
    "starcoder2": "patchkit.patches.starcoder2",
    "olmo2": "patchkit.patches.olmo2",
    "smollm3": "patchkit.patches.smollm3",
    "glm4": "patchkit.patches.glm4",
    "mixtral": "patchkit.patches.mixtral",
    "qwen2_moe": "patchkit.patches.qwen2_moe",
    "qwen3_moe": "patchkit.patches.qwen3_moe",
    "phi": "patchkit.patches.phi",
    "qwen2_vl": "patchkit.patches.qwen2_vl",
    "qwen2_5_vl": "patchkit.patches.qwen2_5_vl",
    "qwen3_vl": "patchkit.patches.qwen3_vl",
    "qwen3_vl_moe": "patchkit.patches.qwen3_vl_moe",
    "glm4v": "patchkit.patches.glm4v",
    "glm4v_moe": "patchkit.patches.glm4v_moe",
}
ALIASES = {"llama": "llama2"}


def patch_names() -> list[str]:
    """Every accepted patch name: "all" (every family, the default), registered names, then aliases."""
    return [GROUP_NAME, *sorted(PATCH_MODULES), *sorted(ALIASES)]
