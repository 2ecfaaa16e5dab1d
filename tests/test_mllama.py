"""Llama 3.2 Vision (Mllama), served patched: its language model runs on the real tokens, its self-attention layers
varlen; its cross-attention layers (text to the image tiles, under the batch's own (B, 1, N, tiles) mask) run the
attention the model was loaded with (`hooks/attention/cross_layers.py`) on the padded batch, scattered back to it
and gathered again (`hooks/forwards/padded_layers.py`). Before, `apply_patch(model=...)` refused the model and a
class patch left it unpatched. Training (both paddings, both ways in, both unpad modes,
gradient checkpointing), generation, the text model alone and the registered name equal unpatched."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
import transformers as tf
from packaging.version import Version
from test_image_blocks import assert_same, generates_patched_as_unpatched, train_step, under_the_name

import patchkit

if Version(tf.__version__) < Version("5.0"):
    pytest.skip("Mllama's text model served from data: transformers 5.x", allow_module_level=True)

IMAGE, LENGTH, TILES = 120, 14, 2
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, cross_attention_layers=[1, 3], max_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, dropout=0.0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, num_attention_heads=4,
              image_size=28, patch_size=14, max_num_tiles=TILES, vision_output_dim=64, intermediate_layers_indices=[0],
              supported_aspect_ratios=[[1, 1], [1, 2]])
SELF_LAYERS = TEXT["num_hidden_layers"] - len(TEXT["cross_attention_layers"])


def mllama(attention: str = "sdpa") -> torch.nn.Module:
    config = tf.MllamaConfig(vision_config=VISION, text_config=TEXT, image_token_index=IMAGE)
    torch.manual_seed(0)
    return tf.MllamaForConditionalGeneration._from_config(config, attn_implementation=attention).train()


def image_batch(side: str, labels: bool = True) -> dict:
    """Three rows as Mllama's processor lays them out: <bos>, the image token, the text; rows 1 and 2 padded by 3 and
    5 on `side`. Row 0's image has one tile, the others two; a token sees its image's tiles from the image token on
    (the processor's cross-attention mask), the <bos> before it none (transformers zeroes that row's cross-attention
    MLP). Right padding keeps the image's columns to the end, as the processor's mask does."""
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(3, LENGTH, dtype=torch.long)
    mask = torch.zeros(3, LENGTH, dtype=torch.long)
    cross = torch.zeros(3, LENGTH, 1, TILES, dtype=torch.long)
    for row, pad in enumerate((0, 3, 5)):
        start = pad if side == "left" else 0
        real = slice(start, start + LENGTH - pad)
        ids[row, real] = torch.randint(3, 100, (LENGTH - pad,), generator=g)
        ids[row, start], ids[row, start + 1] = 1, IMAGE
        mask[row, real] = 1
        cross[row, start + 1:, 0, :1 if row == 0 else TILES] = 1
    batch = dict(input_ids=ids, attention_mask=mask, cross_attention_mask=cross,
                 pixel_values=torch.randn(3, 1, TILES, 3, 28, 28, generator=g),
                 aspect_ratio_ids=torch.tensor([[1], [2], [2]]),
                 aspect_ratio_mask=torch.tensor([[[1, 0]], [[1, 1]], [[1, 1]]]))
    if labels:
        batch["labels"] = ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == 1), -100)
    return batch


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("way", ["instance", "class"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_training_step_with_images_runs_patched_as_unpatched(attention, side, way, unpad):
    """Every self-attention layer patched, none stepped aside; the cross-attention layers on the loaded attention."""
    model, batch = mllama(attention), image_batch(side)
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", strict=True,
                              unpad=unpad) as handle:
        with layer_inputs(model) as seen:
            got = loss_step(model, batch) if unpad == "loss" else train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == SELF_LAYERS
    real = int(batch["attention_mask"].sum())  # the self-attention layers' MLPs on the real tokens alone, the
    assert seen == {"self": {(1, real)}, "cross": {(3, LENGTH)}}  # cross-attention layers on the padded batch
    if unpad == "loss":  # the head ran fused with the loss, on the labelled rows: no logits
        del want["logits"]
    assert_same(got, want)


@contextlib.contextmanager
def layer_inputs(model: torch.nn.Module) -> Iterator[dict]:
    """The (batch, tokens) shapes the decoder layers' MLPs see, self-attention and cross-attention layers apart."""
    seen: dict = {"self": set(), "cross": set()}

    def recorder(kind: str) -> object:
        return patchkit.shape_free(lambda module, args: seen[kind].add(tuple(args[0].shape[:2])))

    layers = model.model.language_model.layers
    hooks = [layer.mlp.register_forward_pre_hook(recorder("cross" if "Cross" in type(layer).__name__ else "self"))
             for layer in layers]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def loss_step(model: torch.nn.Module, batch: dict) -> dict:
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    assert out.logits is None
    return {"loss": out.loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gradient_checkpointing_recomputes_the_cross_layers_as_the_forward_ran_them(attention):
    """A recompute runs after the forward, where the config names the loaded attention again: the cross-attention
    layers run that attention in the forward too, so both compute the same numbers (under strict, every self-attention
    layer's recompute patched)."""
    model, batch = mllama(attention), image_batch("left")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == 2 * SELF_LAYERS
    assert_same(got, want)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_mllama_generates_from_left_padded_prompts_patched_as_unpatched(attention, cache):
    """generate() with images: the prefill fills the cross-attention layers' cache with the tiles' keys, each decode
    step reads them back; the self-attention layers' decode runs on the padded cache. A static cache's masks are read
    back as the padding they were made from, its cross-attention layers (sized for the tiles) left out; before, each
    forward stepped aside (custom_4d_mask). The same tokens."""
    generates_patched_as_unpatched(mllama(attention).eval(), image_batch("left", labels=False), SELF_LAYERS, cache)


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_text_model_alone_runs_patched_as_unpatched(side):
    """MllamaForCausalLM on text (Llama 3.2 Vision's language model fine-tuned alone): the cross-attention layers are
    skipped with no image, every self-attention layer patched."""
    config = tf.MllamaTextConfig(**TEXT)
    torch.manual_seed(0)
    model = tf.MllamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    batch = {k: v for k, v in image_batch(side).items() if k in ("input_ids", "attention_mask", "labels")}
    want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = train_step(model, batch)
        assert handle.stepped_aside == {} and handle.calls == SELF_LAYERS
    assert_same(got, want)


def test_mllama_under_the_registered_name_alone_runs_patched_as_unpatched():
    """attn_implementation={'text_config': 'patchkit', 'vision_config': 'sdpa'}: the cross-attention layers, which
    read the same text config, run sdpa (transformers' default). A training step and generation, strict."""
    model, batch = mllama(), image_batch("left")
    want = train_step(model, batch)
    got, calls, aside = under_the_name(model, lambda m: train_step(m, batch))
    assert calls == SELF_LAYERS and aside == {}
    assert_same(got, want)
    model = mllama().eval()
    prompt = image_batch("left", labels=False)
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(**prompt, **options)
    got, calls, aside = under_the_name(model, lambda m: m.generate(**prompt, **options))
    assert torch.equal(got, want) and calls == 3 * SELF_LAYERS and aside == {}
