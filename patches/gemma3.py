"""Gemma3 (text): Gemma2's attention plus q/k norms, with a sliding-window pattern over the layers."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("gemma3_text", "gemma3", "Gemma3", "Gemma3 text: q/k norm, sliding pattern",
                   base="TextModel")
