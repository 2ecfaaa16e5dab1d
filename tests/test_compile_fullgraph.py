"""torch.compile(fullgraph=True) of a patched model runs patchkit's varlen attention inside the one graph."""

from __future__ import annotations

import warnings

import pytest
import torch
from families import FAMILIES_FROM, any_model
from models import labels_for, padded_batch
from packaging.version import Version

import patchkit

pytestmark = [pytest.mark.heavy, pytest.mark.skipif(
    Version(__import__("transformers").__version__) < Version(FAMILIES_FROM),
    reason="the in-graph plan routes masks through transformers' mask interface (4.53+)",
)]  # heavy: torch.compile of patched models
POSITIONS = torch.cat([torch.arange(10), torch.arange(14)]).expand(4, -1)  # two documents per row


def compiled_step(model, kw: dict, train: bool, fullgraph: bool = True) -> tuple:
    """One forward (with backward in training), compiled with fullgraph or eager: logits, loss, every grad."""
    torch._dynamo.reset()
    model.train(train).zero_grad(set_to_none=True)
    run = torch.compile(model, backend="eager", fullgraph=True) if fullgraph else model
    with torch.set_grad_enabled(train):
        out = run(**kw)
    if train:
        out.loss.backward()
    return out.logits.detach(), out.loss, [p.grad for p in model.parameters()]


def unpatched_step(model, kw: dict, train: bool) -> tuple:
    """The unpatched model's fullgraph step; skips where this transformers cannot compile it so (transformers 4.56's
    sliding-window cache branches on a tensor in eval)."""
    try:
        return compiled_step(model, kw, train)
    except torch._dynamo.exc.Unsupported as refused:
        pytest.skip(f"the unpatched model does not compile with fullgraph=True here: {str(refused).splitlines()[0]}")


def assert_same(got: tuple, want: tuple, real: torch.Tensor) -> None:
    (logits, loss, grads), (want_logits, want_loss, want_grads) = got, want
    torch.testing.assert_close(logits[real], want_logits[real], atol=2e-5, rtol=1e-4)
    if want_loss is not None:
        torch.testing.assert_close(loss, want_loss, atol=2e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-3)


def patched(family: str, way: str, model) -> patchkit.PatchHandle:
    """The patch by `way`: the class patch, the instance patch, or the registered name alone (model switched)."""
    if way != "name":
        return patchkit.apply_patch(family, backend="sdpa", **({"model": model} if way == "instance" else {}))
    from patchkit.hooks.name import attention_interface

    attention_interface.register(backend="auto")
    attention_interface.register(backend="sdpa")  # a fresh route state: no counts of earlier tests in this process
    model.config._attn_implementation = "patchkit"
    return attention_interface.route_state()


CASES = {  # name -> (arguments, training); LLaMA has no sliding window: its padded eval forward is served too
    "eval_padded": (lambda ids, mask: dict(input_ids=ids, attention_mask=mask), False),
    "eval_dense": (lambda ids, mask: dict(input_ids=ids), False),
    "train_dense": (lambda ids, mask: dict(input_ids=ids, labels=ids), True),
    "train_packed": (lambda ids, mask: dict(input_ids=ids, position_ids=POSITIONS, labels=ids), True),
}


