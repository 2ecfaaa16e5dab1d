"""Token mixers outside attention (linear attention, convolutions) on the packed row: each padded row alone, as padded.

A hybrid family's linear-attention layers (Qwen3.5's and Qwen3-Next's gated delta rule with its causal convolution)
carry a state along the sequence, so one packed row would carry each row's state into the next. transformers hands
them the padded batch's 2D mask (`create_recurrent_attention_mask`), and they zero the hidden states at padding with
it. When the base model runs on the packed row, patchkit's mask builder hands them `MixerRows` instead (the real
tokens of each padded row), and their wrapped forward runs each row's stretch of the packed row alone and
concatenates the outputs: what the padded row computed at its real tokens, since its padding carried nothing into
the state (the census checks each family that runs this way). The rows travel as the layer's mask argument, so a
checkpointed layer recomputed in backward splits the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from patchkit.forward.context import current
from patchkit.hooks.install.patching import dressed_as


@dataclasses.dataclass(frozen=True)
class MixerRows:
    """The packed row's stretches, one per row of the padded batch: `lengths` real tokens each, in order."""

    lengths: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.lengths)


MASK_BUILDER = "create_recurrent_attention_mask"  # transformers' recurrent layers' mask, by the modeling modules' name


def hand_rows(modeling: ModuleType) -> None:
    """From now on `modeling`'s recurrent layers get `MixerRows` for their mask in a forward that runs packed, and
    transformers' mask everywhere else. Installed once per module and kept, as patchkit's registered attention name
    is: a revert between two patches' forwards must not leave the other's wrapped mixers a mask of None (one state
    across every row)."""
    original = getattr(modeling, MASK_BUILDER, None)
    if original is None or getattr(original, "__patchkit_rows__", False):
        return

    def create_recurrent_attention_mask(*args: Any, **kwargs: Any) -> Any:
        padded = current().plan.padded
        if padded is None:
            return original(*args, **kwargs)
        return MixerRows(tuple(padded.seqlens_q))

    wrapper = dressed_as(create_recurrent_attention_mask, original)
    wrapper.__patchkit_rows__ = True  # type: ignore[attr-defined]
    setattr(modeling, MASK_BUILDER, wrapper)


def make_mixer_forward(original: Callable) -> Callable:
    """A mixer's forward that, given `MixerRows` for its mask, runs each row's stretch of the packed row alone."""
    signature = inspect.signature(original)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(v, MixerRows) for v in (*args, *kwargs.values())):
            return original(self, *args, **kwargs)
        return _by_row(original, signature, self, args, kwargs)

    return dressed_as(forward, original)


@torch.compiler.disable  # one call per row, by the rows' lengths: eager between compiled frames, never a guard
def _by_row(original: Callable, signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    arguments = signature.bind(module, *args, **kwargs).arguments
    rows = next(v for v in arguments.values() if isinstance(v, MixerRows))
    outs, start = [], 0
    for length in rows.lengths:
        one = {k: _stretch(v, rows, start, length) for k, v in arguments.items()}
        outs.append(_call(original, signature, one))
        start += length
    return _joined(outs)


def _stretch(value: Any, rows: MixerRows, start: int, length: int) -> Any:
    """One row's share of an argument: its stretch of a (1, total, ...) tensor; no mask (the row has no padding)."""
    if isinstance(value, MixerRows):
        return None
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, rows.total):
        return value[:, start:start + length]
    if isinstance(value, dict):  # **kwargs
        return {k: _stretch(v, rows, start, length) for k, v in value.items()}
    return value


def _call(original: Callable, signature: inspect.Signature, arguments: dict) -> Any:
    bound = inspect.BoundArguments(signature, arguments)  # type: ignore[arg-type]
    return original(*bound.args, **bound.kwargs)


def _joined(outs: list) -> Any:
    """The rows' outputs as one packed row: tensors concatenated along the sequence, tuples element by element."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=1)
    if isinstance(first, tuple):
        return type(first)(_joined(list(parts)) if parts[0] is not None else None for parts in zip(*outs))
    raise TypeError(f"a token mixer returned {type(first).__name__}: patchkit joins tensors and tuples of them")
