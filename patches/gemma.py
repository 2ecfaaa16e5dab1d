"""Gemma: LLaMA's attention; scaled embeddings and GeGLU live outside attention, so only the classes differ."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("gemma", "gemma", "Gemma", "Gemma: LLaMA attention (scaled embeddings, GeGLU outside it)")
