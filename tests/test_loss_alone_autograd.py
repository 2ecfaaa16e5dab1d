"""Loops that read the loss alone and do more with autograd than one backward: second-order gradients, a second
backward, a checkpoint around the loss, torch.func transforms, a loss of the model's own.

Each gets the unpatched loop's numbers, or a `PatchkitError` naming the fix where the fused head cannot serve it (it
keeps no graph of its gradients); never a silent difference (a Hessian-vector product through a tied head was 0.19
off before)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import padded_batch
from test_lm_head import batch, family
from torch.utils.checkpoint import checkpoint

import patchkit

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")


def loss_of(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs).loss  # reads the loss alone: the fused head serves it under unpad="model"


def hvp(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """A Hessian-vector product over every parameter (a gradient penalty's, a second-order optimizer's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_of(model, inputs)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return list(torch.autograd.grad(grads, params, grad_outputs=[torch.full_like(g, 0.01) for g in grads]))


@pytest.mark.parametrize("model_type", ["gemma2", "llama"])
def test_a_second_order_gradient_through_the_fused_head_is_refused_naming_the_fix(model_type):
    """The fused head writes its gradients in one pass, with no graph: a tied head's second-order terms were dropped
    silently (Gemma 2), an untied one failed in torch's words. Refused by name; unpad="attention" serves it."""
    model = family(model_type, tie_word_embeddings=True).train()
    inputs = batch(model)
    want = hvp(copy.deepcopy(model), inputs)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with pytest.raises(patchkit.PatchkitError, match=r"create_graph=True.*Fix: apply the patch with "
                                                         r"unpad='attention'"):
            hvp(model, inputs)
    if model_type == "llama":
        return  # its eager attention's double backward: the sdpa backend's CPU kernel has none (backends-and-gates.md)
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="attention") as handle:
        got = hvp(model, inputs)
        assert handle.layers_patched > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_a_second_backward_through_the_fused_head_is_refused_naming_the_fix():
    model = family("llama").train()
    inputs = batch(model)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        loss = loss_of(model, inputs)
        loss.backward(retain_graph=True)
        with pytest.raises(patchkit.PatchkitError, match=r"a second backward \(retain_graph=True\).*unpad='attention'"):
            loss.backward()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_non_reentrant_checkpoint_around_the_loss_trains_as_unpatched(model_type):
    """The first fused call also runs the family's head on a few rows to check it; the checkpoint's recompute, already
    checked, ran it on one: the head saved another number of tensors for the backward (CheckpointError)."""
    model = family(model_type).train()
    inputs = batch(model)

    def steps(model: torch.nn.Module) -> list[tuple[float, torch.Tensor]]:
        out = []
        for _ in range(2):
            model.zero_grad()
            loss = checkpoint(lambda b: loss_of(model, b), inputs, use_reentrant=False)
            loss.backward()
            out.append((loss.item(), model.get_output_embeddings().weight.grad.clone()))
        return out

    want = steps(copy.deepcopy(model))
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = steps(model)
        assert handle.layers_patched > 0
    for (loss, grad), (loss_w, grad_w) in zip(got, want):
        assert loss == pytest.approx(loss_w, abs=1e-5)
        torch.testing.assert_close(grad, grad_w, atol=1e-5, rtol=1e-4)


def test_torch_func_transforms_run_as_unpatched_stepped_aside():
    """torch.func.grad over a loss function, and vmap of it (per-sample gradients, DP-SGD's): unpadding reads the
    mask on the host, which vmap refuses, and the fused head's function takes no part in the transforms."""
    model = family("llama").train()
    inputs = batch(model)
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach()
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}

    def by_embeds(e: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(inputs_embeds=e, attention_mask=mask, labels=labels, use_cache=False).loss

    def per_sample(e: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(by_embeds)(e[None], mask[None], labels[None])

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        whole = torch.func.grad(by_embeds)(embeds, rest["attention_mask"], rest["labels"])
        return whole, torch.func.vmap(per_sample)(embeds, rest["attention_mask"], rest["labels"])

    want = both()
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = both()
        assert set(handle.stepped_aside) == {"functorch_transform"}
        model(**inputs).loss.backward()  # outside a transform: patched again
        assert handle.layers_patched > 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_a_subclass_loss_function_and_a_loss_ignore_index_get_their_own_numbers():
    """A subclass's own `loss_function` property (a focal loss) was missed, and handed the packed rows' logits beside
    padded labels (an IndexError); `ignore_index=-1` passed to the forward was refused by the attention's allow-list,
    then met the -100 the packed labels are padded with. The head now runs on the padded batch for both, exact."""
    from transformers import LlamaForCausalLM

    class FocalLlama(LlamaForCausalLM):
        @property
        def loss_function(self):
            def focal(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
                logits, labels = logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
                keep = labels != ignore_index
                logp = F.log_softmax(logits[keep], -1).gather(1, labels[keep, None]).squeeze(1)
                return (-(1 - logp.exp()) ** 2 * logp).mean()

            return focal

    base = family("llama").train()
    focal = FocalLlama(base.config).train()
    focal.load_state_dict(base.state_dict())
    inputs = batch(base)
    ids, mask = padded_batch("right", batch=4, seq=16)
    minus_one = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -1), ignore_index=-1)
    want = [loss_of(focal, inputs).item(), loss_of(base, minus_one).item()]
    with patchkit.apply_patch(model=focal, backend="sdpa") as own, patchkit.apply_patch(model=base, backend="sdpa") \
            as ignoring:
        got = [loss_of(focal, inputs).item(), loss_of(base, minus_one).item()]
        assert own.stepped_aside == ignoring.stepped_aside == {}
        assert dict(own.heads) == {"a loss function other than transformers' ForCausalLMLoss": 1}
        assert dict(ignoring.heads) == {"a loss ignore_index other than -100": 1}
    assert got == pytest.approx(want, abs=1e-5)


def test_the_chunked_loss_gives_torchs_second_order_gradient():
    """unpad="loss" where the head is not fused: the chunked cross-entropy's backward, differentiable when a
    gradient of it is asked for (create_graph=True), as torch's cross-entropy is."""
    from patchkit.forward.loss.cross_entropy import chunked_causal_lm_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5)).index_fill(1, torch.tensor([2]), -100)

    def torchs(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    def second(loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        grad, = torch.autograd.grad(loss_fn(logits), logits, create_graph=True)
        return grad, torch.autograd.grad(grad.square().sum(), logits)[0]

    for ours, theirs in zip(second(lambda z: chunked_causal_lm_loss(z, labels, 7)), second(torchs)):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
