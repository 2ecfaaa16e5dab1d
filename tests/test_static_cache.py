"""generate(cache_implementation="static") runs patched: generate()'s 4D mask read back as its 2D padding mask."""

from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch
import transformers
from census import tiny_lm
from families import FAMILIES, any_model, family_model, set_attention, static_cache_served
from models import padded_batch, static_cache, tiny_model
from packaging.version import Version

import patchkit
from patchkit.hooks.generation.slots_mask import padding_from_slots_mask
from patchkit.hooks.name import attention_interface

ATOL, RTOL = 2e-5, 1e-4
NEW_ENOUGH = Version(transformers.__version__) >= Version("5.0")  # hybrids from data, their cache layers
# generate()'s static-cache mask read back and served patched (slots_mask.static_layers): transformers 4.56+;
# before it such forwards step aside (exact), which test_a_custom_4d_mask_over_a_static_cache_steps_aside_exactly
# checks from 4.48 on
served_patched = pytest.mark.skipif(
    importlib.util.find_spec("transformers.masking_utils") is None or not static_cache_served("llama"),
    reason="static caches served patched: transformers 4.56+ (cache layers)",
)

MODELS = {  # patch -> a model with no sliding window; glm4: GQA (2 K/V heads), partial rotary
    "llama2": lambda: tiny_model(kv_heads=4, seed=7),
    "glm4": lambda: family_model("glm4", seed=1),
}


def generate_static(model, ids, mask, n: int = 8):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, cache_implementation="static", output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def first_layer_inputs(model) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    model.model.layers[0].register_forward_pre_hook(patchkit.shape_free(
        lambda m, args, kw: shapes.append(tuple((args[0] if args else kw["hidden_states"]).shape))), with_kwargs=True)
    return shapes


def served_packed_as_unpatched(model, ids, mask, patch=None) -> None:
    """generate_static patched (strict: nothing stepped aside) gives the unpatched tokens and per-step logits, its
    prefill packed (one row of real tokens at the first layer), then 7 decode steps of one token per row."""
    want, want_logits = generate_static(model, ids, mask)
    shapes = first_layer_inputs(model)
    with patchkit.apply_patch(patch, backend="sdpa", strict=True) as handle:
        got, got_logits = generate_static(model, ids, mask)
        assert handle.calls == 8 * model.config.get_text_config().num_hidden_layers and not handle.stepped_aside
    hidden = model.config.hidden_size
    assert shapes == [(1, int(mask.sum()), hidden)] + [(ids.shape[0], 1, hidden)] * 7
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


@served_patched
@pytest.mark.parametrize("attn", ["eager", "sdpa"])  # generate() builds the model's own kind of mask: additive, bool
@pytest.mark.parametrize("patch", list(MODELS))
def test_static_cache_generation_runs_patched_with_unpatched_tokens_and_scores(patch, attn):
    """A left-padded prompt: the prefill runs packed into the static cache, every decode step on the varlen path
    (nothing stepped aside), the same greedy tokens and per-step logits as unpatched."""
    model = set_attention(MODELS[patch](), attn)
    ids, mask = padded_batch("left", batch=3, seq=14)
    served_packed_as_unpatched(model, ids, mask, patch)


@served_patched
def test_a_right_padded_static_prefill_steps_aside_and_its_decode_steps_run_patched():
    """A short row's next token is read at a padding position: that prefill steps aside as right_padded_generation;
    the decode steps (padding between real tokens, no window) run patched, with the unpatched tokens."""
    model = MODELS["llama2"]()
    ids, mask = padded_batch("right", batch=3, seq=14)
    want, want_logits = generate_static(model, ids, mask, n=4)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got, got_logits = generate_static(model, ids, mask, n=4)
        assert handle.stepped_aside == {"right_padded_generation": 1}
        assert handle.calls == 3 * model.config.get_text_config().num_hidden_layers
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


