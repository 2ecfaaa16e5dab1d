"""Never silently wrong in generation: generate() and hand-written decode loops over padded prompts and caches.

Each gives unpatched's tokens and logits, patched or stepped aside by name (a row that is all padding, a right-padded
prefill, a static kind of cache)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from families import set_attention
from models import (
    CACHE,
    VOCAB,
    dynamic_cache,
    dynamic_decode,
    needs_mask_interface,
    padded_batch,
    static_decode,
    tiny_model,
)
from packaging.version import Version

import patchkit
from patchkit.hooks.name import attention_interface

VERSION = Version(transformers.__version__)


@pytest.mark.parametrize("cache", [
    pytest.param("sliding_window", marks=pytest.mark.skipif(
        VERSION < Version("4.53"), reason="unpatched transformers < 4.53 fails it: LLaMA's _update_causal_mask "
        "cannot size a mask for a SlidingWindowCache shorter than the prompt (RuntimeError in generate())")),
    "static",
])
def test_generate_with_a_static_kind_of_cache_steps_aside_naming_the_cause(cache):
    """generate() builds a 4D mask for these caches before the model runs: transformers' attention serves it."""
    model = tiny_model()
    model.config.sliding_window = 8  # the sliding_window cache needs a window
    ids, mask = padded_batch("left", batch=2, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=2, pad_token_id=0, do_sample=False, cache_implementation=cache)
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = model.generate(input_ids=ids, **kw)
        counted = handle.stepped_aside
    assert torch.equal(got, want)
    if counted:  # the versions whose generate() builds the 4D mask itself
        assert set(counted) == {"custom_4d_mask"}


