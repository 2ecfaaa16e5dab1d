"""Whether a served base model runs inside a generative head that no patchkit wrapper tells it about.

A multimodal model of another modeling module (LLaVA around LLaMA's) computes its head and loss over every position
of the batch its language model returns. patchkit wraps such a head on the instance when a whole model is built under
a class patch or patched by `apply_patch(model=...)` (`family_route.outer_heads`); one built before the class patch,
or whose language model alone was patched, is not wrapped, so its base model cannot know whether the call reads
padding positions (labels predicted from padding, generate()'s next token). Found by the calling frames, it steps
aside (`head_outside_patch`), exact. So does one under a head that does not generate and that patchkit does not
wrap (ColPali's retrieval head, a user's own): it reads every position's hidden state (`unwrapped_head`).

A forward a framework set on a causal LM's instance after the class patch (Liger's `lce_forward`, TRL's fused head,
Unsloth's) runs in place of the class's: it calls the base model and its own head and loss over the padded batch.
Its call's arguments are read off its frame (`foreign_call`), so the base model steps aside only where they read
padding (labels predicted from padding, generate()'s next token at padding), as the class's wrapper would tell it.
So are the labels of a subclass's own forward that calls the class's wrapper through `super()` without them and
computes its loss from the logits (`subclass_labels`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import CodeType
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from patchkit.forward.inputs.module_hooks import origin_of
from patchkit.hooks.install.forward_source import innermost
from patchkit.hooks.install.patching import BoundPatch
from patchkit.warn import MAX_FRAMES, trainers

CLEAN = "_patchkit_callers_read"  # set on a base model whose callers were read and hold no such head (a dict read
# a forward: a WeakSet's lookup would build a weak reference every call)
_generative: dict[type, bool] = {}
_overriding: dict[type, tuple] = {}  # a causal LM class -> (its forward, that forward's code where it is a subclass's)
LM_WRAPPERS: set = set()  # the code of patchkit's causal-LM wrappers (the patch's, the registered name's)


def outer_models(base: nn.Module) -> Iterator[Optional[nn.Module]]:
    """The models whose forward called `base`, innermost first, read off the calling frames; None, and nothing after
    it, for a wrapper of patchkit's on the way (it tells the base model about its call)."""
    pretrained = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in LM_WRAPPERS:
            yield None
            return
        owner = frame.f_locals.get("self") if "forward" in frame.f_code.co_name else None  # lce_forward too
        if owner is not base and isinstance(owner, pretrained) and any(m is base for m in owner.modules()):
            yield owner
        frame = frame.f_back


def head_outside_patch(base: nn.Module) -> Optional[nn.Module]:
    """The generative head around `base` that called it where no LM wrapper of patchkit's is on the way, else None.
    Read off the calling frames once per base model (every call while one is found: the user may patch it since)."""
    if vars(base).get(CLEAN):
        return None
    found, foreign = None, False
    for owner in outer_models(base):
        foreign = foreign or (owner is not None and foreign_forward(owner) is not None)
        if owner is not None and not generative_head(type(owner)):
            continue
        if owner is None or wrapped(owner):  # a wrapper of patchkit's speaks (a frame torch.compile rewrote is not
            found = None  # the wrapper's own code: its module's forward tells)
            break
        found = found or owner
    if found is None and not foreign:  # a framework's forward may call the base model past the class's wrapper
        vars(base)[CLEAN] = True
    return found


def foreign_forward(module: nn.Module) -> Optional[Callable]:
    """The function of a forward that runs in place of the class patch's wrapper: set on `module`'s instance (Liger's,
    TRL's fused head, Unsloth's), or on its class after the class patch (Liger's `apply_liger_kernel_to_*`); not
    patchkit's, not transformers', and not a wrapper around the class's (accelerate's hooks and mixed precision),
    else None. patchkit's class wrapper does not see its calls."""
    own = instance_forward(module)
    if isinstance(own, BoundPatch):
        return None
    runs = innermost(type(module).forward if own is None else own, through_patchkit=False)
    runs = getattr(runs, "__func__", runs)  # a functools.wraps of the class's copies its marks: code tells
    code = getattr(runs, "__code__", None)
    if code is None or code in LM_WRAPPERS:
        return None
    if own is None:  # the class's own: a framework's only where neither transformers nor patchkit wrote it
        return None if ours_or_transformers(runs) else runs
    return None if code is getattr(type(module).forward, "__code__", None) else runs


def ours_or_transformers(function: Callable) -> bool:
    """`function` was written by transformers or patchkit, not by a framework or the user."""
    return origin_of(function).startswith(("transformers.", "patchkit."))


def instance_forward(module: nn.Module) -> Optional[Callable]:
    """The forward set on `module`'s instance, seen through torch.compile's wrapper: `model.forward =
    torch.compile(model.forward)` (transformers' recipe for compiled generation) compiles patchkit's forward, the
    instance patch's or the class patch's bound to it, and runs no other."""
    own = vars(module).get("forward")
    own = getattr(own, "_torchdynamo_orig_callable", own)
    inner = getattr(own, "__wrapped__", None)  # dynamo's frame around a callable object (`wrap_inline`)
    return inner if isinstance(inner, BoundPatch) else own


