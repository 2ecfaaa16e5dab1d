"""Vision-language models (LLaVA, Gemma3): patchkit patches the language model inside, and leaves the vision tower."""

from __future__ import annotations

import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers as tf
from entrypoints import clean_env, launch, run, spy_of
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


def llava(text: type = tf.LlamaConfig) -> torch.nn.Module:
    """LLaVA: a LLaMA (or another `text` config's) language model and a CLIP vision tower (which comes first among
    its modules)."""
    config = tf.LlavaConfig(
        text_config=text(**TEXT).to_dict(),
        vision_config=tf.CLIPVisionConfig(projection_dim=32, **VISION).to_dict(),
        image_token_index=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="default",
        image_seq_length=4,
    )
    torch.manual_seed(0)
    return tf.LlavaForConditionalGeneration(config).float()


# A language model patchkit does not serve (Cohere is served from data on transformers 5.x; Doge, whose dynamic mask
# attention reads the mask itself, is refused there)
UNSERVED_TEXT = tf.DogeConfig if Version(tf.__version__) >= Version("5") else tf.CohereConfig


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


def test_a_loaded_vision_language_model_with_an_unserved_language_model_is_refused_by_its_own_model_type():
    """LLaVA around a language model patchkit does not serve (Cohere; Doge on 5.x): the refusal named the
    vision tower's model_type, the first config with attention heads ('clip_vision_model'), as if the tower were
    what the user asked to patch. It names the model's own model_type now, and leaves the model as it was."""
    model = llava(UNSERVED_TEXT)
    forwards = {name: m.forward for name, m in model.named_modules()}
    with pytest.raises(PatchkitError, match=r"no patch for model_type 'llava': patchkit serves .*llama.*Nothing was "
                                            r"patched"):
        patchkit.apply_patch(model=model)
    assert {name: m.forward for name, m in model.named_modules()} == forwards and not patchkit.active_patches()


def unserved_warnings(build) -> list[str]:
    """The "runs unpatched" warnings of building a model under a class patch of every family."""
    with patchkit.apply_patch(backend="sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if "runs unpatched" in str(w.message)]


def test_a_class_patch_judges_a_vision_language_model_whole(monkeypatch):
    """Under a class patch every model built says whether it runs unpatched. A VLM's parts are models too, built
    inside its own: LLaVA and Gemma3, whose language models the patch serves, warned that their CLIP / SigLIP vision
    tower "runs unpatched", which it does by design; LLaVA around an unserved language model warned for the tower
    and the inner LlavaModel apart. One judgement per whole model now: none, and one naming 'llava'."""
    from patchkit.hooks.forwards import unserved

    monkeypatch.setattr(unserved, "_warned", set())
    assert unserved_warnings(llava) == []
    if Version(tf.__version__) >= Version(FAMILIES_FROM):
        assert unserved_warnings(gemma3) == []
    (message,) = unserved_warnings(lambda: llava(UNSERVED_TEXT))
    assert "LlavaForConditionalGeneration (model_type 'llava') runs unpatched" in message, message


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


def test_gemma3_images_attend_bidirectionally_through_the_patch():
    """Gemma3's image tokens see each other both ways, and the text after an image attends into it (no document of
    its own). Its multimodal model builds those masks before its language model runs: `apply_patch(model=...)` picks
    the gemma3_text patch, which reads each image's block off them and serves it with a pass of its own
    (`forward/metadata.py`). Before, such forwards stepped aside to transformers' attention; now they run patched,
    strict mode included, with unpatched logits."""
    model = gemma3().eval()
    batch = image_batch(first=3)
    batch.pop("labels")
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    with torch.no_grad():
        want = model(**batch).logits
        with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
            got = model(**batch).logits
            assert handle.name == "gemma3_text" and handle.check(model) == 2
            assert handle.stepped_aside == {} and handle.calls == 2
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=1e-4)


def test_gemma3_generates_with_images_under_every_family_patch_as_unpatched():
    """`apply_patch()` before load (the env var's and the launcher's way): Gemma3's image prefill (its image blocks
    both ways) and its decode steps run patched; its tokens equal unpatched."""
    batch = image_batch(first=3)
    batch.pop("labels")
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    batch["input_ids"], batch["attention_mask"] = batch["input_ids"].flip(-1), batch["attention_mask"].flip(-1)
    batch["token_type_ids"] = batch["token_type_ids"].flip(-1)  # left-padded for generation
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = gemma3().eval().generate(**batch, **options)
    with patchkit.apply_patch(backend="sdpa", strict=True) as group:
        got = gemma3().eval().generate(**batch, **options)
        handle = next(h for h in group if h.name == "gemma3_text")
        assert handle.stepped_aside == {}
        assert handle.calls == 2 * options["max_new_tokens"]  # the prefill and the decode steps, 2 layers each
    assert torch.equal(got, want)


