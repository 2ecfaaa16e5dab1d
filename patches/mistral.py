"""Mistral: LLaMA's attention with a sliding window on every layer (`config.sliding_window`).

transformers hands the window to the attention function as `sliding_window`; patchkit runs it as flash-attn's
`window_size=(w - 1, 0)` (flash-attn >= 2.3 on the flash_attn backend), exact across a dynamic KV cache.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("mistral", "mistral", "Mistral", "Mistral: sliding window on every layer")
