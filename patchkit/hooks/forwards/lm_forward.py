"""The causal LM's forward wrapper: tell its base model what of the call reads padding, and run its head and loss on
the real tokens the base model hands back (or fused with the loss where its caller reads the loss alone)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from patchkit.forward.context import current, within
from patchkit.forward.inputs.arguments import (
    check_one_cache,
    given_cache,
    input_tokens,
    transformers_mask_in_graph,
)
from patchkit.forward.liveness import in_one_graph, is_compiling
from patchkit.hooks.decide.graph_plan import lm_in_graph, lm_plan
from patchkit.hooks.decide.outer_caller import LM_WRAPPERS
from patchkit.hooks.decide.self_check_lm import head_cause
from patchkit.hooks.decide.step_aside import lm_cause
from patchkit.hooks.decide.task_reads import CHOICE, choice_cause
from patchkit.hooks.forwards.model_forward import bound_call, tuple_cache_kwargs
from patchkit.hooks.head.fused_head import fused_head
from patchkit.hooks.head.head_request import HeadRequest, run_lm
from patchkit.hooks.head.lm_head import compiled_loss_alone, declined, finish
from patchkit.hooks.head.loss_reader import reads_loss_alone
from patchkit.hooks.head.padding_readers import padding_cause, say_padding_reader
from patchkit.hooks.install.forward_source import unservable_why
from patchkit.hooks.install.patching import dressed_as
from patchkit.names import WHOLE_MODEL


def takes_logits_to_keep(signature: inspect.Signature) -> bool:
    """The forward takes `logits_to_keep` (or its older name), which generate() sets in its prefill."""
    return any(name in signature.parameters for name in ("logits_to_keep", "num_logits_to_keep"))


def wide(arguments: dict) -> bool:
    """The call runs several tokens a row (not a decode step's one)."""
    tokens = input_tokens(arguments)
    return tokens is not None and tokens.dim() >= 2 and tokens.shape[1] > 1


def labelled(arguments: dict, extra: dict) -> bool:
    """The LM's call has labels: it computes a loss (from its `shift_labels` too, where the caller gave them).
    transformers' causal LMs compute none from `shift_labels` alone: the HF Trainer's context-parallel step pops
    `labels` for a loss of its own (label smoothing, `compute_loss_func`), which it computes from the logits."""
    return arguments.get("labels") is not None


# Under torch.compile a causal LM's ask of its base model, its run and its counts run eagerly (dynamo would guard on
# the counts and compile again every step); the LM's own forward, and the base model's in it, compile as frames of
# their own. `recursive=False` skips only that function's frame: each helper it calls is skipped whole, but run_lm.
eager_finish, eager_run_lm = torch._dynamo.disable(finish), torch._dynamo.disable(run_lm, recursive=False)
eager_choice_cause = torch.compiler.disable(choice_cause)  # host reads, as lm_cause's


def misfit_labels(arguments: dict) -> bool:
    """Labels that are not one per token of the call (a caller's shape bug: another length, or one row's `(N,)`):
    its loss is transformers' to refuse (the labelled rows patchkit would gather are not there)."""
    labels, tokens = arguments.get("labels"), input_tokens(arguments)
    return isinstance(labels, torch.Tensor) and labels.dim() in (1, 2) and isinstance(tokens, torch.Tensor) and (
        tokens.dim() >= 2 and labels.shape != tokens.shape[:2])


def make_lm_forward(original: Callable, unpad: str = "model", state: Any = None) -> Callable:
    """Wrap a causal LM's forward: tell the base model's forward what of this call reads padding positions, and,
    under unpad="model", ask it for the packed row so the head and the loss run on real tokens (`lm_head`; counted
    in `state`'s `heads`)."""
    signature, var_kw, bind, _ = bound_call(original)
    unservable = unservable_why(original)
    heads = state.heads if state is not None else None
    takes_keep = takes_logits_to_keep(signature)
    chooses = CHOICE in signature.parameters  # a multiple-choice head's: it pools a position of each choice's row
    # unpad="loss" asked of the patch: the loss alone, also where this family's base model unpads inside attention
    loss_alone = state is not None and state.unpad == "loss"
    # the patch's unpad is "model" or "loss": a caller that reads the loss alone gets it fused, also from a family
    # whose base model runs padded (unpadding inside attention: `unpad` is then "attention")
    whole = (state.unpad if state is not None else unpad) in WHOLE_MODEL
    compiled_said = compiled_loss_alone(state) if loss_alone else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = bind(self, args, kwargs)
        check_one_cache(arguments)
        extra = arguments.get(var_kw, {}) if var_kw else {}
        if compiled_said is not None and in_one_graph() and self.training and labelled(arguments, extra):
            compiled_said()
        if transformers_mask_in_graph(arguments.get("attention_mask")):
            return original(self, *args, **kwargs)  # the base model's forward decides (and hands that mask on)
        if in_one_graph():  # what the base model's traced forward plans by: labels over a padded batch
            pools = chooses and isinstance(arguments.get("attention_mask"), torch.Tensor)  # a position per choice
            with lm_in_graph(lm_plan(arguments, extra) or pools):
                return original(self, *args, **kwargs)
        kwargs = tuple_cache_kwargs(self, arguments, extra, kwargs)  # the tuple's cache element
        # a call inside another LM's (Llama 4's causal LM in its multimodal model, which holds the labels) keeps what
        # that call reads at padding
        choice = eager_choice_cause(arguments) if chooses else None
        cause = lm_cause(arguments, extra, self.training, takes_keep, self) or choice or (None if is_compiling() else
                                                                                    current().lm_cause)
        if cause is None and not labelled(arguments, extra) and wide(arguments) and not is_compiling():
            cause = padding_cause(arguments.get("attention_mask"), given_cache(arguments, extra) is not None)
            # contrastive search's prefill; generate()'s without a cache
            if cause is None:
                say_padding_reader()  # a caller that reads the logits at padding (TRL's ORPO's metrics)
        if cause is None and misfit_labels(arguments):
            return original(self, *args, **kwargs)  # transformers' loss refuses them, in its own words
        if cause is None and not is_compiling() and current().head is not None:
            return original(self, *args, **kwargs)  # inside another LM's call (Llama 4's multimodal model, which
            # computes the loss from this one's logits): that call's request is served here, one head a forward
        if cause is None and not is_compiling():
            alone = reads_alone(self, arguments, extra)
            if unpad in WHOLE_MODEL or alone:
                return with_head(self, args, kwargs, arguments, extra, alone)
        if cause is None and (loss_alone and self.training and labelled(arguments, extra) or (
                unpad in WHOLE_MODEL and arguments.get("attention_mask") is not None)):
            return eager_with_head(self, args, kwargs, arguments, extra, None)  # compiled: served eagerly
        if cause is None and is_compiling() and whole and labelled(arguments, extra) and (
                eager_reads_alone(self, arguments, extra)):
            return eager_with_head(self, args, kwargs, arguments, extra, True)  # compiled, run padded: as above
        if cause is None and (is_compiling() or (current().lm_cause is None and current().head is None)):
            return original(self, *args, **kwargs)  # nothing to tell (and no contextvar inside a compiled graph)
        with within(lm_cause=cause, head=None):
            return original(self, *args, **kwargs)

    def reads_alone(self: nn.Module, arguments: dict, extra: dict) -> bool:
        """The loss alone: asked of the patch for training forwards, or where the caller reads nothing else."""
        return loss_alone and self.training or (whole and labelled(arguments, extra) and reads_loss_alone())

    def ask(self: nn.Module, arguments: dict, extra: dict, alone: Optional[bool]) -> HeadRequest:
        alone = reads_alone(self, arguments, extra) if alone is None else alone
        asks_loss = alone and labelled(arguments, extra)
        why_not = declined(self, arguments, extra, unservable)
        if why_not is None:  # on a transformers newer than CI's: the LM's head and loss check (`self_check_lm`)
            why_not = head_cause(self, state)
        return HeadRequest(why_not, loss_only=alone,
                           labels=(arguments.get("labels"), extra.get("shift_labels")) if asks_loss else None,
                           fused=fused_head(self) if asks_loss else None,
                           num_items=extra.get("num_items_in_batch"))

    def with_head(self: nn.Module, args: tuple, kwargs: dict, arguments: dict, extra: dict,
                  alone: Optional[bool]) -> Any:
        out, head = eager_run_lm(original, self, args, kwargs, eager_ask(self, arguments, extra, alone))
        return eager_finish(self, out, head, labelled(arguments, extra), heads)

    LM_WRAPPERS.add(forward.__code__)  # its frame tells a base model's caller check that this call is told
    eager_with_head, eager_ask = torch._dynamo.disable(with_head, recursive=False), torch._dynamo.disable(ask)
    eager_reads_alone = torch._dynamo.disable(reads_alone)
    return dressed_as(forward, original, signature)
