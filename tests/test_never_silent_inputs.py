"""Never silently wrong, a forward's inputs: masks, positions, labels and caches that once gave wrong numbers.

Each is now exact, or refused with its cause and fix; so are the models and arguments patchkit does not serve."""

from __future__ import annotations

import copy
import functools
import re
import sys
import warnings
from typing import Any

import pytest
import torch
import transformers
from families import set_attention
from models import VOCAB, dynamic_cache, labels_for, needs_mask_interface, padded_batch, static_decode, tiny_model
from packaging.version import Version

import patchkit
from patchkit import PatchInputError
from patchkit.hooks.name import attention_interface

MOD = sys.modules["transformers.models.llama.modeling_llama"]
VERSION = Version(transformers.__version__)


@pytest.mark.parametrize("full_mask", [True, False], ids=["full-length mask", "short mask"])
def test_static_cache_decode_places_queries_by_the_cache(full_mask):
    """Item 1: a mask over all max_cache_len slots (0 for the unfilled tail) gave logits off by ~0.44."""
    model = tiny_model(kv_heads=2, seed=3)
    ids, mask = padded_batch("left", batch=3, seq=14)
    want = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = static_decode(model, ids, mask, steps=4, max_len=24, full_mask=full_mask)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def decode_on_a_doubled_mask(model: torch.nn.Module, side: str) -> torch.Tensor:
    """The FastChat bug: a decode step whose mask has the past's columns prepended again (2, 14 + 14 + 1)."""
    ids, mask = padded_batch("left", batch=2, seq=14)
    mask = mask if side == "left" else torch.ones_like(mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        doubled = torch.cat([torch.ones_like(mask), mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        return model(input_ids=ids[:, -1:], attention_mask=doubled, past_key_values=out.past_key_values).logits


@pytest.mark.parametrize("way", ["class", "named"])
def test_a_mask_longer_than_the_dynamic_cache_steps_aside_unless_it_unmasks_the_prefills_padding(way):
    """transformers (4.53+) reads such a mask's first columns: over an unpadded prefill they mask nothing that exists,
    so the step runs on its attention with a warning, the unpatched numbers; over a padded one they unmask the
    padding slots, whose keys no path can make (refused, naming the fix). Before 4.53 refused by its shape."""
    if way == "named":
        needs_mask_interface()
    model = tiny_model(kv_heads=2).eval()

    def run(side: str) -> torch.Tensor:
        if way == "named":
            return decode_on_a_doubled_mask(set_attention(copy.deepcopy(model), "patchkit"), side)
        with patchkit.apply_patch("llama2", backend="sdpa"):
            return decode_on_a_doubled_mask(model, side)

    if not FILLS_SHORT_MASKS:
        if way == "class":
            with pytest.raises(PatchInputError, match="do not prepend past columns"):
                run("left")
        return  # the name's masks before 4.53 are transformers' 4D ones: they step aside
    want = decode_on_a_doubled_mask(model, "none")
    state = attention_interface.route_state() if way == "named" else None
    before = state.stepped_aside.get("mask_shape", 0) if state else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run("none")
    if state is None:
        assert any(re.search(r"more columns than the keys \(mask_shape\).*Fix: pass a \[batch", str(w.message))
                   for w in caught)
    else:  # the registered route warns once a process: its count tells
        assert state.stepped_aside.get("mask_shape", 0) > before
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(PatchInputError, match="leaves that forward's padding unmasked"):
        run("left")


def decode_on_an_unextended_mask(model: torch.nn.Module) -> torch.Tensor:
    """A hand-written decode loop's step that forgot to extend the prompt's mask: (2, 14) for 14 + 1 keys."""
    ids, mask = padded_batch("left", batch=2, seq=14)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        return model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask,
                     past_key_values=out.past_key_values).logits


# transformers' masks fill in a 2D mask's missing columns as padding from 4.53 (masking_utils); before, its attention
# failed on the shapes, and patchkit refuses the forward with the fix
FILLS_SHORT_MASKS = VERSION >= Version("4.53")


@pytest.mark.parametrize("way", ["class", "instance", "named"])
def test_a_mask_short_of_the_keys_steps_aside_to_the_unpatched_numbers(way):
    """A mask without the new token's column: transformers fills in what it lacks (as padding), so the step runs on
    its attention, the unpatched logits, one warning naming the fix, counted; strict refuses it by name. Before
    transformers filled masks in, unpatched failed on the shapes: patchkit refuses, naming the fix."""
    if way == "named":
        needs_mask_interface()
    model = tiny_model(kv_heads=2)

    def patch(**options: bool) -> Any:
        return patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", **options)

    if not FILLS_SHORT_MASKS:
        with pytest.raises(RuntimeError):
            decode_on_an_unextended_mask(model)
        with patch(), pytest.raises(PatchInputError, match="a decode loop extends it by a column of ones"):
            decode_on_an_unextended_mask(model)
        return
    want = decode_on_an_unextended_mask(model)
    with pytest.warns(RuntimeWarning, match=r"no column for the new tokens \(short_mask\).*Fix: extend"):
        if way == "named":
            got = decode_on_an_unextended_mask(set_attention(copy.deepcopy(model), "patchkit"))
        else:
            with patch() as handle:
                got = decode_on_an_unextended_mask(model)
            assert handle.stepped_aside == {"short_mask": 1}
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)  # the prefill ran patched
    if way != "named":
        with patch(strict=True), pytest.raises(PatchInputError, match="no column for this forward's new tokens"):
            decode_on_an_unextended_mask(model)


def test_a_mask_short_of_the_tokens_with_no_past_is_refused_with_the_fix():
    """No cache: a mask one column short of the tokens (a collator's mistake, not a loop's unextended mask; transformers
    4.53+ reads the last token as padding, before it failed on the shapes): refused, naming the fix."""
    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("right", batch=2, seq=14)
    with patchkit.apply_patch(backend="sdpa"), pytest.raises(PatchInputError, match="give it a column per key"):
        model(input_ids=ids, attention_mask=mask[:, :-1], labels=labels_for(ids, mask))


@pytest.mark.parametrize("misfit", ["a row more", "columns more"])
@pytest.mark.parametrize("way", ["class", "instance", "named"])
def test_a_mask_of_more_rows_or_columns_than_the_call_runs_as_transformers_reads_it(way, misfit):
    """A mask of another batch (a row more) or wider than the tokens with no cache: transformers (4.53+) reads its
    first rows and columns, so the forward steps aside to the unpatched numbers, warned and counted; strict refuses.
    Before 4.53 refused, the row's refusal naming the batch (it told the user not to prepend past columns)."""
    if way == "named":
        needs_mask_interface()
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    wide = torch.cat([mask, mask[:1]]) if misfit == "a row more" else torch.cat([mask, torch.ones_like(mask)], 1)
    labels = labels_for(ids, mask)

    def run(target: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        out = target(input_ids=ids, attention_mask=wide, labels=labels)
        out.loss.backward()
        return out.logits[mask.bool()], target.model.layers[0].self_attn.o_proj.weight.grad

    def patch(**options: bool) -> Any:
        return patchkit.apply_patch(model=model if way == "instance" else None, backend="sdpa", **options)

    if not FILLS_SHORT_MASKS:
        if way != "class":
            return  # the instance patch refuses 4.35-4.37, the name's masks step aside before 4.53
        with patch(), pytest.raises(PatchInputError, match=r"one row per sequence.*\(4\)" if misfit == "a row more"
                                    else "attention_mask covers"):
            run(model)
        return
    want = run(copy.deepcopy(model))
    if way == "named":  # the registered route warns once a process: its count tells
        state = attention_interface.route_state()
        before = state.stepped_aside.get("mask_shape", 0)
        got = run(set_attention(copy.deepcopy(model), "patchkit"))
        assert state.stepped_aside.get("mask_shape", 0) > before
    else:
        with pytest.warns(RuntimeWarning, match=r"more rows than the batch or more columns.*\(mask_shape\)"):
            with patch() as handle:
                got = run(model)
        assert handle.stepped_aside == {"mask_shape": 1}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    if way != "named":
        with patch(strict=True), pytest.raises(PatchInputError, match="more rows than the batch or more columns"):
            run(copy.deepcopy(model))


def test_positions_across_a_padding_hole_stay_one_document():
    """Item 3: mask [1,0,1,1,1,1] with positions [0,1,1,2,3,4] was split into two documents."""
    model = tiny_model(kv_heads=2)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for unpad in ("model", "attention"):
            with patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad):
                got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            real = mask.bool()
            torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("unpad", ["model", "attention"])
def test_labels_predicted_from_padding_match_the_unpatched_model(unpad, attn):
    """Item 4: with labels = input_ids where mask == 1, a left-padded row's first label is predicted from padding.

    Unpatched transformers' own answer there depends on its attention implementation (eager and sdpa differ);
    patchkit steps aside for such a batch, so the loss and every gradient match the model's own implementation.
    """
    model = set_attention(tiny_model(kv_heads=2).train(), attn)
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)
    reference = copy.deepcopy(model)
    want = reference(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    with patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad):
        got = model(input_ids=ids, attention_mask=mask, labels=labels)
        got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_activation_checkpointing_in_training_is_served_whether_or_not_the_batch_has_padding(padded):
    """Item 10: the recompute appended the keys to a DynamicCache again; the step failed or not by padding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("right")
    if not padded:
        mask = torch.ones_like(mask)
    labels = ids.masked_fill(mask == 0, -100)
    reference = copy.deepcopy(model)
    want = reference(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    want.loss.backward()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MOD.LlamaDecoderLayer))
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = model(input_ids=ids, attention_mask=mask, labels=labels)  # use_cache defaults to True
        got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_a_cache_that_grows_during_the_forward_is_refused_with_the_real_cause():
    """Under the registered name there is no model wrapper: the recompute's second append is refused, not blamed
    on the mask."""
    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("right")
    layer = model.model.layers[0].self_attn
    with patchkit.apply_patch("llama2", backend="sdpa"):
        original = layer.forward

        @functools.wraps(original)  # a wrapper of the layer's own forward (not a forward of its own)
        def twice(*args, **kwargs):  # what a recomputing checkpoint does to a cache
            original(*args, **kwargs)
            return original(*args, **kwargs)

        layer.forward = twice
        with pytest.raises(PatchInputError, match="cache changed during the forward.*use_cache=False"):
            model(input_ids=ids, attention_mask=mask, past_key_values=dynamic_cache(model))


def tiny_family(kind: str, implementation: str = patchkit.ATTENTION_NAME):
    """A tiny random model of another family, loaded with attn_implementation="patchkit" by default."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  attn_implementation=implementation)
    torch.manual_seed(0)
    if kind == "mistral-window":
        return tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=3, **common))
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=8, attn_logit_softcapping=5.0,
                                                    layer_types=["full_attention"], **common))
    if kind == "olmo":
        return tf.OlmoForCausalLM(tf.OlmoConfig(num_key_value_heads=2, **common))
    if kind == "doge":
        return tf.DogeForCausalLM(tf.DogeConfig(**common))
    return tf.BertModel(tf.BertConfig(**common))


