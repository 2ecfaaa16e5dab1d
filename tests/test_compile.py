"""torch.compile keeps working on a patched model (graph breaks allowed, results equal to eager)."""

from __future__ import annotations

import torch
from models import labels_for, padded_batch, tiny_model

import patchkit


def test_torch_compile_of_a_patched_model_matches_eager():
    model = tiny_model(kv_heads=2, layers=1)
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    want = model(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    want_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        compiled = torch.compile(model, backend="aot_eager")
        got = compiled(input_ids=ids, attention_mask=mask, labels=labels)
        got.loss.backward()
        assert handle.layers_patched == 1
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(model.lm_head.weight.grad, want_grad, atol=2e-5, rtol=1e-3)
