"""PEFT's LoRA on a mixture of experts' fused weights (`target_parameters`, the recipe of OpenAI's GPT-OSS fine-tune):
the experts run on the unpadded rows through PEFT's parametrization of their 3D weights; the loss and every adapter's
gradient equal unpatched."""

from __future__ import annotations

import copy

import pytest
import torch
from families import served_tiny
from models import labels_for, padded_batch

import patchkit
from patchkit.hooks.head import lm_head

peft = pytest.importorskip("peft", reason="peft is a test extra")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def expert_lora(base: torch.nn.Module) -> torch.nn.Module:
    """`base` under LoRA on every linear layer and on its experts' 3D weights, the adapters drawn non-zero."""
    weights = sorted({name.rsplit(".", 1)[-1] for name, p in base.named_parameters()
                      if ".experts." in name and p.dim() == 3})
    assert weights, "the tiny model has no fused expert weights"
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False,
                             target_parameters=[f"mlp.experts.{w}" for w in weights])
    return peft.get_peft_model(copy.deepcopy(base).train(), config)


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "mixtral"])
def test_lora_on_the_experts_weights_trains_as_unpatched(family, unpad):
    base = served_tiny(family)
    ids, mask = padded_batch("right", seq=24)
    ids = ids % base.config.vocab_size
    labels = labels_for(ids, mask)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    want_loss, want = step(expert_lora(base))
    with patchkit.apply_patch(backend="sdpa", unpad=unpad, strict=True) as handle:
        got_loss, got = step(expert_lora(base))
        calls, heads = handle.calls, dict(handle.heads)
    assert calls == base.config.num_hidden_layers, calls  # every layer's attention ran patched (strict: none aside)
    assert heads == {lm_head.FUSED: 1}, heads  # the loss alone read: fused with the head under either unpad
    assert any(".experts." in n for n in want) and want.keys() == got.keys()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