@pytest.mark.parametrize("family, way, case", [
    ("llama", "class", "eval_padded"), ("llama", "class", "train_dense"), ("llama", "class", "train_packed"),
    ("llama", "instance", "eval_padded"), ("llama", "instance", "train_packed"),
    ("llama", "name", "train_dense"), ("qwen2", "class", "train_packed"), ("qwen2", "instance", "eval_dense"),
    ("qwen2_moe", "class", "train_dense"), ("qwen2_moe", "class", "train_packed"), ("qwen2_moe", "class", "eval_dense"),
    # its Model and ForConditionalGeneration record router logits (contextvar wrappers), its text attention layer
    # has a model_type of its own (the family check answered while traced): both stopped fullgraph (transformers'
    # own test_generate_compile_model_forward_fullgraph)
    ("qwen3_vl_moe", "class", "eval_dense"), ("qwen3_vl_moe", "class", "train_dense"),
])
def test_fullgraph_compile_of_a_patched_model_runs_patchkit_attention_in_the_graph(family, way, case):
    """torch.compile(fullgraph=True) (dense and mixture of experts; class and instance patch, the registered name):
    the forward runs patchkit's in-graph varlen path (real tokens sorted first on the device, cu_seqlens from the
    mask or the position_ids, no host read, no graph break), every layer counted, nothing stepped aside. Equal to
    the unpatched compiled model, packed rows to patchkit's eager path (each document alone, the padding-free
    contract). Before, every such forward ran transformers' attention."""
    model = any_model(family, "eager" if way == "name" else "sdpa")
    ids, mask = padded_batch("mixed")
    make, train = CASES[case]
    kw = make(ids, mask)
    real = mask.bool() if "attention_mask" in kw else torch.ones_like(mask, dtype=torch.bool)
    if case == "train_packed":
        with patchkit.apply_patch(family, backend="sdpa"):
            want = compiled_step(model, kw, train, fullgraph=False)
    else:
        want = unpatched_step(model, kw, train)
    handle = patched(family, way, model)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="patchkit: torch.compile")
            got = compiled_step(model, kw, train)
        layers = handle.layers_patched if way != "name" else None
    finally:
        if way == "name":
            model.config._attn_implementation = "eager"
        else:
            handle.revert()
    assert handle.stepped_aside == {}, handle.stepped_aside
    assert getattr(handle, "state", handle).compiled  # a compiled call ran through the patch
    if layers is not None:
        assert layers == model.config.get_text_config().num_hidden_layers
    assert_same(got, want, real)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph"])
def test_packed_rows_in_the_graph_are_each_document_alone(fullgraph):
    """Packed rows in the graph, against the unpatched model run on each document alone: the documents do not see
    each other, where transformers' sdpa joins them behind the cache this eval forward makes. Said once while
    traced, as the eager path says it (before, unsaid: 0.46 off the unpatched logits, no word)."""
    from unittest import mock

    from patchkit.forward import documents

    model = any_model("llama", "sdpa").eval()
    ids, _ = padded_batch("right")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, :10]).logits, model(input_ids=ids[:, 10:]).logits], 1)
        torch._dynamo.reset()
        with patchkit.apply_patch("llama", backend="sdpa"), mock.patch.object(documents, "_said", set()):
            with pytest.warns(RuntimeWarning, match="kept apart here.*cannot read whether its position_ids restart"):
                got = torch.compile(model, backend="eager", fullgraph=fullgraph)(input_ids=ids,
                                                                                  position_ids=POSITIONS)
    torch.testing.assert_close(got.logits, alone, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family, way, case, words", [
    ("llama", "class", "padded_labels", "a padded batch with labels"),
    ("llama", "instance", "padded_labels", "a padded batch with labels"),
    ("llama", "name", "eval_padded", "attn_implementation='patchkit' alone"),
    ("qwen2", "class", "eval_padded", "a sliding window"),
    ("qwen2_moe", "class", "padded_labels", "a padded batch with labels"),
    ("mistral", "name", "eval_dense", "a mask transformers joins from parts"),  # was custom_mask_pattern, "none"
])
def test_a_forward_the_graph_cannot_plan_steps_aside_with_one_warning(family, way, case, words):
    """What the graph cannot decide without reading values (a label after padding; a padding hole under a sliding
    window; labels the registered name alone cannot see; a sliding window joined into transformers' mask function
    under the name alone) steps aside: transformers' attention, equal to the unpatched compiled model, one warning
    naming it, counted when traced."""
    model = any_model(family, "eager" if way == "name" else "sdpa")
    ids, mask = padded_batch("right")
    kw = dict(input_ids=ids) if case == "eval_dense" else dict(input_ids=ids, attention_mask=mask)
    if case == "eval_dense":
        mask = torch.ones_like(mask)
        assert model.config.sliding_window < ids.shape[1]
    train = case == "padded_labels"
    if train:
        kw["labels"] = labels_for(ids, mask)
    want = unpatched_step(model, kw, train)
    handle = patched(family, way, model)
    try:
        with pytest.warns(RuntimeWarning, match=rf"torch.compile\(fullgraph=True\).*{words}.*compile without"):
            got = compiled_step(model, kw, train)
    finally:
        if way == "name":
            model.config._attn_implementation = "eager"
        else:
            handle.revert()
    assert handle.stepped_aside.get("compiled_fullgraph", 0) >= 1, handle.stepped_aside
    assert_same(got, want, mask.bool())


