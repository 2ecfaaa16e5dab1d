"""Models loaded with transformers' own "flash_attention_3" (flash-attn 3, the Hopper build: what an H100 user who
installed it loads), patched: transformers' integration runs on the CPU over the recording flash-attn 3 stand-in
(`fakes.install_transformers_flash_attention_3`), in bf16, the kernel's dtype; patchkit serves them on its exact
backend (on a GPU, `backend="auto"` picks torch_varlen or flash-attn 4 there: flash-attn 3 is not one of patchkit's)."""

from __future__ import annotations

import pytest
from fakes import install_transformers_flash_attention_3
from test_flash_attention_4_loaded import assert_loaded_flash_equals_unpatched, loaded_with

# LLaMA, Mistral's window, Gemma 2's softcap (flash-attn 3 takes it), Qwen3's q/k norms, Gemma 3's sliding and
# global layers. Not GPT-OSS and the other sink families: flash-attn 3 has no sink, and transformers loads them with
# a kernel that has one (`_compatible_flash_implementations`), never with flash_attention_3.
FAMILIES = ["llama", "mistral", "gemma2", "qwen3", "gemma3_text"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_loaded_with_flash_attention_3_equals_unpatched(family, monkeypatch):
    """A training step on a mixed-padded batch, a packed row under a one-row mask of ones (flash_attention_3 keeps
    its documents apart, as flash_attention_2 does) and left-padded greedy generation into a dynamic and a static
    cache equal the unpatched model on flash-attn 3, every attention layer through the patch."""
    flash3 = install_transformers_flash_attention_3(monkeypatch)
    model = loaded_with(family, "flash_attention_3")
    assert_loaded_flash_equals_unpatched(model, flash3.calls, "sdpa")
