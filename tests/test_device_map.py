"""A model dispatched by accelerate's big-model inference (`from_pretrained(device_map=...)`, `dispatch_model`):
every module whose weights sit apart runs under accelerate's hook, which moves its inputs to its device and loads an
offloaded weight for its forward. patchkit runs inside those hooks: the numbers of the unpatched model dispatched the
same way, the head and loss on real tokens, and, under unpad="loss", the head fused with the loss (its weight read
while accelerate's hook holds it). On this machine's one device the hooks are forced (`force_hooks`), or weights are
offloaded to disk, which the hooks really load and unload around each forward."""

from __future__ import annotations

import pytest
import torch
from models import labels_for, padded_batch, tiny_model

import patchkit
from patchkit.hooks.forwards import fused_head, lm_head

accelerate = pytest.importorskip("accelerate")

PLACES = {
    "hooks": {},  # every module on the one device, each under accelerate's hook (device_map="auto" across GPUs)
    "offload": {"model.layers.1": "disk", "lm_head": "disk"},  # a layer and the head loaded per forward
}


def dispatched(place: str, folder: str) -> torch.nn.Module:
    """The tiny LLaMA as `device_map` places it: one entry per module, as accelerate's auto map writes it."""
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu", **PLACES[place]}
    model = tiny_model().train()
    return accelerate.dispatch_model(model, device_map=device_map, offload_dir=folder, force_hooks=True)


def train_step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """Two forwards with labels (the fused head is checked on the first) and the second's gradients: those of the
    weights in place (an offloaded weight is a new tensor each forward; its gradient is dropped with it)."""
    ids, mask = padded_batch("right")
    labels = labels_for(ids, mask)
    model(input_ids=ids, attention_mask=mask, labels=labels)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("way", ["before dispatch", "after dispatch"])
@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_a_dispatched_model_trains_as_unpatched(tmp_path, place, way, unpad):
    """Loss and gradients equal the unpatched dispatched model's, with the head on real tokens (fused under
    unpad="loss"), whether the class patch came before the dispatch or the instance patch after it (the LM's forward
    is then accelerate's hook around the family's own)."""
    want = train_step(dispatched(place, str(tmp_path / "want")))
    if way == "before dispatch":
        with patchkit.apply_patch("llama2", backend="sdpa", strict=True, unpad=unpad) as handle:
            got = train_step(dispatched(place, str(tmp_path / "got")))
    else:
        model = dispatched(place, str(tmp_path / "got"))
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad) as handle:
            got = train_step(model)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    assert got[1].keys() == want[1].keys() and want[1]
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)
    served = lm_head.FUSED if unpad == "loss" else lm_head.REAL_TOKENS
    assert handle.heads == {served: 2}


@pytest.mark.parametrize("place", PLACES)
def test_a_dispatched_model_generates_as_unpatched(tmp_path, place):
    """generate() on a left-padded batch: the unpatched dispatched model's tokens."""
    ids, mask = padded_batch("left")

    def generate(model: torch.nn.Module) -> torch.Tensor:
        return model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                     pad_token_id=0)

    want = generate(dispatched(place, str(tmp_path / "want")))
    model = dispatched(place, str(tmp_path / "got"))
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
        torch.testing.assert_close(generate(model), want, atol=0, rtol=0)


def test_only_accelerates_placing_hooks_fuse_the_head(tmp_path):
    """A head under accelerate's hook is fused only where that hook places and computes nothing (AlignDevicesHook
    alone, or in a SequentialHook); under another hook of accelerate's the family's own head runs."""
    model = dispatched("hooks", str(tmp_path))
    assert fused_head.plain_head(model) is model.lm_head

    class Scaling(accelerate.hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 2

    accelerate.hooks.add_hook_to_module(model.lm_head, Scaling(), append=True)
    assert type(model.lm_head._hf_hook).__name__ == "SequentialHook"
    assert fused_head.plain_head(model) is None
    accelerate.hooks.remove_hook_from_module(model.lm_head)
    assert fused_head.plain_head(model) is model.lm_head  # nn.Linear's own forward: plain again