LLAVA_TRAIN = Path(__file__).parent / "user_scripts" / "llava_train.py"


def llava_repo_model() -> torch.nn.Module:
    """LLaVA's own repo model: LlamaForCausalLM's subclass under model_type "llava_llama" (user_scripts/llava_llama)."""
    from user_scripts.llava_llama import LlavaLlamaForCausalLM, tiny_config

    torch.manual_seed(0)
    model = LlavaLlamaForCausalLM(tiny_config()).train()
    set_attention(model, "sdpa")
    return model


def llava_repo_batch() -> dict:
    """Three rows with one image each (IMAGE_TOKEN_INDEX), right-padded, LLaVA's boolean mask, loss on answers."""
    from user_scripts.llava_llama import IGNORE_INDEX, IMAGE_TOKEN_INDEX

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (3, 12), generator=g)
    ids[:, 2] = IMAGE_TOKEN_INDEX
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, 7:], mask[2, 4:] = False, False
    ids = ids.masked_fill(~mask, 0)
    labels = ids.masked_fill(~mask, IGNORE_INDEX)
    labels[:, :3] = IGNORE_INDEX
    return dict(input_ids=ids, attention_mask=mask, labels=labels, images=torch.randn(3, 3, 28, 28, generator=g))


@pytest.mark.parametrize("way", ["instance", "class"])
def test_llava_repos_own_model_type_runs_through_the_llama_patch(way):
    """LLaVA's repo registers its LlamaForCausalLM subclass as model_type "llava_llama": `apply_patch(model=...)`
    refused it ("no patch for model_type 'llava_llama'"), and under the class patch its first forward raised
    "attn_implementation='patchkit' was given to LlamaAttention (model_type 'llava_llama')". Its layers are LLaMA's:
    strict, a training step with images equals unpatched (loss and every gradient), and an eval forward that keeps a
    cache gives the same logits."""
    model = llava_repo_model()
    batch = llava_repo_batch()
    want_loss, want_grads = train_step(model, batch)
    with torch.no_grad():
        want_logits = model.eval()(**batch, use_cache=True).logits
    with patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", strict=True) as patch:
        if way == "class":
            model = llava_repo_model()
        handle = patch if way == "instance" else patch.handle_for(model)
        assert handle.name == "llama2" and handle.check(model) == 2
        rows = []
        model.model.layers[0].register_forward_pre_hook(
            patchkit.shape_free(lambda layer, args: rows.append(args[0].shape[:2])))
        got_loss, got_grads = train_step(model.train(), batch)
        with torch.no_grad():
            got_logits = model.eval()(**batch, use_cache=True).logits
        assert handle.calls == 4 and not handle.stepped_aside
    real_tokens = int(batch["attention_mask"].sum()) + 3 * 15  # each row's image token became 16 patch tokens
    packed = [(1, real_tokens)] * 2 if Version(tf.__version__) >= Version("4.53") else [(1, real_tokens), (3, 27)]
    assert rows == packed  # training on real tokens; eval with a cache too where patchkit makes the family's cache
    torch.testing.assert_close(got_loss, want_loss, atol=3e-6, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=3e-6, rtol=1e-4, msg=name)
    real = torch.ones(got_logits.shape[:2], dtype=torch.bool)
    real[1, 7 + 15:], real[2, 4 + 15:] = False, False
    torch.testing.assert_close(got_logits[real], want_logits[real], atol=3e-5, rtol=1e-4)


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_a_llava_training_script_asking_for_flash_attention_2_trains_as_unpatched(tmp_path):
    """LLaVA's train_mem.py loads its model with attn_implementation="flash_attention_2" and trains it with the HF
    Trainer (gradient checkpointing on). On a machine without flash-attn, under PATCHKIT_FLASH_ATTN=1 and under the
    launcher, the class patch serves that request for LLaVA's own model type: the same losses as the script run
    unpatched with sdpa, and no padded LLaMA attention or (B, 1, N, N) mask (the CLIP tower's own attention runs)."""
    python = [LLAVA_TRAIN, "--attn", "flash_attention_2", "--output_dir"]
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(run, [sys.executable, LLAVA_TRAIN, "--attn", "sdpa", "--output_dir", tmp_path / "a"]),
                pool.submit(run, [sys.executable, *python, tmp_path / "b"], env=clean_env(PATCHKIT_FLASH_ATTN="1")),
                pool.submit(launch, "--backend", "sdpa", *python, tmp_path / "c")]
        plain, by_env, by_launcher = (spy_of(job.result()) for job in jobs)
    assert plain["patches"] == [] and plain["padded_masks"] in (3, None)  # None: masks built outside the interface
    for got in (by_env, by_launcher):
        assert got["patches"] == [["llama2", "sdpa", 12]], got  # 3 steps x 2 layers, forward and recompute
        assert got["padded_masks"] in (0, None) and got["padded_attention"] == plain["padded_attention"] - 12
        assert got["losses"] == pytest.approx(plain["losses"], abs=1e-5)


