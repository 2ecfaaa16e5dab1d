"""The fused head and loss of unpad="loss" in the HF Trainer as users run it (checkpointing, micro-batches,
torch.compile, LoRA): the losses and trained weights of the unpatched Trainer, every micro-batch fused."""

from __future__ import annotations

import functools

import pytest
import torch
from test_fused_head import long_batch
from test_lm_head import assert_trained_alike, family, trainer_run

from patchkit.hooks.head import lm_head


def trainer_rows(model: torch.nn.Module) -> list[dict]:
    """The Trainer's dataset: the first 3 rows of the long completion-only batch, twice (2 steps of 3)."""
    batch = long_batch(model)
    return [dict(input_ids=i, attention_mask=m, labels=lab)
            for i, m, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"])][:3] * 2


@pytest.mark.parametrize("model_type", ["gemma2", "modernbert-decoder"])
def test_the_trainer_runs_the_fused_head_under_checkpointing_with_unpatched_numbers(tmp_path, model_type):
    """The HF Trainer as users run it: Gemma2 (its softcap in the fused loss), ModernBERT-decoder (its dense, GELU and
    LayerNorm before the head, `PRE_HEADS`, trained on the labelled rows), gradient checkpointing on, completion-
    only labels, 2 micro-batches a step (num_items_in_batch): the losses and the trained weights equal unpatched,
    and every micro-batch ran the fused head (the first after its check)."""
    rows = trainer_rows(family(model_type))
    want, got = (trainer_run(family(model_type), rows, unpad, tmp_path, max_steps=3, per_device_train_batch_size=3,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
                 for unpad in (None, "loss"))
    assert got[2] == {lm_head.FUSED: 6}  # 3 steps x 2 micro-batches, the first checked
    assert_trained_alike(got, want)


@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("tuning", ["full", "lora, checkpointed"])
def test_the_trainers_torch_compile_runs_the_fused_head_with_unpatched_numbers(tmp_path, tuning):
    """The HF Trainer with `torch_compile=True` (dynamo's eager backend here; inductor on a GPU): the compiled model's
    layers run compiled, its head and loss fused between the compiled frames; the losses and trained weights equal
    the unpatched compiled run, every micro-batch fused. Gemma 2 fully fine-tuned, or LLaMA under PEFT's LoRA with
    gradient checkpointing (non-reentrant), as a compiled LoRA run is set up."""
    from torch._dynamo.utils import counters

    lora = tuning.startswith("lora")
    rows = trainer_rows(family("gemma2"))

    def model() -> torch.nn.Module:
        if not lora:
            return family("gemma2")
        peft = pytest.importorskip("peft")
        torch.manual_seed(0)  # the adapters' A matrices
        return peft.get_peft_model(family("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    run = functools.partial(trainer_run, rows=rows, tmp_path=tmp_path, max_steps=2, per_device_train_batch_size=3,
                            torch_compile=True, torch_compile_backend="eager", **(checkpointing if lora else {}))
    try:
        want = run(model(), unpad=None)
        counters.clear()
        got = run(model(), unpad="loss")
    finally:
        torch._dynamo.reset()
    assert got[2] == {lm_head.FUSED: 4} and counters["stats"]["unique_graphs"] > 0  # compiled, and fused
    assert_trained_alike(got, want)


@pytest.mark.parametrize("tuning", ["lora", "lora training tokens, head tied", "lora on the head too",
                                    "lora on the head too, head tied"])
def test_the_trainer_runs_a_lora_fine_tune_on_the_fused_head_with_unpatched_numbers(tmp_path, tuning):
    """The most common fine-tune: PEFT's LoRA (the head frozen) in the HF Trainer, gradient checkpointing on,
    completion-only labels, 2 micro-batches a step: the losses and the trained adapters equal unpatched, every
    micro-batch fused. With a chat template's new tokens trained (`trainable_token_indices` on Gemma 2's tied head
    and embedding: PEFT's wrapper over both), their rows train as unpatched too; with LoRA on the head too
    (continued pretraining's recipe; TRL refuses it), its adapter trains as unpatched, fused with the loss: on LLaMA,
    and on Gemma 2's head, tied to its embedding and softcapped (the adapters' terms inside the softcap)."""
    peft = pytest.importorskip("peft")
    name = "gemma2" if "tied" in tuning else "llama"
    rows = trainer_rows(family(name))
    tokens = {"embed_tokens": [3, 5, 8]} if "tokens" in tuning else None
    targets = ["q_proj", "v_proj"] + (["lm_head"] if "head too" in tuning else [])

    def lora() -> torch.nn.Module:
        torch.manual_seed(0)  # the adapters' A matrices
        return peft.get_peft_model(family(name), peft.LoraConfig(r=4, target_modules=targets,
                                                                 trainable_token_indices=tokens))

    want, got = (trainer_run(lora(), rows, unpad, tmp_path, max_steps=3, per_device_train_batch_size=3,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
                 for unpad in (None, "loss"))
    assert got[2] == {lm_head.FUSED: 6}
    assert any("lora_A" in name for name in want[1])
    assert not tokens or any(float(w.abs().max()) > 0 for name, w in want[1].items() if "tokens_delta" in name)
    assert "head too" not in tuning or any(float(w.abs().max()) > 0 for name, w in want[1].items()
                                           if "lm_head.lora_B" in name)  # the head's adapter trained
    assert_trained_alike(got, want)
