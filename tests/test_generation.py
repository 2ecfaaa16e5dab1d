"""KV-cache paths: greedy generation, decode steps and chunked prefill match the unpatched model."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from models import padded_batch, static_decode, tiny_model
from transformers import DynamicCache

import patchkit
from patchkit import PatchInputError
from patchkit.forward.inputs.arguments import cache_parameter


def greedy(model, ids, mask, n=32):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_greedy_generate_left_padded_matches_eager(kv_heads):
    model = tiny_model(kv_heads=kv_heads, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=16)
    want = greedy(model, ids, mask)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = greedy(model, ids, mask)
        assert handle.calls >= 32 * model.config.num_hidden_layers
    assert torch.equal(got, want)


def test_chunked_prefill_with_cache_matches_single_pass():
    model = tiny_model(kv_heads=2, seed=4)
    ids, mask = padded_batch("left", batch=3, seq=20)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            single = model(input_ids=ids, attention_mask=mask).logits
            cache = DynamicCache()
            chunks = []
            position = mask.long().cumsum(-1) - 1
            position.masked_fill_(mask == 0, 1)
            for start, stop in [(0, 7), (7, 8), (8, 15), (15, 20)]:  # prefill, a decode step, more chunks
                out = model(
                    input_ids=ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache,
                    position_ids=position[:, start:stop], use_cache=True,
                )
                chunks.append(out.logits)
            chunked = torch.cat(chunks, dim=1)
    real = mask.bool()
    torch.testing.assert_close(single[real], want[real], atol=2e-5, rtol=1e-4)
    # the single pass above used arange positions; compare chunked against the same positions run at once
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        once = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    eager_once = model(input_ids=ids, attention_mask=mask, position_ids=position).logits.detach()
    torch.testing.assert_close(chunked[real], once[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunked[real], eager_once[real], atol=2e-5, rtol=1e-4)


def test_llama1_refuses_a_past_but_runs_an_empty_cache():
    model = tiny_model(seed=6)
    ids, mask = padded_batch("right", batch=2, seq=14)
    with torch.no_grad(), patchkit.apply_patch("llama1", backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)  # an empty cache is a prefill: it runs
        assert out.past_key_values.get_seq_length() == 14
        nxt = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        with pytest.raises(PatchInputError, match="llama1' is for training and prefill only.*llama2"):
            model(input_ids=ids[:, :1], attention_mask=nxt, past_key_values=out.past_key_values)


def test_static_cache_generation_equals_unpatched():
    """generate(cache_implementation="static"): the same tokens as unpatched (patched where generate()'s 4D mask is
    read back as its 2D mask, tests/test_static_cache.py; else stepped aside), and the default dynamic cache still
    runs patched after."""
    model = tiny_model(seed=7)
    ids, mask = padded_batch("left", batch=2, seq=14)
    want = greedy(model, ids, mask, n=3)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    static = model.generate(input_ids=ids, cache_implementation="static", **kw)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        assert torch.equal(model.generate(input_ids=ids, cache_implementation="static", **kw), static)
        assert torch.equal(greedy(model, ids, mask, n=3), want)


@pytest.mark.parametrize("full_mask", [True, False], ids=["full-length mask", "short mask"])
def test_a_static_cache_decode_loop_with_the_first_row_padded_equals_unpatched(full_mask):
    """A decode loop of one's own into a StaticCache (no cache_position: the cache's count of filled slots places
    each step). transformers 4.56-5.x count them as the first row's nonzero keys, and the packed prefill left zeros
    at padding slots: the count came up short and the steps were wrong (up to 0.26, no error). 4.48's StaticCache
    has no `is_compileable`: patchkit took it for a growing cache and refused it, blaming activation checkpointing."""
    model = tiny_model(kv_heads=2, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=14)
    ids, mask = ids.flip(0), mask.flip(0)  # the first row padded
    want = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


GENERATE_MODES = {  # generate()'s modes beside greedy that reshape the batch or the cache behind the decode steps
    "beam search": dict(num_beams=4),  # the batch grows to B x beams; the cache is reordered by beam every step
    "beams, two returned": dict(num_beams=3, num_return_sequences=2),
    "sampling, two returned": dict(do_sample=True, num_return_sequences=2),  # rows expanded before the prefill
    "prompt lookup": dict(prompt_lookup_num_tokens=3),  # several candidate tokens per step, the cache cropped after
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("mode", list(GENERATE_MODES))
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generate_modes_equal_unpatched(family, mode, cache):
    """Beam search, returned sequences, sampling and prompt-lookup decoding over a left-padded batch (prompt lookup:
    one row, as transformers requires), a windowed family among them, into the default cache and a static one (beams
    reorder its slots in place; transformers refuses prompt lookup there, and must refuse it patched too): the same
    tokens and scores as unpatched, every forward patched (strict)."""
    from families import any_model, static_cache_served

    if cache == "static" and not static_cache_served(family):
        pytest.skip("this transformers' static-cache generation steps aside (tests/test_step_aside.py)")
    model = any_model(family)
    ids, mask = padded_batch("left", batch=3, seq=14, seed=2)
    if mode == "prompt lookup":  # a prompt that repeats itself, so lookup finds candidates
        ids, mask = ids[:1].repeat(1, 2), mask[:1].repeat(1, 2)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, **({} if cache == "dynamic" else {"cache_implementation": cache}),
              **{"do_sample": False, **GENERATE_MODES[mode]})
    same_generation(model, kw)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_assisted_generation_equals_unpatched(family):
    """Assisted generation: a second, smaller-seeded model drafts tokens that the main one checks several at a time
    behind its cache, which is cropped to the accepted ones; both models patched. Same tokens and scores. The
    assistant is sometimes handed a mask whose last column is 0 behind its cache and its next token read there:
    those drafting forwards step aside (their drafts equal unpatched too), the rest run patched."""
    from families import any_model

    main, assistant = any_model(family), any_model(family)
    for p in assistant.parameters():  # another draft model than the main one, so some drafts are rejected
        p.data.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(2))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0,
              assistant_model=assistant, return_dict_in_generate=True, output_scores=True)
    same_generation(main, kw, aside={"right_padded_generation"})


def same_generation(model, kw: dict, aside: frozenset = frozenset()) -> None:
    """generate(**kw) unpatched and under apply_patch (strict: every forward patched): the same tokens and scores.
    Where transformers itself cannot run it (4.56-5.0 refuse to crop a sliding-window cache past its window, as
    prompt lookup and assisted decoding do; every era refuses them on a static cache), the patched run meets the
    same error, not another one."""
    torch.manual_seed(0)
    try:
        want = model.generate(**kw)
    except ValueError as refused:
        vars(model).pop("_cache", None)  # 4.56 breaks on a static cache a refused generate() left behind
        with patchkit.apply_patch(backend="sdpa", strict=True), pytest.raises(ValueError) as also:
            torch.manual_seed(0)
            model.generate(**kw)
        assert str(also.value) == str(refused)
        return
    with patchkit.apply_patch(backend="sdpa", strict=not aside) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `aside`: the causes this generation may step aside for (named elsewhere)
        torch.manual_seed(0)
        got = model.generate(**kw)
        assert handle.calls > 0 and set(handle.stepped_aside) <= set(aside)
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.scores, want.scores):
        finite = step_want.isfinite()  # sampling's filtered scores are -inf
        assert torch.equal(finite, step_got.isfinite())
        torch.testing.assert_close(step_got[finite], step_want[finite], atol=2e-5, rtol=1e-4)


def verified_families() -> list[str]:
    from census import causal_lm_types

    from patches import table

    # left-padded batches of a family whose compressors or recurrent layers read padding step aside (DeepSeek-V4's:
    # `padding_into_mixer`); its generation: `test_compressed_attention.py`
    return sorted(set(causal_lm_types()) & set(table.VERIFIED) - table.PADDING_INTO_MIXERS)


@pytest.mark.parametrize("family", verified_families())
def test_a_chunk_behind_a_cache_equals_unpatched_in_every_family(family):
    """A chunk of new tokens behind a filled cache (chunked prefill; assisted and prompt-lookup decoding verify
    several candidates at once): its logits equal the unpatched model's. AFMoE views the attention output
    (`.view(*input_shape, -1)`), which patchkit's decode path returned non-contiguous for a chunk of more than one
    token (RuntimeError); transformers' own attention functions return it contiguous."""
    from families import served_tiny

    model = served_tiny(family)
    ids, mask = padded_batch("left", batch=3, seq=16)
    ids = ids.clamp(max=model.config.vocab_size - 1)

    # by the family's own name: Ergo's forwards (5.25) take `cache` without transformers' rename of the deprecated
    # `past_key_values`, which they leave in **kwargs and run without (unpatched: on a fresh cache, the chunk's mask
    # read from the 2D mask's first columns; patchkit refuses that mask, wider than the keys)
    name = cache_parameter(inspect.signature(type(model).forward).parameters)

    def chunked() -> torch.Tensor:
        first = model(input_ids=ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        rest = model(input_ids=ids[:, 10:], attention_mask=mask, use_cache=True, **{name: first.past_key_values})
        return torch.cat([first.logits, rest.logits], 1)

    with torch.no_grad():
        try:
            want = chunked()
        except Exception as unpatched:  # noqa: BLE001 - a tiny model transformers cannot run this way either
            pytest.skip(f"unpatched raises {type(unpatched).__name__}")
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = chunked()
            assert handle.calls
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
