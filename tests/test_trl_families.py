"""TRL's SFTTrainer on the families patchkit serves from data, as users train them (a part of `make census`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trl import MODES, STEPS, one_thread, sft_losses  # noqa: F401 - one_thread: a fixture

import patchkit

FROM_DATA = ["gpt_oss", "llama4_text", "deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "dots3_note_text",
             "kolibri1_1",
             "qwen4_exp_text", "glm4_moe", "gemma4_text", "qwen3_5_text", "falcon_h1", "zaya", "hrm_text", "falcon",
             "recurrent_gemma"]
# hrm_text: a packed row without a mask steps aside (transformers' own mask keeps its documents apart only there)
PADDED_ONLY = ("hrm_text",)
JOINS = ("gpt_oss", "gemma4_text")  # their eager attention lets a packed row's documents see each other
# unpatched, their conv / Mamba layers refuse padding-free rows without their CUDA kernels (they cannot keep the
# documents apart), or ZAYA's convolution carries one state across them; patched, each document runs from a zero
# state (`mixer_rows.document_rows`); DeepSeek-V4's compressors pool a padding-free row across its documents unpatched,
# each document alone patched (`forward/documents.documents`); Qwen4-Exp's convolutions raise on them unpatched
APART = ("qwen3_5_text", "falcon_h1", "zaya", "deepseek_v4", "qwen4_exp_text")
CASES = [(f, mode) for f in FROM_DATA for mode in MODES
         if mode == "padded" or (f not in PADDED_ONLY and not (f in JOINS + APART and mode == "packing"))]
# attention calls per training step where they are not every layer's forward and recompute: HRM-Text's 2 layers
# recur (2 H-cycles x (3 L-cycles + 1) x 2 layers = 16 calls a forward), and the checkpointed recompute runs only the
# cycles that carry gradients (L_bp_cycles [1, 2] padded, + each H-step: (1 + 1 + 2 + 1) x 2 = 10)
PER_STEP = {"hrm_text": 16 + 10}
# Gemma4's 512-wide full-attention heads at unit scale: its first step's loss is equal to 1e-6 and its gradients to
# 2e-5 relative (fp32 rounding, as any two attention kernels; the census checks them), which Adam at lr 1e-2 grows
# step by step (it moves a weight by about its rate whatever the size of its gradient, so rounding that flips a
# near-zero gradient's sign moves it two rates): 1.3e-4 by the third step when this was written, 2.3e-4 by the
# second and 2.7e-2 by the third on 2026-12-02, the same with the code of a week before. Its losses are compared
# up to the second step.
DRIFT = {"gemma4_text": 1e-3}
COMPARED_STEPS = {"gemma4_text": 2}
# Kolibri-1.1 packing: its first step's loss and gradients are equal (to 1.6e-6 relative); Adam's first update moves a
# weight by its rate whatever its gradient's size, and one gradient of 8e-12 flips sign between two fp32 attention
# kernels, so the second and third losses differ by 4e-5 and 1.2e-4 (NVFP4 rounding of the sparse layers' keys and
# values grows it: 1.2e-5 without). transformers' own sdpa against its own eager differ as much (4.1e-5 and 1.3e-4,
# measured 2026-12-05); patchkit's run lies within 1.4e-5 of transformers' sdpa.
DRIFT[("kolibri1_1", "packing")] = 1e-3


def built(family: str):
    """The census's tiny model of `family`, as TRL can train it. TRL 1.16's fused LM head finds the backbone by
    `base_model_prefix`, which Llama4ForCausalLM names "language_model" (its multimodal model's name) while its
    backbone is `model`, and reads the load-balancing loss's expert count as `num_experts`, which Llama 4's config
    names `num_local_experts` (DeepSeek-V4's `n_routed_experts`): unpatched TRL raises on both, so both runs point
    them at the family's own."""
    from census import tiny_lm

    model, why = tiny_lm(family)
    if model is not None and family == "llama4_text" and not hasattr(model, model.base_model_prefix):
        model.base_model_prefix = "model"
        model.config.num_experts = model.config.num_local_experts
    if model is not None and family == "deepseek_v4":
        model.config.num_experts = model.config.n_routed_experts
    return model, why


@pytest.mark.parametrize("family, mode", CASES)
def test_sft_on_families_served_from_data_matches_unpatched(family: str, mode: str, tmp_path: Path) -> None:
    """The families patchkit serves from data (no module of their own: `patches/table.py`; sinks, latent attention,
    routed experts, Llama 4's chunks and NoPE layers, Gemma4's per-layer head sizes, hybrids, Falcon's multi-query
    attention through the interface from 5.25, RecurrentGemma's RG-LRU beside attention), as a user trains
    them: `apply_patch()` before the tiny model is built (the census's sizes), TRL's defaults (gradient
    checkpointing), padded, padding-free and packing. Every attention layer runs through the patch in each step's
    forward and recompute (a hybrid's other layers are its own); the losses equal the unpatched run's. GPT-OSS's and
    Gemma4's eager attention let the documents of a packed row see each other (TRL warns that padding-free needs
    flash attention), and the hybrids' mixers refuse padding-free rows on the CPU or join them: there the reference
    is the unpatched padded run of the same examples (their label tokens are the same; packing makes other batches,
    which no unpatched run of theirs gives exactly)."""
    from patches.table import serves_here

    if not serves_here():
        pytest.skip("the table serves transformers 5.x")
    model, why = built(family)
    if model is None:
        pytest.skip(why)
    joins = family in JOINS + APART and mode != "padded"
    want = sft_losses(model, tmp_path, **MODES["padded" if joins else mode])
    handle = patchkit.apply_patch(backend="sdpa")
    try:
        model, _ = built(family)
        got = sft_losses(model, tmp_path, **MODES[mode])
        layers = handle.check(model)
        assert layers >= 1 and handle.calls == STEPS * PER_STEP.get(family, layers * 2), handle.report()
        assert not handle.stepped_aside, handle.stepped_aside
    finally:
        handle.revert()
    assert got[0] == pytest.approx(want[0], abs=1e-5), (got, want)  # the first step: before any optimizer step
    steps = COMPARED_STEPS.get((family, mode), COMPARED_STEPS.get(family, STEPS))
    drift = DRIFT.get((family, mode), DRIFT.get(family, 1e-5))
    assert got[:steps] == pytest.approx(want[:steps], abs=drift), f"patched {got} != unpatched {want}"
