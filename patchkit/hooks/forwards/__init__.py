"""The wrappers on transformers' forwards: the base model's unpad-once forward, the LM's head and loss."""
