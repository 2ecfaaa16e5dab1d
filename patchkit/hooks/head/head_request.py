"""The causal LM's ask of its base model for one call (hand me the packed row, or the labelled rows), and the LM's
run on it, again where the fused head's check failed: what both wrapped forwards (`model_forward.py` and
`lm_forward.py`) share."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.forward.context import current, within
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.forward.loss.cross_entropy import IGNORE_INDEX
from patchkit.forward.metadata import VarlenMetadata
from patchkit.hooks.head.fused_head import FusedHead
from patchkit.hooks.head.weight_holders import InItsCall


class HeadRequest:
    """A causal LM's word to its base model, for one call: hand me the packed row (`wanted`), or why not. The base
    model's wrapper answers with the forward's metadata (`meta`) when it ran packed (and handed the packed row if
    wanted); the loss wrapper counts its calls on that row (`losses`). `loss_only` (unpad="loss", training): the
    loss runs chunked and the LM returns no logits once it ran; given the call's `labels` (labels, shift_labels),
    the base model hands the labelled rows alone, whose shifted labels `handed` keeps for the loss. With a `fused`
    head (`fused_head.py`) it keeps those rows in `rows` for the fused loss and hands the LM one zero row, or, on the
    call that checks it, its first rows, the zero row and the probes (kept in `check_rows`), and keeps the base
    model's `output` for a rerun of the LM (`replay`, `again`) should the check fail."""

    __slots__ = ("wanted", "why_not", "meta", "losses", "loss_only", "labels", "handed", "fused", "rows",
                 "check_rows", "output", "replay", "restore", "num_items", "in_call")

    def __init__(self, why_not: Optional[str], loss_only: bool = False,
                 labels: Optional[tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                 fused: Optional[FusedHead] = None, num_items: Any = None) -> None:
        self.wanted = why_not is None
        self.why_not = why_not
        self.meta: Optional[VarlenMetadata] = None
        self.losses = 0
        self.loss_only = loss_only and self.wanted
        self.labels = labels if self.loss_only else None
        self.fused = fused if self.labels is not None else None
        self.handed: Optional[torch.Tensor] = None
        self.rows: Optional[torch.Tensor] = None
        self.check_rows: Optional[tuple[torch.Tensor, int, int]] = None  # handed, labelled rows, probe rows
        self.output: Any = None  # the base model's output on the checking call
        self.replay: Any = None  # an output the base model's forward returns as it is (`again`)
        self.restore: Optional[Callable[[], None]] = None  # turns a LoRA head's dropouts on after the check
        self.num_items = num_items  # the forward's num_items_in_batch, for a loss computed in the head's call
        self.in_call: Optional[InItsCall] = None  # the fused loss in the family's call of the head (FSDP2)

    def end_check(self) -> None:
        """The checking call's logits are compared (or the call ended): the head's dropouts on again."""
        restore, self.restore = self.restore, None
        if restore is not None:
            restore()
        if self.in_call is not None:
            self.in_call.undo()

    def again(self) -> HeadRequest:
        """This checking call's request, for the LM's rerun once the check failed: the base model's forward returns
        its output again, now holding every labelled row and the zero row, for the family's own head."""
        again = HeadRequest(None, loss_only=True, labels=self.labels)
        again.meta, again.replay = self.meta, self.output
        again.replay["last_hidden_state"], again.handed = with_zero_row(self.rows, self.handed[0])
        return again


def with_zero_row(rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, H) labelled rows and their (L,) labels -> (1, L + 1, H) and (1, L + 1): one zero row after them, labelled
    -100 (a forward with no label still has a row to run), for the family's own head and loss."""
    return (torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])[None],
            torch.cat([labels, labels.new_full((1,), IGNORE_INDEX)])[None])


ASKING = [0]  # causal LM calls with an ask of their base model running now: a plain list, read in a compiled frame


def asked() -> Optional[HeadRequest]:
    """The running causal LM's ask of its base model, or None. A compiled frame reads it only while one is running
    (eagerly, between compiled frames: `lm_forward.eager_run_lm`): the contextvar's read breaks the graph, and one
    that may not break never reads it (dynamo guards on `ASKING`, so each of the two compiles once)."""
    if is_compiling() and (not ASKING[0] or in_one_graph()):
        return None
    return current().head


class CheckFailed(Exception):
    """The family's logits on the checking call were not the fused loss's (`fused_head.check`): its LM reruns
    (`run_lm`)."""

    def __init__(self, request: HeadRequest) -> None:
        super().__init__("patchkit: the fused head's check failed; the causal LM reruns with its own head")
        self.request = request


def run_lm(original: Callable, lm: nn.Module, args: tuple, kwargs: dict, request: HeadRequest,
           ) -> tuple[Any, HeadRequest]:
    """The causal LM's forward with its ask of the base model (`request`), and the request it was served by. Where
    the family's logits failed the fused head's check, the LM runs again on its base model's output (which does
    not run again: no layer, dropout draw or collective repeats), with its own head on every labelled row."""
    ASKING[0] += 1
    try:
        try:
            with within(lm_cause=None, head=request):
                return original(lm, *args, **kwargs), request
        except CheckFailed as failed:
            if failed.request is not request or request.output is None:
                raise
        again = request.again()
        with within(lm_cause=None, head=again):
            return original(lm, *args, **kwargs), again
    finally:
        request.end_check()
        ASKING[0] -= 1
