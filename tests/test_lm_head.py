"""The causal LM's head and loss run on real tokens only (`patchkit/hooks/head/lm_head.py`), with unpatched numbers.

Every family's padded training step is compared with unpatched by the census (loss, logits, every gradient) and
it requires the head on real tokens wherever the base model unpads; these tests pin what the census does not
read: how many rows the head sees, the logits at padding, the families' own logit transforms and auxiliary loss,
and the callers whose calls keep the padded exit.
"""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
from census import tiny_lm
from models import labels_for, padded_batch

import patchkit
from patchkit.errors import PatchkitError
from patchkit.hooks.head import lm_head
from patchkit.hooks.install.forward_source import servable_forward

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def family(model_type: str, **overrides) -> torch.nn.Module:
    model, why = tiny_lm(model_type)
    assert model is not None, why
    for key, value in overrides.items():
        setattr(model.config.get_text_config(), key, value)
    return model


def batch(model: torch.nn.Module) -> dict:
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    ids = ids.clamp(max=model.config.get_text_config().vocab_size - 1)
    return dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), use_cache=False)


def head_rows(model: torch.nn.Module) -> list:
    """The row counts the LM's head sees, one entry per call (a forward hook on its output embeddings, marked as
    reading no layout: an unmarked one would keep the head on the padded batch)."""
    seen: list = []
    model.get_output_embeddings().register_forward_hook(
        patchkit.shape_free(lambda m, i, o: seen.append(i[0].shape[:-1].numel())))
    return seen


def step(model: torch.nn.Module, **inputs) -> tuple:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, out


def assert_same(got: tuple, want: tuple, mask: torch.Tensor) -> None:
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=2e-5, rtol=1e-4)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=2e-5, rtol=1e-3, msg=name)


