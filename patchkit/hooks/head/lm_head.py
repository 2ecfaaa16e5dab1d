"""The causal LM's head and loss on real tokens only: the base model hands its LM the packed row, not the padded batch.

Under unpad="model" the base model runs on one packed row of real tokens. Without this module it repads its hidden
states at its exit, and the LM then runs its head (B·N·H -> B·N·V, the step's largest matmul at a large vocabulary)
and transformers' loss (which upcasts every logit to float32) on padding too. Here the causal LM's wrapper asks its
base model for the packed row (`HeadRequest`), so the family's own forward runs its head, its logit transforms
(softcapping, scaling) and its loss on (nnz + 1, V):

- one zero row follows the nnz real tokens, so the logits at padding keep the meaning they have always had in
  patchkit: the head (and the family's transforms) of a zero hidden state; the LM's `logits` come back (B, N, V);
- the labels are shifted in the padded layout (no label crosses a row's end), then unpadded; transformers' loss
  function receives them as `shift_labels` (`PreTrainedModel.loss_function`, wrapped while a patch is active).

Served where the family's forward computes its loss through `self.loss_function` on its head's logits (read once
per class), the loss is transformers' `ForCausalLMLoss` and the caller wants every position's logits
(`logits_to_keep=0`); everything else keeps the padded exit, as before.

Under unpad="loss" a training forward with labels returns its loss alone (`logits=None`): the base model hands the LM
only its labelled rows (`hand_labelled`: a prompt's tokens, padding, each row's last token are not run through the
head at all, as TRL's fused head does on a GPU), the loss runs chunked (`forward/loss/cross_entropy.py`, no float32 copy
of the logits) and the (B, N, V) logits are never written. Once the LM's own logits were checked against them, the
labelled rows skip its head and go to the head fused with the loss (`fused_head.py`, `forward/loss/
linear_cross_entropy.py`): no logits of their size at all.
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError, PatchkitError
from patchkit.forward.inputs.module_hooks import head_hook, layout_hook_on, said_layout
from patchkit.forward.loss.cross_entropy import IGNORE_INDEX, chunked_causal_lm_loss, shifted_labels
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import on_device, unpad_rows
from patchkit.hooks.head.fused_head import CHECK_ROWS, PROBE_LOGITS, check, checked_rows, probed, probes
from patchkit.hooks.head.head_request import CheckFailed, HeadRequest, asked, with_zero_row
from patchkit.hooks.head.weight_holders import InItsCall, held, in_its_call, one_call
from patchkit.hooks.install.patching import Replacement, SharedInstall

_hook = SharedInstall()


def _default_loss() -> Optional[Callable]:
    """transformers' ForCausalLMLoss where it takes `shift_labels` (4.50+), else None (the padded exit serves)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return None
    loss = LOSS_MAPPING.get("ForCausalLM")
    return loss if loss is not None and "shift_labels" in inspect.signature(loss).parameters else None


REAL_TOKENS = "real tokens"  # the key of heads run on the packed row, in a state's `heads` count
LOSS_ONLY = "labelled tokens, the loss alone"  # the head on the labelled rows alone, the loss and no logits back
LOSS_ONLY_KEPT = "the loss alone"  # unpad="loss" where no rows were handed: the head on every position
FUSED = "labelled tokens, the loss alone, fused with the head"  # ... computed by the fused head and loss


def padded(heads: dict[str, int]) -> dict[str, int]:
    """The forwards whose head and loss ran on the padded batch, by why (a state's `heads` without the served)."""
    return {why: n for why, n in heads.items() if why not in (REAL_TOKENS, LOSS_ONLY, LOSS_ONLY_KEPT, FUSED)}