@pytest.mark.skipif(Version(tf.__version__) < Version("4.53"), reason="the registered name: transformers 4.53+")
def test_the_name_given_to_a_whole_vlm_refuses_its_vision_tower_naming_the_per_part_fix(tmp_path):
    """`from_pretrained(vlm, attn_implementation="patchkit")` hands the name to the CLIP tower too (transformers gives
    a string to every sub-config), and its bidirectional attention is refused. The error told a LLaVA user to load
    "this model" with sdpa: it now names the dict that gives patchkit to the language model alone, and that dict
    loads a model whose language layers run through the name, with the unpatched logits."""
    from patchkit.hooks.name import attention_interface

    llava().save_pretrained(tmp_path)
    batch = image_batch(first=2)
    whole = tf.LlavaForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="patchkit")
    with pytest.raises(PatchkitError, match=r"CLIPAttention .*is_causal=False.*vision_config part of a multimodal "
                       r"model.*attn_implementation=\{'text_config': 'patchkit', 'vision_config': 'sdpa'\}"):
        whole(**batch)
    plain = tf.LlavaForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa")
    per_part = tf.LlavaForConditionalGeneration.from_pretrained(
        tmp_path, attn_implementation={"text_config": "patchkit", "vision_config": "sdpa"})
    before = attention_interface.route_state().calls
    with torch.no_grad():
        want, got = plain(**batch).logits, per_part(**batch).logits
    assert attention_interface.route_state().calls - before == 2  # the two language layers
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-6, rtol=1e-5)


def text_only(batch: dict) -> dict:
    """`batch` without its image: the image tokens become text, no pixel values."""
    ids = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, 5)
    return dict(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids.masked_fill(
        batch["attention_mask"] == 0, -100))


@pytest.mark.parametrize("types", [False, True], ids=["no-token-types", "text-token-types"])
def test_a_gemma3_text_batch_runs_patched_through_its_multimodal_model(types):
    """Gemma3ForConditionalGeneration builds its language model's masks itself (4D, per layer type): on a padded
    batch without image tokens they are exactly causal, windowed and padded, read back as the 2D mask, and the
    forward runs patched (before: stepped aside as custom_4d_mask, 'pass the 2D padding mask', which the user did).
    Loss and every gradient equal unpatched."""
    model = gemma3().train()
    batch = text_only(image_batch(first=3))
    if types:
        batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    want_loss, want = train_step(model, batch)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got_loss, got = train_step(model, batch)
        assert handle.calls == 2 and not handle.stepped_aside
    torch.testing.assert_close(got_loss, want_loss, atol=3e-5, rtol=1e-4)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=3e-5, rtol=1e-4, msg=name)


def test_gemma3s_multimodal_labels_and_generation_read_padding_by_their_own_causes():
    """The multimodal model's own forward tells its language model what of its call reads padding positions: labels
    predicted from padding step aside as labels_from_padding (exact loss), a left-padded text prompt generates
    patched (strict) with the unpatched tokens."""
    model = gemma3().train()
    batch = text_only(image_batch(first=3))
    batch["labels"] = batch["input_ids"]  # labels at the right padding, predicted from padding positions
    want_loss, _ = train_step(model, batch)
    with pytest.warns(RuntimeWarning, match="labels_from_padding"):
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got_loss, _ = train_step(model, batch)
            assert handle.stepped_aside == {"labels_from_padding": 1}
    torch.testing.assert_close(got_loss, want_loss, atol=0, rtol=0)
    model.eval()
    prompt = dict(input_ids=batch["input_ids"].flip(-1), attention_mask=batch["attention_mask"].flip(-1))
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(**prompt, **options)
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = model.generate(**prompt, **options)
        assert handle.calls == 2 * options["max_new_tokens"] and not handle.stepped_aside
    assert torch.equal(got, want)


def test_a_vision_tower_whose_config_names_no_part_gets_the_per_part_fix_too():
    """Pixtral's vision config (Mistral 3's, pixtral-12b's tower) has no `base_config_key` in 5.x: its refusal told the
    user to load the whole model with sdpa, giving up the patch of its language model too."""
    from patchkit.forward.inputs.arguments import part_of_multimodal

    pixtral = getattr(tf, "PixtralVisionModel", None)
    if pixtral is None:
        pytest.skip("Pixtral: transformers 4.45+")
    tower = pixtral(tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14))
    assert "'vision_config': 'sdpa'" in part_of_multimodal(tower)