@needs_mask_interface
@pytest.mark.parametrize("kind,match", [
    pytest.param("bert", r"BertSelfAttention \(model_type 'bert'\), a model family patchkit has no patch for",
                 marks=pytest.mark.skipif(VERSION < Version("5"), reason="BERT's attention goes through the "
                                          "attention interface from transformers 5.0 (4.x: BERT_SELF_ATTENTION_CLASSES,"
                                          " no registered name reaches it)")),
    pytest.param("olmo", r"OlmoAttention \(model_type 'olmo'\), a model family patchkit has no patch for",
                 marks=pytest.mark.skipif(VERSION >= Version("5"), reason="served from data on transformers 5.x")),
    pytest.param("doge", r"model_type 'doge', which uses dynamic mask attention", marks=pytest.mark.skipif(
        VERSION < Version("5"), reason="served from data, or refused by name, on transformers 5.x")),
])
def test_registered_name_refuses_what_it_does_not_serve(kind, match):
    """Item 2: the registered name reached BERT and other families and ran them silently wrong."""
    model = tiny_family(kind)
    ids, mask = padded_batch("right", batch=2)
    with pytest.raises(PatchInputError, match=match):
        model(input_ids=ids, attention_mask=mask)


@needs_mask_interface
@pytest.mark.parametrize("kind", ["mistral-window", "gemma2"])
def test_registered_name_serves_windows_and_softcap_exactly(kind):
    """Item 2: Mistral's sliding_window=3 (0.36 off) and Gemma2's softcap (0.32 off) are now exact."""
    ours, eager = tiny_family(kind), tiny_family(kind, "eager")
    ids, mask = padded_batch("mixed")
    patchkit.register_attention(backend="sdpa")
    try:
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask).logits
            want = eager(input_ids=ids, attention_mask=mask).logits
    finally:
        patchkit.register_attention(backend="auto")
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def test_an_unserved_argument_is_refused_by_name():
    """The allow-list: an argument patchkit does not implement (sparse attention's selected keys) raises, never
    ignored."""
    from patchkit.hooks.attention.varlen import make_attention_function
    from patchkit.hooks.name.attention_interface import route_state

    layer = tiny_model().model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    attention = make_attention_function(route_state(), {"llama"})
    with pytest.raises(PatchInputError, match=r"LlamaAttention \(model_type 'llama'\) passes sparse_indices=.*keys "
                                              "an indexer selected"):
        attention(layer, q, q, q, None, sparse_indices=torch.zeros(1, 3, 2, dtype=torch.int32))


