"""Gemma: LLaMA's attention; scaled embeddings and GeGLU live outside attention, so only the classes differ."""

from patchkit.route_patch import family_spec

SPEC = family_spec("gemma", "gemma", "Gemma", "Gemma: LLaMA attention (scaled embeddings, GeGLU outside it)")