def test_strict_refuses_a_forward_the_graph_cannot_plan():
    """strict=True: such a forward is refused while dynamo traces it, by patchkit's error (dynamo wraps it), naming
    the cause and what keeps the model patched."""
    model = any_model("llama", "sdpa").train()
    ids, mask = padded_batch("right")
    torch._dynamo.reset()
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True) as handle:
        with pytest.raises(Exception, match=r"strict=True\): torch.compile\(fullgraph=True\) of a padded batch") as e:
            torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, attention_mask=mask,
                                                                  labels=labels_for(ids, mask))
        assert handle.stepped_aside == {}
    chain = [e.value, e.value.__cause__, e.value.__context__]
    assert any(isinstance(x, patchkit.PatchkitError) for x in chain), [type(x) for x in chain]


def test_a_fullgraph_training_step_is_one_graph():
    """The number the issue asks for: a fullgraph-compiled patched training step (packed rows) and padded eval
    forward are each one graph (fullgraph forbids a break; nothing else compiled beside it)."""
    from torch._dynamo.utils import counters

    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("right")
    graphs = []
    with patchkit.apply_patch("llama", backend="sdpa"):
        for kw, train in ((dict(input_ids=ids, position_ids=POSITIONS, labels=ids), True),
                          (dict(input_ids=ids, attention_mask=mask), False)):
            counters.clear()
            compiled_step(model, kw, train)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1], graphs


def test_a_compiled_forward_without_a_mask_runs_the_in_graph_plan_without_a_graph_break():
    """torch.compile(model) (graph breaks allowed; the Trainer's torch_compile=True): a forward with no mask (packed
    rows, TRL's padding_free and packing) needs no host read, so it runs the in-graph plan as one graph, equal to
    patchkit's eager path. A padded batch keeps the eager path's unpadding at the model (the MLP then skips padding),
    whose host reads break the graph."""
    model = any_model("llama", "sdpa")
    ids, _ = padded_batch("right")
    kw = dict(input_ids=ids, position_ids=POSITIONS, labels=ids)
    with patchkit.apply_patch("llama", backend="sdpa"):
        want = compiled_step(model, kw, True, fullgraph=False)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**kw)
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        out = torch.compile(model, backend="eager")(**kw)
        out.loss.backward()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert_same((out.logits.detach(), out.loss, [p.grad for p in model.parameters()]), want,
                torch.ones_like(ids, dtype=torch.bool))


def test_what_the_graph_does_not_serve_is_read_from_the_modeling_source():
    """The in-graph plan finds attention sinks and mask patterns beyond causal in a family's own modeling code (no
    list of families to fall behind transformers): GPT-OSS passes sinks, LLaMA-4 asks for chunked masks, LLaMA
    neither. And a layer handed sinks inside a planned graph refuses rather than drop them."""
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss
    import transformers.models.llama.modeling_llama as llama

    from patchkit.hooks.decide.graph_plan import _modeling_cause

    assert _modeling_cause(gpt_oss.__name__, "GptOssModel") == "sinks"
    assert _modeling_cause(llama.__name__, "LlamaModel") == ""
    llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
    assert _modeling_cause(llama4.__name__, "Llama4TextModel") == "custom_mask_pattern"

    from patchkit.forward.in_graph import GraphMask
    from patchkit.hooks.attention.varlen import make_attention_function
    from patchkit.hooks.name import attention_interface

    attention_interface.register(backend="sdpa")
    attend = make_attention_function(attention_interface.route_state(), ["llama"])
    model = any_model("llama", "sdpa")
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(patchkit.PatchkitError, match="attention sinks inside a compiled graph"):
        attend(model.model.layers[0].self_attn, q, k, v, GraphMask(None, False, None, None), s_aux=torch.zeros(4))