@pytest.mark.parametrize(("family", "new"), [("mistral", 3), ("starcoder2", 3), ("llama", 1)])
def test_a_right_padded_static_generation_on_a_sliding_model_reads_no_padding_logit(family, new):
    """generate(cache_implementation="static") on a right-padded prompt longer than the window (8 > 5), its rows'
    real tokens within it: the sliding layers' prefill mask is square, and it was taken for packed documents
    (neat_packing's mask) and served, so a short row's next token, which generate() reads at a padding position,
    came from patchkit's zero there: another first token for every right-padded row, no error (4.56-5.23). A
    static cache's mask is now never read as documents, and a prefill reading a padding position steps aside
    (right_padded_generation), as with a 2D mask. Every layer sliding (Mistral, Starcoder2): generate() makes one 4D
    mask; a LLaMA generating one token has a static cache as long as the prompt, so its mask is square too."""
    from families import any_model

    model = any_model(family)
    mask = (torch.arange(8)[None] < torch.tensor([[4], [2], [1]])).long()  # right-padded, each row within the window
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(0)).masked_fill(mask == 0, 0)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
              cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    want = model.generate(**kw)
    with patchkit.apply_patch(backend="sdpa") as handle:
        got = model.generate(**kw)
        aside = handle.stepped_aside  # before 4.57 such static caches are not served: every forward steps aside
        assert aside.get("right_padded_generation") == 1 or aside == {"custom_4d_mask": new}
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("unpad", ["model", "attention"])
def test_generate_with_a_row_that_is_all_padding_equals_unpatched(cache, unpad):
    """A row with no real token: transformers gives it real logits at its last (padding) position, varlen kernels
    zeros, so its tokens were all 0 under the patch, silently. The prefill steps aside, named; the steps after it
    (the row now has tokens of its own) run patched, and every row's tokens equal unpatched."""
    from families import static_cache_served

    if cache == "static" and not static_cache_served("llama"):
        pytest.skip("this transformers' static-cache generation steps aside (tests/test_step_aside.py)")
    model = set_attention(tiny_model(kv_heads=2), "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    ids[1] = torch.randint(3, VOCAB, (14,), generator=torch.Generator().manual_seed(5))  # a pad id that embeds
    mask[1] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
              **({} if cache == "dynamic" else {"cache_implementation": "static"}))
    want = model.generate(input_ids=ids, **kw)
    assert want[1, 14:].any()  # unpatched: the empty row generates real tokens
    with patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad) as handle:
        with pytest.warns(RuntimeWarning, match="a row that is all padding"):
            got = model.generate(input_ids=ids, **kw)
        assert handle.stepped_aside == {"right_padded_generation": 1} and handle.calls == 2 * 4
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache", ["dynamic", "static", "static over every slot"])
def test_a_hand_written_decode_loop_with_a_row_that_is_all_padding_equals_unpatched(cache):
    """The loop generate() runs, by hand: its prefill into an empty cache reads each row's next token at the last
    prompt column, padding for a row with no real token (transformers computes logits there, varlen kernels give
    zeros: 0.3 off, and other tokens after). It steps aside as generate() does, named; the steps after run patched."""
    model = set_attention(tiny_model(kv_heads=2), "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    mask[1] = 0
    if cache == "dynamic":
        def loop():
            return dynamic_decode(model, ids, mask, forwards=4)
    else:
        def loop():
            return static_decode(model, ids, mask, steps=3, max_len=20, full_mask=cache != "static")
    with torch.no_grad():
        want = loop()
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match="decode loop.*a row that is all padding"):
                got = loop()
            assert handle.stepped_aside == {"right_padded_generation": 1} and handle.calls == 2 * 3
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(VERSION < Version("5"), reason="GPT-2 is served from data on transformers 5.x")
@pytest.mark.parametrize("cache", ["generate", "hand-written prefill"])
def test_right_padded_prefill_of_a_model_that_takes_no_logits_to_keep_steps_aside(cache):
    """GPT-2's double-heads model (transformers' own test_generate_with_static_cache and
    test_generate_compile_model_forward_fullgraph, 2026-11-29): its forward takes no `logits_to_keep` and, on 5.x,
    generate() passes no `cache_position` either, so patchkit could not tell generate()'s prefill from a plain forward.
    A right-padded prompt then ran packed and each short row's next token was read from the zeros at its padding:
    other tokens than unpatched, with no warning (the static cache's prefill stepped aside, so static and dynamic
    disagreed). Such a model's prefill into an empty cache with a row ending in padding steps aside, named."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.GPT2DoubleHeadsModel(config).eval()
    ids, mask = padded_batch("right", batch=3, seq=14)
    if cache == "generate":
        def run():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                  pad_token_id=0)
    else:
        def run():
            return model(input_ids=ids, attention_mask=mask, **{CACHE: dynamic_cache(model)},
                         use_cache=True).logits[:, -1]
    with torch.no_grad():
        want = run()
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match="right_padded_generation"):
                got = run()
            assert handle.stepped_aside == {"right_padded_generation": 1}
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("way", ["model", "attention", pytest.param("name", marks=needs_mask_interface)])
def test_a_continuation_that_would_attend_to_a_padded_prefills_padding_is_refused(way):
    """patchkit's attention computes nothing for padding, so a padded prefill's cache holds other keys and values at
    the padding slots than transformers' (zeros; under unpad="attention" or the name alone, those of padding rows whose
    hidden states differ from the first layer on). A continuation whose mask covers them (none, or ones) would read
    them: 0.06 off unpatched's logits on LLaMA, silently, before. It is refused naming the fix; with the prefill's mask
    extended it equals unpatched, and a prefill without padding continues with no mask as unpatched does."""
    model = tiny_model(seed=3)
    ids, mask = padded_batch("left", batch=2, seq=10)
    new = torch.randint(3, VOCAB, (2, 2), generator=torch.Generator().manual_seed(4))
    extended = torch.cat([mask, mask.new_ones(2, 2)], -1)

    def continued(model, prefill_mask, step_mask):
        with torch.no_grad():
            cache = model(input_ids=ids, attention_mask=prefill_mask, use_cache=True).past_key_values
            return model(input_ids=new, attention_mask=step_mask, past_key_values=cache).logits

    want = continued(model, mask, extended)
    whole = continued(model, torch.ones_like(mask), None)
    patched = set_attention(model, "patchkit") if way == "name" else model
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="attention" if way == "attention" else "model") \
            if way != "name" else _route_sdpa():
        ones = torch.ones_like(extended)
        for step_mask, said in ((None, "no attention_mask masks"), (ones, "its attention_mask leaves that")):
            with pytest.raises(patchkit.PatchkitError, match=f"a padded forward filled, and {said}.*Fix: pass "
                               r"attention_mask over the past and new tokens, the padding 0, as generate\(\) does"):
                continued(patched, mask, step_mask)
        torch.testing.assert_close(continued(patched, mask, extended), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(continued(patched, torch.ones_like(mask), None), whole, atol=1e-5, rtol=1e-5)


def test_a_next_turn_over_a_padded_generations_cache_is_checked_again():
    """A second turn over generate()'s returned cache, its mask rebuilt as ones over the first turn's sequences
    (padding included), or with a hole so that generate() keeps it: the first turn's decode steps had read the
    prefill's mask already, and the turn ran on, silently other tokens (0.053 off in scores on LLaMA). A forward of
    several tokens over the cache is checked again; one extending the mask as generate() does equals unpatched."""
    model = tiny_model(seed=3)
    ids, mask = padded_batch("left", batch=2, seq=10)
    turn = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(5))

    def second_turn(model, turn_mask):
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                               return_dict_in_generate=True)
        both = torch.cat([first.sequences, turn], 1)
        return model.generate(input_ids=both, attention_mask=turn_mask(first.sequences), max_new_tokens=3,
                              do_sample=False, pad_token_id=0, past_key_values=first.past_key_values,
                              return_dict_in_generate=True, output_scores=True)

    def extended(sequences):
        return torch.cat([mask, mask.new_ones(2, sequences.shape[1] - mask.shape[1] + turn.shape[1])], -1)

    def ones_with_a_hole(sequences):
        ones = torch.ones(2, sequences.shape[1] + turn.shape[1], dtype=mask.dtype)
        ones[1, -2] = 0
        return ones

    want = second_turn(model, extended)
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with pytest.raises(patchkit.PatchkitError, match="a padded forward filled, and its attention_mask leaves"):
            second_turn(model, ones_with_a_hole)
        got = second_turn(model, extended)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-5, rtol=1e-5)


def _route_sdpa():
    """The registered name's route on the sdpa backend for a `with` block, and its own default after."""
    import contextlib

    from patchkit.hooks.name import attention_interface

    @contextlib.contextmanager
    def route():
        attention_interface.register(backend="sdpa")
        try:
            yield
        finally:
            attention_interface.register(backend="auto", strict=False)

    return route()


