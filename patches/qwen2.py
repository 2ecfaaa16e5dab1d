"""Qwen2: LLaMA's attention with q/k/v bias (inside its own forward) and per-layer sliding windows (`layer_types`)."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("qwen2", "qwen2", "Qwen2", "Qwen2: q/k/v bias, per-layer sliding window")