def chunk_mask(model, mask: torch.Tensor, new: int = 3):
    """A prefill into a StaticCache of 20 slots (unpatched), then the 4D mask generate() makes for `new` more tokens
    (a chunk: with one query, any key mask is a padding mask)."""
    batch, prompt = mask.shape
    cache = static_cache(model, batch, 20)
    ids = torch.randint(3, 90, (batch, prompt), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    grown = torch.cat([mask, torch.ones_like(mask[:, :new])], 1)
    return cache, grown, generate_mask(model, cache, grown, new)


def generate_mask(model, cache, grown: torch.Tensor, new: int) -> torch.Tensor:
    """The 4D mask generate() builds for the last `new` tokens of `grown` over the static cache, as this transformers
    builds it: create_masks_for_generate (4.53+; input_embeds and cache_position before 5.x's inputs_embeds), or
    the base model's _prepare_4d_causal_attention_mask_with_cache_position before it."""
    batch, total = grown.shape
    position_ids = grown.cumsum(-1)[:, -new:] - 1
    cache_position = torch.arange(total - new, total)
    if importlib.util.find_spec("transformers.masking_utils") is None:
        return model.model._prepare_4d_causal_attention_mask_with_cache_position(
            grown, sequence_length=new, target_length=cache.get_max_cache_shape(), dtype=torch.float32,
            device=grown.device, cache_position=cache_position, batch_size=batch, config=model.config,
            past_key_values=cache)
    from transformers.masking_utils import create_masks_for_generate

    kw = dict(config=model.config, attention_mask=grown, past_key_values=cache, position_ids=position_ids)
    if "cache_position" in inspect.signature(create_masks_for_generate).parameters:
        return create_masks_for_generate(input_embeds=torch.empty(batch, new, 0), cache_position=cache_position, **kw)
    return create_masks_for_generate(inputs_embeds=torch.empty(batch, new, 0), **kw)


@served_patched
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_2d_mask_is_read_back_exactly_and_anything_else_is_not(attn):
    """generate()'s mask for a chunk behind a static cache is its 2D mask; a real key hidden from one query only, an
    unfilled slot shown, a key biased rather than hidden, -inf in place of the dtype's minimum, or a mask sized for
    another cache is not, and keeps stepping aside."""
    model = set_attention(MODELS["llama2"](), attn)
    _, mask = padded_batch("left", batch=3, seq=14)
    cache, grown, four_d = chunk_mask(model, mask)
    tokens = torch.zeros(3, 3, dtype=torch.long)

    def read(m):
        found = padding_from_slots_mask(model.model, {"attention_mask": m, "past_key_values": cache,
                                                      "input_ids": tokens})
        return None if found is None else found[0]

    assert four_d.shape == (3, 1, 3, 20) and four_d.dtype == (torch.bool if attn == "sdpa" else torch.float32)
    assert torch.equal(read(four_d), grown)
    seen, unseen = (True, False) if attn == "sdpa" else (0.0, torch.finfo(torch.float32).min)
    for query, key, value in ((0, 5, unseen), (2, 17, seen)):  # a real key hidden; the next unfilled slot shown
        changed = four_d.clone()
        changed[0, 0, query, key] = value
        assert read(changed) is None, (query, key)
    if attn == "eager":
        assert read(four_d.masked_fill(four_d == 0, -1.0).masked_fill(four_d != 0, unseen)) is None  # a bias
        assert read(four_d.masked_fill(four_d != 0, float("-inf"))) is None
    assert read(four_d[..., :19]) is None


# windowed families' static caches served patched: transformers 4.57+ (StaticSlidingWindowLayer, its keys in order)
windowed_served = pytest.mark.skipif(
    not static_cache_served("mistral"),
    reason="windowed static caches served patched: transformers 4.57+ (StaticSlidingWindowLayer)",
)


@windowed_served
@pytest.mark.parametrize("prompt", [14, 4], ids=["prompt past the window", "prompt inside the window"])
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])  # sliding layers only; sliding and full, a dict
def test_windowed_static_cache_generation_runs_patched_with_unpatched_tokens_and_scores(family, prompt):
    """A window of 5: the sliding layers' static caches fill, overflow and roll (the prompt longer than the window),
    or fill slot by slot first. The prefill runs packed into the cache, every step patched, nothing stepped aside,
    the unpatched tokens and per-step logits."""
    model = set_attention(family_model(family, seed=2), "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    ids, mask = ids[:, -prompt:], mask[:, -prompt:]
    mask[:, -1] = 1  # every row has a real token
    served_packed_as_unpatched(model, ids, mask)


@windowed_served
@pytest.mark.parametrize("family", ["mistral", "gemma3_text"])
def test_a_right_padded_windowed_static_generation_equals_unpatched(family):
    """A right-padded prompt on a windowed model: the prefill reads a short row's next token at padding and steps
    aside (right_padded_generation). Its decode steps have padding between real tokens: where full layers see the
    whole row (Gemma3), inside the window too, so they step aside (window_over_padding_hole); a sliding-only model's
    masks cover the window alone, which holds no hole here (the rows' real prompts end more than 5 positions back),
    so its steps run patched. The unpatched tokens and logits either way."""
    model = set_attention(family_model(family, seed=2), "sdpa")
    ids, mask = padded_batch("right", batch=3, seq=14)
    want, want_logits = generate_static(model, ids, mask, n=4)
    with patchkit.apply_patch(backend="sdpa") as handle:
        got, got_logits = generate_static(model, ids, mask, n=4)
        decode_steps = {"window_over_padding_hole": 3} if family == "gemma3_text" else {}
        assert handle.stepped_aside == {"right_padded_generation": 1, **decode_steps}
        assert handle.calls == (0 if decode_steps else 3 * model.config.get_text_config().num_hidden_layers)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


@windowed_served
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_windowed_masks_are_read_back_exactly_and_anything_else_is_not(attn):
    """generate()'s masks per layer type for a chunk behind a full sliding layer (its window's last keys in order)
    and a full one are the 2D mask; a key inside the window hidden, a key behind the window shown, or a sliding mask
    sized for another cache is not."""
    model = set_attention(family_model("gemma3_text", seed=2), attn)
    _, mask = padded_batch("left", batch=3, seq=14)
    cache, grown, masks = chunk_mask(model, mask)
    tokens = torch.zeros(3, 3, dtype=torch.long)

    def read(changed):
        found = padding_from_slots_mask(model.model, {"attention_mask": {**masks, **changed},
                                                      "past_key_values": cache, "input_ids": tokens})
        return None if found is None else found[0]

    sliding = masks["sliding_attention"]
    assert set(masks) == {"sliding_attention", "full_attention"} and sliding.shape == (3, 1, 3, 7)  # 5 + 3 - 1
    assert torch.equal(read({}), grown)
    seen, unseen = (True, False) if attn == "sdpa" else (0.0, torch.finfo(torch.float32).min)
    for query, key, value in ((2, 6, unseen), (2, 0, seen)):  # the newest key hidden; one behind the window shown
        changed = sliding.clone()
        changed[0, 0, query, key] = value
        assert read({"sliding_attention": changed}) is None, (query, key)
    assert read({"sliding_attention": sliding[..., 1:]}) is None


def test_a_custom_4d_mask_over_a_static_cache_steps_aside_exactly():
    """A chunk behind a static cache given a mask that is not causal-and-padding (a real key hidden from one query):
    transformers' own attention runs it, counted as custom_4d_mask, with the unpatched logits."""
    model = MODELS["llama2"]()
    _, mask = padded_batch("left", batch=3, seq=14)
    chunk = torch.randint(3, 90, (3, 3), generator=torch.Generator().manual_seed(4))

    def run(patched: bool):
        cache, grown, four_d = chunk_mask(model, mask)
        four_d[1, 0, 0, 9] = torch.finfo(four_d.dtype).min
        handle = patchkit.apply_patch("llama2", backend="sdpa") if patched else None
        try:
            with torch.no_grad():
                logits = model(input_ids=chunk, attention_mask=four_d, past_key_values=cache,
                               position_ids=grown.cumsum(-1)[:, -3:] - 1).logits
            return logits, None if handle is None else dict(handle.stepped_aside)
        finally:
            if handle is not None:
                handle.revert()

    want, _ = run(False)
    got, aside = run(True)
    assert aside == {"custom_4d_mask": 1}
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("model_type", ["llama4_text", "zaya", "deepseek_v32"])
def test_generates_static_masks_over_layers_it_cannot_read_back_step_aside_by_their_own_name(model_type):
    """generate(cache_implementation="static") builds each layer type's 4D mask before the model runs. Llama 4's
    chunked layers (a chunk in a sliding cache layer), ZAYA's linear-attention-and-attention layers and DeepSeek-V3.2's
    indexed layers have masks patchkit does not read back as a padding mask. They step aside, exact, and that was
    named `custom_4d_mask`, "the model was given a 4D attention mask. Fix: pass the 2D padding mask", though the user
    passed exactly that. They are named `static_cache_mask` now, with the default dynamic cache as the way to run
    patched."""
    import warnings

    from patches.table import SPARSE_TRANSFORMERS, installed_in, serves_here

    if not serves_here():
        pytest.skip("the table serves transformers 5.x")
    if model_type == "deepseek_v32" and not installed_in(SPARSE_TRANSFORMERS):
        pytest.skip(f"DSA's indexed cache layers: transformers {SPARSE_TRANSFORMERS} (5.16's fail unpatched)")
    model, why = tiny_lm(model_type)
    if model is None:
        pytest.skip(why)
    ids, mask = padded_batch("left", batch=3, seq=14)
    try:
        want, want_logits = generate_static(model.eval(), ids, mask, n=4)
    except TypeError as error:  # 5.16: Llama 4's chunked mask takes no block_sequence_ids; generate() passes them
        if "block_sequence_ids" not in str(error):
            raise
        with patchkit.apply_patch(model=model, backend="sdpa"), pytest.raises(TypeError) as patched:
            generate_static(model, ids, mask, n=4)
        assert str(patched.value) == str(error)  # the same failure as unpatched, not one of ours
        return
    with warnings.catch_warnings(record=True) as record, patchkit.apply_patch(model=model, backend="sdpa") as handle:
        warnings.simplefilter("always")
        got, got_logits = generate_static(model, ids, mask, n=4)
    assert torch.equal(got, want) and handle.stepped_aside == {"static_cache_mask": 4}
    torch.testing.assert_close(got_logits, want_logits, atol=0, rtol=0)
    said = [str(w.message) for w in record if "static_cache_mask" in str(w.message)]
    assert len(said) == 1 and "generate()'s 4D masks for a static cache" in said[0], said


@pytest.mark.parametrize("family", ["llama"] + FAMILIES)
def test_static_cache_generation_under_the_registered_name_alone_runs_patched(family):
    """attn_implementation="patchkit" alone, no patch: generate()'s static-cache masks carry the 2D mask they were
    made from, so every step runs on the varlen path (strict: nothing steps aside) with eager's tokens and per-step
    logits; the windowed families cross their window of 5 (8 tokens after a 14-token prompt)."""
    model = any_model(family)
    if not static_cache_served(family):
        pytest.skip("static caches served patched: transformers 4.56+ (4.57+ with a sliding window)")
    named = set_attention(copy.deepcopy(model), patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("left", batch=3, seq=14)
    want, want_logits = generate_static(model, ids, mask)
    patchkit.register_attention(backend="sdpa", strict=True)
    try:
        state = attention_interface.route_state()
        got, got_logits = generate_static(named, ids, mask)
        assert state.calls == 8 * model.config.get_text_config().num_hidden_layers and not state.stepped_aside
    finally:
        patchkit.register_attention(backend="auto", strict=False)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


@served_patched
@pytest.mark.skipif(not NEW_ENOUGH, reason="hybrid families from data: transformers 5.x")
@pytest.mark.parametrize("family", ["bamba", "qwen3_next"])  # Mamba / gated DeltaNet layers beside attention ones
def test_static_cache_generation_of_a_hybrid_runs_patched_with_unpatched_tokens_and_scores(family):
    """A hybrid's StaticCache holds key-less layers (LinearAttentionLayer) beside its StaticLayers, and generate()
    hands its recurrent layers the 2D mask ("linear_attention") beside the 4D ones: the attention layers' masks are
    read back, the recurrent one is the 2D mask's last columns, so every step runs patched (strict) with the
    unpatched tokens and per-step logits (before: AttributeError: no max_cache_len on LinearAttentionLayer)."""
    model, why = tiny_lm(family)
    assert model is not None, why
    model.eval()
    ids, mask = padded_batch("left", batch=2, seq=14)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    try:
        want, want_logits = generate_static(model, ids, mask)
    except KeyError as unpatched:  # 5.10: create_masks_for_generate has no mask for "mamba", "linear_attention"
        pytest.skip(f"unpatched raises KeyError {unpatched}")
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got, got_logits = generate_static(model, ids, mask)
        assert handle.calls and not handle.stepped_aside
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=RTOL)


@served_patched
@pytest.mark.skipif(not NEW_ENOUGH, reason="hybrid families from data: transformers 5.x")
def test_a_hybrids_recurrent_mask_is_read_back_exactly_and_anything_else_is_not():
    """The recurrent layers' 2D mask must be the read-back mask's last q_len columns (None where transformers makes
    none): a mask that hides another token there is not the 2D mask generate() was given."""
    from transformers import StaticCache

    model, why = tiny_lm("bamba")
    assert model is not None, why
    ids, mask = padded_batch("left", batch=2, seq=14)
    cache = StaticCache(config=model.config, max_cache_len=14)
    allowed = torch.ones(14, 14).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    four_d = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    arguments = {"input_ids": ids, "past_key_values": cache, "cache_position": torch.arange(14),
                 "attention_mask": {"full_attention": four_d, "linear_attention": mask}}
    keys, past = padding_from_slots_mask(model.model, arguments)
    assert past == 0 and torch.equal(keys, mask)
    other = mask.clone()
    other[1, -1] = 0
    arguments["attention_mask"] = {"full_attention": four_d, "linear_attention": other}
    assert padding_from_slots_mask(model.model, arguments) is None
    arguments["attention_mask"] = {"full_attention": four_d, "linear_attention": None}  # padding, yet unmasked
    assert padding_from_slots_mask(model.model, arguments) is None
