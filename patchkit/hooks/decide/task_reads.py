"""What a task head around a served base model reads at padding positions, which its base model must know to step aside.

A sequence classifier pools one position per row, a token classifier's loss reads each labelled position, and
question answering's loss normalises its start and end logits over every position. transformers computes a hidden
state at each padding position (a padding query row attends to the real keys before it; eager attention averages
over a left-padded query's masked keys); varlen kernels compute none there, so a head that reads one gets other
numbers unless the forward runs on transformers' attention. A row that is all padding is no exception: its values
agree on some families, its gradients not on those with biases (StarCoder2's, StableLM's).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from patchkit.forward.inputs.arguments import given_cache, input_tokens
from patchkit.forward.loss.cross_entropy import IGNORE_INDEX
from patchkit.hooks.decide.step_aside import padded

# the task heads of transformers' modeling modules, by the end of their class names
TASKS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
# the argument of a multiple-choice head beside a language model's (GPT-2's DoubleHeadsModel): the position it pools
# in each choice's row, the last column where None
CHOICE = "mc_token_ids"


def task_of(cls: type) -> Optional[str]:
    """The task (an entry of TASKS) whose head `cls` is, or None."""
    return next((task for task in TASKS if cls.__name__.endswith(task)), None)


def pad_token_ids(head: Any) -> list[Optional[int]]:
    """The pad token a sequence classifier pools by, as its forward reads it: transformers' generic classifier (5.x)
    its text config's (where a composite config keeps it; a pad token set on the composite itself is not read),
    a family's own its config's; both where its code cannot be read (each is checked: a false positive steps
    aside)."""
    config = head.config
    own = getattr(config, "pad_token_id", None)
    text = getattr(config.get_text_config(), "pad_token_id", None) if hasattr(config, "get_text_config") else own
    reads = _pad_read_from(type(head))
    return [text] if reads == "text" else [own] if reads == "config" else list(dict.fromkeys([own, text]))


_pad_reads: dict[type, Optional[str]] = {}


def _pad_read_from(cls: type) -> Optional[str]:
    """Which config the classifier's forward reads its pad token from ("text", "config"), read off its code once."""
    if cls not in _pad_reads:
        try:
            code = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            code = ""
        _pad_reads[cls] = ("text" if "get_text_config().pad_token_id" in code
                           else "config" if "config.pad_token_id" in code else None)
    return _pad_reads[cls]


def pooled_positions(input_ids: Any, pad: Optional[int], batch: int, width: int, device: Any) -> list[torch.Tensor]:
    """The position each row of a sequence classifier's batch pools, under each rule transformers has used (a row's
    candidates are all read: a false positive only steps aside): the last token that is not `pad` (4.48+), and the
    one before the first `pad`, wrapping to the last column (4.31-4.47); the last column without ids or pad token."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or pad is None:
        return [torch.full((batch,), width - 1, dtype=torch.long, device=device)]
    columns = torch.arange(width, device=input_ids.device)
    not_pad = input_ids != pad
    last_not_pad = (columns * not_pad).argmax(-1)
    before_first_pad = ((~not_pad).int().argmax(-1) - 1) % width
    return [last_not_pad, before_first_pad]


def reads_by_position(task: Optional[str], arguments: dict) -> bool:
    """The call of a head of `task` may read a padding position (known without the tensors' values, as in a graph):
    a sequence classifier always, the others where given their labels."""
    if task == "ForSequenceClassification":
        return True
    if task == "ForTokenClassification":
        return arguments.get("labels") is not None
    return task is not None and arguments.get("start_positions") is not None and (
        arguments.get("end_positions") is not None)


def task_cause(head: Any, arguments: dict) -> Optional[str]:
    """Why `head`'s call (a task head's: `task_of` its class) reads transformers' values at padding positions, or
    None: `pooled_at_padding`, `labels_from_padding` (a token label at padding), `softmax_over_padding` (question
    answering's loss over a padded row)."""
    task = task_of(type(head))
    mask, tokens = arguments.get("attention_mask"), input_tokens(arguments)
    if (isinstance(mask, torch.Tensor) and mask.dim() == 2 and tokens is not None and given_cache(arguments) is not None
            and 0 < tokens.shape[1] < mask.shape[-1]):
        mask = mask[:, -tokens.shape[1]:]  # behind a past (PEFT's prefix tuning): the tokens' own columns
    if not padded(mask) or not reads_by_position(task, arguments):
        return None
    batch, width = mask.shape
    padding = mask == 0
    if task == "ForSequenceClassification":
        rows = torch.arange(batch, device=mask.device)
        ids = arguments.get("input_ids")
        if input_tokens(arguments) is None or (ids is not None and tuple(ids.shape) != (batch, width)):
            return None  # transformers refuses it, or a shape patchkit's own checks refuse
        pads = pad_token_ids(head)
        if all(pad is None for pad in pads) and batch != 1:
            return None  # transformers refuses it: "Cannot handle batch sizes > 1 if no padding token is defined."
        read = [p for pad in pads for p in pooled_positions(ids if pad is not None else None, pad, batch, width,
                                                             mask.device)]
        return "pooled_at_padding" if any(bool(padding[rows, p.to(mask.device)].any()) for p in read) else None
    if task == "ForTokenClassification":
        labels = arguments.get("labels")
        if isinstance(labels, torch.Tensor) and tuple(labels.shape) == (batch, width):
            return "labels_from_padding" if bool(((labels != IGNORE_INDEX) & padding).any()) else None
        return None
    return "softmax_over_padding"  # question answering, given its positions


def choice_cause(arguments: dict) -> Optional[str]:
    """`choice_at_padding` where a multiple-choice head (a forward that takes `CHOICE`) pools a padding position:
    GPT-2's DoubleHeadsModel reads each choice's `mc_token_ids` position (batch, choices) of its (batch, choices,
    tokens) rows, the last column where None (a right-padded choice's padding); else None."""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or bool(mask.all()):
        return None
    rows = mask.reshape(-1, mask.shape[-1])
    width, index = rows.shape[-1], arguments.get(CHOICE)
    read = torch.full((rows.shape[0],), width - 1, device=mask.device) if index is None else index
    if not isinstance(read, torch.Tensor) or read.numel() != rows.shape[0] or not bool(
            ((read >= 0) & (read < width)).all()):
        return None  # transformers refuses it
    read = read.reshape(-1, 1).to(device=mask.device, dtype=torch.long)
    return "choice_at_padding" if bool((rows.gather(1, read) == 0).any()) else None
