"""Padding before real tokens under DeepSpeed Ulysses: served where position_ids separate it, else refused by name.

Ulysses drops each rank's attention mask and hands attention the gathered sequence, whose documents come from the
gathered `position_ids` alone. Right padding is then harmless (causal attention never looks ahead), but a real token
after padding (left padding, a hole) attends to that padding, patched or not, unless its position restarts there:
then patchkit's attention starts a new document and the padding drops out, exactly (as `mask.cumsum(-1) - 1` with
padding at 1 makes them, the way generate() does). Each rank sees only its shard of the mask, and padding on one rank
may precede real tokens on the next, so the base model's forward gathers the shards' masks and positions once (one
all_gather on the sequence-parallel group, on every rank, before anything a rank decides alone) and every rank reaches
the same verdict. A forward that would step aside to transformers' attention there is refused: Ulysses would run that
attention without the mask.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.hooks.parallel.sequence_parallel import ulysses_of

FIX = (
    "Pad on the right (the collators' default), or pack documents in one row with position_ids restarting at 0 "
    "and no attention_mask, or give position_ids that restart at each row's first real token "
    "(attention_mask.cumsum(-1) - 1 with padding at 1, as generate() makes them), which patchkit serves exactly."
)


def sequence_parallel_runs(module: nn.Module, wrapper: Callable) -> bool:
    """Ulysses shards this forward's attention: training, or evaluation with `disable_in_eval` off (its own test)."""
    uattn = ulysses_of(wrapper)
    return uattn is not None and (module.training or not getattr(uattn, "disable_in_eval", False))


def gather_shards(mask: torch.Tensor, position_ids: Optional[torch.Tensor], wrapper: Callable) -> torch.Tensor:
    """The whole batch's (mask, position_ids) as one (2, batch, seq) tensor: one all_gather on the SP group."""
    import torch.distributed as dist

    uattn = ulysses_of(wrapper)
    batch, local = mask.shape
    if position_ids is None:  # transformers' default on each rank: its shard counted from 0
        position_ids = torch.arange(local, device=mask.device)
    mine = torch.stack([mask.to(torch.int64), position_ids.to(device=mask.device, dtype=torch.int64)
                        .expand(batch, local)]).contiguous()
    shards = [torch.empty_like(mine) for _ in range(uattn.world_size)]
    dist.all_gather(shards, mine, group=uattn.process_group)
    return torch.cat(shards, dim=-1)


def padding_verdict(mask: torch.Tensor, position_ids: torch.Tensor) -> tuple[bool, bool]:
    """(some real token follows padding, some such token does not start a new document) for a whole batch.

    A document starts where a position does not increase over the previous token's (what attention sees under
    Ulysses, no mask) and over the previous real token's of its row, if any (what one process sees, with the mask).
    """
    real = mask.bool()
    after_padding = real[:, 1:] & ~real[:, :-1]
    columns = torch.arange(real.shape[1], device=real.device).expand_as(real)
    last_real = torch.cummax(torch.where(real, columns, -1), dim=-1).values[:, :-1]  # at or before the padding
    previous_real = position_ids.gather(1, last_real.clamp(min=0))
    here = position_ids[:, 1:]
    restarts = (here <= position_ids[:, :-1]) & ((last_real < 0) | (here <= previous_real))
    found, unserved = torch.stack([after_padding.any(), (after_padding & ~restarts).any()]).tolist()
    return bool(found), bool(unserved)


def check_padding(module: nn.Module, wrapper: Optional[Callable], arguments: dict, extra: dict) -> bool:
    """Under Ulysses, True when the batch holds padding before real tokens that patchkit serves; raises where it
    cannot. Every rank must call it in the same forwards (it gathers): the base model's forward, first thing."""
    mask = arguments.get("attention_mask")
    if wrapper is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    if not sequence_parallel_runs(module, wrapper):
        return False
    position_ids = arguments.get("position_ids", extra.get("position_ids"))
    with torch.no_grad():
        whole = gather_shards(mask, position_ids if isinstance(position_ids, torch.Tensor) else None, wrapper)
    found, unserved = padding_verdict(whole[0], whole[1])
    if unserved:
        raise PatchInputError(
            "padding before real tokens (left padding, or a hole) under DeepSpeed Ulysses sequence parallelism, and "
            "position_ids do not restart at the real token after it: Ulysses drops the attention mask and attends "
            "over the gathered sequence with documents from position_ids only, so those real tokens would attend "
            f"to the padding (transformers' attention does too, unpatched). {FIX}"
        )
    return found


def refuse_step_aside(cause: str, what: str, fix: str) -> PatchInputError:
    """A forward with padding before real tokens under Ulysses that would run on transformers' attention."""
    return PatchInputError(
        f"under DeepSpeed Ulysses, a batch with padding before real tokens would step aside to transformers' own "
        f"attention ({cause}: {what}), which Ulysses runs without the mask, so real tokens would attend to padding. "
        f"To stay patched: {fix}; or pad on the right."
    )

