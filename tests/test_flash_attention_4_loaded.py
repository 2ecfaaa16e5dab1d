"""Models loaded with transformers' own "flash_attention_4", patched: what an H100 or B200 user loads, and what
transformers loads GPT-OSS and the other attention-sink families with when asked for flash attention (flash-attn 2
has no sink). transformers' integration runs on the CPU over the recording flash-attn 4 stand-in, the one patchkit's
flash_attn_4 backend calls too (`fakes.install_transformers_flash_attention_4`); both in bf16, the kernel's dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from census import packed_rows
from fakes import install_transformers_flash_attention_4
from families import served_tiny, set_attention
from models import labels_for, padded_batch

import patchkit

# the sink families (GPT-OSS, Flint, the Granite sliding-window pair, MiMo-V2-Flash: transformers loads each with
# flash_attention_4 or a hub kernel, never flash_attention_2), and LLaMA, Mistral's window, Qwen3's q/k norms, Gemma 3
FAMILIES = ["gpt_oss", "flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "llama", "mistral", "qwen3",
            "gemma3_text"]
GRAD_RTOL = 2e-2  # bf16: a gradient summed over the padded batch unpatched, over its real tokens patched (measured:
# <= 1.4e-2 of the largest element, GPT-OSS's expert biases)


@pytest.fixture
def flash4(monkeypatch):
    return install_transformers_flash_attention_4(monkeypatch)


def loaded_with(family: str, attention: str = "flash_attention_4") -> torch.nn.Module:
    """The census's tiny `family` in bf16, as `from_pretrained(attn_implementation=attention)` leaves it."""
    model = served_tiny(family).to(torch.bfloat16)
    model.config._attn_implementation = attention
    return model


def train_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    model.train().zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_loaded_with_flash_attention_4_equals_unpatched(family, flash4):
    """On patchkit's flash_attn_4 backend: a training step on a mixed-padded batch (the sinks' gradients included),
    a packed row under a one-row mask of ones (flash_attention_4 keeps its documents apart, as flash_attention_2 does)
    and left-padded greedy generation, into a dynamic and a static cache, equal the unpatched model, every attention
    layer through the patch."""
    assert_loaded_flash_equals_unpatched(loaded_with(family), flash4.calls, "flash_attn_4")


def assert_loaded_flash_equals_unpatched(model: torch.nn.Module, kernel_calls: list, backend: str) -> None:
    """A bf16 model loaded with one of transformers' flash attentions (its kernel's stand-in recording
    `kernel_calls`), patched on `backend`: a training step on a mixed-padded batch, a packed row under a one-row mask
    of ones (kept apart, as the flash mask keeps it; eager joins it) and left-padded greedy generation into a
    dynamic and a static cache equal the unpatched model's."""
    ids, mask = padded_batch("mixed")
    calls = len(kernel_calls)
    want = train_step(model, ids, mask)
    assert len(kernel_calls) > calls  # transformers ran its flash attention on the stand-in
    with patchkit.apply_patch(model=model, backend=backend, strict=True) as handle:
        got = train_step(model, ids, mask)
        assert handle.calls > 0 and handle.backend == backend
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-2)
    real = mask.bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=2e-2, rtol=2e-2)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert (got[2][name] - grad).abs().max() <= GRAD_RTOL * grad.abs().max() + 1e-6, name

    model.eval()
    row, positions = (t[:1] for t in packed_rows())
    packed = dict(input_ids=row, position_ids=positions, attention_mask=torch.ones_like(row))
    prompts, prompt_mask = padded_batch("left", batch=3, seq=14)
    generate = dict(input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    eos_token_id=None)
    static = dict(generate, cache_implementation="static")  # generate() makes the masks per layer type ahead
    with torch.no_grad():
        want_packed, want_tokens = model(**packed, use_cache=False).logits, model.generate(**generate)
        want_static = model.generate(**static)
        # eager lets the documents see each other under the mask
        joined = set_attention(copy.deepcopy(model), "eager")(**packed, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend=backend, strict=True):
            got_packed, got_tokens = model(**packed, use_cache=False).logits, model.generate(**generate)
            got_static = model.generate(**static)
    torch.testing.assert_close(got_packed, want_packed, atol=2e-2, rtol=2e-2)
    apart = (got_packed - joined)[:, 7:].abs().max()  # the first document is 7 tokens; the rest see it when joined
    assert apart > 0.05 * joined.abs().max(), apart  # measured: 0.17-1.6 of it; patched equals unpatched to the bit
    assert torch.equal(got_tokens, want_tokens) and torch.equal(got_static, want_static)


def trainer_run(model: torch.nn.Module, tmp_path, reentrant: bool, patched: bool) -> tuple[list, dict, int]:
    """The HF Trainer (AdamW, its default) over the mixed-padded batch a row a micro-batch, 2 a step (the last micro-
    batch all padding), gradient checkpointing on: the logged losses, the trained weights, patchkit's calls."""
    import transformers as tf

    ids, mask = padded_batch("mixed", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels_for(ids, mask))]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1, gradient_accumulation_steps=2,
        learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    handle = patchkit.apply_patch(model=model, backend="flash_attn_4", strict=True) if patched else None
    try:
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        calls = handle.calls if handle else 0
    finally:
        if handle is not None:
            handle.revert()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}, calls


# GPT-OSS's expert biases start at zero and take bf16 gradients summed over the padded batch unpatched, over its real
# tokens patched; AdamW's first step moves each by about its rate whichever its gradient's size, so where that noise
# flips a near-zero gradient's sign the weight ends up to two rates away (measured: 14 of 512 elements, 9.7e-4)
NOISY = ("experts.gate_up_proj_bias", "experts.down_proj_bias")


@pytest.mark.parametrize("family, reentrant", [("gpt_oss", False), ("gpt_oss", True), ("flint", False),
                                               ("gemma3_text", True)])
def test_the_trainer_with_gradient_checkpointing_trains_a_flash_attention_4_model_as_unpatched(
        family, reentrant, flash4, tmp_path):
    """The HF Trainer with gradient checkpointing (either kind) on a model loaded with flash_attention_4: the losses
    and the weights after two AdamW steps equal unpatched, the sinks' included, each layer through the patch on its
    forward and its recompute; a micro-batch of padding alone (transformers' attention gets no token) included."""
    want = trainer_run(loaded_with(family), tmp_path, reentrant, patched=False)
    got = trainer_run(loaded_with(family), tmp_path, reentrant, patched=True)
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0), (got[0], want[0])
    assert got[2] == 4 * 2 * served_tiny(family).config.num_hidden_layers  # 4 micro-batches, forward + recompute
    for name, weight in want[1].items():
        atol = 2e-3 if name.endswith(NOISY) else 0
        torch.testing.assert_close(got[1][name], weight, atol=atol, rtol=0, msg=name)
