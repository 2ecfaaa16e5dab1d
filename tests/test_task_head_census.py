"""The task-head census: every served family's sequence classifier, token classifier and question-answering head, tiny,
against itself on transformers' eager attention, through the class patch, the instance patch and the registered name;
with the multimodal heads beside a family's causal LM (Gemma 3's, Qwen 3.5's: a composite config, built from the
census's tiny multimodal model).

Each head reads its own positions of the base model's output: the pooled token, each labelled token, every position
under question answering's softmax. Where the batch makes one of them a padding position, the forward steps aside by
name and gives transformers' numbers; where none is, it runs patched and gives them too.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Callable, Optional

import pytest
import torch
import transformers
from census import causal_lm_name, causal_lm_types, tiny_config, tiny_wrapper, wrapper_types
from packaging.version import Version
from patchkit.patches import table

import patchkit
from patchkit.errors import PatchTargetError
from patchkit.hooks.install.registry import PATCH_MODULES, for_model_type
from patchkit.hooks.name import attention_interface

ATOL = 5e-5
PAD = 0
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.0"),
                                reason="families from data: transformers 5.x")


def batch(pad_ids: Optional[int], vocab: int, empty_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows: whole, right-padded, left-padded, and a fourth all padding where `empty_row` (a reward batch's
    answer truncated away); ids at padding `pad_ids` (None: random tokens, as a tokenizer padding with another token
    than the config's pad_token_id gives)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, vocab, (4 if empty_row else 3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, :6] = 0
    mask[3:] = 0
    if pad_ids is not None:
        ids = ids.masked_fill(mask == 0, pad_ids)
    return ids, mask


def cases(task: str, vocab: int) -> list[tuple[str, dict, Optional[str]]]:
    """(name, inputs, the cause the forward steps aside for, or None: patched) of a task head. A row all padding is
    read like any padding (its values agree on some families, its gradients not on those with biases)."""
    ids, mask = batch(PAD, vocab)
    other_ids, _ = batch(None, vocab)
    ids4, mask4 = batch(PAD, vocab, empty_row=True)
    if task == "ForSequenceClassification":
        labels = torch.tensor([0, 1, 2])
        return [("pad ids", dict(input_ids=ids, attention_mask=mask, labels=labels), None),
                ("other ids at padding", dict(input_ids=other_ids, attention_mask=mask, labels=labels),
                 "pooled_at_padding"),
                ("a row all padding", dict(input_ids=ids4, attention_mask=mask4, labels=torch.tensor([0, 1, 2, 1])),
                 "pooled_at_padding")]
    if task == "ForTokenClassification":
        labels = torch.randint(0, 3, ids4.shape, generator=torch.Generator().manual_seed(2))
        unread = labels.masked_fill(mask4 == 0, -100)
        return [("-100 at padding", dict(input_ids=ids4, attention_mask=mask4, labels=unread), None),
                ("labels at padding", dict(input_ids=ids4, attention_mask=mask4, labels=labels),
                 "labels_from_padding")]
    positions = dict(start_positions=torch.tensor([1, 2, 7]), end_positions=torch.tensor([4, 5, 9]))
    only_empty = torch.ones_like(mask4)
    only_empty[3] = 0  # the other rows whole
    return [("unpadded", dict(input_ids=ids, attention_mask=torch.ones_like(mask), **positions), None),
            ("padded", dict(input_ids=ids, attention_mask=mask, **positions), "softmax_over_padding"),
            ("a row all padding", dict(input_ids=ids4, attention_mask=only_empty,
                                       start_positions=torch.tensor([1, 2, 7, 0]),
                                       end_positions=torch.tensor([4, 5, 9, 0])), "softmax_over_padding")]


def outputs(model: torch.nn.Module, inputs: dict) -> dict:
    """The loss, the logits at real tokens (every row's pooled ones for a sequence classifier) and every gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the token classifier's dropout: the same mask every way
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    got = {"loss": out.loss.detach()}
    real = inputs["attention_mask"].bool()
    for key in ("logits", "start_logits", "end_logits"):
        value = getattr(out, key, None)
        if value is not None:
            got[key] = value.detach()[real] if value.shape[:2] == real.shape else value.detach()
    got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return got


def differs(got: dict, want: dict) -> str:
    for key, w in want.items():
        d = (got[key] - w).abs().max().item() if key in got else float("inf")
        if not d <= ATOL * max(1.0, w.abs().max().item()):
            return f"{key} differs by {d:.2g}"
    return ""


TASKS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def task_heads(model_type: str) -> list[type]:
    """The task heads transformers defines beside the family's causal LM (read here, not from patchkit)."""
    name = causal_lm_name(model_type)
    module = sys.modules[getattr(transformers, name).__module__]
    return [cls for cls in vars(module).values()
            if isinstance(cls, type) and cls.__module__ == module.__name__ and cls.__name__.endswith(TASKS)]


def head_config(model_type: str, head: type):
    """A tiny config `head` builds from, 3 labels, padding with PAD: the family's own, or for a multimodal head beside
    it (Gemma 3's, Qwen 3.5's sequence classifier: a composite config) the census's tiny multimodal model's, its
    language model the family's tiny one; None where the head is of another family's config, or no tiny multimodal
    model builds."""
    config = tiny_config(model_type)
    if not isinstance(config, head.config_class):
        composite = head.config_class.model_type
        wrapper = tiny_wrapper(composite)[0] if composite in wrapper_types() else None
        if wrapper is None:
            return None
        config = copy.deepcopy(wrapper.config)
    config.num_labels = 3
    config.pad_token_id = config.get_text_config().pad_token_id = PAD
    return config


def run_way(way: str, model_type: str, model: torch.nn.Module, inputs: dict,
            measure: Callable[[torch.nn.Module, dict], dict] = outputs) -> tuple[dict, dict]:
    """`measure` (`outputs`) of `inputs` through one way in, and the forwards it stepped aside for (cause: count;
    under the registered name alone, the attention calls)."""
    if way == "registered name":
        attention_interface.register(backend="sdpa")
        model.set_attn_implementation(attention_interface.ATTENTION_NAME)
        state = attention_interface.route_state()
        before = dict(state.stepped_aside)
        try:
            got = measure(model, inputs)
        finally:
            model.set_attn_implementation("eager")
            after = dict(state.stepped_aside)
            attention_interface.register(backend="auto")
        return got, {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    patch = dict(model=model) if way == "instance" else {}
    with patchkit.apply_patch(None if patch else model_type, **patch, backend="sdpa") as handle:
        got = measure(model, inputs)
        return got, dict(handle.stepped_aside)


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_task_heads(model_type):
    try:
        spec = for_model_type(model_type)
    except PatchTargetError as stop:
        pytest.skip(f"not served: {stop}")
    if model_type not in table.VERIFIED and spec.name not in PATCH_MODULES:
        pytest.skip("not verified by the causal-LM census")
    built = [(head, config) for head in task_heads(model_type) for config in [head_config(model_type, head)]
             if config is not None]  # a head of another config class (a module several families share) is theirs
    if not built:
        pytest.skip("no task head on this family's config")
    failures = {}
    for head, config in built:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = head._from_config(config, attn_implementation="eager").float().train()
        task = next(t for t in TASKS if head.__name__.endswith(t))
        for name, inputs, cause in cases(task, config.get_text_config().vocab_size):
            want = outputs(model, inputs)
            for way in ("class", "instance", "registered name"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got, aside = run_way(way, model_type, model, inputs)
                what = differs(got, want)
                expected = set() if cause is None else {cause}
                if set(aside) != expected:
                    what = f"stepped aside {aside}, not {expected}" + (f"; {what}" if what else "")
                if what:
                    failures[f"{head.__name__} {name} ({way})"] = what
    assert not failures, failures
