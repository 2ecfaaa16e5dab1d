"""Patch mechanics: idempotent, reversible to identity, all or nothing, instance patches that do not leak."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from models import padded_batch, tiny_model

import patchkit
import patchkit.api
import patchkit.hooks.install.registry
from patchkit import PatchInputError, PatchkitError, PatchTargetError, eras
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.install.patching import Replacement
from patchkit.hooks.install.routing import is_patched_forward

MOD = sys.modules["transformers.models.llama.modeling_llama"]


def originals():
    return MOD.LlamaAttention.__dict__["forward"], getattr(MOD, "create_causal_mask", None)


def test_apply_twice_equals_once_and_revert_restores_identity():
    before = originals()
    first = patchkit.apply_patch("llama2", backend="sdpa")
    patched = originals()
    second = patchkit.apply_patch("llama2", backend="sdpa")
    assert second is first and originals() == patched
    assert patched[0] is not before[0]
    first.revert()
    assert originals()[0] is before[0] and originals()[1] is before[1]
    first.revert()  # a second revert does nothing
    assert originals()[0] is before[0]


def test_context_manager_and_revert_patch():
    before = originals()
    with patchkit.apply_patch("llama", backend="sdpa") as handle:
        assert handle.name == "llama2"  # alias
        assert is_patched_forward(MOD.LlamaAttention.forward)
    assert originals() == before
    patchkit.apply_patch("llama1", backend="sdpa")
    assert patchkit.revert_patch() == 1
    assert originals() == before


def test_a_different_patch_on_the_same_target_is_refused_until_reverted():
    patchkit.apply_patch("llama2", backend="sdpa")
    with pytest.raises(PatchkitError, match="'llama2'.*already applied.*revert"):
        patchkit.apply_patch("llama1", backend="sdpa")
    with pytest.raises(PatchkitError, match="already applied"):
        patchkit.apply_patch("llama2", backend="sdpa", strict=True)


def test_instance_patch_does_not_leak_to_other_instances_or_classes():
    model, other = tiny_model(seed=1), tiny_model(seed=1)
    before = originals()
    config_impl = other.config._attn_implementation
    handle = patchkit.apply_patch("llama2", model=model, backend="sdpa")
    assert originals() == before
    assert handle.check(model) == model.config.num_hidden_layers
    assert not any(is_patched_forward(layer.self_attn.forward) for layer in other.model.layers)
    assert other.config._attn_implementation == config_impl
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = other(input_ids=ids, attention_mask=mask).logits
    assert handle.layers_patched == 2 and handle.calls == 2
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    with pytest.raises(PatchTargetError, match="live in 0 of 2"):
        handle.check(other)
    handle.revert()
    assert all("forward" not in vars(layer.self_attn) for layer in model.model.layers)
    assert model.config._attn_implementation == config_impl
    with pytest.raises(PatchTargetError, match="reverted"):
        handle.check(model)


def test_instance_patch_looks_through_wrappers():
    model = tiny_model()
    wrapper = torch.nn.Sequential(model)  # stands in for DDP/FSDP/PEFT containers
    handle = patchkit.apply_patch("llama2", model=wrapper, backend="sdpa")
    assert handle.check(model) == 2


def test_class_patch_report_counts_layers_and_check_finds_unpatched_models():
    model = tiny_model(layers=3)
    ids, mask = padded_batch("right")
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    assert handle.layers_patched == 0
    model(input_ids=ids, attention_mask=mask)
    assert handle.layers_patched == 3 and handle.calls == 3
    report = handle.report()
    for text in ("backend: sdpa", "transformers_version: ok", "LlamaAttention.forward",
                 "attention layers through the patch: 3 (3 calls)"):
        assert text in report
    assert handle.check(model) == 3
    vars(model.model.layers[1].self_attn)["forward"] = lambda *a, **k: None  # e.g. a remote-code override
    with pytest.raises(PatchTargetError, match="live in 2 of 3"):
        handle.check(model)


def test_zero_attention_layers_is_an_error_and_nothing_is_patched():
    not_llama = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(PatchTargetError, match="patched 0 layers"):
        patchkit.apply_patch("llama2", model=not_llama, backend="sdpa")
    assert patchkit.active_patches() == []


def test_missing_target_patches_nothing(monkeypatch):
    """All or nothing: if one target is absent, none is replaced."""
    before = originals()
    spec = patchkit.hooks.install.registry.resolve("llama2")

    def with_a_missing_target(state):
        return [*eras.class_replacements(state), Replacement(MOD.LlamaModel, "_no_such_method", None)]

    broken = dataclasses.replace(spec, build_class=with_a_missing_target)
    monkeypatch.setattr(patchkit.api, "resolve", lambda name: broken)
    with pytest.raises(PatchTargetError, match="_no_such_method.*nothing was patched"):
        patchkit.apply_patch("llama2", backend="sdpa")
    assert originals() == before and patchkit.active_patches() == []


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(name="llama3"), ValueError, "unknown patch 'llama3'; available patches: gemma, .*llama1, llama2, "
                                          "mistral, .*starcoder2, llama \\(= llama2\\)"),
        (dict(backend="flash"), ValueError,
         "unknown backend 'flash'; choose one of auto, flash_attn, flash_attn_4, torch_varlen, sdpa"),
        (dict(strict="yes"), TypeError, "strict must be True or False"),
        (dict(model="path/to/model"), TypeError, "model= must be a loaded torch.nn.Module"),
    ],
)
def test_bad_arguments_raise_clearly_and_change_nothing(kwargs, error, match):
    before = originals()
    with pytest.raises(error, match=match):
        patchkit.apply_patch(**kwargs)
    assert originals() == before and patchkit.active_patches() == []


@pytest.mark.parametrize("way", ["class", "instance"])
def test_4d_mask_is_served_by_transformers_attention_never_dropped(way):
    """An additive 4D mask in no pattern of padding, causality and blocks (each query sees the first key and itself):
    transformers' attention serves it exactly."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    seen = torch.eye(24, dtype=torch.bool)
    seen[:, 0] = True
    custom = torch.zeros(4, 1, 24, 24).masked_fill(~seen, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=custom).logits
        handle = patchkit.apply_patch("llama2", backend="sdpa", model=model if way == "instance" else None)
        got = model(input_ids=ids, attention_mask=custom).logits
        assert handle.stepped_aside == {"custom_4d_mask": 1}
        model(input_ids=ids, attention_mask=mask)  # a 2D mask runs patched again
        assert handle.calls == 2
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("way", ["class", "instance"])
def test_an_all_zeros_4d_mask_runs_patched_as_one_block_per_row(way):
    """An all-zeros additive 4D mask is bidirectional attention over every key: read back, each row is one block
    (`forward/metadata.py`), served by the block pass with transformers' numbers."""
    model = tiny_model()
    ids = padded_batch("right")[0]
    custom = torch.zeros(4, 1, 24, 24)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=custom).logits
        with patchkit.apply_patch("llama2", backend="sdpa", model=model if way == "instance" else None,
                                  strict=True) as handle:
            got = model(input_ids=ids, attention_mask=custom).logits
            assert handle.stepped_aside == {} and handle.calls == model.config.num_hidden_layers
    torch.testing.assert_close(got, want)


