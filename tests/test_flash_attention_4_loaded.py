"""Models loaded with transformers' own "flash_attention_4", patched: what an H100 or B200 user loads, and what
transformers loads GPT-OSS and the other attention-sink families with when asked for flash attention (flash-attn 2
has no sink). transformers' integration runs on the CPU over the recording flash-attn 4 stand-in, the one patchkit's
flash_attn_4 backend calls too (`fakes.install_transformers_flash_attention_4`); both in bf16, the kernel's dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from census import packed_rows
from fakes import install_transformers_flash_attention_4
from families import served_tiny, set_attention
from models import labels_for, padded_batch

import patchkit

# the sink families (GPT-OSS, Flint, the Granite sliding-window pair, MiMo-V2-Flash: transformers loads each with
# flash_attention_4 or a hub kernel, never flash_attention_2), and LLaMA, Mistral's window, Qwen3's q/k norms, Gemma 3
FAMILIES = ["gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "llama", "mistral", "qwen3",
            "gemma3_text"]
GRAD_RTOL = 2e-2  # bf16: a gradient summed over the padded batch unpatched, over its real tokens patched (measured:
# <= 1.4e-2 of the largest element, GPT-OSS's expert biases)


@pytest.fixture
def flash4(monkeypatch):
    return install_transformers_flash_attention_4(monkeypatch)


def on_flash_attention_4(family: str) -> torch.nn.Module:
    """The census's tiny `family` in bf16, as `from_pretrained(attn_implementation="flash_attention_4")` leaves it."""
    model = served_tiny(family).to(torch.bfloat16)
    model.config._attn_implementation = "flash_attention_4"
    return model


def train_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    model.train().zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_loaded_with_flash_attention_4_equals_unpatched(family, flash4):
    """On patchkit's flash_attn_4 backend: a training step on a mixed-padded batch (the sinks' gradients included),
    a packed row under a one-row mask of ones (flash_attention_4 keeps its documents apart, as flash_attention_2 does)
    and left-padded greedy generation, into a dynamic and a static cache, equal the unpatched model, every attention
    layer through the patch."""
    model = on_flash_attention_4(family)
    ids, mask = padded_batch("mixed")
    calls = len(flash4.calls)
    want = train_step(model, ids, mask)
    assert len(flash4.calls) > calls  # transformers ran its flash_attention_4 on the stand-in
    with patchkit.apply_patch(model=model, backend="flash_attn_4", strict=True) as handle:
        got = train_step(model, ids, mask)
        assert handle.calls > 0 and handle.backend == "flash_attn_4"
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-2)
    real = mask.bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=2e-2, rtol=2e-2)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert (got[2][name] - grad).abs().max() <= GRAD_RTOL * grad.abs().max() + 1e-6, name

    model.eval()
    row, positions = (t[:1] for t in packed_rows())
    packed = dict(input_ids=row, position_ids=positions, attention_mask=torch.ones_like(row))
    prompts, prompt_mask = padded_batch("left", batch=3, seq=14)
    generate = dict(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    static = dict(generate, cache_implementation="static")  # generate() makes the masks per layer type ahead
    with torch.no_grad():
        want_packed, want_tokens = model(**packed, use_cache=False).logits, model.generate(**generate)
        want_static = model.generate(**static)
        # eager lets the documents see each other under the mask
        joined = set_attention(copy.deepcopy(model), "eager")(**packed, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend="flash_attn_4", strict=True):
            got_packed, got_tokens = model(**packed, use_cache=False).logits, model.generate(**generate)
            got_static = model.generate(**static)
    torch.testing.assert_close(got_packed, want_packed, atol=2e-2, rtol=2e-2)
    apart = (got_packed - joined)[:, 7:].abs().max()  # the first document is 7 tokens; the rest see it when joined
    assert apart > 0.05 * joined.abs().max(), apart  # measured: 0.17-1.6 of it; patched equals unpatched to the bit
    assert torch.equal(got_tokens, want_tokens) and torch.equal(got_static, want_static)
