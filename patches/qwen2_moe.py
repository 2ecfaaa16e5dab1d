"""Qwen2-MoE: Qwen2's attention (q/k/v bias, per-layer sliding windows), sparse experts and a shared expert.

Its attention calls transformers' attention interface only from transformers 5.0 (before, a class per
implementation), so the patch needs 5.0.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen2_moe", "qwen2_moe", "Qwen2Moe", "Qwen2-MoE: bias, sliding window, shared expert",
                   transformers=">=5.0,<6")