# llama: the plain head; gemma2: final_logit_softcapping; cohere: logit_scale; granite: logits_scaling; phi: a head
# with a bias; mixtral: the router's auxiliary loss added to the loss (output_router_logits)
FAMILIES = {"llama": {}, "gemma2": {}, "cohere": {}, "granite": {}, "phi": {},
            "mixtral": {"output_router_logits": True, "router_aux_loss_coef": 0.5}}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_head_and_the_loss_run_on_real_tokens_with_unpatched_numbers(model_type):
    model = family(model_type, **FAMILIES[model_type])
    inputs = batch(model)
    mask = inputs["attention_mask"]
    want = step(model, **inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        rows = head_rows(model)
        got = step(model, **inputs)
        assert handle.heads == {lm_head.REAL_TOKENS: 1}
    assert rows == [int(mask.sum()) + 1]  # the real tokens and one zero row, whose logits fill the padding
    assert_same(got, want, mask)
    if model_type == "mixtral":
        assert got[3].aux_loss is not None
        torch.testing.assert_close(got[3].aux_loss, want[3].aux_loss)


@pytest.mark.parametrize("model_type", ["llama", "phi", "gemma2"])
def test_logits_at_padding_are_the_heads_of_a_zero_hidden_state(model_type):
    """What patchkit's logits at padding have always been (the base model repadded zeros): the family's head and
    logit transforms of a zero vector, so a bias or a softcap shows there as before."""
    model = family(model_type).eval()
    inputs = batch(model)
    del inputs["labels"]
    with patchkit.apply_patch(model=model, backend="sdpa"), torch.no_grad():
        logits = model(**inputs).logits
        text = model.config.get_text_config()
        zero = model.get_output_embeddings()(torch.zeros(1, text.hidden_size))
        cap = getattr(text, "final_logit_softcapping", None)
        if cap:
            zero = torch.tanh(zero / cap) * cap
    pad = inputs["attention_mask"] == 0
    torch.testing.assert_close(logits[pad], zero.expand(int(pad.sum()), -1))


def test_callers_own_shift_labels_and_num_items_in_batch_reach_the_loss_on_real_tokens():
    model = family("llama")
    inputs = batch(model)
    labels = inputs.pop("labels")
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    inputs.update(labels=labels, shift_labels=shift, num_items_in_batch=torch.tensor(int((shift != -100).sum()) + 5))
    want = step(model, **inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = step(model, **inputs)
        assert handle.heads == {lm_head.REAL_TOKENS: 1}
    assert_same(got, want, inputs["attention_mask"])


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_shift_labels_without_labels_ask_for_no_loss_as_transformers_computes_none(unpad):
    """The HF Trainer's context-parallel step builds `shift_labels`, then pops `labels` where it computes a loss of its
    own (label smoothing, `compute_loss_func`) from the logits: transformers' LM computes no loss then, and every
    position's logits are the caller's (was: a PatchkitError blaming patchkit)."""
    model = family("qwen3").train()
    inputs = batch(model)
    labels = inputs.pop("labels")
    inputs["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    want = model(**inputs)
    with patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad):
        got = model(**inputs)
    assert want.loss is None and got.loss is None
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    smoothed = torch.nn.functional.cross_entropy(  # the Trainer's own loss, from the logits
        got.logits.flatten(0, 1), inputs["shift_labels"].flatten(), ignore_index=-100, label_smoothing=0.1)
    torch.testing.assert_close(smoothed, torch.nn.functional.cross_entropy(
        want.logits.flatten(0, 1), inputs["shift_labels"].flatten(), ignore_index=-100, label_smoothing=0.1))


@pytest.mark.parametrize("how", ["logits_to_keep", "own_loss", "tuple"])
def test_calls_the_packed_row_cannot_serve_keep_the_padded_exit_and_say_why(how):
    model = family("llama")
    inputs = batch(model)
    if how == "logits_to_keep":
        inputs.pop("labels")
        inputs["logits_to_keep"] = 3
    elif how == "own_loss":
        model.loss_function = lambda logits, labels, vocab_size, **kw: torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    else:
        inputs["return_dict"] = False
    with torch.no_grad():
        want = model(**inputs)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle, torch.no_grad():
        rows = head_rows(model)
        got = model(**inputs)
        why = handle.heads
    n, seq = inputs["input_ids"].shape
    assert rows == [n * (3 if how == "logits_to_keep" else seq)]
    if how == "logits_to_keep":
        assert why == {}  # the last positions only: no head on padding to save
    else:
        assert list(why) != [lm_head.REAL_TOKENS] and sum(why.values()) == 1
        assert ("return_dict=False" if how == "tuple" else "ForCausalLMLoss") in next(iter(why))
    got_logits, want_logits = (got[1], want[1]) if how == "tuple" else (got.logits, want.logits)
    real = inputs["attention_mask"].bool()
    if how == "logits_to_keep":
        real = real[:, -3:]
    torch.testing.assert_close(got_logits[real], want_logits[real], atol=2e-5, rtol=1e-4)
    if how != "logits_to_keep":
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_the_report_says_where_the_head_ran():
    model = family("llama")
    inputs = batch(model)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        model(**inputs)
        model(**{**inputs, "return_dict": False})
        report = handle.report()
    assert "LM head and loss: 1 forwards on real tokens; 1 on the padded batch: a tuple output" in report


@pytest.mark.parametrize("unpad, layout", [("model", "padded"), ("loss", "padded"), ("loss", "packed")])
def test_a_forward_that_computes_its_loss_past_loss_function_is_refused_by_name(unpad, layout):
    """A family whose forward reads as one that computes its loss through `self.loss_function` (no other value is
    assigned to a `loss`) but does not would compute it on the rows handed to its head (the packed row; the labelled
    rows alone under unpad="loss", of a packed batch too): patchkit refuses it rather than return that loss."""
    from transformers import LlamaForCausalLM

    class OwnLoss(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
            # reads like transformers' (self.loss_function(...)), computes its own
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            logits = self.lm_head(out.last_hidden_state)
            # every position's, padding's too: not transformers' loss
            return {"loss": logits.logsumexp(-1).mean(), "logits": logits}

    base = family("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = OwnLoss(base.config)
    inputs = batch(model)
    if layout == "packed":  # one row of documents, no padding: the base model keeps it
        real = inputs.pop("attention_mask").bool()
        inputs.update(input_ids=inputs["input_ids"][real][None], labels=inputs["labels"][real][None])
    with patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad):
        with pytest.raises(PatchkitError, match="computed its loss without transformers' loss_function"):
            model(**inputs)


def test_a_loss_the_caller_computes_from_the_logits_gets_unpatched_gradients():
    """The Trainer's label smoothing and `compute_loss_func` pass no labels and read `logits` (B, N, V): gradients
    flow back through the repadded logits to the head and every layer."""
    model = family("phi")  # a head with a bias
    inputs = batch(model)
    labels = inputs.pop("labels")

    def caller_step() -> dict:
        model.zero_grad(set_to_none=True)
        logits = model(**inputs).logits
        smoothed = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                     label_smoothing=0.1)
        smoothed.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = caller_step()
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = caller_step()
        assert handle.heads == {lm_head.REAL_TOKENS: 1}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-3, msg=name)


def trainer_run(model: torch.nn.Module, rows: list, unpad: Optional[str], tmp_path, **arguments) -> tuple:
    """The HF Trainer over `rows` (2 micro-batches per step, seeded), under a patch with `unpad` (None: unpatched):
    the logged losses, the trained weights, the patch's `heads` and the forwards it stepped aside."""
    import transformers as tf

    args = tf.TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=2, learning_rate=1e-2,
                                use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
                                dataloader_num_workers=0, disable_tqdm=True, **arguments)
    handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if unpad else None
    try:
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        heads, aside = (dict(handle.heads), dict(handle.stepped_aside)) if handle else ({}, {})
    finally:
        if handle is not None:
            handle.revert()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, heads, aside


