"""TRL's SFTTrainer fine-tuning the Qwen VL families on images, as users run it: the family's own processor, TRL's
vision collator and defaults (gradient checkpointing on); per-step losses equal to the unpatched run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from families import VL_TOKENS, family_model, served_here
from models import VOCAB
from test_trl import LAYERS, STEPS, assert_ran_through_patch, assert_same_losses, common_args, logged_losses

import patchkit

pytest.importorskip("trl")
if not served_here("qwen2_vl"):
    pytest.skip("patchkit serves the Qwen VL families from transformers 4.54", allow_module_level=True)
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

FAMILIES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor",
            "qwen3_vl_moe": "Qwen3VLProcessor"}
FAMILIES = {f: p for f, p in FAMILIES.items() if served_here(f)}  # Qwen3-VL from 4.57, its MoE from 5.3
SPECIALS = {"<|image_pad|>": VL_TOKENS["image_token_id"], "<|video_pad|>": VL_TOKENS["video_token_id"],
            "<|vision_start|>": VL_TOKENS["vision_start_token_id"], "<|vision_end|>": 3}
# A chat template of the Qwen shape, word-level: an image part becomes vision start, image pad, vision end; the
# processor then repeats the image pad once per merged patch.
TEMPLATE = ("{% for m in messages %}{{ m.role }} {% for c in m.content %}{% if c.type == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ c.text }} {% endif %}{% endfor %}</s> "
            "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
LENGTHS = (3, 9, 5, 12, 4, 7)  # words per user turn; the assistant answers in about half as many
GRID = 4  # each image 4 x 4 patches, merged 2 x 2: 4 image tokens


def tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over the tiny models' vocabulary, with the Qwen vision tokens at the ids the tiny configs use."""
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    for token, index in SPECIALS.items():
        words[index] = token
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w4"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def processor(family: str, model: torch.nn.Module) -> object:
    """The family's own processor class around the PIL image processor (this machine has no torchvision) and no video
    processor (its classes need torchvision; images only here)."""
    import transformers

    base = getattr(transformers, FAMILIES[family])

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, name: str, argument: object) -> object:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    side = model.config.vision_config.patch_size * GRID
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=model.config.vision_config.patch_size, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": side * side})
    return ImagesOnly(image_processor=images, tokenizer=tokenizer(), chat_template=TEMPLATE)


def dataset(side: int, prompt_completion: bool) -> Dataset:
    """A dozen conversations, one random image each, in TRL's "messages" shape or its prompt-completion shape."""
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(f"w{int(t)}" for t in torch.randint(4, VOCAB - 3, (n,), generator=g))

    images = [[Image.fromarray((torch.rand(side, side, 3, generator=g).numpy() * 255).astype(np.uint8))]
              for _ in LENGTHS]
    users = [[{"role": "user", "content": words(n)}] for n in LENGTHS]
    answers = [[{"role": "assistant", "content": words(n // 2 + 1)}] for n in LENGTHS]
    rows = {"images": images, "prompt": users, "completion": answers} if prompt_completion else \
        {"images": images, "messages": [u + a for u, a in zip(users, answers)]}
    return Dataset.from_dict({k: v * 2 for k, v in rows.items()})


def vlm_sft_losses(family: str, tmp_path: Path, prompt_completion: bool = False, instance: bool = False,
                   peft_config: LoraConfig | None = None) -> tuple[list[float], patchkit.PatchHandle | None]:
    """Per-step losses of STEPS SFTTrainer steps on image conversations (right-padded by TRL's vision collator);
    with `instance`, the model is patched after it is built (the handle is returned, reverted)."""
    model = family_model(family, layers=LAYERS)
    handle = patchkit.apply_patch(model=model, backend="sdpa", strict=True) if instance else None
    try:
        args = SFTConfig(**common_args(tmp_path), max_length=None)
        assert args.gradient_checkpointing  # TRL's default, kept
        side = model.config.vision_config.patch_size * GRID
        torch.manual_seed(0)  # LoRA's A matrices are drawn when the trainer wraps the model
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(side, prompt_completion),
                             processing_class=processor(family, model), peft_config=peft_config)
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
@pytest.mark.parametrize("family", list(FAMILIES))
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vlm_sft_lora_on_a_patched_instance_matches_unpatched(family: str, tmp_path: Path) -> None:
    """The usual VLM recipe: LoRA on the language model's projections through `peft_config`, the loaded model patched
    by `apply_patch(model=...)` before TRL wraps it."""
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                task_type="CAUSAL_LM")
    want, _ = vlm_sft_losses(family, tmp_path, peft_config=LoraConfig(**lora))
    got, handle = vlm_sft_losses(family, tmp_path, instance=True, peft_config=LoraConfig(**lora))
    assert_ran_through_patch(handle)
    assert_same_losses(got, want)
