"""Liger-Kernel's causal-LM forwards with patchkit, in either order: `use_liger_kernel=True` (TRL, the HF Trainer,
axolotl's plugin) sets Liger's `lce_forward` on the model, which runs the base model and then its own head fused with
the loss over the padded hidden states, past `self.loss_function`.

- Set after a class patch (the Trainer's order), it runs in place of patchkit's wrapper, which no longer tells the
  base model what the call reads at padding: a label predicted from a padding position was computed from the
  packed path's padding states (another loss and gradients, silently). Its call is read off its frame now.
- Patched after it, its text reads as transformers' (it calls `self.loss_function` where it keeps the logits), so
  the base model handed it the packed row, which its fused loss cannot take (a crash). It gets the padded exit now.

Liger's kernels are Triton's (GPUs): here a forward of Liger's shape (`lce_forward` below, its steps as Liger 0.8
writes them) with a float32 torch loss; with liger-kernel installed, Liger's own forward with its loss run in torch.
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from families import any_model
from models import labels_for, padded_batch
from test_multimodal_wrappers import assert_same_step

import patchkit

ORDERS = ["class patch, then Liger on the instance", "instance patch, then Liger on the instance",
          "Liger on the class, then the class patch", "Liger on the instance, then the instance patch",
          "class patch, then Liger on the class"]


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Liger's fused head and loss, as a torch reference: mean over the targets that are not -100."""
    return F.cross_entropy((hidden @ weight.T).float(), target, ignore_index=-100)


def lce_forward(self: Any, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                past_key_values: Any = None, inputs_embeds: Any = None, labels: Any = None, use_cache: Any = None,
                logits_to_keep: int = 0, skip_logits: Any = None, **kwargs: Any) -> dict:
    """Liger's `lce_forward`: the base model, then (training with labels) its fused loss on the hidden states it
    returned, shifted as Liger shifts them; else the head and `self.loss_function`."""
    out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = out[0][:, slice(-logits_to_keep, None), :]
    logits = loss = None
    if skip_logits is None:
        skip_logits = self.training and labels is not None
    if skip_logits:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                          shift_labels.reshape(-1))
    else:
        logits = self.lm_head(hidden)
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


def ligered(model: torch.nn.Module, forward: Callable, on_class: bool) -> Callable[[], None]:
    """Liger's forward set as Liger sets it: on the class (`apply_liger_kernel_to_llama()`) or on the instance
    (`model=`, what `use_liger_kernel=True` does); returns its undo."""
    if on_class:
        cls, before = type(model), vars(type(model))["forward"]
        cls.forward = forward
        return lambda: setattr(cls, "forward", before)
    model.forward = types.MethodType(forward, model)
    return lambda: vars(model).pop("forward", None)


def naive_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-100 at padding only: under left padding the last padding position predicts each row's first token."""
    return ids.masked_fill(mask == 0, -100)


def step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def under(order: str, forward: Callable, labels: Callable, side: str) -> tuple[tuple, tuple, Any]:
    """One training step of the unpatched model under Liger's forward, and of its copy patched in `order`."""
    ids, mask = padded_batch(side)
    model = any_model("llama", "sdpa").train()
    undo = ligered(model, forward, on_class="on the class" in order)
    try:
        want = step(model, ids, mask, labels(ids, mask))
    finally:
        undo()
    model = copy.deepcopy(model)
    liger_first = order.startswith("Liger")
    undo = ligered(model, forward, on_class="on the class" in order) if liger_first else None
    handle = patchkit.apply_patch("llama" if "class patch" in order else None, model=None if "class patch" in order
                                  else model, backend="sdpa", strict=False)
    try:
        if not liger_first:
            undo = ligered(model, forward, on_class="on the class" in order)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = step(model, ids, mask, labels(ids, mask))
        return want, got, (handle.calls, dict(handle.stepped_aside), dict(handle.heads))
    finally:  # Liger's forward on the class after the patch is undone first, as it was set last
        for end in (undo, handle.revert) if order.endswith("Liger on the class") else (handle.revert, undo):
            end()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("order", ORDERS)
