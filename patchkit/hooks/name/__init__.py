"""attn_implementation='patchkit': the registered attention and mask functions, and a model's adoption."""