def declined(lm: nn.Module, arguments: dict, extra: dict, unservable: Optional[str]) -> Optional[str]:
    """Why this call of a causal LM cannot take its base model's packed row ("" where it needs no more than the
    padded exit gives: a few positions' logits), or None: it can. It can when its forward is `servable_forward` (else
    `unservable` says why),
    every position's logits are asked for in a dict output and, with labels, the loss is transformers' own
    causal-LM loss (not one the user set)."""
    keep = arguments.get("logits_to_keep", arguments.get("num_logits_to_keep", extra.get("logits_to_keep", 0)))
    if not (keep is None or (isinstance(keep, int) and keep == 0)):
        return ""  # generate()'s last position, or chosen positions: no head on padding to save
    if unservable is not None:
        return f"{type(lm).__name__}'s forward {unservable}"
    base_name = getattr(lm, "base_model_prefix", "")
    if base_name in lm._modules and said_layout(lm, head_hook(lm, base_name)):
        return "a hook on its head that may read the (B, S, V) layout"
    if base_name in lm._modules and said_layout(lm, layout_hook_on(lm._modules[base_name])):
        return "a hook on its base model that may read the (B, S, H) layout"  # it sees what is handed
    asked = arguments.get("return_dict", extra.get("return_dict"))
    if asked is False or (asked is None and getattr(lm.config, "return_dict", True) is False):
        return "a tuple output (return_dict=False)"
    if arguments.get("labels") is None and extra.get("shift_labels") is None:
        return None
    if extra.get("ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
        return "a loss ignore_index other than -100"  # the labelled rows are told by -100
    loss = _default_loss()
    if loss is None:
        return "this transformers' causal-LM loss takes no shift_labels"
    if _lm_loss(lm) is not loss or not transformers_own(loss, "ForCausalLMLoss"):
        return "a loss function other than transformers' ForCausalLMLoss"
    return None if cross_entropy_own() else "a cross-entropy set in place of transformers' or torch's own"


def transformers_own(function: Any, name: str) -> bool:
    """`function` is transformers' `loss_utils.<name>`, not a script's put in its place (or in LOSS_MAPPING)."""
    return (getattr(function, "__module__", None), getattr(function, "__qualname__", None)) == (
        "transformers.loss.loss_utils", name)


def cross_entropy_own() -> bool:
    """What transformers' causal-LM loss calls is its own: `loss_utils.fixed_cross_entropy` and torch's
    `cross_entropy` it calls, neither replaced (label smoothing, another reduction; Liger's `cross_entropy=True`
    replaces torch's). patchkit's loss on the packed row computes what they compute unreplaced."""
    utils = sys.modules.get("transformers.loss.loss_utils")
    fixed = getattr(utils, "fixed_cross_entropy", None)
    return transformers_own(fixed, "fixed_cross_entropy") and getattr(
        torch.nn.functional.cross_entropy, "__module__", None) == "torch.nn.functional"


def _lm_loss(lm: nn.Module) -> Optional[Callable]:
    """The loss function this model's `loss_function` property gives: a subclass's own, else transformers' (not
    patchkit's wrapper of it)."""
    original = inspect.getattr_static(type(lm), "loss_function", None)
    replaced = _hook.replacements[0] if _hook.replacements else None
    if replaced is not None and original is replaced.new:
        original = replaced.original
    try:
        return original.fget(lm) if isinstance(original, property) else None
    except Exception:  # noqa: BLE001 - a model whose loss cannot be resolved keeps the padded exit
        return None


def _last_hidden(out: Any, rows: tuple[int, int]) -> Optional[torch.Tensor]:
    """The output's (*rows, H) last hidden state, or None where it has no such field or another shape."""
    if not hasattr(out, "keys") or "last_hidden_state" not in out.keys():  # noqa: SIM118 - a ModelOutput
        return None
    hidden = out["last_hidden_state"]
    ok = isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and tuple(hidden.shape[:2]) == rows
    return hidden if ok else None


def hand_packed(out: Any, meta: VarlenMetadata, request: HeadRequest) -> Optional[torch.Tensor]:
    """The base model's (1, nnz, H) last hidden state with one zero row after the real tokens, for the LM's head
    (the labelled rows alone where `request` is for the loss alone, `hand_labelled`); None where the output has no
    such field (the base model then repads it)."""
    hidden = _last_hidden(out, (1, meta.nnz_q))
    if hidden is None:
        return None
    if request.labels is not None:
        return hand_labelled(hidden[0], unpad_rows(shifted_labels(*request.labels), meta.indices_q), request)
    return torch.cat([hidden, hidden.new_zeros(1, 1, hidden.shape[-1])], dim=1)


def hand_kept(out: Any, request: Optional[HeadRequest]) -> Any:
    """A batch its base model kept (no padding, packed documents, a family unpadded inside attention), under the loss
    alone: its last hidden state becomes the labelled rows (`hand_labelled`) where the labels match its (B, N)."""
    if request is None or request.labels is None:
        return out
    shifted = shifted_labels(*request.labels)
    hidden = _last_hidden(out, tuple(shifted.shape)) if shifted.dim() == 2 else None
    if hidden is not None:
        out["last_hidden_state"] = hand_labelled(hidden.flatten(0, 1), shifted.flatten(), request)
    return out


@torch.compiler.disable  # host reads (which rows are labelled): one break at the call in a compiled forward
def hand_labelled(hidden: torch.Tensor, shifted: torch.Tensor, request: HeadRequest) -> torch.Tensor:
    """(n, H) hidden rows and their (n,) shifted labels -> (1, L + 1, H): the L labelled rows and one zero row,
    labelled -100 (a forward with no label still has a row to run); their labels go to `request.handed`. The rows
    left out are those whose loss term and gradient are zero: the loss and every gradient are the same. With a
    fused head the L rows are kept for the fused loss (`request.rows`): the LM's own head runs on the zero row
    alone once checked, and on the checking call on the first labelled rows, the zero row and the probes."""
    keep = (shifted != IGNORE_INDEX).nonzero().squeeze(1)
    labelled, keep = shifted[keep], keep.to(hidden.device)
    fused = request.fused
    if fused is not None and keep.numel() > 0:
        request.rows, request.handed = hidden.index_select(0, keep), labelled[None]
        # needing a gradient as the checking call's rows do, the head saves as many tensors for the backward either
        # way (a non-reentrant checkpoint recomputes the checked call after the checking one, and counts them)
        zero = hidden.new_zeros(1, hidden.shape[-1]).requires_grad_(hidden.requires_grad)
        in_call = one_call(fused)
        if in_call:  # the loss, the probes and the check in the family's call of the head's unit: as many calls
            request.in_call = in_its_call(fused, functools.partial(_loss_in_call, request),  # as unpatched makes
                                          before=None if fused.checked else functools.partial(_probed_in_call, request))
        if fused.checked:
            return zero[None]
        first = min(CHECK_ROWS, keep.numel())
        if in_call:  # placeholders, made the probes in that call
            probe = hidden.new_zeros(min(len(PROBE_LOGITS), fused.linear.out_features), hidden.shape[-1])
        else:
            probe = held(fused, lambda: probes(fused.weight)).to(hidden.device, hidden.dtype)
        handed = torch.cat([request.rows[:first], zero, probe])[None]
        request.check_rows, request.restore = (handed, first, probe.shape[0]), fused.dropouts_off()
        return handed
    handed, request.handed = with_zero_row(hidden.index_select(0, keep), labelled)
    return handed


def _loss_in_call(request: HeadRequest) -> torch.Tensor:
    """The fused loss in the head's own call, the checking call's dropouts (a LoRA head's) on again for it."""
    restore, request.restore = request.restore, None
    if restore is not None:
        restore()
    return request.fused.loss(request.rows, request.handed[0], IGNORE_INDEX, request.num_items)


def _probed_in_call(request: HeadRequest, rows: torch.Tensor, call: InItsCall) -> torch.Tensor:
    """In the head's call on the checking call's rows (FSDP2 gathers its weight there alone): the probes in place of
    their placeholders, and the fused head's logits of the rows the check compares."""
    handed, labelled, n = request.check_rows
    probe = probes(request.fused.weight)
    handed = probed(handed, probe)
    with torch.no_grad():
        call.checked = request.fused.logits(handed.reshape(-1, handed.shape[-1])[checked_rows(handed, labelled, n)])
    return probed(rows, probe) if rows.shape == handed.shape else rows


def repad_logits(logits: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
    """(1, nnz + 1, V) -> (B, N, V): each real token's logits at its place, the zero row's at every padding place.
    The (B, N, V) logits are the largest tensor the step writes outside the head itself: one broadcast fill, then
    the real rows copied over it (measured the fastest of the ways to write it on a CPU, where first touching fresh
    pages dominates)."""
    nnz, rows = meta.nnz_q, logits[0]
    padded = rows.new_empty(meta.batch * meta.q_len, rows.shape[-1])
    padded.copy_(rows[nnz].expand_as(padded))
    padded.index_copy_(0, on_device(meta.indices_q, rows), rows[:nnz])
    return padded.view(meta.batch, meta.q_len, rows.shape[-1])


def packed_labels(meta: VarlenMetadata, labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                  ) -> torch.Tensor:
    """(1, nnz + 1) shifted labels of the packed row: shifted in the padded layout (a row's last token predicts
    nothing), the real tokens' taken, -100 for the zero row."""
    real = unpad_rows(shifted_labels(labels, shift_labels), meta.indices_q)
    return torch.cat([real, real.new_full((1,), IGNORE_INDEX)]).unsqueeze(0)


def _packed_loss(loss: Callable, request: HeadRequest, logits: torch.Tensor, labels: Optional[torch.Tensor] = None,
                 vocab_size: Optional[int] = None, *args: Any, shift_labels: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> torch.Tensor:
    meta, shifted = request.meta, request.handed
    if (meta is None and shifted is None) or (labels is None and shift_labels is None):
        return loss(logits, labels, vocab_size, *args, shift_labels=shift_labels, **kwargs)
    request.losses += 1
    if request.rows is not None or request.loss_only:  # transformers' loss, computed by patchkit: what it fails on
        refuse_misfit_labels(labels if shift_labels is None else shift_labels, logits.shape[-1], vocab_size)
    if request.check_rows is not None:
        try:
            ours = request.in_call.checked if request.in_call is not None else None
            same = check(request.fused, logits, *request.check_rows, ours=ours)
        finally:
            request.end_check()
        if not same:
            raise CheckFailed(request)  # `logits`: a few rows' only; the LM reruns with its own head on every row
    if request.rows is not None:  # the fused head and loss on the labelled rows; `logits`: the zero row's or the
        return _fused_loss(request, logits, *args, **kwargs)  # checked rows'
    if shifted is None:
        shifted = packed_labels(meta, labels, shift_labels)
    if request.loss_only:  # `loss` is transformers' ForCausalLMLoss (`declined`): the same numbers, chunked
        loss = chunked_causal_lm_loss
    return loss(logits, shifted, vocab_size, *args, shift_labels=shifted, **kwargs)


def refuse_misfit_labels(labels: Any, width: int, vocab_size: Any) -> None:
    """What transformers' loss fails on, where patchkit's would run: labels of another dtype than int64 (its
    cross-entropy takes no other), a head of another width than `vocab_size` (it reads the logits as rows that wide)."""
    if isinstance(labels, torch.Tensor) and labels.dtype not in (torch.long, torch.uint8):
        raise PatchInputError(f"labels are {labels.dtype}, and transformers' cross-entropy takes int64: pass "
                              "labels.long() (the loss raises without patchkit too)")
    if isinstance(vocab_size, int) and width != vocab_size:
        raise PatchInputError(f"the LM head gives {width} logits a position but the loss is told vocab_size="
                              f"{vocab_size} (config.vocab_size): set it to the head's width, as "
                              "resize_token_embeddings() does (the loss raises without patchkit too)")


def _fused_loss(request: HeadRequest, logits: torch.Tensor, num_items_in_batch: Optional[Any] = None,
                ignore_index: int = IGNORE_INDEX,
                **_: Any) -> torch.Tensor:
    """ForCausalLMLoss's numbers (its arguments after `vocab_size`) from the fused head on `request.rows`: computed
    in the head's own call where its hooks gather its weight by collectives, and tied to its `logits` there."""
    fused, labels = request.fused, request.handed[0]
    if request.in_call is not None and ignore_index == IGNORE_INDEX and num_items_in_batch is request.num_items:
        loss = request.in_call.loss(logits)
        if loss is not None:
            return loss
    return held(fused, lambda rows: fused.loss(rows, labels, ignore_index, num_items_in_batch), request.rows)


def _loss_alone(request: HeadRequest, *args: Any, **kwargs: Any) -> torch.Tensor:
    """unpad="loss" on a batch its base model did not unpad: transformers' loss, chunked, on every position."""
    request.losses += 1
    return chunked_causal_lm_loss(*args, **kwargs)


# Under torch.compile these run eagerly: their loops over chunks and their counts would be traced, guarded and compiled
# again for every count of labelled rows
_eager_packed_loss, _eager_loss_alone = torch._dynamo.disable(_packed_loss), torch._dynamo.disable(_loss_alone)


def _loss_property(original: property) -> property:
    """transformers' `loss_function`, which inside a causal LM whose base model handed it the packed row returns the
    same loss on that row's labels."""
    getter = original.fget

    def loss_function(self: nn.Module) -> Callable:
        loss = getter(self)
        request = asked()
        if request is None or not request.wanted:
            return loss
        if request.meta is None and request.handed is None:  # a batch kept whole (its base model handed no rows)
            return functools.partial(_eager_loss_alone, request) if request.loss_only else loss
        return functools.partial(_eager_packed_loss, loss, request)

    return property(functools.wraps(getter)(loss_function), original.fset, original.fdel, original.__doc__)


def replacements() -> list[Replacement]:
    """The wrapper on PreTrainedModel.loss_function (none where this transformers has no such property)."""
    from transformers.modeling_utils import PreTrainedModel

    original = vars(PreTrainedModel).get("loss_function")
    if not isinstance(original, property) or _default_loss() is None:
        return []
    return [Replacement(PreTrainedModel, "loss_function", _loss_property(original),
                        "PreTrainedModel.loss_function (the loss on the packed row's labels)")]


def attach() -> None:
    """While any patch is active, a causal LM handed the packed row computes its loss there (idempotent)."""
    _hook.attach(replacements)


def detach() -> None:
    """The last patch is gone: transformers' own property again (identity)."""
    _hook.detach()


def finish(lm: nn.Module, out: Any, request: HeadRequest, labelled: bool, heads: Optional[dict]) -> Any:
    """The LM's output with its logits (and any other field of the packed row's) back at (B, N, ...), once its base
    model handed it the packed row (or, for the loss alone, no logits once it handed the labelled rows), counted in
    `heads` (a patch state's: where the head ran). A family that computed a loss with labels outside `loss_function`
    would have seen the rows handed to it: refused by name."""
    meta, handed = request.meta, request.handed is not None
    alone = request.loss_only and labelled and request.losses > 0  # unpad="loss" served: no logits back
    if meta is None and not handed:
        if alone:  # the head on every position of a batch its base model kept
            _count(heads, LOSS_ONLY_KEPT)
            _drop_logits(out)
        return out
    if not request.wanted:
        if request.why_not:
            _count(heads, request.why_not)
        return out
    _count(heads, (FUSED if request.rows is not None else LOSS_ONLY) if alone else REAL_TOKENS)
    if labelled and request.losses == 0:
        raise PatchkitError(
            f"patchkit: {type(lm).__name__} computed its loss without transformers' loss_function, on the rows of "
            "real tokens patchkit handed it; this loss cannot be trusted. This is a patchkit bug: report it, and "
            "meanwhile apply the patch with unpad='attention'."
        )
    if alone:
        _drop_logits(out)  # the loss alone: the caller asked for no logits (unpad="loss")
    elif meta is not None and hasattr(out, "keys"):  # the logits, and a hidden state returned beside them (Moshi's)
        for key in list(out.keys()):
            value = out[key]
            if isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[:2] == (1, meta.nnz_q + 1):
                out[key] = repad_logits(value, meta)
    return out


COMPILED_LOSS_ALONE = (
    "patchkit: unpad='loss' under torch.compile(fullgraph=True): the causal LM's head and loss run inside the graph "
    "as transformers' own, on the padded batch, and return their logits; the loss alone is served where the graph "
    "may break (torch.compile's default). The loss and gradients are the same."
)


def compiled_loss_alone(state: Any) -> Callable[[], bool]:
    """Said once per patch while dynamo traces a training forward with labels under unpad="loss" in a graph that may
    not break (a constant of the graph: nothing of it runs there): that graph returns the logits."""

    def said() -> bool:
        state.warn_once("compiled_loss_alone", COMPILED_LOSS_ALONE)
        return True

    return torch._dynamo.assume_constant_result(said)


def _count(heads: Optional[dict], key: str) -> None:
    if heads is not None:
        heads[key] = heads.get(key, 0) + 1


def _drop_logits(out: Any) -> None:
    """`out` as a ModelOutput built without logits: the field None and no entry (ModelOutput refuses pop and del)."""
    if hasattr(out, "keys") and out.get("logits") is not None:
        collections.OrderedDict.pop(out, "logits", None)
        object.__setattr__(out, "logits", None)


def heads_line(heads: dict[str, int]) -> str:
    """A report's line on where the LM head and loss ran over batches unpadded at the model."""
    fused = heads.get(FUSED, 0)
    alone = heads.get(LOSS_ONLY, 0) + fused
    real, kept = heads.get(REAL_TOKENS, 0) + alone, heads.get(LOSS_ONLY_KEPT, 0)
    on_padding = "; ".join(f"{n} on the padded batch: {why}" for why, n in padded(heads).items())
    return (f"  LM head and loss: {real} forwards on real tokens" + (
        f" ({alone} returned the loss alone, the head on the labelled tokens only" + (
            f"; {fused} fused with the loss" if fused else "") + ")" if alone else "") + (
        f"; {kept} returned the loss alone from every position (no rows handed to the head)" if kept else "") + (
        f"; {on_padding}" if on_padding else ""))
