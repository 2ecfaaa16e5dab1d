"""StarCoder2: q/k/v/o bias and a LayerNorm / GELU MLP around LLaMA-shaped attention, with `sliding_window`."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("starcoder2", "starcoder2", "Starcoder2", "StarCoder2: bias, sliding window")
