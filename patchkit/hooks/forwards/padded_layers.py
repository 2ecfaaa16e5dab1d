"""Layers that read the padded batch (Mllama's cross-attention decoder layers) run on it inside a packed forward.

A cross-attention layer's keys are each row's image tiles, and its masks are the batch's own: (B, 1, N, tiles) for
attention, (B, 1, N, 1) for the rows that see no tile. On the packed row of real tokens it would read all the
batch's tiles as one row's. So its wrapped forward scatters the packed hidden states back to (B, N), runs the layer
as transformers wrote it, and gathers the real tokens' rows of its output: the numbers the padded batch computes
there (the layer works token by token on its queries). Every other layer stays on the packed row. The padded
layout rides the layer's `attention_mask` (the forward's `VarlenMask`), so a checkpoint's recompute in backward
repads the same way.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from patchkit.forward.masks import VarlenMask
from patchkit.forward.padding import pad_input, unpad_rows
from patchkit.hooks.install.patching import dressed_as


def make_padded_layer_forward(original: Callable) -> Callable:
    """`original` (a decoder layer's forward) run on the padded batch when handed the packed row."""

    def forward(self: nn.Module, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        padded = mask.padded if isinstance(mask, VarlenMask) else None
        if padded is None or padded.indices_q is None or hidden_states.shape[:2] != (1, padded.nnz_q):
            return original(self, hidden_states, *args, **kwargs)  # a padded batch, or the caller's own rows
        full = pad_input(hidden_states[0], padded.indices_q, padded.batch, padded.q_len)
        out = original(self, full, *args, **kwargs)
        if isinstance(out, tuple):  # transformers before 4.54 returns (hidden_states, ...)
            return (unpad_rows(out[0], padded.indices_q).unsqueeze(0), *out[1:])
        return unpad_rows(out, padded.indices_q).unsqueeze(0)

    return dressed_as(forward, original)
