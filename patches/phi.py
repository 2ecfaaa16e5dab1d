"""Phi (Phi-1, 1.5 and 2): partial rotary, optional q/k layer norms, attention and MLP in parallel off one norm."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("phi", "phi", "Phi", "Phi-1/1.5/2: partial rotary, q/k layernorm, parallel block")
