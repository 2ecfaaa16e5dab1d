"""`apply_patch()` with no name patches every family; a model no active class patch serves says so once."""

from __future__ import annotations

import gc
import importlib
import warnings

import pytest
import torch
import transformers
from families import ATOL, FAMILIES_FROM, family_model, served_here
from models import assert_same, padded_batch, step, tiny_model
from packaging.version import Version
from transformers import BertConfig, BertModel

import _patchkit_startup
import patchkit
from patchkit.errors import PatchkitError, PatchTargetError
from patchkit.handles import PatchGroup
from patchkit.hooks.forwards import unserved
from patchkit.hooks.head.lm_head import heads_line
from patchkit.hooks.install.registry import registered, resolve

SERVED = sorted({t for s in registered() for t in s.model_types})
# before 4.53 only LLaMA's patches exist: apply_patch() patches LLaMA and names every other family as skipped; a
# family served from a later transformers (qwen2_moe: 5.0) is skipped until then, by its transformers gate
FAMILIES = Version(transformers.__version__) >= Version(FAMILIES_FROM)
GATED = {s.name for s in registered() if not served_here(s.name)}
PATCHED = sorted({t for s in registered() if s.name not in GATED for t in s.model_types})
SKIPPED = sorted(GATED)
needs_families = pytest.mark.skipif(
    not FAMILIES, reason=f"family patches (mistral, ...): transformers {FAMILIES_FROM}+ (before it only LLaMA's exist)")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(unserved, "_warned", set())


def adopted(group: PatchGroup) -> list[str]:
    """The families served from data the group took on: their modeling module was imported before it was applied
    (by another test module here), or a model of theirs was built under it."""
    named = {s.name for s in registered()}
    return [h.name for h in group if h.spec.name not in named]


def unserved_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "runs unpatched" in str(w.message)]


@pytest.mark.parametrize("family", ["llama", pytest.param("mistral", marks=needs_families),
                                    pytest.param("gemma2", marks=needs_families),
                                    pytest.param("qwen3", marks=needs_families)])
def test_no_name_patches_every_family_exactly(family):
    model = tiny_model().train() if family == "llama" else family_model(family).train()
    ids, mask = padded_batch("mixed")
    want = step(model, ids, mask)
    group = patchkit.apply_patch(backend="sdpa")
    assert isinstance(group, PatchGroup)
    assert sorted(set(group.model_types) - set(adopted(group))) == PATCHED
    assert sorted(group.skipped) == SKIPPED
    got = step(model, ids, mask)
    assert group.check(model) == 2 and group.layers_patched == 2
    assert_same(got, want, mask, atol=ATOL)
    group.revert()
    assert not group.active and patchkit.active_patches() == []


def test_every_family_is_one_handle_per_family_and_applying_twice_is_once():
    group = patchkit.apply_patch(backend="sdpa")
    again = patchkit.apply_patch("all", backend="sdpa")
    assert again is group  # "all" is the same request
    report = group.report(detail=True)
    assert "patch 'llama2'" in report
    families = len(registered()) - 1  # every patch but llama1, whose family is llama2's
    if not FAMILIES:  # LLaMA alone; every other family named with the gate that kept it off
        assert f"1 families patched, {families - 1} skipped" in report
        assert f"skipped gemma2: transformers_version: FAILED (required transformers<6,>={FAMILIES_FROM}" in report
        return
    assert patchkit.apply_patch("mistral", backend="sdpa") is next(h for h in group if h.name == "mistral")
    patched = families - len(GATED) + len(adopted(group))
    assert f"{patched} families patched, {len(GATED)} skipped" in report and "patch 'gemma2'" in report
    if Version(transformers.__version__) < Version("5.0"):  # Qwen2-MoE's attention calls the interface from 5.0
        assert "qwen2_moe" in GATED
    for name in GATED:  # each family served from a later transformers (Qwen2-MoE's from 5.0) named with its range
        assert f"skipped {name}: transformers_version: FAILED (required transformers{resolve(name).supported}" in report


@needs_families
def test_a_conflicting_patch_leaves_nothing_of_the_group_behind():
    mistral = patchkit.apply_patch("mistral", backend="sdpa", unpad="attention")
    with pytest.raises(PatchkitError, match="'mistral' .* is already applied to the mistral classes"):
        patchkit.apply_patch(backend="sdpa")
    assert patchkit.active_patches() == [mistral]  # the families applied before the conflict were reverted


def test_a_family_outside_the_group_is_named_by_check():
    group = patchkit.apply_patch(backend="sdpa")
    bert = BertModel(BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64))
    with pytest.raises(PatchTargetError, match="model_type 'bert'"):
        group.check(bert)


