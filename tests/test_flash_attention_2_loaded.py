"""A model loaded with transformers' own "flash_attention_2", then patched: what patchkit serves equals it, and what
steps aside runs on it (the mask transformers makes for it: 2D), as on a GPU machine with flash-attn installed."""

from __future__ import annotations

import warnings

import pytest
import torch
from census import PACKED, packed_rows
from fakes import install_transformers_flash_attention_2
from families import FAMILIES_FROM, family_model, served_here
from models import labels_for, padded_batch, tiny_model

import patchkit

FAMILIES = ["llama", "mistral", "gemma2", "qwen3"]  # GQA, a sliding window, softcap and both, q/k norms


@pytest.fixture(autouse=True)
def flash_attention_2(monkeypatch):
    install_transformers_flash_attention_2(monkeypatch)


def loaded(family: str) -> torch.nn.Module:
    """The tiny model in bf16 (flash-attn's dtypes), its config naming "flash_attention_2" as `from_pretrained` on a
    GPU leaves it."""
    if family != "llama" and not served_here(family):
        pytest.skip(f"{family}'s patch needs transformers {FAMILIES_FROM}+")
    model = (tiny_model(kv_heads=2) if family == "llama" else family_model(family)).to(torch.bfloat16).eval()
    model.config._attn_implementation = "flash_attention_2"
    return model


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
        alone = torch.cat([torch.cat([model(input_ids=ids[r:r + 1, a:a + n], use_cache=False).logits
                                      for a, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)], 1)
                           for r, lengths in enumerate(PACKED)])
        with patchkit.apply_patch(family, backend="sdpa"):
            got_one = model(input_ids=ids[:1], position_ids=positions[:1], use_cache=False).logits
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got_one, one, atol=0, rtol=0)
    torch.testing.assert_close(got, alone, atol=0, rtol=0)
    assert (joined[1] - alone[1]).abs().max() > 1e-2  # unpatched, the second row's later documents saw the first