def same_code(running: CodeType, code: CodeType) -> bool:
    """`running` is `code`, or the copy of it torch.compile runs (the same name, file and first line)."""
    return running is code or (running.co_name, running.co_filename, running.co_firstlineno) == (
        code.co_name, code.co_filename, code.co_firstlineno)


def foreign_call(head: nn.Module) -> Optional[tuple[dict, bool]]:
    """The arguments `head`'s `foreign_forward` was called with (its frame's locals, its `**kwargs` spread; the frame
    of torch.compile's copy of it too: SFTTrainer's fused head under `torch_compile=True`), and whether it takes
    `logits_to_keep`; None where no such call is on the stack."""
    return call_of(head, getattr(foreign_forward(head), "__code__", None))


def subclass_labels(module: nn.Module) -> Optional[torch.Tensor]:
    """The labels of the forward that `module`'s class defines over a patched class's wrapper and that called it
    through `super()` without them (a user's causal LM that computes its own loss from the logits), read off its
    frame; None where the class runs patchkit's or transformers' forward (decided once per class and forward)."""
    cls = type(module)
    seen = _overriding.get(cls)
    if seen is None or seen[0] is not cls.forward:
        code = getattr(cls.forward, "__code__", None)
        seen = _overriding[cls] = (cls.forward, code if code is not None and code not in LM_WRAPPERS
                                   and not ours_or_transformers(cls.forward) else None)
    call = call_of(module, seen[1]) if seen[1] is not None else None
    return None if call is None else next(
        (call[0][name] for name in LABEL_NAMES if isinstance(call[0].get(name), torch.Tensor)), None)


# What a causal LM's own forward names its labels: transformers', nanoGPT's and its descendants', older scripts'
LABEL_NAMES = ("labels", "targets", "target", "lm_labels", "label_ids")


def trainer_labels() -> Optional[torch.Tensor]:
    """The labels the HF Trainer's `compute_loss` popped from the batch before it called the model, to compute its
    loss from the logits itself (label smoothing, `compute_loss_func`; a subclass's override, transformers' recipe
    for a loss of one's own), read off its frame; None elsewhere."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return None
    frame = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        if trainers(frame, "compute_loss") or (frame.f_code.co_name == "compute_loss" and isinstance(
                frame.f_locals.get("self"), getattr(module, "Trainer", ()))):
            labels = frame.f_locals.get("labels")
            return labels if isinstance(labels, torch.Tensor) else None
        frame = frame.f_back
    return None


def call_of(head: nn.Module, code: Optional[CodeType]) -> Optional[tuple[dict, bool]]:
    """The arguments of the call of `code` on `head` on the stack, and whether it takes `logits_to_keep`."""
    frame = sys._getframe(2)
    while code is not None and frame is not None:
        if same_code(frame.f_code, code) and frame.f_locals.get("self") is head:
            local = dict(frame.f_locals)
            named = code.co_argcount + code.co_kwonlyargcount
            spread = {}
            if code.co_flags & inspect.CO_VARKEYWORDS:  # its **kwargs, after the named ones and *args
                spread = local.pop(code.co_varnames[named + bool(code.co_flags & inspect.CO_VARARGS)], {})
            keeps = "logits_to_keep" in code.co_varnames[:named]
            return {**(spread if isinstance(spread, dict) else {}), **local}, keeps
        frame = frame.f_back
    return None


READER = "_patchkit_unwrapped_head"  # set on a base model once its callers were read for `unwrapped_head`


def unwrapped_head(base: nn.Module) -> bool:
    """`base` was called by a model with a head of its own that patchkit does not wrap and that does not generate
    (those are `head_outside_patch`'s), with no wrapper of patchkit's on the way: a retrieval head (ColPali's) or a
    user's, which reads the hidden state at every position, padding included. Varlen attention computes nothing at
    padding (its hidden states there are an embedding's, or zeros), and such a head may divide by them (ColPali
    L2-normalizes each position before it masks padding: 0 / 0). Read off the calling frames once per base model."""
    known = vars(base).get(READER)
    if known is not None:
        return known
    head = next((m for m in outer_models(base) if m is None or m.base_model is not m), None)
    found = head is not None and not wrapped(head) and not generative_head(type(head))
    vars(base)[READER] = found
    return found


def generative_head(cls: type) -> bool:
    """`cls` generates and its forward takes labels: it computes its head and loss over the logits at every
    position (a sequence classifier does not generate: what it reads is `task_reads`'s)."""
    if cls not in _generative:
        generation = importlib.import_module("transformers.generation").GenerationMixin
        _generative[cls] = issubclass(cls, generation) and "labels" in inspect.signature(cls.forward).parameters
    return _generative[cls]


def wrapped(module: nn.Module) -> bool:
    """`module.forward` is patchkit's: on the instance, or on its class or a base class (a LLaVA repo's subclass of
    LlamaForCausalLM calls the class patch's forward through `super()`)."""
    if foreign_forward(module) is not None:
        return False  # the class's forward is patchkit's, but the instance runs its own
    return isinstance(instance_forward(module), BoundPatch) or any(
        hasattr(vars(cls).get("forward"), "__wrapped_original__") for cls in type(module).__mro__)