@pytest.mark.parametrize("step", ["first", "second"])
def test_a_decode_step_whose_mask_is_narrower_than_the_keys_is_read_as_transformers_reads_it(step):
    """A hand-written loop passing a mask of the new token's column alone (`ones(batch, 1)`), on its first decode step
    or after one that extended the mask: transformers pads a narrow mask with zeros, so its columns are the cache's
    first, a left-padded row's padding slots. It stepped aside as `short_mask`, warned exact, and read patchkit's
    filler there (0.2 off in logits on LLaMA, another greedy token), silently. Refused now, naming the fix; a mask
    over the past alone (transformers masks the new column) reads only real slots and steps aside exactly."""
    model = tiny_model(seed=3).eval()
    ids, mask = padded_batch("left", batch=2, seq=10)
    new = torch.tensor([[5], [6]])

    def decode(model, step_mask):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache, width = out.past_key_values, mask
            if step == "second":
                width = torch.cat([mask, mask.new_ones(2, 1)], -1)
                cache = model(input_ids=new, attention_mask=width, past_key_values=cache).past_key_values
            return model(input_ids=new, attention_mask=step_mask(width), past_key_values=cache).logits

    want = decode(model, lambda past: past)  # the past's columns alone
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        with pytest.raises(patchkit.PatchkitError, match="a padded forward filled, and its attention_mask leaves"):
            decode(model, lambda past: torch.ones(2, 1, dtype=past.dtype))
        with pytest.warns(RuntimeWarning, match="short_mask"):
            got = decode(model, lambda past: past)
        assert handle.stepped_aside.get("short_mask") == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def quantized_generate(model: torch.nn.Module, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """generate() into transformers' fp8 quantized cache (a scale per tensor, over every row and slot)."""
    seq, g = max(lengths), torch.Generator().manual_seed(5)
    ids, mask = torch.zeros(len(lengths), seq, dtype=torch.long), torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding
        ids[row, seq - n:] = torch.randint(3, 90, (n,), generator=g)
        mask[row, seq - n:] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                         cache_implementation="quantized", cache_config={"backend": "fp8"},
                         return_dict_in_generate=True, output_scores=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("way", ["instance", "named"])
def test_a_padded_prefill_into_a_quantized_cache_steps_aside_and_its_decode_runs_patched(way):
    """The fp8 cache's scale is the amax of every row's keys, padding slots included: patchkit's filler there changed
    every real key's quantization, and so the scores (0.48) and the tokens, of the unpadded row too. The padded
    prefill now runs on transformers' attention, the decode steps patched; an unpadded batch runs patched."""
    model = tiny_model(seed=5, kv_heads=2)
    try:
        want = quantized_generate(model, (3, 7, 11))
    except (ImportError, ValueError, TypeError) as error:  # no fp8 backend before transformers 5.x
        pytest.skip(f"no fp8 quantized cache here: {error}")
    even = quantized_generate(model, (11, 11, 11))
    if way == "named":
        needs_mask_interface()
        state = attention_interface.route_state()
        before = state.stepped_aside.get("quantized_cache", 0)
        named = set_attention(copy.deepcopy(model), "patchkit")
        got, got_even = quantized_generate(named, (3, 7, 11)), quantized_generate(named, (11, 11, 11))
        assert state.stepped_aside.get("quantized_cache", 0) > before
    else:
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match=r"quantized KV cache.*\(quantized_cache\)"):
                got = quantized_generate(model, (3, 7, 11))
            assert handle.calls > 0  # its decode steps ran patched
            got_even = quantized_generate(model, (11, 11, 11))
            assert handle.stepped_aside == {"quantized_cache": 1}
    for a, b in zip((*got, *got_even), (*want, *even)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("how", ["call", "generation_config"])
def test_generate_without_a_cache_on_a_right_padded_prompt_steps_aside(how):
    """generate(use_cache=False) passes its prefill neither a cache nor logits_to_keep, so a right-padded row's first
    new token was read at a padding column, patched: the zero hidden state's logits (token 0, then the rest shifted),
    silently. It is told by generate()'s frame, as before 4.38, and gives unpatched's tokens and scores."""
    model = tiny_model(kv_heads=2, seed=2)
    ids, mask = padded_batch("right", batch=3, seq=14)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                   return_dict_in_generate=True, output_scores=True)
    if how == "call":
        options["use_cache"] = False
    else:
        model.generation_config.use_cache = False
    want = model.generate(**options)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = model.generate(**options)
        assert handle.stepped_aside.get("right_padded_generation", 0) >= 1
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=2e-5, rtol=1e-4)
