"""Granite: LLaMA's attention with `attention_multiplier` as the scale (it arrives as `scaling`); the embedding,
residual and logit multipliers live outside attention."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("granite", "granite", "Granite", "Granite: attention_multiplier scaling")
