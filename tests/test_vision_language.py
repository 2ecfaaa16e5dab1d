"""Vision-language models (LLaVA, Gemma3): patchkit patches the language model inside, and leaves the vision tower."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from families import FAMILIES_FROM, set_attention
from packaging.version import Version

import patchkit
from patchkit.errors import PatchkitError

if Version(tf.__version__) < Version("4.48"):
    pytest.skip("one attention class per family (the VLMs' language models): transformers 4.48+",
                allow_module_level=True)

IMAGE = 122  # the image token id in both tiny models
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)  # 2 x 2 patches: 4 image tokens
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)


def llava() -> torch.nn.Module:
    """LLaVA: a LLaMA language model and a CLIP vision tower (which comes first among its modules)."""
    config = tf.LlavaConfig(
        text_config=tf.LlamaConfig(**TEXT).to_dict(),
        vision_config=tf.CLIPVisionConfig(projection_dim=32, **VISION).to_dict(),
        image_token_index=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="default",
        image_seq_length=4,
    )
    torch.manual_seed(0)
    return tf.LlavaForConditionalGeneration(config).float()


def gemma3() -> torch.nn.Module:
    """Gemma3: a Gemma3 text model (one sliding, one full layer) and a SigLIP vision tower."""
    if Version(tf.__version__) < Version(FAMILIES_FROM):
        pytest.skip(f"family patches need transformers >= {FAMILIES_FROM}")
    text = tf.Gemma3TextConfig(head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                               **TEXT)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=tf.SiglipVisionConfig(**VISION).to_dict(),
                             mm_tokens_per_image=4, boi_token_index=120, eoi_token_index=121,
                             image_token_index=IMAGE)
    torch.manual_seed(0)
    return tf.Gemma3ForConditionalGeneration(config).float()


def image_batch(first: int) -> dict:
    """Two rows, each with one image's 4 tokens from column `first`, the second row right-padded; labels -100 there."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 110, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    ids[1, 11:] = 0
    ids[:, first : first + 4] = IMAGE
    return dict(input_ids=ids, attention_mask=mask, pixel_values=torch.randn(2, 3, 28, 28, generator=g),
                labels=ids.masked_fill(mask == 0, -100))


def train_step(model: torch.nn.Module, batch: dict, **extra) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_loaded_llava_patches_its_language_model_not_its_vision_tower():
    """`apply_patch(model=llava)` found the CLIP vision tower's config first and refused ("no patch for model_type
    'clip_vision_model'"): it now picks LLaMA's patch for the language model. A strict training step equals
    unpatched, every gradient (vision tower and projector included), with the two language layers on the patch."""
    model = llava().train()
    set_attention(model, "sdpa")
    batch = image_batch(first=2)
    want_loss, want_grads = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got_loss, got_grads = train_step(model, batch)
        assert handle.name == "llama2" and handle.layers_patched == 2 and handle.calls == 2
        assert handle.check(model) == 2  # the language model's two layers; the vision tower's are not counted
    torch.testing.assert_close(got_loss, want_loss, atol=3e-6, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=3e-6, rtol=1e-4, msg=name)


def test_a_class_patch_serves_llava_loaded_after_it():
    """The class patch before load (a LLaVA training script's `replace_llama_attn_with_flash_attn()`): the same."""
    model = llava().train()
    set_attention(model, "sdpa")
    batch = image_batch(first=2)
    want_loss, want_grads = train_step(model, batch)
    with patchkit.apply_patch("llama", backend="sdpa", strict=True) as handle:
        model = llava().train()
        set_attention(model, "sdpa")
        got_loss, got_grads = train_step(model, batch)
        assert handle.calls == 2 and not handle.stepped_aside
    torch.testing.assert_close(got_loss, want_loss, atol=3e-6, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=3e-6, rtol=1e-4, msg=name)


def test_gemma3_images_attend_bidirectionally_through_transformers_attention():
    """Gemma3's image tokens see each other both ways, a pattern no key-padding mask expresses. Its multimodal model
    builds those masks before its language model runs: `apply_patch(model=...)` picks the gemma3_text patch, and
    those forwards run transformers' attention, counted; logits equal unpatched, and strict mode refuses."""
    model = gemma3().eval()
    batch = image_batch(first=3)
    batch.pop("labels")
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    with torch.no_grad():
        want = model(**batch).logits
        with pytest.warns(RuntimeWarning, match="4D attention mask"):
            with patchkit.apply_patch(model=model, backend="sdpa") as handle:
                got = model(**batch).logits
                assert handle.name == "gemma3_text" and handle.check(model) == 2
                assert handle.stepped_aside == {"custom_4d_mask": 1} and handle.calls == 0
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True):
            with pytest.raises(PatchkitError, match="strict=True.*vision-language model.s own masks"):
                model(**batch)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=1e-4)
