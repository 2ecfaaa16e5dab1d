"""The causal-LM loss without a float32 copy of the logits: in row chunks, and fused with the LM head."""
