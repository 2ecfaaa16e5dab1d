"""The LLaMA patches on whatever transformers is installed (4.31 to 5.x), each against that version's own eager model.

This file imports nothing newer than transformers 4.31 has, so the version matrix (`tests/matrix.py`, run by
`.ci/run`) runs it on every era; on the newest version it runs with the rest of the suite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from entrypoints import clean_env, launch, run
from models import assert_same, check_packed_rows, labels_for, padded_batch, step, tiny_config, tiny_model
from packaging.version import Version
from transformers.generation.utils import GenerationMixin

import patchkit
from patchkit import eras
from patchkit.errors import PatchGateError, PatchInputError, PatchTargetError

VERSION = Version(transformers.__version__)
MODULE_LEVEL_MASK = Version("4.35") <= VERSION < Version("4.38")  # no instance patch there


@pytest.mark.parametrize("unpad", ["model", "attention"])
@pytest.mark.parametrize("patch,kv_heads", [("llama2", 4), ("llama2", 2), ("llama1", 4)])
@pytest.mark.parametrize("kind", ["right", "left", "mixed"])
def test_padded_logits_and_gradients_match_this_versions_eager(patch, kv_heads, kind, unpad):
    model = tiny_model(kv_heads=kv_heads).train()
    ids, mask = padded_batch(kind)
    want = step(model, ids, mask)
    with patchkit.apply_patch(patch, backend="sdpa", unpad=unpad) as handle:
        got = step(model, ids, mask)
        assert handle.check(model) == 2 and handle.layers_patched == 2
    assert_same(got, want, mask)


@torch.no_grad()
def greedy(model: transformers.LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          use_cache=True)


def loss_and_step(model: transformers.LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    """The loss, then `step`'s logits and gradients, of one padded training step."""
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
    return loss, step(model, ids, mask)


@pytest.mark.skipif(VERSION < Version("4.36"), reason="one attention class before transformers 4.36")
def test_the_sdpa_attention_class_a_model_loads_by_default_runs_through_the_patch(tmp_path: Path) -> None:
    """4.36-4.47 build LlamaSdpaAttention when from_pretrained is given no attn_implementation, as LLaVA (4.37.2)
    and FastChat-era scripts load: a patch of LlamaAttention.forward alone would miss it."""
    tiny_model(kv_heads=2).save_pretrained(tmp_path)
    ids, mask = padded_batch("mixed")
    prompt, prompt_mask = padded_batch("left", batch=3, seq=16)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).train()
    want = loss_and_step(plain, ids, mask)
    want_tokens = greedy(plain.eval(), prompt, prompt_mask)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).train()  # built after the class patch
        got = loss_and_step(model, ids, mask)
        got_tokens = greedy(model.eval(), prompt, prompt_mask)
        assert handle.check(model) == handle.layers_patched == model.config.num_hidden_layers == 2
        assert handle.stepped_aside == {}
    built = "LlamaSdpaAttention" if hasattr(eras.modeling_llama(), "LlamaSdpaAttention") else "LlamaAttention"
    for m in (plain, model):
        assert m.config._attn_implementation == "sdpa"
        assert {type(layer.self_attn).__name__ for layer in m.model.layers} == {built}
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
    assert_same(got[1], want[1], mask)
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_left_padded_greedy_generation_with_a_cache_matches_eager(kv_heads):
    model = tiny_model(kv_heads=kv_heads, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=16)
    want = greedy(model, ids, mask)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = greedy(model, ids, mask)
        assert handle.layers_patched == 2
    assert torch.equal(got, want)


@pytest.mark.parametrize("use_cache", [True, False])
def test_packed_rows_equal_documents_run_separately(use_cache):
    check_packed_rows(kv_heads=2, use_cache=use_cache)


def test_an_instance_patch_matches_eager_or_is_refused_naming_why():
    model = tiny_model(kv_heads=2)
    other = tiny_model(kv_heads=2, seed=1)
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        other_want = other(input_ids=ids, attention_mask=mask).logits
    if MODULE_LEVEL_MASK:
        with pytest.raises(PatchGateError, match="module-level function, which only a class patch can replace"):
            patchkit.apply_patch("llama2", backend="sdpa", model=model)
        assert patchkit.active_patches() == []
        return
    with torch.no_grad(), patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = model(input_ids=ids, attention_mask=mask).logits
        assert handle.check(model) == 2
        torch.testing.assert_close(other(input_ids=ids, attention_mask=mask).logits, other_want)  # untouched
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


def patches(model: torch.nn.Module, unpad: str = "model"):
    """The class patch, or the instance patch where the era allows one (a module-level mask builder does not)."""
    if MODULE_LEVEL_MASK:
        return patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad)
    return patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad)


