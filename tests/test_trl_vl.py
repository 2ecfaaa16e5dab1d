"""TRL's SFTTrainer fine-tuning vision-language models on images (the Qwen VL families, LLaVA), as users run it: the
family's own processor, TRL's vision collator and defaults (gradient checkpointing on); per-step losses equal to the
unpatched run."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from entrypoints import clean_env, launch, run
from families import VL_TOKENS, family_model, served_here
from test_trl import (
    LAYERS,
    STEPS,
    assert_ran_through_patch,
    assert_same_losses,
    common_args,
    logged_losses,
    script_result,
)

import patchkit

pytest.importorskip("trl")
if not served_here("qwen2_vl"):
    pytest.skip("patchkit serves the Qwen VL families from transformers 4.54", allow_module_level=True)
from peft import LoraConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from user_scripts.vl_data import PROCESSORS, SPECIALS, conversations, processor, word_tokenizer  # noqa: E402

SCRIPT = Path(__file__).parent / "user_scripts" / "trl_sft_vl.py"
FAMILIES = [f for f in PROCESSORS if served_here(f)]  # Qwen3-VL and its MoE from 4.57


def test_the_conversations_use_the_tiny_models_vision_token_ids() -> None:
    assert [SPECIALS[t] for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")] == \
        [VL_TOKENS[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id")]


def vlm_sft_losses(family: str, tmp_path: Path, prompt_completion: bool = False, instance: bool = False,
                   peft_config: LoraConfig | None = None) -> tuple[list[float], patchkit.PatchHandle | None]:
    """Per-step losses of STEPS SFTTrainer steps on image conversations (right-padded by TRL's vision collator);
    with `instance`, the model is patched after it is built (the handle is returned, reverted)."""
    model = family_model(family, layers=LAYERS)
    handle = patchkit.apply_patch(model=model, backend="sdpa", strict=True) if instance else None
    try:
        args = SFTConfig(**common_args(tmp_path), max_length=None)
        assert args.gradient_checkpointing  # TRL's default, kept
        patch = model.config.vision_config.patch_size
        torch.manual_seed(0)  # LoRA's A matrices are drawn when the trainer wraps the model
        trainer = SFTTrainer(model=model, args=args, train_dataset=conversations(patch, prompt_completion),
                             processing_class=processor(family, patch), peft_config=peft_config)
        batch = next(iter(trainer.get_train_dataloader()))
        assert "pixel_values" in batch and (batch["attention_mask"] == 0).any()  # images, and padding to skip
        trainer.train()
        losses = logged_losses(trainer)
    finally:
        if handle is not None:
            handle.revert()
    assert len(losses) == STEPS
    return losses, handle


@pytest.mark.parametrize("shape", ["messages", "prompt_completion"])
@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_sft_class_patch_matches_unpatched(family: str, shape: str, tmp_path: Path) -> None:
    """`apply_patch(backend="sdpa")` before the model is built: the same losses in TRL's two conversation shapes
    (prompt-completion: loss on the answer only), every language layer's forward and recompute through the patch."""
    pc = shape == "prompt_completion"
    want, _ = vlm_sft_losses(family, tmp_path, prompt_completion=pc)
    handle = patchkit.apply_patch(backend="sdpa", strict=True)
    try:
        got, _ = vlm_sft_losses(family, tmp_path, prompt_completion=pc)
        assert_ran_through_patch(handle)
        assert not handle.stepped_aside
    finally:
        handle.revert()
    assert_same_losses(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_sft_lora_on_a_patched_instance_matches_unpatched(family: str, tmp_path: Path) -> None:
    """The usual VLM recipe: LoRA on the language model's projections through `peft_config`, the loaded model patched
    by `apply_patch(model=...)` before TRL wraps it."""
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                task_type="CAUSAL_LM")
    want, _ = vlm_sft_losses(family, tmp_path, peft_config=LoraConfig(**lora))
    got, handle = vlm_sft_losses(family, tmp_path, instance=True, peft_config=LoraConfig(**lora))
    assert_ran_through_patch(handle)
    assert_same_losses(got, want)


@pytest.mark.heavy  # make test-heavy
def test_env_var_and_launcher_run_an_unmodified_vlm_sft_script_as_unpatched(tmp_path: Path) -> None:
    """A user's Qwen2.5-VL SFT script (TRL's vision collator, checkpointing on) unpatched, under PATCHKIT_FLASH_ATTN=1
    and under the launcher: the same losses, every language layer through the patch. Side by side."""
    with ThreadPoolExecutor(3) as pool:
        python = [sys.executable, SCRIPT]
        procs = [pool.submit(run, python, env=clean_env(), cwd=tmp_path),
                 pool.submit(run, python, env=clean_env(PATCHKIT_FLASH_ATTN="1"), cwd=tmp_path),
                 pool.submit(launch, "--backend", "sdpa", SCRIPT, env=clean_env(), cwd=tmp_path)]
        plain, by_env, by_launcher = (script_result(p.result()) for p in procs)
    assert plain["calls"] == 0
    for got in (by_env, by_launcher):
        assert got["calls"] == STEPS * LAYERS * 2  # forward + checkpointed recompute, both language layers
        assert_same_losses(got["losses"], plain["losses"])


def llava_processor() -> object:
    """LLaVA's own processor: CLIP's PIL image processor at the tiny tower's 28 pixels (4 image tokens once its class
    token is dropped) and a word-level tokenizer with <image> at the tiny model's id."""
    import transformers
    from test_vision_language import IMAGE, TEXT

    template = ("{% for m in messages %}{{ m.role }} {% for c in m.content %}{% if c.type == 'image' %}<image> "
                "{% else %}{{ c.text }} {% endif %}{% endfor %}</s> {% endfor %}"
                "{% if add_generation_prompt %}assistant {% endif %}")
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return transformers.LlavaProcessor(
        image_processor=images, tokenizer=word_tokenizer(TEXT["vocab_size"], {"<image>": IMAGE}), patch_size=14,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=template)


def mllama_processor() -> object:
    """Llama 3.2 Vision's own processor: Mllama's PIL image processor at the tiny tower's 28-pixel tiles (2 at most)
    and a word-level tokenizer with <|image|> at the tiny model's id; it builds the cross-attention mask."""
    import transformers
    from test_mllama import IMAGE, TEXT

    template = ("{% for m in messages %}{{ m.role }} {% for c in m.content %}{% if c.type == 'image' %}<|image|> "
                "{% else %}{{ c.text }} {% endif %}{% endfor %}</s> {% endfor %}"
                "{% if add_generation_prompt %}assistant {% endif %}")
    images = transformers.MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    return transformers.MllamaProcessor(image_processor=images, tokenizer=word_tokenizer(TEXT["vocab_size"],
                                                                                         {"<|image|>": IMAGE}),
                                        chat_template=template)


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_vlm_sft_on_images_through_its_own_processor_matches_unpatched(family: str, way: str, tmp_path: Path) -> None:
    """LLaVA and Llama 3.2 Vision on image conversations through their own processors, TRL's defaults (checkpointing
    on): every language layer's forward and recompute through the patch (Mllama's self-attention ones; its
    cross-attention layers on the padded batch), the unpatched losses; the vision towers keep transformers'
    attention."""
    from test_mllama import mllama
    from test_vision_language import llava

    build, processing, patch, seen = {"llava": (llava, llava_processor, "llama2", "pixel_values"),
                                      "mllama": (mllama, mllama_processor, "mllama_text_model",
                                                 "cross_attention_mask")}[family]

    def losses(patched: bool) -> tuple[list[float], patchkit.PatchHandle | None]:
        model = build()
        handle = patchkit.apply_patch(model=model, backend="sdpa", strict=True) if patched else None
        args = SFTConfig(**common_args(tmp_path), max_length=None)
        torch.manual_seed(0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=conversations(14), processing_class=processing())
        batch = next(iter(trainer.get_train_dataloader()))
        assert seen in batch and (batch["attention_mask"] == 0).any()
        try:
            trainer.train()
        finally:
            if handle is not None:
                handle.revert()
        return logged_losses(trainer), handle

    want, _ = losses(patched=False)
    if way == "class":
        with patchkit.apply_patch(backend="sdpa", strict=True) as group:
            got, _ = losses(patched=False)
            handle = next(h for h in group if h.name == patch)
    else:
        got, handle = losses(patched=True)
    assert_ran_through_patch(handle)
    assert not handle.stepped_aside
    assert_same_losses(got, want)
