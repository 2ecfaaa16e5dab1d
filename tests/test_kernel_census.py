"""Every family the census verifies, on flash-attn 2's kernels (through the recording double, `fakes.py`).

The census runs patchkit's exact sdpa backend, which reads no head size and takes every shape; the kernel backends
read the layer's head size for their gate and take one head size for queries, keys and values. DeepSeek's latent
attention (no `head_dim`) and Gemma 4's per-layer head sizes (a config that refuses a global read) crashed there
only. Here each family runs a bf16 training step and a left-padded greedy generation on the kernels, every call held
to the kernel's contract by the double, with the numbers of patchkit's exact backend.
"""

from __future__ import annotations

import pytest
import torch
from census import causal_lm_types
from fakes import install_flash_double
from families import served_tiny
from models import labels_for, padded_batch

import patchkit
from patches import table

FAMILIES = sorted(set(causal_lm_types()) & set(table.VERIFIED))


def run(model, ids, mask, left, left_mask, **patch) -> tuple:
    """Under `apply_patch(model=model, **patch)`: the eval logits, the training step's loss and gradients, and the
    greedy tokens of a left-padded batch; with the patch's handle."""
    model.zero_grad(set_to_none=True)
    with patchkit.apply_patch(model=model, **patch) as handle:
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), use_cache=False).loss
        loss.backward()
        model.eval()
        with torch.no_grad():
            tokens = model.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=2, do_sample=False,
                                    pad_token_id=0)
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return (logits, loss.detach().float(), grads, tokens), handle


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_verified_family_trains_and_generates_on_the_flash_attn_kernels(model_type, monkeypatch):
    """The kernel path (its head size, layout, casts and decode kernel) gives the numbers of patchkit's exact sdpa
    backend on the same bf16 model, which the census holds to transformers' own: the double computes what the
    kernel computes with that backend, so they agree to the bit where the path hands the kernel the right call."""
    model = served_tiny(model_type).to(torch.bfloat16)
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    left, left_mask = padded_batch("left", batch=3, seq=16)
    left = left.clamp(max=model.config.vocab_size - 1)
    want, _ = run(model, ids, mask, left, left_mask, backend="sdpa")
    fake = install_flash_double(monkeypatch)
    got, handle = run(model, ids, mask, left, left_mask)
    assert handle.backend == "flash_attn" and handle.calls
    assert fake.calls or model_type in SINKS, "no layer reached the kernel"
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)
    assert torch.equal(got[3], want[3])


# attention sinks, which flash-attn 2 does not take: their layers run on patchkit's exact backend (said once)
SINKS = {"gpt_oss", "flint", "granite_swa", "granitemoe_swa"}
