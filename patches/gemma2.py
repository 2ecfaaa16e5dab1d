"""Gemma2: `query_pre_attn_scalar` scaling, attention-logit softcapping and alternating sliding windows.

The scale arrives as `scaling`, the cap as `softcap` (flash-attn >= 2.6 on the flash_attn backend), the window
as `sliding_window` on the sliding layers.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("gemma2", "gemma2", "Gemma2", "Gemma2: softcap, query_pre_attn_scalar, alternating window")