def test_an_unserved_model_under_a_class_patch_says_so_once():
    patchkit.apply_patch("llama2", backend="sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        family_model("mistral")
        family_model("mistral", seed=1)
        tiny_model()  # served: no warning
    (message,) = unserved_warnings(caught)
    assert "(model_type 'mistral') runs unpatched" in message
    (where,) = [w.filename for w in caught if "runs unpatched" in str(w.message)]
    assert where.endswith("tests/families.py")  # the line that built the model, not patchkit's or transformers'
    if FAMILIES:
        assert "apply_patch('mistral') before loading" in message
    else:  # no patch serves it on this transformers: the message says which versions would
        assert f"patch 'mistral' supports transformers<6,>={FAMILIES_FROM}" in message


def test_an_unregistered_family_under_every_family_says_so_once_and_runs_as_transformers_does():
    config = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64)
    torch.manual_seed(0)
    want_model = BertModel(config).eval()
    ids, mask = padded_batch("right")
    want = want_model(input_ids=ids, attention_mask=mask).last_hidden_state
    patchkit.apply_patch(backend="sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = BertModel(config).eval()
        BertModel(config)
    (message,) = unserved_warnings(caught)
    assert "model_type 'bert'" in message and "patchkit has no patch for this family" in message
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state, want)


@needs_families
def test_the_warning_hook_is_gone_with_the_last_class_patch():
    utils = importlib.import_module("transformers.modeling_utils").PreTrainedModel
    original = utils.__dict__["post_init"]
    first = patchkit.apply_patch("llama2", backend="sdpa")
    second = patchkit.apply_patch("mistral", backend="sdpa")
    first.revert()
    assert utils.__dict__["post_init"] is not original  # mistral's class patch is still active
    second.revert()
    assert utils.__dict__["post_init"] is original
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        family_model("gemma")
    assert unserved_warnings(caught) == []


@pytest.mark.skipif(not FAMILIES, reason=f"not every served family's modeling module exists before transformers "
                    f"{FAMILIES_FROM} (4.52 has no smollm3, 4.48 no qwen3, gemma3, glm4, smollm3); the lists "
                    "compared do not depend on the version")
def test_the_startup_hook_watches_every_registered_family_module():
    served = [spec for spec in registered() if served_here(spec.name)]  # Qwen3-VL's module exists from 4.57
    modules = {spec.attention_class().__module__ for spec in served}
    assert modules <= set(_patchkit_startup.FAMILY_MODULES)
    if len(served) == len(registered()):  # a transformers every patch serves: those modules and no other
        assert set(_patchkit_startup.FAMILY_MODULES) == modules


def test_the_groups_report_is_a_summary_that_names_what_ran():
    """The default apply_patch()'s report was every family's full report (296 lines) ending on an unused family's
    "0 (0 calls)", which reads as "nothing patched": it is now a summary, each family's report on request."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    with patchkit.apply_patch(backend="sdpa") as group:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        summary, detail = group.report(), group.report(detail=True)
    lines = summary.splitlines()
    assert lines[0].startswith("patchkit patch 'all': backend 'sdpa' (requested 'sdpa', strict=False)")
    heads = [heads_line(group.heads)] if group.heads else []  # where the LM's head ran (1 forward)
    assert sum(group.heads.values()) <= 1  # none where this era unpads inside attention only
    assert lines[1:3 + len(heads)] == ["  ran: llama2 (2 attention layers, 2 calls)",
                                       "  forwards stepped aside to transformers' attention: none", *heads]
    idle = len(list(group)) > 1  # one line names every family that ran nothing (none before 4.53: LLaMA alone)
    summary_lines = 4 + len(heads) + len(group.skipped)
    assert len(lines) == summary_lines + idle and "report(detail=True)" in lines[summary_lines - 1]
    assert detail.splitlines()[:3] == lines[:3] and "  gates:" in detail
    if idle:  # the tail names what is patched but idle, never an unused family's "0 (0 calls)"
        for text in (summary, detail):
            assert text.splitlines()[-1].startswith("  patched, no forward through them yet: mistral, ")
            assert not any("0 (0 calls)" in line for line in text.splitlines()[-3:]), text.splitlines()[-3:]
        llama2 = detail.index("patchkit patch 'llama2'")
        assert all(llama2 < detail.index(f"patchkit patch {h.name!r}") for h in group if h.name != "llama2")
    del model  # read at exit, as the launcher does: the model is gone, the layers it ran through are still counted
    gc.collect()
    assert group.report().splitlines()[1] == "  ran: llama2 (2 attention layers, 2 calls)"
    first = next(h for h in group if h.name == "llama2").report().splitlines()[:5]  # a family's own: summary first
    assert first[2].startswith("  backend: sdpa") and first[3] == "  attention layers through the patch: 2 (2 calls)"
    assert first[4] == "  forwards stepped aside to transformers' own attention: none"


@pytest.mark.parametrize("model_type", ["olmo", "gpt2"])
def test_a_family_served_from_data_built_before_apply_patch_runs_through_it(model_type):
    """A family served from data is adopted as its model is built (post_init); a model built before `apply_patch()`
    had passed that point, so it ran unpatched with no word. Its family's class patch is now applied with the group,
    because its modeling module is imported."""
    from census import tiny_lm
    from patchkit.patches import table

    if not table.serves_here():
        pytest.skip(f"families served from data need transformers{table.TABLE_TRANSFORMERS}")
    model, why = tiny_lm(model_type)
    assert model is not None, why
    model.eval()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = patchkit.apply_patch(backend="sdpa")
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
    handle = group.handle_for(model)
    assert handle.name == model_type and model_type in adopted(group)
    assert handle.calls > 0 and group.check(model) == handle.layers_patched > 0
    assert unserved_warnings(caught) == []
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=1e-4)