@pytest.mark.parametrize("unpad", ["model", "attention"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_labels_predicted_from_padding_step_aside_with_this_versions_numbers(unpad, checkpointed):
    """Every era: `labels = input_ids` on a left-padded batch predicts a real token from a padding position, whose
    logits this version's eager attention computes: the forward steps aside (`labels_from_padding`, named once) and
    gives those numbers, its gradient-checkpointing recompute too; labels at real tokens only run patched. Before,
    4.31-4.47 ran it patched with another loss (2.7e-4 off on 4.46), silently."""
    model = tiny_model(kv_heads=2).train()
    if checkpointed:
        model.gradient_checkpointing_enable()
    ids, mask = padded_batch("left")
    want = step(model, ids, mask, labels=ids)
    want_real = step(model, ids, mask)
    with patches(model, unpad) as handle:
        with pytest.warns(RuntimeWarning, match=r"\(labels_from_padding\)"):
            got = step(model, ids, mask, labels=ids)
        assert handle.stepped_aside == {"labels_from_padding": 1}
        got_real = step(model, ids, mask)
        assert handle.stepped_aside == {"labels_from_padding": 1} and handle.calls > 0
    assert_same(got, want, torch.ones_like(mask))
    assert_same(got_real, want_real, mask)


def test_a_sequence_classifier_pooling_padding_steps_aside_with_this_versions_numbers():
    """Every era: a LLaMA sequence classifier whose padding holds other ids than its config's pad token pools a
    padding position; that forward steps aside (`pooled_at_padding`) with this version's scores and gradients, and
    one padded with the config's token runs patched."""
    from transformers import LlamaForSequenceClassification

    config = tiny_model(kv_heads=2).config
    config.num_labels, config.pad_token_id = 3, 0
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).train()
    ids, mask = padded_batch("right", batch=3)
    labels = torch.tensor([0, 1, 2])

    def scored(batch_ids: torch.Tensor) -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=batch_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = ids.masked_fill(mask == 0, 0)
    want, want_padded = scored(ids), scored(padded)
    with patches(model) as handle:
        got = scored(ids)
        assert handle.stepped_aside == {"pooled_at_padding": 1}
        got_padded = scored(padded)
        assert handle.stepped_aside == {"pooled_at_padding": 1} and handle.calls > 0
    everything = torch.ones(3, 3, dtype=torch.bool)
    assert_same(got, want, everything)
    assert_same(got_padded, want_padded, everything)


def test_output_attentions_steps_aside_with_this_versions_weights():
    """Every era: output_attentions=True asks for weights varlen kernels never form; the forward steps aside
    (`output_attentions`) with this version's logits and attention weights. Before, 4.31-4.47 refused it."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        with patches(model) as handle:
            got = model(input_ids=ids, attention_mask=mask, output_attentions=True)
            assert handle.stepped_aside == {"output_attentions": 1}
    torch.testing.assert_close(got.logits, want.logits)
    for g, w in zip(got.attentions, want.attentions):
        torch.testing.assert_close(g, w)


def test_a_model_whose_attention_never_ran_through_the_patch_is_an_error():
    model = tiny_model()
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    assert handle.check(model) == 2
    handle.revert()
    with pytest.raises(PatchTargetError, match="live in 0 of 2 attention layers"):
        handle.check(model)


def test_the_report_names_the_installed_era():
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        report = handle.report()
    assert f"era {eras.installed_era().name}" in report and transformers.__version__ in report


def test_a_version_outside_every_era_is_refused_naming_it_and_the_range(monkeypatch):
    from patchkit import gates

    probe = gates.probe_environment
    monkeypatch.setattr(gates, "probe_environment",
                        lambda: probe().__class__(**{**vars(probe()), "transformers_version": "4.30.2"}))
    with pytest.raises(PatchGateError, match=r"found 4\.30\.2.*supports transformers<6,>=4\.31"):
        patchkit.apply_patch("llama2", backend="sdpa")
    assert patchkit.active_patches() == []


FASTCHAT = Path(__file__).parent / "user_scripts" / "fastchat_train.py"
DATA = Path(__file__).parent.parent / "examples" / "data" / "instructions.jsonl"


@pytest.mark.skipif(VERSION >= Version("5"), reason="it fails unpatched on 5.x: Trainer(tokenizer=) was removed")
def test_a_fastchat_era_trainer_script_under_the_launcher_trains_like_unpatched(tmp_path):
    """fschat-style train.py, unmodified: the launcher patches (every family it can) and the losses are unchanged."""
    made = run([sys.executable, FASTCHAT, "--make_model", tmp_path / "model", DATA], cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    args = [FASTCHAT, "--model_name_or_path", tmp_path / "model", "--data_path", DATA, "--output_dir",
            tmp_path / "out", "--max_steps", "3", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
            "--logging_steps", "1", "--model_max_length", "48", "--report_to", "none", "--save_strategy", "no",
            "--seed", "0"]
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    unpatched = run([sys.executable, *args], cwd=tmp_path, env=env, timeout=600)
    patched = launch("--backend", "sdpa", *args, cwd=tmp_path, env=env, timeout=600)

    def losses(proc):
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("LOSSES "))[7:])

    want, got = losses(unpatched), losses(patched)
    assert len(want) == 3 and got == pytest.approx(want, abs=2e-4)
    assert "attention layers ran through patch 'all'" in patched.stderr and "WARNING" not in patched.stderr


CONTRASTIVE = any(hasattr(GenerationMixin, name) for name in ("contrastive_search", "_contrastive_search"))


@pytest.mark.skipif(not CONTRASTIVE, reason="contrastive search is a Hub generation method from 4.57")
def test_contrastive_search_on_a_left_padded_batch_gives_this_versions_tokens():
    """It ranks candidates by their cosine similarity to the prompt's last hidden states, padding's included, which
    varlen kernels leave zero (not a number after the norm: other tokens, silently, 4.39-4.52; a crash on 4.32,
    whose candidates' past is a list): its prefill steps aside."""
    model = tiny_model(kv_heads=2, seed=4)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, penalty_alpha=0.6, top_k=4, pad_token_id=0)
    want = model.generate(**kw)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = model.generate(**kw)
        assert handle.stepped_aside == {"contrastive_search": 1} and handle.layers_patched == 2
    assert torch.equal(got, want)


def _contrastive_search(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """As the Hub's custom_generate copy (transformers-community/contrastive-search, 4.57+) names its loop: a
    module-level function of the model, whose prefill reads the prompt's last hidden states at every position."""
    return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]


def test_the_hubs_contrastive_search_function_is_read_as_the_method_was():
    """From 4.57 contrastive search is the Hub's `_contrastive_search(model, ...)`, a function, no `self` to read:
    its left-padded prefill ran patched (zero hidden states at padding: not a number after its norm). It steps
    aside as the method's did, and its hidden states at real positions are unpatched's."""
    model = tiny_model(kv_heads=2, seed=4).eval()
    ids, mask = padded_batch("left", batch=3, seq=16)
    with torch.no_grad():
        want = _contrastive_search(model, ids, mask)
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            got = _contrastive_search(model, ids, mask)
            assert handle.stepped_aside == {"contrastive_search": 1}
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_right_padded_generation_steps_aside_with_this_versions_tokens():
    """Before 4.38 generate()'s prefill passes neither cache_position nor logits_to_keep: it is told by its frame,
    and runs on transformers' attention, as every later version's does (it ran patched, reading a zero hidden
    state's logits at the padding, with strict=True too)."""
    model = tiny_model(kv_heads=2, seed=5)
    ids, mask = padded_batch("right", batch=3, seq=16)
    want = greedy(model, ids, mask)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = greedy(model, ids, mask)
        assert "right_padded_generation" in handle.stepped_aside
    assert torch.equal(got, want)
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True), pytest.raises(PatchInputError, match="right"):
        greedy(model, ids, mask)


