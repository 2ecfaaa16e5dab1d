"""The causal LM's head and loss on real tokens: the packed row's head, the fused head and loss, who reads the loss."""
