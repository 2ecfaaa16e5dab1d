"""Never silently wrong: each input that once gave wrong numbers is now exact, or refused with its cause and fix."""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
import transformers
from families import set_attention
from models import CACHE, VOCAB, dynamic_cache, needs_mask_interface, padded_batch, static_decode, tiny_model
from packaging.version import Version

import patchkit
from patchkit import PatchInputError
from patchkit.hooks.install.routing import is_patched_forward

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


def test_a_mask_longer_than_the_dynamic_cache_is_refused():
    """The FastChat bug (past columns prepended again): refused, never read as other keys."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("left", batch=2, seq=14)
    with patchkit.apply_patch("llama2", backend="sdpa"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        doubled = torch.cat([torch.ones_like(mask), mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        with pytest.raises(PatchInputError, match="do not prepend past columns"):
            model(input_ids=ids[:, -1:], attention_mask=doubled, past_key_values=out.past_key_values)


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


def test_revert_while_a_forward_is_in_flight_finishes_it_exactly():
    """Item 5: a revert from inside a forward crashed deep in torch with a VarlenMask type error. The forward's
    masks were made for patchkit, so its remaining layers finish on patchkit's attention; the next runs unpatched."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    hook = model.model.layers[0].register_forward_hook(lambda *a: handle.revert())
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    hook.remove()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)
    assert handle.calls == 2 and not handle.active
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert handle.calls == 2  # the next forward runs unpatched


def test_apply_while_a_forward_is_in_flight_finishes_it_on_transformers_attention():
    """The layers after the apply get transformers' own mask, so they run transformers' own attention: exact."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    hook = model.model.layers[0].register_forward_hook(
        lambda *a: patchkit.apply_patch("llama2", backend="sdpa") and None
    )
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    hook.remove()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    assert patchkit.active_patches()[0].calls == 0  # the next forward runs patched


def test_set_attn_implementation_after_an_instance_patch_names_the_cause():
    """Item 6: refused with the generic 4D-mask text, which named neither cause."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    patchkit.apply_patch("llama2", model=model, backend="sdpa")
    set_attention(model, "sdpa")  # set_attn_implementation (4.56+), or the config field it sets
    with pytest.raises(PatchInputError, match=r"changed to 'sdpa' after patchkit patched it.*set_attn_implementation"):
        model(input_ids=ids, attention_mask=mask)


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


def test_deepcopy_of_an_instance_patched_model_is_patched_and_reverted_with_it():
    """Item 7: the copy stayed patched after revert_patch(), and nothing could revert it."""
    model = tiny_model()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    handle = patchkit.apply_patch("llama2", model=model, backend="sdpa")
    twin = copy.deepcopy(model)
    assert handle.check(twin) == 2
    with torch.no_grad():
        got = twin(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    patchkit.revert_patch()
    modules = [*twin.modules(), *model.modules()]
    assert not any(is_patched_forward(vars(m).get("forward")) for m in modules if "forward" in vars(m))
    # every instance-level method is gone from the copy too: attention, the base model's and the LM's forward
    assert [type(m).__name__ for m in modules if "forward" in vars(m)] == []
    assert twin.config._attn_implementation == model.config._attn_implementation == "eager"
    with torch.no_grad():
        after = twin(input_ids=ids, attention_mask=mask).logits  # the reverted copy runs as the unpatched model
    torch.testing.assert_close(after[real], want[real], atol=2e-5, rtol=1e-4)


def test_a_saved_instance_patched_model_loads_and_runs_without_patchkit(tmp_path):
    import subprocess

    model = tiny_model()
    ids, mask = padded_batch("mixed")
    patchkit.apply_patch("llama2", model=model, backend="sdpa")
    torch.save({"model": model, "ids": ids, "mask": mask}, tmp_path / "model.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids, attention_mask=mask).logits, tmp_path / "want.pt")
    script = (
        "import sys, torch; sys.modules['patchkit'] = None  # patchkit cannot be imported here\n"
        f"d = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "with torch.no_grad(): got = d['model'](input_ids=d['ids'], attention_mask=d['mask']).logits\n"
        f"want = torch.load({str(tmp_path / 'want.pt')!r}); real = d['mask'].bool()\n"
        "torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4); print('LOADED', "
        "d['model'].config._attn_implementation)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED eager" in done.stdout


def test_a_collected_model_leaves_no_handle():
    model = tiny_model()
    patchkit.apply_patch("llama2", model=model.model, backend="sdpa")  # a submodule: the patch binds to it
    assert len(patchkit.active_patches()) == 1
    del model
    gc.collect()
    assert patchkit.active_patches() == []


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


@pytest.mark.parametrize("route", ["class patch", pytest.param("registered name", marks=needs_mask_interface)])
def test_bidirectional_attention_is_refused(route):
    """LLM2Vec sets is_causal=False on every attention module: causal varlen kernels must refuse, never mask it."""
    model = tiny_model(kv_heads=2)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    ids, mask = padded_batch("right", batch=2)
    if route == "class patch":
        with patchkit.apply_patch("llama2", backend="sdpa"), pytest.raises(PatchInputError, match=r"is_causal=False"):
            model(input_ids=ids, attention_mask=mask)
        return
    set_attention(model, patchkit.ATTENTION_NAME)
    patchkit.register_attention(backend="sdpa")
    try:
        with pytest.raises(PatchInputError, match=r"LlamaAttention \(model_type 'llama'\) passes is_causal=False"):
            model(input_ids=ids, attention_mask=mask)
    finally:
        patchkit.register_attention(backend="auto", strict=False)


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
            kv, step_mask, nxt, logits = dynamic_cache(model), mask, ids, []
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            for _ in range(4):
                out = model(input_ids=nxt, attention_mask=step_mask, position_ids=positions, **{CACHE: kv},
                            use_cache=True)
                logits.append(out.logits[:, -1])
                nxt, positions = out.logits[:, -1:].argmax(-1), positions[:, -1:] + 1
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], -1)
            return torch.stack(logits, 1)
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


@pytest.mark.parametrize("revert_class_first", [True, False])
def test_an_instance_patch_over_a_class_patch_counts_its_own_forwards(revert_class_first):
    """A class patch, a model built under it, then an instance patch on that model: its forwards ran through both
    wrappers and were counted on the class handle, even after the class patch was reverted (the instance patch had
    wrapped the class's patched forward), while the instance handle said 0 calls and 0 layers. The instance patch
    now wraps transformers' own forward: its handle counts every forward, the class handle none, exact throughout."""
    ids, mask = padded_batch("right")
    model = tiny_model()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    cls = patchkit.apply_patch("llama2", backend="sdpa")
    instance = patchkit.apply_patch(model=model, backend="sdpa")
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).logits
        assert instance.layers_patched == model.config.num_hidden_layers and cls.calls == 0
        (cls if revert_class_first else instance).revert()
        second = model(input_ids=ids, attention_mask=mask).logits
    (instance if revert_class_first else cls).revert()
    layers = model.config.num_hidden_layers
    assert cls.calls == (0 if revert_class_first else layers)  # the class patch serves the model once alone
    assert instance.calls == (2 * layers if revert_class_first else layers)
    real = mask.bool()
    for got in (first, second):
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert not is_patched_forward(model.model.forward)


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
