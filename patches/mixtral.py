"""Mixtral: Mistral's attention (a sliding window on every layer) and a sparse mixture of experts per layer.

The experts route each token on its own, so a packed row routes exactly the real tokens; the per-layer router logits
(`output_router_logits`, the load-balancing loss) come back repadded, zeros at padding, which the loss masks out.
"""

from patchkit.hooks.family_route import family_spec

SPEC = family_spec("mixtral", "mixtral", "Mixtral", "Mixtral: sliding window, sparse experts")