def test_ligers_forward_trains_patched_with_unpatched_numbers_in_either_order(order, side):
    """Labels that no padding position predicts: both layers through the patch, Liger's fused loss on the padded
    hidden states the base model hands back, named in the report where patchkit wraps Liger's forward."""
    want, got, (calls, aside, heads) = under(order, lce_forward, labels_for, side)
    assert_same_step(got, want)
    assert calls == 2 and not aside
    if order.startswith("Liger"):  # patchkit's wrapper around Liger's forward: the padded exit, said why
        assert list(heads) == ["LlamaForCausalLM's forward is test_liger.lce_forward, which computes its head or "
                               "loss its own way"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_label_predicted_from_padding_under_ligers_forward_steps_aside(order):
    """Left-padded rows labelled everywhere but at padding: each row's first token is predicted from the padding
    before it, whose state the packed path does not compute as transformers does. Under Liger's forward set after
    the class patch this trained on other numbers, silently; now every order steps aside, counted, exact."""
    want, got, (calls, aside, _) = under(order, lce_forward, naive_labels, "left")
    assert_same_step(got, want)
    assert calls == 0 and aside == {"labels_from_padding": 1}


def test_generation_under_ligers_forward_set_after_the_class_patch_equals_unpatched():
    """generate() on left-padded prompts through Liger's forward (its logits path): the same greedy tokens, the
    prefill and every decode step through the patch; a right-padded prompt's next token is read at padding: that
    prefill steps aside, as under the class's own forward."""
    model = any_model("llama", "sdpa").eval()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    undo = ligered(model, lce_forward, on_class=False)
    try:
        outputs = {}
        for side in ("left", "right"):
            ids, mask = padded_batch(side)
            want = model.generate(ids, attention_mask=mask, **kw)
            with patchkit.apply_patch("llama", backend="sdpa") as handle, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = model.generate(ids, attention_mask=mask, **kw)
                outputs[side] = (handle.calls, dict(handle.stepped_aside))
            assert torch.equal(got, want), side
    finally:
        undo()
    assert outputs["left"] == (2 * 4, {})
    assert outputs["right"][1] == {"right_padded_generation": 1}


def test_reverting_an_instance_patch_keeps_the_forward_liger_set_after_it():
    """Liger's forward set on the instance after `apply_patch(model=...)`: revert takes back patchkit's and leaves
    the user's (Liger's) in place."""
    model = any_model("llama", "sdpa")
    handle = patchkit.apply_patch(model=model, backend="sdpa")
    ligered(model, lce_forward, on_class=False)
    handle.revert()
    assert getattr(model.forward, "__func__", None) is lce_forward


def real_liger_forward(monkeypatch: pytest.MonkeyPatch) -> Callable:
    """liger-kernel's own `lce_forward` for LLaMA, its fused loss run by the torch reference (no Triton here)."""
    functional = pytest.importorskip("liger_kernel.transformers.functional")
    llama = pytest.importorskip("liger_kernel.transformers.model.llama")

    def reference(hidden, weight, target, reduction="mean", ignore_index=-100, softcap=None, **_):
        logits = (hidden @ weight.T).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    monkeypatch.setattr(functional, "liger_fused_linear_cross_entropy", reference)
    return llama.lce_forward


@pytest.mark.parametrize("labels", [labels_for, naive_labels], ids=["labels", "labels from padding"])
@pytest.mark.parametrize("order", ORDERS)
def test_liger_kernels_own_forward_in_either_order(order, labels, monkeypatch):
    """The same with liger-kernel's own forward where it is installed (skipped otherwise)."""
    forward = real_liger_forward(monkeypatch)
    want, got, (calls, aside, _) = under(order, forward, labels, "left")
    assert_same_step(got, want)
    assert (calls, aside) == ((2, {}) if labels is labels_for else (0, {"labels_from_padding": 1}))


@pytest.mark.parametrize("labels", [labels_for, naive_labels], ids=["labels", "labels from padding"])
def test_the_trainers_use_liger_kernel_trains_as_unpatched(labels, monkeypatch, tmp_path):
    """The HF Trainer with `use_liger_kernel=True` (liger-kernel installed): it sets Liger's forward on the patched
    model; two steps of two left-padded micro-batches give the unpatched losses and weights (SGD: Adam's first steps
    turn rounding-sized gradients into whole steps). Liger's RoPE, RMSNorm and SwiGLU are Triton kernels alone: off
    here."""
    real_liger_forward(monkeypatch)
    from test_lm_head import assert_trained_alike, trainer_run

    ids, mask = padded_batch("left", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels(ids, mask))]
    liger = dict(use_liger_kernel=True, liger_kernel_config={"rope": False, "rms_norm": False, "swiglu": False},
                 max_steps=2, per_device_train_batch_size=2, optim="sgd")
    want, got = (trainer_run(any_model("llama", "sdpa").train(), rows, way, tmp_path, **liger)
                 for way in (None, "model"))
    assert_trained_alike(got, want)
    assert got[3] == ({} if labels is labels_for else {"labels_from_padding": 4})


@pytest.mark.parametrize("order", [ORDERS[0], ORDERS[2]])
def test_ligers_fused_loss_is_handed_the_rows_it_scores(order, monkeypatch):
    """Liger's kernel computes the logits of every row it is handed before it drops those whose target is -100. Under
    liger-kernel's own forward (set after the class patch, the Trainer's order, or before it), the patched run hands
    it the rows of a completion-only loss alone, neither padding nor prompt, with the unpatched loss and gradients;
    the unpatched run hands it every row. Reverted, Liger's function is its own again."""
    import sys

    from patchkit.hooks.head import liger_rows

    forward = real_liger_forward(monkeypatch)
    functional = sys.modules[liger_rows.FUNCTIONAL]
    reference, handed = functional.liger_fused_linear_cross_entropy, []

    def kernel(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, **kw: Any) -> torch.Tensor:
        handed.append((hidden.shape[0], int((target != -100).sum())))
        return reference(hidden, weight, target, **kw)

    monkeypatch.setattr(functional, liger_rows.NAME, kernel)

    def completions(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        labels = labels_for(ids, mask)
        prompt = (mask.cumsum(-1) <= 4) & (mask == 1)  # each row's first four real tokens: its prompt
        return labels.masked_fill(prompt, -100)

    want, got, (calls, aside, _) = under(order, forward, completions, "left")
    assert_same_step(got, want)
    assert calls == 2 and not aside
    (rows, scored), (patched_rows, patched_scored) = handed
    assert patched_rows == patched_scored == scored < rows
    assert functional.liger_fused_linear_cross_entropy is kernel
