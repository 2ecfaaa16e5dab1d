"""A model loaded with transformers' own "flash_attention_2", then patched: what patchkit serves equals it, and what
steps aside runs on it (the mask transformers makes for it: 2D), as on a GPU machine with flash-attn installed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from census import causal_lm_types, document_logits, packed_rows
from fakes import install_transformers_flash_attention_2
from families import ATOL, FAMILIES_FROM, family_model, served_here, served_tiny, set_attention
from models import assert_same, labels_for, padded_batch, step, tiny_model

import patchkit
from patches import table
from patchkit.hooks.install.registry import registered

FAMILIES = ["llama", "mistral", "gemma2", "qwen3"]  # GQA, a sliding window, softcap and both, q/k norms


@pytest.fixture(autouse=True)
def flash_attention_2(monkeypatch):
    install_transformers_flash_attention_2(monkeypatch)


def loaded_as(family: str, loaded: str) -> torch.nn.Module:
    """The tiny fp32 model, its config naming `loaded` as `from_pretrained` leaves it."""
    if family != "llama" and not served_here(family):
        pytest.skip(f"{family}'s patch needs transformers {FAMILIES_FROM}+")
    model = tiny_model(kv_heads=2) if family == "llama" else family_model(family)
    model.config._attn_implementation = loaded
    return model


def loaded(family: str) -> torch.nn.Module:
    """The tiny model in bf16 (flash-attn's dtypes), loaded with "flash_attention_2", in eval mode."""
    return loaded_as(family, "flash_attention_2").to(torch.bfloat16).eval()


def patch(family: str, way: str, model: torch.nn.Module):
    return patchkit.apply_patch(family, backend="sdpa") if way == "class" else patchkit.apply_patch(
        model=model, backend="sdpa")


CALLS = {  # a served forward, and two that step aside (their cause)
    "served": lambda ids, mask: dict(labels=labels_for(ids, mask)),
    "labels_from_padding": lambda ids, mask: dict(labels=ids.clone()),
    "output_attentions": lambda ids, mask: dict(output_attentions=True),
}


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", FAMILIES)
def test_served_and_stepped_aside_forwards_equal_flash_attention_2(family, way):
    """Logits and loss equal the unpatched flash_attention_2 model's, bit for bit where a forward steps aside (the
    same kernel runs it) and served (patchkit's bf16 attention rounds as the kernel does here)."""
    model = loaded(family)
    ids, mask = padded_batch("mixed")
    real = mask.bool()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: flash attention returns no attention weights
        want = {name: model(input_ids=ids, attention_mask=mask, **kw(ids, mask)) for name, kw in CALLS.items()}
        handle = patch(family, way, model)
        try:
            got = {name: model(input_ids=ids, attention_mask=mask, **kw(ids, mask)) for name, kw in CALLS.items()}
            assert dict(handle.stepped_aside) == {"labels_from_padding": 1, "output_attentions": 1}
            assert handle.calls == 2  # the served forward's two layers
        finally:
            handle.revert()
    assert model.config._attn_implementation == "flash_attention_2"
    for name in CALLS:
        torch.testing.assert_close(got[name].logits[real], want[name].logits[real], atol=0, rtol=0, msg=name)
        torch.testing.assert_close(got[name].loss, want[name].loss, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_left_padded_served_and_right_padded_aside_gives_flash_attention_2s_tokens(family, way):
    model = loaded(family)
    batches = [padded_batch(side, batch=3) for side in ("left", "right")]

    def generated() -> list[torch.Tensor]:
        return [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               pad_token_id=0) for ids, mask in batches]

    want = generated()
    handle = patch(family, way, model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = generated()
        assert handle.stepped_aside.get("right_padded_generation") == 1 and handle.calls > 0
    finally:
        handle.revert()
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert any("(right_padded_generation): ran on transformers' attention" in str(w.message) for w in caught)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_keep_their_documents_apart_where_flash_attention_2_joins_more_than_one_row(family):
    """One packed row (DataCollatorWithFlattening's, TRL's padding-free): flash_attention_2 reads the documents from
    position_ids, and patchkit gives its logits. Two packed rows: transformers' flash_attention_2 runs each row as
    one sequence (it reads documents only from a batch of one row; its eager and sdpa masks read them from every
    row), and patchkit keeps each row's documents apart, each document's logits as it gives them run alone."""
    model = loaded(family)
    ids, positions = packed_rows()
    with torch.no_grad():
        one = model(input_ids=ids[:1], position_ids=positions[:1], use_cache=False).logits
        joined = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = document_logits(model, ids)
        with patchkit.apply_patch(family, backend="sdpa"):
            got_one = model(input_ids=ids[:1], position_ids=positions[:1], use_cache=False).logits
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got_one, one, atol=0, rtol=0)
    torch.testing.assert_close(got, alone, atol=0, rtol=0)
    assert (joined[1] - alone[1]).abs().max() > 1e-2  # unpatched, the second row's later documents saw the first


# the families served from data (`patches/table.py`) and those with a patch module of their own (`patches/`)
VERIFIED = sorted(set(causal_lm_types()) & (set(table.VERIFIED) | {t for s in registered() for t in s.model_types}))
# RecurrentGemma's recurrent layers carry their state across a row's documents, patched or not, and its attention is
# served documents apart (docs/families.md: attention-only packing): a packed row is neither its documents alone
# nor unpatched flash_attention_2's (whose attention, handed no position_ids, joins them), but what unpatched sdpa
# gives it (its mask finds the documents)
CARRIED = ("recurrent_gemma",)


@pytest.mark.parametrize("loaded", ["flash_attention_2", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_packed_row_with_a_mask_of_no_padding_keeps_the_loaded_attentions_rule(family, loaded):
    """One packed row and an attention_mask of ones (a collator that flattens and still hands a mask): transformers'
    flash_attention_2 takes a mask with no padding for none, and keeps the documents apart by position_ids; its eager
    masks take the mask as padding only, and join them. Two such rows: flash_attention_2 joins them too. Patched, a
    training step's logits and gradients equal the unpatched model's either way."""
    model = loaded_as(family, loaded)
    ids, positions = packed_rows()
    for rows in (1, 2):
        ones = torch.ones_like(ids[:rows])
        want = step(model.train(), ids[:rows], ones, position_ids=positions[:rows])
        handle = patchkit.apply_patch(family, backend="sdpa")
        try:
            got = step(model, ids[:rows], ones, position_ids=positions[:rows])
            assert handle.calls > 0 and not handle.stepped_aside
        finally:
            handle.revert()
        assert_same(got, want, ones, atol=ATOL)
        if rows == 1 and loaded == "flash_attention_2":
            with torch.no_grad():
                alone = document_logits(model.eval(), ids[:1])
            torch.testing.assert_close(got[0], alone, atol=ATOL, rtol=1e-4)  # each document as run alone


def on_flash_attention_2(model: torch.nn.Module) -> torch.nn.Module:
    """The model as transformers loads it when asked for flash_attention_2; skips where it never does (a family
    that names its own flash kernels, for attention sinks: transformers loads the first of them instead) or refuses."""
    kernels = getattr(model, "_compatible_flash_implementations", None)
    if kernels and "flash_attention_2" not in kernels:
        pytest.skip(f"asked for flash_attention_2, transformers loads {type(model).__name__} with {kernels[0]!r}")
    try:
        model.config._attn_implementation = "flash_attention_2"
    except ValueError as refusal:  # HRM-Text's prefix-LM config
        pytest.skip(f"transformers refuses flash_attention_2 here: {str(refusal).splitlines()[0][:120]}")
    return model


@pytest.mark.parametrize("model_type", VERIFIED)
def test_every_verified_family_loaded_with_flash_attention_2_is_served_with_its_numbers(model_type):
    """fp32 (the stand-in takes it; transformers' flash_attention_2 keeps it): a mixed-padded training step's logits
    and gradients, and left-padded greedy tokens into a dynamic and a static cache (whose masks generate() makes
    ahead per layer type, 2D for flash attention), equal the unpatched flash_attention_2 model's; a packed row's
    logits are each document's run alone (unpatched flash_attention_2 joins them in layers handed no position_ids
    and in a hybrid's mixers; RecurrentGemma's: unpatched sdpa's). Where transformers' flash_attention_2 fails
    unpatched, the test skips with its error (GPT-2 in fp32: its Conv1D layers have no nn.Linear to take a dtype
    from; Llama 4's chunks)."""
    model = on_flash_attention_2(served_tiny(model_type).train())
    ids, mask = padded_batch("mixed")
    left, left_mask = padded_batch("left", batch=3)
    packed, positions = packed_rows()
    packed, positions = packed[:1], positions[:1]

    def run() -> tuple:
        model.train()
        trained = step(model, ids, mask)
        model.eval()
        tokens = torch.cat([model.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=4,
                                           do_sample=False, pad_token_id=0, cache_implementation=cache)
                            for cache in (None, "static")])
        return trained, tokens

    try:
        want, want_tokens = run()
    except Exception as failure:  # noqa: BLE001 - what transformers' own path raises, named in the skip
        pytest.skip(f"unpatched flash_attention_2 fails: {type(failure).__name__}: {str(failure)[:100]}")
    with torch.no_grad():
        joined = model(input_ids=packed, position_ids=positions, use_cache=False).logits
        alone = (set_attention(copy.deepcopy(model), "sdpa")(input_ids=packed, position_ids=positions, use_cache=False)
                 .logits if model_type in CARRIED else document_logits(model, packed)[:1])
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got, tokens = run()
        with torch.no_grad():
            got_packed = model(input_ids=packed, position_ids=positions, use_cache=False).logits
        assert handle.calls > 0 and not handle.stepped_aside, handle.report()
    assert_same(got, want, mask, atol=ATOL)
    assert tokens.tolist() == want_tokens.tolist()
    apart, as_unpatched = ((got_packed - ref).abs().max().item() for ref in (alone, joined))
    assert min(apart, as_unpatched) <= ATOL, f"packed: {apart:.2g} off each document alone, {as_unpatched:.2g} off it"


@pytest.mark.heavy  # torch.compile
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
def test_a_compiled_forward_keeps_the_flash_rule_for_a_mask_of_no_padding(fullgraph):
    """Compiled, the rule above without a host read: one packed row with a mask of ones is its documents (as the eager
    patched forward and unpatched flash_attention_2 give it), one with padding is its padding alone, and two rows
    with masks of ones join (flash_attention_2's one-row rule)."""
    model = loaded_as("llama", "flash_attention_2").eval()
    ids, positions = packed_rows()
    padded = torch.ones_like(ids[:1]).index_fill(1, torch.tensor([22, 23]), 0)
    cases = [(ids[:1], positions[:1], torch.ones_like(ids[:1])), (ids[:1], positions[:1], padded),
             (ids, positions, torch.ones_like(ids))]
    with torch.no_grad():
        want = [model(input_ids=i, position_ids=p, attention_mask=m, use_cache=False).logits for i, p, m in cases]
        torch._dynamo.reset()
        with patchkit.apply_patch("llama", backend="sdpa") as handle:
            compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
            got = [compiled(input_ids=i, position_ids=p, attention_mask=m, use_cache=False).logits
                   for i, p, m in cases]
            assert not handle.stepped_aside
    for (_, _, m), g, w in zip(cases, got, want):
        real = m.bool()
        torch.testing.assert_close(g[real], w[real], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got[0], document_logits(model, ids[:1]), atol=ATOL, rtol=1e-4)
