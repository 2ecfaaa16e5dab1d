"""The wrappers on transformers' forwards: the base model's unpad-once forward, the causal LM's around it."""
