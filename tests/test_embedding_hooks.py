"""Hooks on the input embedding under the packed forward: NEFTune's noise is drawn over the batch as transformers gives
it (its scale reads the padded shape), PEFT's input-gradient switch keeps the embedding on real tokens."""

from __future__ import annotations

import pytest
import torch
from models import clone, labels_for, padded_batch, tiny_model
from test_lm_head import assert_trained_alike, family, trainer_run

import patchkit
from patchkit.hooks.head import lm_head

try:  # 5.x; the Trainer's own module before it
    from transformers.integrations.neftune import neftune_post_forward_hook
except ImportError:
    from transformers.trainer_utils import neftune_post_forward_hook

ALPHA = 5.0  # NEFTune's alpha: noise of at most alpha / sqrt(S * H) per element, S the padded length


def neftune(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """NEFTune's hook on the input embedding, as the Trainer adds it (`neftune_noise_alpha`), and the shapes it sees."""
    embedding = model.get_input_embeddings()
    embedding.neftune_noise_alpha = ALPHA
    seen: list[tuple[int, ...]] = []
    embedding.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    embedding.register_forward_hook(neftune_post_forward_hook)
    return seen


def noisy_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same noise both ways, drawn over the same (B, S, H)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("kind", ["right", "left"])
def test_neftune_draws_its_noise_over_the_padded_batch_as_unpatched(unpad, kind):
    """NEFTune scales its noise by the embedding output's size (alpha / sqrt(S * H)): on one packed row of real
    tokens it would be sqrt(B * S / nnz) times smaller, silently. Its hook sees the padded batch, and the loss and
    gradients equal unpatched (the same noise), while the layers after it run on real tokens."""
    model = tiny_model(kv_heads=2).train()
    ref = clone(model)
    ids, mask = padded_batch(kind)
    want_seen, seen = neftune(ref), neftune(model)
    want = noisy_step(ref, ids, mask)
    layers: list[int] = []
    model.model.layers[0].register_forward_pre_hook(lambda m, args: layers.append(args[0].shape[1]))
    with patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) as handle:
        got = noisy_step(model, ids, mask)
        assert handle.calls > 0 and handle.stepped_aside == {}
    assert seen == want_seen == [tuple(ids.shape) + (64,)]
    assert layers == [int(mask.sum())]  # the decoder on real tokens only
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-6, rtol=1e-4, msg=name)
    hooks = model.get_input_embeddings()
    assert len(hooks._forward_hooks) == 2 and not hooks._forward_pre_hooks  # the user's two, none of patchkit's


def test_the_trainers_neftune_trains_as_unpatched(tmp_path):
    """The HF Trainer with `neftune_noise_alpha` (TRL's SFTConfig passes it on), 2 padded rows a micro-batch: the
    losses and trained weights equal unpatched, and every micro-batch ran the fused head. Plain SGD: Adam's first
    steps would magnify float-order differences in near-zero gradients past the weights' tolerance."""
    ids, mask = padded_batch("right", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels_for(ids, mask))]
    want, got = (trainer_run(family("llama"), rows, way, tmp_path, max_steps=2, per_device_train_batch_size=2,
                             optim="sgd", neftune_noise_alpha=ALPHA)
                 for way in (None, "model"))
    assert got[2] == {lm_head.FUSED: 4}  # 2 steps x 2 micro-batches
    assert_trained_alike(got, want)


def make_inputs_require_grad(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
    """PEFT's and TRL's copy of transformers' hook, by its name there."""
    out.requires_grad_(True)


@pytest.mark.parametrize("switch", ["transformers", "peft"])
def test_an_input_gradient_switch_keeps_the_embedding_on_real_tokens(switch):
    """`enable_input_require_grads` (PEFT with gradient checkpointing, every LoRA run that checkpoints) or PEFT's
    and TRL's own copy hook the embedding to mark its output as requiring grad, whatever its shape: the embedding
    still runs on real tokens."""
    model = tiny_model(kv_heads=2).train()
    ref = clone(model)
    for m in (model, ref):
        if switch == "transformers":
            m.enable_input_require_grads()
        else:
            m.get_input_embeddings().register_forward_hook(make_inputs_require_grad)
        m.model.embed_tokens.weight.requires_grad_(False)  # frozen, as under LoRA: the hook gives the layers grads
    seen: list[tuple[int, ...]] = []
    embedding = model.get_input_embeddings()
    embedding.forward = lambda ids, plain=embedding.forward: seen.append(tuple(ids.shape)) or plain(ids)  # no hook
    ids, mask = padded_batch("mixed")
    want = noisy_step(ref, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        got = noisy_step(model, ids, mask)
    assert seen == [(1, int(mask.sum()))]
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert got[1].keys() == want[1].keys()
