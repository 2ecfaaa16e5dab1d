"""Phi-3: fused `qkv_proj` and partial rotary inside its own forward, and `sliding_window` on every layer."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("phi3", "phi3", "Phi3", "Phi-3: fused qkv, partial rotary, sliding window")
