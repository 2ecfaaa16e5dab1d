"""Gradient checkpointing recomputes layers in backward, outside the forward: every family, every way in, exact."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from entrypoints import clean_env, launch, run, tagged
from families import ATOL, FAMILIES, any_model
from models import assert_same, padded_batch, step

import patchkit
from patchkit.errors import PatchStateError

SCRIPT = Path(__file__).parent / "user_scripts" / "checkpoint_train.py"




def checkpointed(model: torch.nn.Module, reentrant: bool) -> torch.nn.Module:
    """Checkpoint every decoder layer, as TRL and LLaMA-Factory do by default (5.x renamed the method)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_checkpointed_step_matches_unpatched(family, way, reentrant):
    """Logits and every gradient equal the unpatched model's; the recompute ran through the patch (4 calls)."""
    model = checkpointed(any_model(family, "sdpa" if reentrant else "eager").train(), reentrant)
    ids, mask = padded_batch("mixed")
    want = step(model, ids, mask)
    handle = patchkit.apply_patch(family, backend="sdpa") if way == "class" else patchkit.apply_patch(
        model=model, backend="sdpa")
    got = step(model, ids, mask)
    assert handle.calls == 4  # 2 layers in the forward, 2 recomputed in backward
    handle.revert()
    assert_same(got, want, mask, atol=ATOL)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_revert_before_backward_raises_a_patchkit_error_naming_the_recompute(family):
    """The mask of a patched forward never reaches transformers' sdpa as a raw TypeError."""
    model = checkpointed(any_model(family, "sdpa").train(), reentrant=False)
    ids, mask = padded_batch("right")
    handle = patchkit.apply_patch(family, backend="sdpa")
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    handle.revert()
    with pytest.raises(PatchStateError, match="before the backward of a gradient-checkpointed forward") as error:
        loss.backward()
    assert "If nothing changed them" in str(error.value) and "report the model type" in str(error.value)


def test_a_checkpointed_deepcopy_of_an_instance_patch_is_reverted_with_it():
    model = checkpointed(any_model("qwen2", "sdpa").train(), reentrant=False)
    handle = patchkit.apply_patch(model=model, backend="sdpa")
    copied = copy.deepcopy(model)
    ids, mask = padded_batch("left")
    got = step(copied, ids, mask)
    handle.revert()
    assert all("forward" not in vars(m) for m in copied.modules())
    assert_same(got, step(copied, ids, mask), mask, atol=ATOL)


def losses(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tagged(proc.stdout, "RESULT")


@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("family, reentrant", [("Mistral", "0"), ("Qwen2", "1")])
def test_env_var_and_launcher_train_with_checkpointing_as_unpatched(family, reentrant, tmp_path):
    """An unmodified script with checkpointing on: the same three losses unpatched, under PATCHKIT_FLASH_ATTN=1 and
    under the launcher, reentrant and not (one family each: the families' checkpointing runs in-process above)."""
    any_model(family.lower())  # skips where transformers has no family patches
    env = dict(FAMILY=family, REENTRANT=reentrant)
    plain = losses(run([sys.executable, SCRIPT], env=clean_env(**env), cwd=tmp_path))
    env_proc = run([sys.executable, SCRIPT], env=clean_env(PATCHKIT_FLASH_ATTN="1", **env), cwd=tmp_path)
    launcher_proc = launch("--backend", "sdpa", SCRIPT, env=clean_env(**env), cwd=tmp_path)
    for got in (losses(env_proc), losses(launcher_proc)):
        assert got["calls"] == 3 * 4  # three steps of 2 layers, each recomputed once
        assert got["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    # the exit line names the way in that applied the patch
    assert "patchkit (PATCHKIT_FLASH_ATTN): rank 0/1 (single process): 2 attention layers ran" in env_proc.stderr
    assert "patchkit.launch:" not in env_proc.stderr
    assert "patchkit.launch: rank 0/1 (single process): 2 attention layers ran" in launcher_proc.stderr


def gemma4_multimodal() -> torch.nn.Module:
    """Gemma4ForConditionalGeneration: the census's tiny Gemma 4 text model (sdpa) under a one-layer vision tower."""
    import transformers
    from census import tiny_config

    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("Gemma 4: transformers 5.x")
    text = {k: v for k, v in tiny_config("gemma4_text").to_dict().items()
            if k not in ("transformers_version", "model_type", "per_layer_config", "architectures")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    return transformers.Gemma4ForConditionalGeneration(config).float()


@pytest.mark.parametrize("padding", ["none", "mixed"])
def test_gemma4_multimodal_checkpointed_non_reentrant_matches_unpatched(padding):
    """Gemma 4's multimodal model builds its language model's masks itself, outside the patch: without padding,
    sdpa's per-layer-type masks are all None. Those forwards build patchkit's own masks, so a non-reentrant
    checkpoint's recompute runs the same attention as the forward (before: the forward ran patchkit's attention on
    the route, the recompute transformers' sdpa on None, and torch raised CheckpointError: saved (B, 2, S, D) keys,
    recomputed (B, 4, S, D)). Loss and every gradient equal unpatched."""
    model = checkpointed(gemma4_multimodal().train(), reentrant=False)
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    ids = ids.clamp(max=model.config.text_config.vocab_size - 1)
    if padding == "none":
        mask = torch.ones_like(mask)
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(-1) == 1), -100)

    def train_step() -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = train_step()
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got_loss, got = train_step()
        assert handle.calls and not handle.stepped_aside  # served, forward and recompute alike (padded: the masks
        # read back as the 2D mask, its per_layer_inputs unpadded with the batch)
    torch.testing.assert_close(got_loss, want_loss, atol=ATOL, rtol=1e-4)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-3, msg=name)
