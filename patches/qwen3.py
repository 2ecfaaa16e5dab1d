"""Qwen3: q_norm / k_norm over head_dim before RoPE (inside its own forward), per-layer sliding windows."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen3", "qwen3", "Qwen3", "Qwen3: q/k norm, per-layer sliding window")
