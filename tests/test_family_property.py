"""Property: every family patchkit serves is served exactly or refused, with its own feature biting.

The same cases as tests/test_property.py (padding of every kind, packed rows, position conventions, caches, modes,
routes, 4D masks, output_attentions) drawn for every family of tests/families.py: sliding windows shorter than the
batch (Mistral, Qwen2/3's windowed layer, Gemma2/3, Phi3, Starcoder2, SmolLM3), Gemma2's softcap and query scale,
Gemma3's per-layer-type RoPE, q/k norms, partial RoPE, Granite's multipliers. The reference is each family's own
unpatched eager model with the same weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from families import ATOL, FAMILIES, FAMILIES_FROM, WINDOW, WINDOWED, family_model
from models import VOCAB, static_cache
from packaging.version import Version
from property_cases import CACHED, RTOL, SINGLE, cases, given
from property_check import check, one_thread, sdpa_route  # noqa: F401 (fixtures)
from transformers import __version__ as transformers_version

import patchkit

pytestmark = pytest.mark.skipif(Version(transformers_version) < Version(FAMILIES_FROM),
                                reason=f"family patches need transformers >= {FAMILIES_FROM}")
needs_layered_caches = pytest.mark.skipif(Version(transformers_version) < Version("4.56"),
                                          reason="before 4.56 a windowed model's static cache steps aside")


@given(case=cases(SINGLE, families=tuple(FAMILIES)))
def test_every_family_single_forward_is_served_exactly_or_refused(case):
    """No cache kept, or use_cache left to the model: logits, and in training loss and every gradient."""
    check(case)


@given(case=cases(CACHED, families=tuple(FAMILIES)))
def test_every_family_prefill_and_decode_are_served_exactly_or_refused(case):
    """A dynamic cache (passed in or made by the model) or a static one (either mask length): prefill, chunks and
    decode steps add up to the single unpatched pass."""
    check(case)


# ---------------------------------------------------------------------------------------------------- regressions
# What the family properties found first (transformers 4.53.3-5.23.0), pinned as plain tests that name it.


def four_d(mask: torch.Tensor) -> torch.Tensor:
    """The additive (B, 1, S, S) causal mask of a 2D padding mask (each padding token sees itself)."""
    seq = mask.shape[-1]
    allowed = (torch.ones(seq, seq).tril().bool()[None] & mask.bool()[:, None, :]) | torch.eye(seq).bool()[None]
    return torch.zeros(mask.shape[0], 1, seq, seq).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3_text"])
def test_a_4d_mask_on_a_windowed_family_is_the_whole_pattern(family):
    """Before the fix, every version from 4.53: a caller's 4D causal mask on a model whose window (5) is shorter
    than the row (12). transformers takes a 4D mask as the whole pattern and applies no window; patchkit turned it
    into key padding and applied the window: logits off by 0.10 (Qwen2) to 0.31 (Gemma2) on 5.23, 0.86 on 4.53,
    no error. Such a forward now steps aside, naming the cause; one whose documents fit the window stays patched."""
    model = family_model(family, seed=11)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    short = torch.zeros(2, 12, dtype=torch.long)
    short[:, -WINDOW:] = 1  # documents of the window's length: the window cannot bite
    with torch.no_grad():
        want = [model(input_ids=ids, attention_mask=four_d(m)).logits for m in (mask, short)]
        with patchkit.apply_patch(family, backend="sdpa") as handle, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(input_ids=ids, attention_mask=four_d(mask)).logits
            fits = model(input_ids=ids, attention_mask=four_d(short)).logits
            assert handle.stepped_aside == {"window_under_4d_mask": 1}
    assert any("applies no sliding window over it" in str(w.message) for w in caught)
    torch.testing.assert_close(got[mask.bool()], want[0][mask.bool()], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fits[short.bool()], want[1][short.bool()], atol=ATOL, rtol=RTOL)


@needs_layered_caches
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3_text"])
@pytest.mark.parametrize("slots", [4, 12])
def test_a_static_cache_of_a_windowed_family_is_served_with_a_mask_over_every_slot(family, slots):
    """Before the fix (4.56-5.23): a windowed family's StaticCache with the 2D mask over every slot was refused,
    blaming a training-mode forward ("attention_mask covers 12 columns, but this forward brings no cached tokens"):
    its sliding layers hold fewer slots than the mask. And a cache shorter than the window (4 slots, window 5),
    which never rolls, was refused as a rolling buffer. Both are served now, exactly."""
    model = family_model(family, seed=11)
    ids = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            cache = static_cache(model, 1, slots)
            got = [model(input_ids=ids[:, a:b], attention_mask=F.pad(torch.ones(1, b, dtype=torch.long),
                                                                     (0, slots - b)), past_key_values=cache).logits
                   for a, b in ((0, 2), (2, 3), (3, 4))]
            assert handle.stepped_aside == {}
    torch.testing.assert_close(torch.cat(got, 1), want, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(Version(transformers_version) >= Version("4.56"), reason="4.56+ serves it (the test above)")
@pytest.mark.skipif(Version(transformers_version) < Version(FAMILIES_FROM), reason="family patches: 4.53+")
def test_a_static_cache_of_a_windowed_family_steps_aside_before_4_56():
    """Before the fix (4.53.3): Mistral's StaticCache under a biting window (5 of 6 tokens) was refused at the layer
    as a rolling buffer, mid-forward. Caches before 4.56 have no layers that say whether their slots roll, so the
    forward now steps aside at the model's forward, exactly, naming the cause."""
    model = family_model("mistral", seed=11)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("mistral", backend="sdpa") as handle, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = static_cache(model, 1, 7)
            got = [model(input_ids=ids[:, a:b], attention_mask=torch.ones(1, b, dtype=torch.long),
                         past_key_values=cache).logits for a, b in ((0, 5), (5, 6))]
            assert handle.stepped_aside == {"window_rolling_cache": 2}
    assert any("may roll a buffer of the window's length" in str(w.message) for w in caught)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------- generate() into static caches
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
GENERATE_MODELS: dict = {}


