"""QLoRA as its recipe runs it (bitsandbytes' 4-bit NF4 base weights, `prepare_model_for_kbit_training`, LoRA on
every linear layer, the HF Trainer with gradient checkpointing): the unpatched run's losses and trained adapters.

`prepare_model_for_kbit_training` casts the norms, the embeddings and the head to float32, so the hidden states are
float32 while the 4-bit layers compute in bfloat16: the attention's inputs come out of the 4-bit projections cast back
to float32. bitsandbytes runs its 4-bit layers on the CPU here (its torch fallback), the test extra's 0.49 and newer."""

from __future__ import annotations

import pytest
import torch
from models import completion_labels, padded_batch, tiny_model
from test_lm_head import assert_trained_alike, trainer_run

from patchkit.hooks.head import lm_head

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is a test extra")
peft = pytest.importorskip("peft", reason="peft is a test extra")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def qlora(folder) -> torch.nn.Module:
    """The tiny LLaMA loaded in 4-bit NF4 (double quantization, bfloat16 compute), prepared and wrapped in LoRA."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, device_map={"": "cpu"})
    model = peft.prepare_model_for_kbit_training(model)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("unpad", ["attention", "model", "loss"])
def test_qlora_trains_as_unpatched(tmp_path, unpad):
    """Two steps of 2 micro-batches of 2 padded rows, completion-only labels: the same losses and adapters, the 4-bit
    base weights untouched; the head (float32, frozen) on real tokens, fused (the Trainer reads the loss alone)."""
    tiny_model().save_pretrained(tmp_path / "tiny")
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
    labels = completion_labels(ids, mask, prompt=2)  # every micro-batch has a labelled token
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels)]
    want, got = (trainer_run(qlora(tmp_path / "tiny"), rows, way, tmp_path / str(way), max_steps=2,
                             per_device_train_batch_size=2, gradient_checkpointing=True)
                 for way in (None, unpad))
    assert_trained_alike(got, want)
    assert any("lora_" in name for name in want[1])
    if unpad != "attention":  # the Trainer's own step reads the loss alone: fused under "model" too
        assert got[2] == {lm_head.FUSED: 4}


def test_an_8bit_models_padded_forward_steps_aside_with_unpatched_numbers(tmp_path):
    """bitsandbytes' LLM.int8() layers (`load_in_8bit`, outlier threshold 6.0) compute in full precision every input
    column where any row they are handed passes the threshold, padding rows' included: on the real tokens alone they
    compute otherwise (7.7e-3 off at real tokens, silently). Such a model's padded forward steps aside
    (`rows_mixed_by_a_module`); its unpadded one runs patched."""
    import warnings

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import patchkit

    model = tiny_model()
    with torch.no_grad():  # norm gains of 4: hidden states reach the threshold, as a trained model's outliers do
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(4.0)
            layer.post_attention_layernorm.weight.mul_(4.0)
    model.save_pretrained(tmp_path / "tiny8")
    eight = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny8", device_map={"": "cpu"},
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True)).eval()
    ids, mask = padded_batch("right", batch=3, seq=16)
    with torch.no_grad():
        want = eight(input_ids=ids, attention_mask=mask).logits
        whole = eight(input_ids=ids[:1], attention_mask=mask[:1]).logits
    with patchkit.apply_patch(model=eight, backend="sdpa") as handle, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        got = eight(input_ids=ids, attention_mask=mask).logits
        assert dict(handle.stepped_aside) == {"rows_mixed_by_a_module": 1}
        alone = eight(input_ids=ids[:1], attention_mask=mask[:1]).logits  # no padding: patched
        assert dict(handle.stepped_aside) == {"rows_mixed_by_a_module": 1}
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, whole, atol=1e-5, rtol=1e-5)
