"""The attention function patchkit's layers call: backend and refusals, then unpad, kernel, repad."""