def assert_trained_alike(got: tuple, want: tuple) -> None:
    """`trainer_run`'s losses and trained weights as unpatched."""
    assert got[0] == pytest.approx(want[0], abs=1e-5), (got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_the_trainer_with_gradient_accumulation_equals_unpatched(tmp_path, unpad):
    """The HF Trainer, 2 micro-batches per step: it passes num_items_in_batch (the labelled tokens of both), which
    the loss on real tokens divides by as transformers' does; the losses and the trained weights equal unpatched.
    The Trainer's own training step reads the loss alone, so under unpad="model" too every micro-batch runs the
    fused head (the first after checking the family's logits)."""
    ids, mask = padded_batch("right", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels_for(ids, mask))]
    want, got = (trainer_run(family("llama"), rows, way, tmp_path, max_steps=2, per_device_train_batch_size=1)
                 for way in (None, unpad))
    assert got[2] == {lm_head.FUSED: 4}
    assert_trained_alike(got, want)


def test_a_transformers_reached_through_a_link_is_still_read_as_transformers(tmp_path, monkeypatch):
    """transformers' `__file__` by a symlink (a linked checkout, a test tree's `src/transformers`, a venv's lib64) and
    its code objects by the real path: its decorators are still seen through, so a causal LM's head and loss run on
    the real tokens, and the frames of its utils still pass the output on (the Trainer's loss alone). Before, every
    family's head ran on the padded batch there, "its forward computes its loss without transformers' loss_function"."""
    from pathlib import Path

    import transformers
    from transformers import LlamaForCausalLM

    from patchkit.hooks.head import loss_reader

    real = Path(transformers.__file__).parent
    link = tmp_path / "transformers"
    link.symlink_to(real, target_is_directory=True)
    monkeypatch.setattr(transformers, "__file__", str(link / "__init__.py"))
    assert servable_forward(LlamaForCausalLM.forward)
    assert loss_reader._passing(str(real / "utils" / "generic.py"))
    assert loss_reader._passing(str(link / "utils" / "generic.py"))
    assert not loss_reader._passing(str(real / "models" / "llama" / "modeling_llama.py"))


def loss_alone(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> float:
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()  # the loss alone: the fused head


@pytest.mark.parametrize("misfit", ["int32 labels", "a head wider than vocab_size"])
def test_what_transformers_loss_fails_on_is_refused_not_computed(misfit):
    """int32 labels, or a head replaced by a wider one without config.vocab_size: transformers' loss raises, and
    patchkit's fused head and loss computed a loss (4.5394, 4.9971), so the script failed only without patchkit.
    Refused, naming the fix; the model still runs once the fix is made."""
    model = family("llama")
    ids, mask = padded_batch("right")
    labels = labels_for(ids, mask)
    if misfit == "int32 labels":
        labels = labels.to(torch.int32)
    else:
        old = model.lm_head
        model.lm_head = torch.nn.Linear(old.in_features, old.out_features + 16, bias=False)
    with pytest.raises(RuntimeError):
        loss_alone(model, ids, mask, labels)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with pytest.raises(patchkit.PatchInputError, match="labels.long" if misfit == "int32 labels" else
                           "vocab_size=.*set it to the head's width"):
            loss_alone(model, ids, mask, labels)
        if misfit == "int32 labels":
            assert loss_alone(model, ids, mask, labels.long()) > 0