@pytest.mark.parametrize("key", ["special_tokens_mask", "length"])
def test_a_collators_other_keys_in_the_batch_step_aside_as_transformers_ignores_them(key):
    """`model(**batch)` with a key the model's forward does not name: its layers hand it on to attention, which
    transformers' ignores and patchkit's refused (a PatchInputError telling the user to run without patchkit). The
    forward steps aside now, exact, and names the key to drop."""
    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("right")
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    batch[key] = torch.zeros_like(ids) if key == "special_tokens_mask" else mask.sum(-1)
    want = model(**batch).loss
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        with pytest.warns(RuntimeWarning, match=r"unserved_argument.*drop the key"):
            got = model(**batch).loss
        assert handle.stepped_aside == {"unserved_argument": 1}
    torch.testing.assert_close(got, want)


def test_nemotron_hs_misspelt_use_cache_is_inert():
    """Nemotron-H's layers on transformers 5.3 to 5.8 hand their attention `user_cache=use_cache` (a misspelling
    that transformers' own attention functions take into **kwargs): it changes nothing, so it runs, with the numbers
    of the call without it (it was refused, so every cached forward of Nemotron-H on 5.5 raised)."""
    from patchkit.hooks.attention.varlen import make_attention_function
    from patchkit.hooks.name.attention_interface import route_state

    layer = tiny_model().model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16, generator=torch.Generator().manual_seed(0))
    attention = make_attention_function(route_state(), {"llama"})
    want, _ = attention(layer, q, q, q, None)
    got, _ = attention(layer, q, q, q, None, user_cache=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_packed_documents_behind_a_cache_are_refused():
    """A chunk whose positions restart with a cache behind it: the new document would see the cached one."""
    model = tiny_model(kv_heads=2)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with patchkit.apply_patch("llama2", backend="sdpa"), torch.no_grad():
        out = model(input_ids=ids[:, :2], position_ids=torch.tensor([[0, 1]]), use_cache=True)
        with pytest.raises(PatchInputError, match="position_ids restart inside a chunk that has a KV cache"):
            model(input_ids=ids[:, 2:], position_ids=torch.tensor([[2, 0, 1]]), past_key_values=out.past_key_values)


def test_a_cache_from_training_mode_is_explained_not_blamed_on_the_mask():
    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("left", batch=2, seq=14)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        out = model(input_ids=ids, attention_mask=mask)  # training keeps no cache
        assert out.past_key_values is None
        longer = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        with pytest.raises(PatchInputError, match="patchkit keeps no KV cache in training.*model.eval"):
            model(input_ids=ids[:, -1:], attention_mask=longer, past_key_values=out.past_key_values)


@pytest.mark.parametrize("route", ["class patch", pytest.param("registered name", marks=needs_mask_interface)])
def test_bidirectional_attention_is_refused(route):
    """LLM2Vec sets is_causal=False on every attention module: causal varlen kernels must refuse, never mask it."""
    model = tiny_model(kv_heads=2)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    ids, mask = padded_batch("right", batch=2)
    if route == "class patch":
        # the fix names the patch's revert: the model is loaded with sdpa already
        with patchkit.apply_patch("llama2", backend="sdpa"), pytest.raises(
                PatchInputError, match=r"is_causal=False.*without patchkit's patch \(its handle's revert\(\)\)"):
            model(input_ids=ids, attention_mask=mask)
        return
    set_attention(model, patchkit.ATTENTION_NAME)
    patchkit.register_attention(backend="sdpa")
    try:
        with pytest.raises(PatchInputError, match=r"LlamaAttention \(model_type 'llama'\) passes is_causal=False"):
            model(input_ids=ids, attention_mask=mask)
    finally:
        patchkit.register_attention(backend="auto", strict=False)


def unread_cache_family() -> str:
    """A family whose forward takes its cache as `cache` without transformers' rename of `past_key_values`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if "ergo" not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip("no family takes `cache` without the rename in this transformers (Ergo is new in 5.25)")
    return "ergo"


def decode_given_past_key_values(model: torch.nn.Module) -> torch.Tensor:
    """A hand-written decode loop's step that hands the cache back as `past_key_values`, the name it had before 5.24."""
    ids, mask = padded_batch("left", batch=2, seq=14)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        longer = torch.cat([mask, mask.new_ones(2, 1)], dim=-1)
        return model(input_ids=ids[:, -1:], attention_mask=longer, past_key_values=out.cache).logits


@pytest.mark.parametrize("way", ["apply_patch", "named"])
def test_a_cache_the_family_does_not_read_steps_aside(way):
    """Ergo (5.25) takes `cache` only and passes `past_key_values` on unread: transformers runs the step on no past.
    patchkit read the cache and refused its mask as wider than the keys; now the step runs as transformers runs it,
    with the cause named."""
    from census import tiny_lm

    model, why = tiny_lm(unread_cache_family())
    assert model is not None, why
    model.eval()
    set_attention(model, "sdpa" if way == "apply_patch" else "eager")
    want = decode_given_past_key_values(model)
    with pytest.warns(RuntimeWarning, match=r"\(unread_cache\).*pass the cache as `cache=`"):
        if way == "apply_patch":
            with patchkit.apply_patch(model=model, backend="sdpa") as handle:
                got = decode_given_past_key_values(model)
            assert handle.stepped_aside == {"unread_cache": 1}
        else:
            model.set_attn_implementation("patchkit")
            got = decode_given_past_key_values(model)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_only_transformers_rename_makes_past_key_values_the_cache():
    """The rename is read from transformers' own decorator, wherever it sits in a forward's wrappers."""
    deprecation = pytest.importorskip("transformers.utils.deprecation")
    from patchkit.forward.inputs.arguments import renames_past_key_values

    def forward(self, cache=None, **kwargs):
        return cache

    renamed = deprecation.deprecate_kwarg("past_key_values", version="9.0", new_name="cache")(forward)
    other = deprecation.deprecate_kwarg("cache_params", version="9.0", new_name="cache")(forward)
    assert renames_past_key_values(renamed) and not renames_past_key_values(forward)
    assert not renames_past_key_values(other)
    dressed = patchkit.hooks.install.patching.dressed_as(lambda self, **kw: None, renamed)
    assert renames_past_key_values(dressed)


def test_left_padded_labels_name_the_first_real_token_and_the_readmes_recipe_runs_patched():
    """`labels = ids.masked_fill(mask == 0, -100)` on a left-padded batch still labels each row's first real token,
    predicted from padding: the warning and the strict refusal name that token (not only "-100 at padding", which
    the user already did), and the README's recipe, run as written, is served patched with the unpatched loss."""
    import re
    from pathlib import Path

    from patchkit import PatchkitError

    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("left")
    with pytest.warns(RuntimeWarning, match="labels_from_padding.*first real token after left padding"):
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    assert handle.stepped_aside == {"labels_from_padding": 1}
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True), pytest.raises(
            PatchkitError, match="first real token after left padding"):
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### Left padding: the label recipe", 1)[1]
    recipe = re.search(r"^labels = (.+?)$", section.split("```python", 1)[1].split("```", 1)[0], re.M).group(1)
    labels = eval(recipe, {"ids": ids, "mask": mask, "torch": torch})  # noqa: S307 (the README's own line)
    want = copy.deepcopy(model)(input_ids=ids, attention_mask=mask, labels=labels).loss
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True) as handle:
        got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert handle.stepped_aside == {}
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_training_forward_given_a_cache_position_runs_patched_and_misfit_labels_get_transformers_error():
    """A plain training forward with labels and `cache_position` from 0 on a right-padded batch was taken for
    generate()'s prefill (which passes no labels) and stepped aside, warned as right-padded generation; labels of
    another width than the tokens were read as a past's new tokens, warned as labels from padding. Now the first runs
    patched, and the second gets transformers' own error, with nothing stepped aside."""
    model = tiny_model(seed=2).train()
    ids, mask = padded_batch("right", batch=3, seq=16)
    labels = labels_for(ids, mask)
    position = torch.arange(16)
    want = model(input_ids=ids, attention_mask=mask, labels=labels, cache_position=position).loss
    with pytest.raises(ValueError) as unpatched:
        model(input_ids=ids, attention_mask=mask, labels=labels[:, :7])
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got = model(input_ids=ids, attention_mask=mask, labels=labels, cache_position=position).loss
        with pytest.raises(ValueError) as patched:
            model(input_ids=ids, attention_mask=mask, labels=labels[:, :7])
        assert handle.stepped_aside == {} and handle.layers_patched > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not isinstance(patched.value, PatchInputError) and str(patched.value) == str(unpatched.value)


