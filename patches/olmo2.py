"""OLMo2: q_norm / k_norm over the whole projection (inside its own forward) and post-norm decoder layers."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("olmo2", "olmo2", "Olmo2", "OLMo2: q/k norm, post-norm layers")