def test_a_4d_mask_whose_new_tokens_see_each_other_both_ways_behind_a_past_steps_aside_as_a_4d_mask():
    """A caller's 4D mask over a cache's past and 4 new tokens that see each other both ways: blocks behind a past
    are not served, and the cause named is the caller's mask (custom_4d_mask), not a multimodal model's images."""
    model = tiny_model().eval()
    ids = padded_batch("right")[0][:1, :12].clamp(min=3)
    seen = torch.ones(1, 1, 4, 12, dtype=torch.bool)  # the 8 past keys and all 4 new ones, both ways
    custom = torch.zeros(1, 1, 4, 12).masked_fill(~seen, torch.finfo(torch.float32).min)
    with torch.no_grad():
        past = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        want = model(input_ids=ids[:, 8:], attention_mask=custom, past_key_values=past).logits
        past = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model(input_ids=ids[:, 8:], attention_mask=custom, past_key_values=past).logits
        assert handle.stepped_aside == {"custom_4d_mask": 1}
    torch.testing.assert_close(got, want)


def test_output_attentions_is_refused_with_the_reason():
    """A layer called on its own with patchkit's mask (the model's forward steps aside for it: test_step_aside)."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    layer = model.model.layers[0].self_attn
    h = model.model.embed_tokens(ids)
    pe = model.model.rotary_emb(h, torch.arange(24)[None])
    with patchkit.apply_patch("llama2", backend="sdpa"):
        with pytest.raises(PatchInputError, match="passes output_attentions=True.*attention weights"):
            layer(h, position_embeddings=pe, attention_mask=VarlenMask.for_forward(mask), output_attentions=True)


def test_available_patches_lists_the_registry():
    patches = {p["name"]: p for p in patchkit.available_patches()}
    assert set(patches) == {"llama1", "llama2", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                            "granite", "starcoder2", "olmo2", "smollm3", "glm4", "mixtral", "qwen2_moe", "qwen3_moe",
                            "phi", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe"}
    assert patches["llama2"]["aliases"] == ["llama"]
    assert patches["llama2"]["transformers"] == ">=4.31,<6" and patches["mistral"]["transformers"] == ">=4.53,<6"
    assert patches["gemma3_text"]["model_types"] == ["gemma3_text"]
    assert "2.1" in patches["llama2"]["flash_attn"] and "2.0" in patches["llama1"]["flash_attn"]
    assert "model_config" in patches["llama1"]["gates"] and "compute_capability" in patches["llama2"]["gates"]


def spy_on_4d_mask_builders(monkeypatch, calls: list) -> None:
    """Record every call of the functions that build (B, 1, N, N) masks in this transformers version."""
    try:
        import transformers.masking_utils as mu
    except ImportError:  # 4.48-4.52: LlamaModel._update_causal_mask builds it with this static method
        original = MOD.LlamaModel._prepare_4d_causal_attention_mask_with_cache_position
        monkeypatch.setattr(MOD.LlamaModel, "_prepare_4d_causal_attention_mask_with_cache_position",
                            staticmethod(lambda *a, **k: calls.append(1) or original(*a, **k)))
        return
    for name in ("sdpa_mask", "eager_mask"):  # 4.53+: masking_utils, dispatched by implementation name
        original = getattr(mu, name)
        monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name.split("_")[0],
                            lambda *a, _o=original, **k: calls.append(1) or _o(*a, **k))


def test_no_4d_mask_is_built_by_a_patched_model(monkeypatch):
    """The mask builders that make (B, 1, N, N) masks are never called while the patch is active."""
    calls = []
    spy_on_4d_mask_builders(monkeypatch, calls)
    model = tiny_model()
    ids, mask = padded_batch("mixed")
    model(input_ids=ids, attention_mask=mask)
    assert calls, "the spy did not see the unpatched model build its mask"
    calls.clear()
    with patchkit.apply_patch("llama2", backend="sdpa"):
        model(input_ids=ids, attention_mask=mask)
        model.generate(input_ids=ids[:2, 10:], attention_mask=mask[:2, 10:], max_new_tokens=3, pad_token_id=0)
    assert calls == []


def test_patched_forwards_show_the_originals_name_docstring_annotations_and_signature():
    """transformers' own MoE test reads `ForCausalLM.forward.__annotations__["return"]` to check that the output type
    declares `router_logits`; the class patch's wrapper had no annotations, so under PATCHKIT_FLASH_ATTN=1 that test
    failed for Mixtral, Qwen2-MoE and Qwen3-MoE. Every wrapper shows what the original shows, class and instance
    patch alike. The model's wrappers set no `__wrapped__`, which frameworks follow to strip a model's forward
    wrappers (accelerate); the attention class's wrapper points it at the family's forward, whose source frameworks
    that rewrite it read (`inspect.getsource` follows it: test_source_rewriting)."""
    import inspect

    from transformers.models.llama import modeling_llama as ml

    classes = [ml.LlamaForCausalLM, ml.LlamaModel, ml.LlamaAttention]
    originals = {cls: cls.forward for cls in classes}
    model = tiny_model()

    def shown(function) -> tuple:
        return (function.__name__, function.__qualname__, function.__doc__, function.__annotations__,
                inspect.signature(function))

    want = {cls: shown(forward) for cls, forward in originals.items()}
    with patchkit.apply_patch("llama2", backend="sdpa"):
        for cls in classes:
            if cls.forward is not originals[cls]:  # the eras this transformers has wrap some of them
                assert shown(cls.forward) == want[cls], cls
                wrapped = getattr(cls.forward, "__wrapped__", None)
                assert wrapped is (originals[cls] if cls is ml.LlamaAttention else None), cls
        assert any(cls.forward is not originals[cls] for cls in classes)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        bound = model.forward
        assert bound.__name__ == "forward" and bound.__annotations__ == originals[ml.LlamaForCausalLM].__annotations__
        assert inspect.signature(bound) == inspect.signature(tiny_model().forward)
