"""Multimodal models around a language model patchkit serves: what their own forwards hand that language model.

LLaVA-OneVision (and GOT-OCR2) pass the head's `logits_to_keep` on to the language model's layers; EmbeddingGemma's
encoders set `use_bidirectional_attention` (PaliGemma's prefix: `test_paligemma.py`). Each against the unpatched
model.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from families import FAMILIES_FROM
from models import labels_for, padded_batch
from packaging.version import Version

import patchkit
from patchkit.errors import PatchInputError

if Version(tf.__version__) < Version(FAMILIES_FROM):
    pytest.skip(f"family patches need transformers >= {FAMILIES_FROM}", allow_module_level=True)

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            max_position_embeddings=256)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
IMAGE = 122


def llava_onevision() -> torch.nn.Module:
    """LLaVA-OneVision: a Qwen2 language model behind a SigLIP tower."""
    config = tf.LlavaOnevisionConfig(text_config=tf.Qwen2Config(**TEXT).to_dict(),
                                     vision_config=tf.SiglipVisionConfig(**VISION).to_dict(), image_token_index=IMAGE)
    torch.manual_seed(0)
    return tf.LlavaOnevisionForConditionalGeneration._from_config(config, attn_implementation="eager").train()


def embedding_gemma() -> torch.nn.Module:
    """EmbeddingGemma's shape: a Gemma 3 text model whose layers attend both ways."""
    config = tf.Gemma3TextConfig(**TEXT, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                 use_bidirectional_attention=True)
    torch.manual_seed(0)
    return tf.Gemma3TextModel._from_config(config, attn_implementation="eager").eval()


def text_batch(side: str = "mixed") -> dict:
    ids, mask = padded_batch(side, batch=3, seq=16)
    ids = ids.clamp(max=100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))


def train_step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], atol=3e-6, rtol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, atol=3e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("way", ["instance", "class"])
def test_llava_onevision_hands_logits_to_keep_to_its_layers_and_trains_patched(way):
    """LlavaOnevisionModel passes `logits_to_keep` (the head's) on to Qwen2's layers, whose attention ignores it:
    patchkit refused every forward ("passes logits_to_keep=0 to its attention function ... refuses rather than
    ignore it"). A strict training step now runs patched and equals unpatched, every gradient."""
    model = llava_onevision()
    batch = text_batch()
    want = train_step(model, batch)
    if way == "instance":
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
            got = train_step(model, batch)
    else:
        with patchkit.apply_patch("qwen2", backend="sdpa", strict=True) as handle:
            got = train_step(llava_onevision(), batch)
    assert handle.calls == 2 and not handle.stepped_aside
    assert_same_step(got, want)


def test_llava_onevision_generates_patched_as_unpatched():
    """generate() hands `logits_to_keep=1` to every step: a left-padded prompt, strict, the unpatched tokens."""
    model = llava_onevision().eval()
    batch = text_batch("left")
    prompt, options = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), dict(
        max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(**prompt, **options)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = model.generate(**prompt, **options)
    assert handle.calls == 2 * options["max_new_tokens"] and not handle.stepped_aside
    assert torch.equal(got, want)


def test_an_embedding_gemma_encoder_under_a_class_patch_runs_as_unpatched():
    """A bidirectional Gemma 3 text model (EmbeddingGemma's encoder) built under PATCHKIT_FLASH_ATTN=1's class patch:
    the hidden states at real tokens equal unpatched, the forward named by its config."""
    batch = text_batch("right")
    with torch.no_grad():
        want = embedding_gemma()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with warnings.catch_warnings(record=True) as caught, patchkit.apply_patch(backend="sdpa") as group:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = embedding_gemma()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert group.stepped_aside == {"use_bidirectional_attention": 1}
    assert any("(use_bidirectional_attention)" in str(w.message) for w in caught)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], atol=0, rtol=0)


# around LLaMA, Mistral and Qwen2, each class in a modeling module of its own
WRAPPERS = ["llava", "mistral3", "internvl"]


def wrapper(model_type: str) -> torch.nn.Module:
    from census import tiny_wrapper

    model, why = tiny_wrapper(model_type)
    assert model is not None, why
    return model


