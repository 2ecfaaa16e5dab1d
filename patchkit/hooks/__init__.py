"""Hooking into transformers: the family route, mask and attention entries, model forwards, stepping aside."""
