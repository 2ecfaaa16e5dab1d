"""Qwen3-MoE: Qwen3's attention (q/k norm, per-layer sliding windows) and sparse experts, routed per token."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen3_moe", "qwen3_moe", "Qwen3Moe", "Qwen3-MoE: q/k norm, sliding window, sparse experts")