def gpt2(cross_attention: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, add_cross_attention=cross_attention)
    torch.manual_seed(0)
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("cross_attention", [False, True], ids=["decoder only", "encoder states"])
def test_a_decoder_that_can_cross_attend_is_served_in_the_graph_unless_given_encoder_states(cross_attention):
    """GPT-2's forward builds an encoder mask (`create_bidirectional_mask`) only when given encoder states: the graph
    serves its decoder-only forwards (before, the word "bidirectional" in its source stepped every one aside), and
    steps a forward with encoder states aside by name, `cross_attention`, as outside a graph."""
    model = gpt2(cross_attention)
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    kw = dict(input_ids=ids.clamp(max=95), attention_mask=mask)
    if cross_attention:
        kw["encoder_hidden_states"] = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(1))
    want = unpatched_step(model, kw, False)
    with patchkit.apply_patch("gpt2", backend="sdpa") as handle:
        got = compiled_step(model, kw, False)
        aside, compiled = dict(handle.stepped_aside), handle.state.compiled
    assert aside == ({"cross_attention": 1} if cross_attention else {})
    assert compiled or cross_attention  # decoder only: a compiled call ran through the patch
    assert_same(got, want, mask.bool())


@pytest.mark.parametrize("family, case", [
    ("gpt_bigcode", "packed"), ("persimmon", "packed"), ("zaya", "packed"), ("zaya", "padded"),
    ("qwen3_5_text", "packed"), ("qwen3_5_text", "padded"), ("jamba", "padded"), ("gpt_bigcode", "packed, cached"),
])
def test_layers_handed_no_position_ids_and_hybrids_compile_in_one_graph_with_unpatched_numbers(family, case):
    """GPT-BigCode's, Persimmon's and ZAYA's attention layers are handed no position_ids: in the graph they read the
    packed documents from the forward's own, where transformers' mask packs by them (they joined the documents:
    logits 0.1-0.22 off), and behind an eval forward's own empty cache, where transformers' would not (the numbers of
    its run without one). A hybrid's recurrent mask builder reads no contextvar in the graph (it raised: Dynamo cannot
    trace ContextVar.get); there its mixers see transformers' own mask, as unpatched."""
    from census import packed_rows, tiny_config

    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    if case.startswith("packed"):
        ids, positions = packed_rows()
        kw, real = dict(input_ids=ids.clamp(max=model.config.vocab_size - 1), position_ids=positions), None
    else:
        ids, mask = padded_batch("right")
        kw, real = dict(input_ids=ids.clamp(max=model.config.vocab_size - 1), attention_mask=mask), mask.bool()
    with torch.no_grad():
        want = model(**kw, use_cache=False).logits
        torch._dynamo.reset()
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            got = torch.compile(model, backend="eager", fullgraph=True)(**kw, use_cache=case.endswith("cached"))
            got = got.logits  # behind the forward's own empty cache too, where transformers joins the documents
            assert handle.stepped_aside == {} and handle.state.compiled
    torch._dynamo.reset()
    real = torch.ones(want.shape[:2], dtype=torch.bool) if real is None else real
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt_bigcode"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_gapped_positions_behind_an_eval_forwards_cache_stay_one_sequence_in_the_graph(family, fullgraph):
    """Position_ids with gaps (0, 3, 6, ...) and no mask, in an eval forward that makes its own cache: transformers
    finds no documents there (its rule, every step other than +1, applies without a cache only), and patchkit's
    eager path reads documents only where a position does not increase: one sequence. The graph applied
    transformers' rule behind the cache too, each token its own document (logits 0.16-0.39 off)."""
    from census import tiny_config

    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12).mul(3).expand_as(ids)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=True).logits
        torch._dynamo.reset()
        with patchkit.apply_patch(family if family != "llama" else "llama2", backend="sdpa") as handle:
            got = torch.compile(model, backend="eager", fullgraph=fullgraph)(
                input_ids=ids, position_ids=positions, use_cache=True).logits
            assert handle.stepped_aside == {} and handle.state.compiled
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