@pytest.mark.skipif(VERSION >= Version("4.38"), reason="from 4.38 the rotary tables are read by position_ids")
def test_dynamic_ntk_rope_past_the_trained_length_gives_this_versions_logits():
    """Before 4.38 the rotary module is called with the sequence's length, from which dynamic NTK scaling picks its
    base: a packed forward's row is its real tokens, so it picked another (3.7e-4 off; and kept those tables on the
    module after revert)."""
    config = tiny_config(kv_heads=2, rope_scaling={"type": "dynamic", "factor": 2.0})
    config.max_position_embeddings = 8
    torch.manual_seed(6)
    model = transformers.LlamaForCausalLM(config).eval()
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            got = model(input_ids=ids, attention_mask=mask).logits
        after = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-5)
    assert torch.equal(after, want)


def test_a_callers_4d_mask_gives_this_versions_logits():
    """transformers 4.37-4.40 read a 4D mask as binary (0 masked, else attended), later ones as additive: an additive
    one ran patched there, read the other way from transformers. Now it steps aside before 4.41; later a 4D mask of
    causal and padding runs patched. Either way this version's numbers (where it takes a 4D mask at all)."""
    model = tiny_model(kv_heads=2, seed=7)
    ids, mask = padded_batch("left", batch=3, seq=16)
    allowed = torch.tril(torch.ones(16, 16, dtype=torch.bool))[None] & mask.bool()[:, None, :]
    additive = torch.zeros(3, 1, 16, 16).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        try:
            want = model(input_ids=ids, attention_mask=additive).logits
        except Exception as exc:  # noqa: BLE001 - an era whose LLaMA takes no 4D mask
            pytest.skip(f"transformers {VERSION} takes no 4D mask: {type(exc).__name__}")
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=additive).logits
            binary = VERSION < Version("4.41")
            assert ("custom_4d_mask" in handle.stepped_aside) == binary
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-5)


def test_static_cache_generation_gives_this_versions_tokens():
    """generate(cache_implementation="static"): on 4.41-4.47 its cache reached the LLaMA patch's attention, which
    refused it (PatchInputError); it steps aside now (legacy_static_cache), as 4.47's own 4D mask does; from 4.48
    it runs patched. The same tokens everywhere (where this version has a static cache)."""
    model = tiny_model(kv_heads=2, seed=8)
    ids, mask = padded_batch("left", batch=3, seq=16)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    try:
        want = model.generate(**kw)
    except Exception as exc:  # noqa: BLE001 - an era without static caches
        pytest.skip(f"transformers {VERSION} has no static cache for generate(): {type(exc).__name__}")
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = model.generate(**kw)
    assert torch.equal(got, want)
