"""GLM-4: partial rotary and extra post-attention / post-MLP norms, all outside the attention function."""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("glm4", "glm4", "Glm4", "GLM-4: partial rotary, extra norms")