def padding_reads(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of labels predicted from padding (labels = input_ids, as a script without a collator writes them) and
    greedy generation from right-padded prompts: both read the logits at padding positions."""
    ids, mask = text_batch()["input_ids"], text_batch()["attention_mask"]
    loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss.detach()
    right = text_batch("right")
    model.eval()
    try:
        tokens = model.generate(input_ids=right["input_ids"], attention_mask=right["attention_mask"],
                                max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        model.train()
    return loss, tokens


@pytest.mark.parametrize("way", ["instance", "class"])
@pytest.mark.parametrize("model_type", WRAPPERS)
def test_a_multimodal_model_of_another_module_reads_padding_as_unpatched(model_type, way):
    """LLaVA, Mistral 3 and InternVL compute their head and loss over every position of what their language model
    returns, in a class patchkit did not wrap (only the family's own causal LM and the multimodal models of its own
    modeling module were): labels predicted from padding gave another loss (0.007-0.02 off) and right-padded
    generation other tokens, silently. Wrapped on the instance now (apply_patch(model=...), or as a class patch
    builds it), they step aside there by name, and a batch labelled -100 at padding still runs patched."""
    want = padding_reads(wrapper(model_type))
    with patchkit.apply_patch(model=wrapper(model_type) if way == "instance" else None, backend="sdpa") as patch:
        model = wrapper(model_type) if way == "class" else patch._model()
        assert "forward" in vars(model)  # its own forward wrapped on the instance
        got = padding_reads(model)
        handle = patch if way == "instance" else patch.handle_for(model)
        assert handle.stepped_aside == {"labels_from_padding": 1, "right_padded_generation": 1}
        calls = handle.calls
        model(**text_batch(), use_cache=False)
        assert handle.calls == calls + 2 and sum(handle.stepped_aside.values()) == 2
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert torch.equal(got[1], want[1])
    assert "forward" not in vars(model)  # the revert unwrapped it


def test_one_built_before_the_class_patch_steps_aside_by_name():
    """A LLaVA built before `apply_patch()` (no model=): its class patch serves LLaMA's layers, but no wrapper of
    patchkit's tells them what LLaVA's head reads. Found by the calling frames, its padded forwards step aside
    (`head_outside_patch`): the unpatched loss; strict refuses, naming the fix."""
    model = wrapper("llava")
    want = padding_reads(model)
    with pytest.warns(RuntimeWarning, match=r"\(head_outside_patch\)"):
        with patchkit.apply_patch(backend="sdpa") as group:
            got = padding_reads(model)
    assert group.stepped_aside == {"head_outside_patch": 4}  # the loss, the prefill and two decode steps
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert torch.equal(got[1], want[1])
    with patchkit.apply_patch(backend="sdpa", strict=True):
        with pytest.raises(PatchInputError, match=r"apply_patch\(model=\.\.\.\) on the whole model"):
            model(**text_batch())


def test_llama4s_multimodal_model_tells_its_causal_lm_of_labels_at_padding():
    """Llama 4's multimodal model holds the labels and calls its causal LM without them: the causal LM's wrapper said
    'nothing read at padding' over the outer call's word, and the loss differed silently. An LM call inside another
    keeps what the outer call reads: it steps aside, the unpatched loss."""
    model = wrapper("llama4")
    ids, mask = text_batch()["input_ids"], text_batch()["attention_mask"]
    want = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert handle.stepped_aside == {"labels_from_padding": 1}
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_sequence_classifier_is_no_generative_head_and_runs_patched():
    """A reward model's head reads each row's last real token (the last that is not the pad token, as a tokenizer
    pads): LlamaForSequenceClassification takes labels but does not generate, so neither the wrapping nor the caller
    check touches it; its padded batch runs patched, as unpatched."""
    config = tf.LlamaConfig(**TEXT)
    torch.manual_seed(0)
    model = tf.LlamaForSequenceClassification._from_config(config, attn_implementation="eager").eval()
    batch = text_batch("right")
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, TEXT["pad_token_id"])
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with patchkit.apply_patch(backend="sdpa") as group:
            got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert group.calls == 2 and not group.stepped_aside
    torch.testing.assert_close(got, want, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["llava", "mistral3", "llama4"])
def test_under_the_registered_name_per_part_a_multimodal_model_reads_padding_as_unpatched(model_type):
    """attn_implementation={'text_config': 'patchkit', ...}: the multimodal model's own config keeps the name it was
    loaded with, so its wrapper, asking that config, told its language model nothing, and labels predicted from
    padding gave another loss (0.002-0.004 off) silently. The wrapper reads its language model's name: the unpatched
    loss and tokens (both forwards step aside, warned once a process)."""
    import copy

    model = wrapper(model_type)
    want = padding_reads(model)
    named = copy.deepcopy(model)
    parts = {key: "sdpa" for key in type(named.config).sub_configs if key != "text_config"}
    named.set_attn_implementation({"text_config": "patchkit", **parts})
    got = padding_reads(named)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert torch.equal(got[1], want[1])