@st.composite
def static_generations(draw):
    """A windowed family (or LLaMA), its mask kind, and a prompt batch padded on either side (or not), each row's
    real length drawn, generating 1-9 tokens into a static cache, greedy or by beam search: prefills inside and past
    the window (5), rows that roll it, padding holes inside it and behind it."""
    family = draw(st.sampled_from(["llama", *sorted(WINDOWED)]))
    attn = "eager" if family == "gemma2" else draw(st.sampled_from(["eager", "sdpa"]))
    batch, seq, new = draw(st.integers(1, 4)), draw(st.integers(1, 12)), draw(st.integers(1, 9))
    side = draw(st.sampled_from(["left", "right", "none"]))
    lengths = [seq if side == "none" else draw(st.integers(1, seq)) for _ in range(batch)]
    beams = draw(st.sampled_from([1, 1, 2, 3]))  # beam search reorders the static cache's slots every step
    return family, attn, side, lengths, seq, new, beams


@hypothesis.settings(max_examples=max(25, hypothesis.settings.default.max_examples // 8), deadline=None)
@hypothesis.given(drawn=static_generations())
def test_generate_into_a_static_cache_equals_unpatched(drawn):
    """generate(cache_implementation="static"): the unpatched tokens and per-step logits, whatever patchkit serves
    (generate()'s 4D masks read back as the 2D mask) or steps aside for (a right-padded prefill, a hole in a window,
    eras whose caches it does not place). A fuzz of this found the right-padded sliding-only bug above."""
    from families import any_model

    family, attn, side, lengths, seq, new, beams = drawn
    key = (family, attn)
    if key not in GENERATE_MODELS:
        GENERATE_MODELS[key] = any_model(family, attn)
    model = GENERATE_MODELS[key]
    positions = torch.arange(seq)[None]
    real = torch.tensor(lengths)[:, None]
    mask = (positions < real if side == "right" else positions >= seq - real).long()
    ids = torch.randint(3, VOCAB, mask.shape, generator=torch.Generator().manual_seed(sum(lengths))) * mask
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, cache_implementation="static", return_dict_in_generate=True, output_logits=True,
              num_beams=beams)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(**kw)
        with patchkit.apply_patch(backend="sdpa"):
            got = model.generate(**kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits, 1), torch.stack(want.logits, 1), atol=ATOL, rtol=RTOL)
