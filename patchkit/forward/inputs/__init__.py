"""What a call hands patchkit, read without deciding: its arguments, per-token inputs, RoPE rows, mask functions."""
