"""RecurrentGemma: its RG-LRU layers run over the padded batch and read the padding positions (transformers does not
zero them), so left padding carries the attention output transformers computes at padding into the real tokens. A
left-padded forward steps aside (`padding_into_mixer`), exact; a right-padded or packed one runs patched, and so do
the decode steps after a left-padded prefill (here and for DeepSeek-V4, whose compressors read padding alike)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import transformers
from families import serves_model_type
from models import VOCAB, padded_batch

import patchkit

pytestmark = pytest.mark.skipif(not serves_model_type("recurrent_gemma"),
                                reason="RecurrentGemma from data: transformers 5.x")


def recurrent_gemma(attn: str = "sdpa") -> torch.nn.Module:
    """Six layers (recurrent, recurrent, attention, twice): the second attention layer reads a recurrence that ran
    over the first one's output at padding (a model of one attention layer never shows it)."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.RecurrentGemmaForCausalLM._from_config(config, attn_implementation=attn).eval()


def logits(model, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = padded_batch(side, batch=3, seq=16)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits, mask


def test_a_left_padded_forward_steps_aside_and_a_right_padded_one_runs_patched():
    model = recurrent_gemma()
    want_left, mask = logits(model, "left")
    want_right, right = logits(model, "right")
    with pytest.warns(RuntimeWarning, match=r"\(padding_into_mixer\).*pad on the right"):
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got_left, _ = logits(model, "left")
            got_right, _ = logits(model, "right")
    assert handle.stepped_aside == {"padding_into_mixer": 1} and handle.calls > 0
    torch.testing.assert_close(got_left[mask.bool()], want_left[mask.bool()], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_right[right.bool()], want_right[right.bool()], atol=2e-5, rtol=1e-4)


def test_under_the_registered_name_alone_a_left_padded_forward_steps_aside():
    model = recurrent_gemma("eager")
    want, mask = logits(model, "left")
    named = copy.deepcopy(model)
    named.set_attn_implementation("patchkit")
    with pytest.warns(RuntimeWarning, match=r"\(padding_into_mixer\)"):
        got, _ = logits(named, "left")
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["recurrent_gemma", "deepseek_v4"])
@pytest.mark.parametrize("way", ["patch", "name"])
def test_a_left_padded_generation_steps_aside_for_its_prefill_and_decodes_patched(family, way):
    """Left-padded generate(): the prefill steps aside (its mixers or compressors read what transformers computes at
    padding), counted as one left-padded forward is, and every decode step runs patched, equal to transformers: a
    decode step's new token is real, and the padding in its past was computed by transformers' prefill (before,
    every step stepped aside, and under the name alone DeepSeek-V4's decode steps were counted as `custom_4d_mask`)."""
    from census import tiny_lm

    from patchkit.hooks.name import attention_interface

    model = recurrent_gemma() if family == "recurrent_gemma" else tiny_lm(family)[0].eval()
    ids, mask = padded_batch("left", batch=3, seq=16)
    ids = ids % (model.config.vocab_size - 3) + 3 * mask  # real tokens past the special ones
    options = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, output_scores=True,
                   return_dict_in_generate=True)
    want = model.generate(input_ids=ids, attention_mask=mask, **options)
    attention_interface.register(backend="auto")
    attention_interface.register(backend="sdpa")
    if way == "name":
        model.set_attn_implementation("patchkit")
    handle = patchkit.apply_patch(model=model, backend="sdpa") if way == "patch" else None
    try:
        with handle or contextlib.nullcontext(), pytest.warns(RuntimeWarning, match=r"\(padding_into_mixer\)"):
            state = handle.state if handle is not None else attention_interface.route_state()
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)  # one left-padded forward, as the prefill
            prefill, calls = dict(state.stepped_aside), state.calls
            got = model.generate(input_ids=ids, attention_mask=mask, **options)
            aside, calls = dict(state.stepped_aside), state.calls - calls
    finally:
        attention_interface.register(backend="auto")
    assert set(prefill) == {"padding_into_mixer"} and aside == {"padding_into_mixer": 2 * prefill["padding_into_mixer"]}
    assert calls > 0  # the decode steps
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


@pytest.mark.heavy  # torch.compile: make test-heavy
def test_a_compiled_left_padded_forward_under_the_name_alone_steps_aside():
    """Compiled (a graph that may break), the base model's wrapper passes the call on untouched (dynamo cannot resume
    into transformers' wrapper of its forward after a break there), so the mask calls tell the cause, from the
    columns of the forward's new tokens: exact, counted as `padding_into_mixer`."""
    from patchkit.hooks.name import attention_interface

    model = recurrent_gemma("eager")
    want, mask = logits(model, "left")
    named = copy.deepcopy(model)
    attention_interface.register(backend="auto")
    attention_interface.register(backend="sdpa")
    named.set_attn_implementation("patchkit")
    torch._dynamo.reset()
    try:
        with pytest.warns(RuntimeWarning, match=r"\(padding_into_mixer\)"):
            got, _ = logits(torch.compile(named, backend="eager"), "left")
        aside = dict(attention_interface.route_state().stepped_aside)
    finally:
        attention_interface.register(backend="auto")
        torch._dynamo.reset()
    assert set(aside) == {"padding_into_mixer"}
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)
