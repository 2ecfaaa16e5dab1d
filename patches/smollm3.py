"""SmolLM3: layers without RoPE (NoPE) every few layers, chosen inside its own forward, and per-layer windows."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("smollm3", "smollm3", "SmolLM3", "SmolLM3: NoPE layers, per-layer sliding window")