@pytest.mark.parametrize("quantized", ["every linear", "the head"])
def test_a_dynamically_quantized_model_runs_as_unpatched(quantized):
    """torch's dynamic quantization scales each Linear's input by the whole tensor's range, padding's included: on
    the real tokens alone it scaled otherwise (1e-2 off in logits, silently). A padded forward of such a model steps
    aside (`rows_mixed_by_a_module`); one with no padding runs patched, with the same numbers."""
    model = tiny_model(kv_heads=2).eval()
    which = {torch.nn.Linear} if quantized == "every linear" else {"lm_head"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        reference = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), which, dtype=torch.qint8)
        patched = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), which, dtype=torch.qint8)
    ids, mask = padded_batch("left", batch=3)
    with patchkit.apply_patch(model=patched, backend="sdpa") as handle, torch.no_grad():
        for rows in (mask, torch.ones_like(mask)):
            want = reference(input_ids=ids, attention_mask=rows, labels=labels_for(ids, rows))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = patched(input_ids=ids, attention_mask=rows, labels=labels_for(ids, rows))
            torch.testing.assert_close(got.logits[rows.bool()], want.logits[rows.bool()], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
        assert handle.stepped_aside == {"rows_mixed_by_a_module": 1} and handle.calls > 0


def test_one_rows_labels_for_a_batch_get_transformers_own_error():
    """Labels of shape (N,) for a (B, N) batch: transformers' loss refuses them naming the batch sizes; the packed
    path failed first, with an IndexError from inside patchkit."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    labels = labels_for(ids, mask)[0]
    with pytest.raises(ValueError) as want:
        model(input_ids=ids, attention_mask=mask, labels=labels)
    with patchkit.apply_patch("llama2", backend="sdpa"), pytest.raises(ValueError) as got:
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert str(got.value) == str(want.value)
