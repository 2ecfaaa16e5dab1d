"""On a transformers newer than CI has passed, a causal LM's head and loss check themselves before its first forward.

patchkit runs the LM's head and loss on real tokens: the family's own head on the packed row with transformers' loss
given the packed labels, or, where the caller reads the loss alone, patchkit's own cross-entropy (chunked, or fused
with the head). A release that changes `ForCausalLMLoss` (label smoothing, another mean) or what the LM's forward does
around its head would then train on other numbers, silently. So before a causal LM's first forward served there, a
tiny model of its class and config runs a labelled training step (rows padded on the right and on the left) on
transformers' own forward, and through the patch twice: the forward as a caller that reads its logits runs it, and as
one that reads its loss alone (the fused head). The loss, the logits at real tokens and every gradient are compared;
where they differ, that LM's head and loss step aside for the process (transformers' own on the padded batch,
`untested_transformers` in its report line, one warning naming what differed; strict mode refuses).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError
from patchkit.hooks.decide import self_check
from patchkit.hooks.decide.tiny_model import check_batch
from patchkit.hooks.install.patching import unpatched
from patchkit.names import WHOLE_MODEL
from patchkit.warn import warn_user

IGNORE = -100  # transformers' label for a position without loss
# The check's callers, compiled under a file name of no package, so that patchkit reads their code as a user's (it
# skips its own frames): one reads the output's logits (the head on the packed row, transformers' loss), one reads
# the loss alone (patchkit's own loss, fused with the head)
_CALLERS = compile(
    "def reads_logits(lm, kwargs):\n    out = lm(**kwargs)\n    return out.loss, out.logits\n\n\n"
    "def reads_loss_alone(lm, kwargs):\n    return lm(**kwargs).loss\n",
    "<patchkit self-check of the LM head and loss>", "exec")
CALLERS: dict[str, Callable] = {}
BASE_DIFFERED = " (the family steps aside)"
NOT_CHECKED = "not checked: a multimodal model's tiny copy would keep its full-size parts"
exec(_CALLERS, CALLERS)  # noqa: S102 - patchkit's own two-line callers above


def head_cause(lm: nn.Module, state: Any) -> Optional[str]:
    """Why this causal LM's head and loss step aside (its check differed, or its base model's did: the loss then
    runs on rows transformers' loss has not been compared on), or None: served. The check runs at the LM's first
    forward outside a compiled graph on an untested transformers (under unpad="model" or "loss", where patchkit
    runs the head and loss)."""
    from patchkit.forward.liveness import is_compiling

    if state is None or state.unpad not in WHOLE_MODEL or self_check.trusted(self_check.model_type(lm)):
        return None
    config = getattr(lm, "config", None)
    key = (type(lm), self_check.check_key(config))
    if key not in self_check.heads:
        if self_check._checking or is_compiling():
            return None
        param = next(lm.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        base = getattr(lm, "base_model", lm)
        said = not composite(config) and base is not lm and self_check.verdict_cause(
            type(base), base.config, device, dtype, state) is not None
        if composite(config):
            what = NOT_CHECKED
        elif said:  # its warning says the family steps aside
            what = f"{type(base).__name__}'s own check differed" + BASE_DIFFERED
        else:
            self_check._checking.add(type(lm))
            try:
                start = time.perf_counter()
                what = self_check.check_family(type(lm), config, device, dtype, state, run_lm_checks)
                self_check.seconds[type(lm)] = self_check.seconds.get(type(lm), 0.0) + (
                    time.perf_counter() - start)
            finally:
                self_check._checking.discard(type(lm))
        self_check.heads[key] = what
        if what is not None and not said:
            warn_user(f"patchkit: {head_words(type(lm), what)}; its head and loss run as transformers' own, on the "
                      f"padded batch ({self_check.failed_cause()}).")
    what = self_check.heads[key]
    if what is not None and state.strict and what != NOT_CHECKED and not what.endswith(BASE_DIFFERED):  # (the
        # base model's forward refuses those)
        raise PatchInputError(
            f"patch {state.patch!r} (strict=True): {head_words(type(lm), what)}. patchkit would run this causal LM's "
            "head and loss as transformers' own on the padded batch; strict refuses instead. To stay patched: a "
            "tested transformers, or one you verified named in PATCHKIT_TESTED_TRANSFORMERS.")
    return None if what is None else f"{self_check.failed_cause()}: {head_words(type(lm), what)}"


def composite(config: Any) -> bool:
    """A multimodal model's config (its text config another): its tiny copy would keep the full-size parts."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text is not config


def head_words(cls: type, what: str) -> str:
    """The words for an LM whose head and loss check differed: the version, the tested one, what differed."""
    import transformers

    found = f"{cls.__name__}'s head and loss are {what}" if what == NOT_CHECKED else (
        f"{cls.__name__}'s head and loss self-check found: {what}")
    if self_check.untested() is None:
        return found
    return (f"transformers {transformers.__version__} is newer than patchkit was tested with "
            f"({self_check.newest_tested()}), and {found.replace('self-check found', 'self-check there found')}")


def run_lm_checks(tiny: nn.Module, reference: bool) -> list[tuple[str, torch.Tensor]]:
    """A labelled training step of a causal LM: its loss, its logits at real tokens and every gradient, on
    transformers' own forward (its base model's too), or through the patch read as logits and as the loss alone."""
    ids, mask, _, _ = check_batch(next(tiny.parameters()).device)
    after = torch.nn.functional.pad(mask, (1, 0), value=1)[:, :-1]  # a left-padded row's first token: predicted
    labels = ids.masked_fill((mask == 0) | (after == 0), IGNORE)  # from padding, unlabelled (as a collator does)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    real = mask.bool()
    if reference:
        base = tiny.base_model
        base.forward = functools.partial(unpatched(type(base).forward), base)  # no patch of its class either
        try:
            out = step(tiny, lambda: unpatched(type(tiny).forward)(tiny, **kwargs), real)
        finally:
            del base.forward
        return [*out, ("loss alone", out[0][1]), ("loss alone's gradients", out[-1][1])]
    out = step(tiny, lambda: CALLERS["reads_logits"](tiny, kwargs), real)
    alone = step(tiny, lambda: (CALLERS["reads_loss_alone"](tiny, kwargs), None), real)
    return [*out, ("loss alone", alone[0][1]), ("loss alone's gradients", alone[-1][1])]


def step(tiny: nn.Module, call: Callable[[], Any], real: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One training forward and backward: [loss, logits at real tokens (where returned), every gradient]."""
    tiny.train()
    tiny.zero_grad(set_to_none=True)
    try:
        got = call()
        loss, logits = (got.loss, got.logits) if not isinstance(got, tuple) else got
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in tiny.parameters() if p.grad is not None])
        results = [("loss with logits", loss.detach().reshape(1))]
        if logits is not None:
            results.append(("logits at real tokens", logits.detach()[real]))
        return [*results, ("gradients", grads)]
    finally:
        tiny.zero_grad(set_to_none=True)
        tiny.eval()
