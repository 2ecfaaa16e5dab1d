"""A hooked input embedding (or a script's own) sees the batch as transformers gives it: NEFTune scales its noise by
its output's shape."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from patchkit.forward.inputs.module_hooks import hooks_on, input_embedding, own_module, reads_no_shape
from patchkit.forward.padding import unpad_rows


def reads_shape(embedding: nn.Module) -> bool:
    """Whether a hook on `embedding` may read its input's or output's shape (any hook not known to read none), or
    its forward is a script's own (`own_module`: a soft prompt spliced into each row's first columns)."""
    return not all(reads_no_shape(hook) for hook in hooks_on(embedding)) or own_module(embedding)


def _same(x: Any, tokens: torch.Tensor) -> bool:
    return isinstance(x, torch.Tensor) and x.shape == tokens.shape and x.data_ptr() == tokens.data_ptr()


@contextlib.contextmanager
def embedded_padded(model: nn.Module, padded: Optional[torch.Tensor], packed: Optional[torch.Tensor],
                    indices: Optional[torch.Tensor]) -> Iterator[None]:
    """For the packed forward's duration: where the input embedding has a hook that may read shapes, the embedding
    and its hooks run on the `padded` (B, S) ids instead of the `packed` (1, nnz) row, exactly as unpatched (NEFTune
    draws the same noise, alpha / sqrt(S * H)), and the output is unpadded after every hook, for the layers."""
    embedding = input_embedding(model) if padded is not None and packed is not None else None
    if embedding is None or not reads_shape(embedding):
        yield
        return

    def to_padded(module: nn.Module, args: tuple) -> Optional[tuple]:
        return (padded, *args[1:]) if args and _same(args[0], packed) else None

    def to_packed(module: nn.Module, args: tuple, out: Any) -> Any:
        if args and args[0] is padded and isinstance(out, torch.Tensor):
            return unpad_rows(out, indices).unsqueeze(0)
        return None

    first = embedding.register_forward_pre_hook(to_padded, prepend=True)
    last = embedding.register_forward_hook(to_packed)
    try:
        yield
    finally:
        first.remove()
        last.remove()
