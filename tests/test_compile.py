"""torch.compile keeps working on a patched model (graph breaks allowed, results equal to eager)."""

from __future__ import annotations

import pytest
import torch
import transformers
from families import FAMILIES_FROM, any_model, static_cache_served
from models import labels_for, padded_batch, tiny_model
from packaging.version import Version

import patchkit

pytestmark = pytest.mark.heavy  # torch.compile of patched models: make test-heavy


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_torch_compile_of_a_patched_model_matches_eager(family):
    """LLaMA's own attention forward, and the family route (each attention call routed to the patch for the
    module's lifetime), compiled: two steps, logits and gradients equal to eager."""
    model = any_model(family).train()
    ids, mask = padded_batch("right" if family != "llama" else "mixed")
    labels = labels_for(ids, mask)
    want = model(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    want_grad = model.lm_head.weight.grad.clone()
    torch._dynamo.reset()
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            got = compiled(input_ids=ids, attention_mask=mask, labels=labels)
            got.loss.backward()
        assert handle.layers_patched == 2 and handle.check(model) == 2
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(model.lm_head.weight.grad, want_grad, atol=3e-5, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_compiled_training_step_under_autocast_equals_unpatched(dtype):
    """Under autocast, RoPE's fp32 cos/sin leave q and k fp32 beside a half v: SDPA casts all three (autocast's
    rule), but the sdpa backend's op in a compiled graph had no rule and raised on the mixed dtypes. The op's
    inputs are now cast as autocast casts SDPA's: the compiled patched step equals the unpatched one."""
    model = tiny_model(kv_heads=2).train()
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    with torch.autocast("cpu", dtype=dtype):
        want = model(input_ids=ids, attention_mask=mask, labels=labels)
    want.loss.backward()
    want_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with patchkit.apply_patch(model=model, backend="sdpa"):
        with torch.autocast("cpu", dtype=dtype):
            got = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask, labels=labels)
        got.loss.backward()
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.loss, want.loss, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(model.lm_head.weight.grad, want_grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "unpad, training", [("model", True), ("attention", True), ("model", False)],
    ids=["train-unpad-model", "train-unpad-attention", "eval-kv-cache"],
)
def test_compiled_report_counts_every_layer(unpad, training):
    # Regression: when dynamo compiles one attention frame for every layer (a graph break in the decoder loop, as
    # with per-layer unpadding, a KV cache or FSDP2), the report said 1 of 4 layers ran through the patch.
    model = tiny_model(kv_heads=2, layers=4).train(training)
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    graphs = []
    with patchkit.apply_patch("llama2", backend="sdpa", unpad=unpad) as handle:
        compiled = torch.compile(model, backend="eager")
        for _ in range(3):
            out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
            if training:
                out.loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
        assert (handle.layers_patched, handle.check(model)) == (4, 4)
        assert graphs[1] == graphs[2], f"a steady-state step recompiled: unique graphs {graphs}"
        assert "attention layers through the patch: 4 (" in handle.report()
        assert "compiled calls are not counted" in handle.report()
        if unpad == "model":  # the head and loss on real tokens, asked for between the compiled frames
            assert handle.heads == {"real tokens": 3}


def test_the_compiled_report_counts_layers_not_copies_of_their_attributes():
    # Regression (CI, under -n 2): the count of compiled layers took every dict holding the patch's mark for a layer's
    # `__dict__`, so a copy of one still alive (dynamo's, a wrapper's) made a 2-layer model report 3 layers.
    model = tiny_model(layers=2).train()
    ids, mask = padded_batch("mixed")
    torch._dynamo.reset()
    with patchkit.apply_patch("llama2", backend="sdpa", unpad="attention") as handle:
        torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask)
        copies = [dict(vars(layer.self_attn)) for layer in model.model.layers]  # noqa: F841 - held while counting
        assert handle.layers_patched == 2 and handle.check(model) == 2
    torch._dynamo.reset()


def test_fullgraph_compile_through_a_wrapper_that_pops_from_its_kwargs():
    """transformers' `can_return_tuple` pops from the compiled frame's kwargs before the base model's forward:
    Dynamo then refuses to read a mapping proxy, so a wrapper that bound its arguments with `Signature.bind`
    failed the fullgraph compile (transformers' Gemma3 vision-to-text fullgraph generate test, patched). The mask
    here is 4D, as generate() makes for a static cache: the compiled forward runs transformers' own attention."""
    model = any_model("qwen2", "sdpa")
    ids, mask = padded_batch("left")
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    mask4d = causal[None, None] & mask.bool()[:, None, None, :]

    def step(kwargs: dict) -> torch.Tensor:
        kwargs.pop("return_dict", None)
        return model.model(**kwargs).last_hidden_state

    with torch.no_grad():
        want = step({"input_ids": ids, "attention_mask": mask4d})
        torch._dynamo.reset()
        with patchkit.apply_patch("qwen2", backend="sdpa"):
            got = torch.compile(step, backend="eager", fullgraph=True)(
                {"input_ids": ids, "attention_mask": mask4d, "return_dict": True})
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=1e-4)


def test_a_compiled_forward_generating_into_a_static_cache_keeps_transformers_mask_in_the_graph():
    """HF's compiled static-cache generation (model.forward compiled, fullgraph): inside the graph generate()'s 4D
    mask goes straight to transformers' attention (no host sync to read it back as a 2D mask), counted and said once
    as `compiled_4d_mask` while traced (before, unsaid); the same tokens as unpatched."""
    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    want = model.generate(**kw)
    torch._dynamo.reset()
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
        try:
            with pytest.warns(RuntimeWarning, match=r"\(compiled_4d_mask\)") as said:
                got = model.generate(**kw)
        finally:
            del model.forward
        assert len([w for w in said if "compiled_4d_mask" in str(w.message)]) == 1
        # one graph for the prefill, one for the decode steps: each counted once, as traced
        assert handle.calls == 0 and handle.stepped_aside == {"compiled_4d_mask": 2}, handle.stepped_aside
    assert torch.equal(got, want)


@pytest.mark.parametrize("way", ["instance", "class"])
def test_a_compiled_forward_set_on_the_model_is_served_patched(way):
    """transformers' recipe for compiled generation, `model.forward = torch.compile(model.forward)` over a patch
    (an instance patch's forward, or the class patch's bound to the model): the base model sees patchkit's forward
    through torch.compile's wrapper, so a left-padded generate() and a training step with labels run patched, with
    the unpatched model's tokens, scores, loss and gradients (before, every forward stepped aside as
    `head_outside_patch`, said as a multimodal model patchkit did not wrap)."""
    model = any_model("llama", "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
              output_scores=True, return_dict_in_generate=True)
    labels = labels_for(ids, mask)
    with torch.no_grad():
        want = model.generate(**kw)
    want_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    want_loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    handle = patchkit.apply_patch(model=model, backend="sdpa") if way == "instance" else patchkit.apply_patch(
        "llama2", backend="sdpa")
    patched = vars(model).get("forward")  # the instance patch's, or none (the class patch's)
    try:
        model.forward = torch.compile(model.forward, backend="eager")
        with torch.no_grad():
            got = model.generate(**kw)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        assert handle.stepped_aside == {} and handle.calls > 0, (handle.stepped_aside, handle.calls)
    finally:
        if patched is None:
            del model.forward  # the compiled one
        else:
            model.forward = patched
        handle.revert()
    assert torch.equal(got.sequences, want.sequences)
    for ours, theirs in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(loss, want_loss, atol=3e-6, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name], atol=3e-5, rtol=1e-4, msg=name)


def cpu_compile_config():
    """transformers' CompileConfig for generate() (the eager backend, fullgraph), made to compile on CPU as generate()
    does unasked on a GPU; skips where this transformers' generate() compiles on a GPU only."""
    config_class = getattr(pytest.importorskip("transformers"), "CompileConfig", None)
    if config_class is None or not hasattr(config_class, "_compile_all_devices"):
        pytest.skip("this transformers' generate() compiles on a GPU only")
    config = config_class(backend="eager", mode="default", fullgraph=True)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3_text"])
def test_generate_compiling_its_own_decode_steps_gets_the_packed_prefill(family):
    """transformers' own compiled generation (a static cache with `generation_config.compile_config`, as generate()
    does by itself on a GPU): the prefill runs eager, so patchkit packs it; each decode step runs the compiled
    `__call__`, where generate()'s 4D mask goes to transformers' attention, counted once as traced
    (`compiled_4d_mask`). The same tokens as unpatched, no graph break, and a second generate() compiles nothing
    new."""
    from torch._dynamo.utils import counters

    compile_config = cpu_compile_config()
    model = any_model(family, "sdpa")
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    want = model.generate(**kw)
    torch._dynamo.reset()
    counters.clear()
    with patchkit.apply_patch(backend="sdpa") as handle:
        got = model.generate(**kw, compile_config=compile_config)
        served = handle.calls
        graphs = counters["stats"]["unique_graphs"]
        again = model.generate(**kw, compile_config=compile_config)
        assert counters["stats"]["unique_graphs"] == graphs >= 1, "generate() did not compile, or compiled again"
        assert sum(counters["graph_break"].values()) == 0
        # what `static_layers` serves: 4.56's layered StaticCache, and 4.57's in-order sliding layers
        aside = dict(handle.stepped_aside)
        assert aside.pop("compiled_4d_mask", 0) >= 1, handle.stepped_aside  # the decode step, once a trace
        if static_cache_served(family):
            assert served == 2 and not aside, handle.stepped_aside  # the prefill, in both layers, packed
        else:  # before that a static cache's prefill steps aside, counted
            assert served == 0 and aside == {"custom_4d_mask": 2}, handle.stepped_aside
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generate_compiling_its_own_decode_steps_under_the_registered_name_alone(family):
    """attn_implementation="patchkit" alone, generate()'s own compiled static-cache decode (fullgraph, as on a GPU
    unasked): the eager prefill runs patched, each compiled decode step hands generate()'s 4D mask to transformers'
    attention without reading patchkit's contextvar (which broke the fullgraph compile with a dynamo error), counted
    per layer as traced (`compiled_4d_mask`). The same tokens as unpatched, no graph break, nothing compiled again on
    a second generate(); strict=True refuses the compiled decode step, naming the cause."""
    import copy

    from torch._dynamo.utils import counters

    from patchkit.hooks.name import attention_interface

    compile_config = cpu_compile_config()
    if not static_cache_served(family):
        pytest.skip("static caches served patched: transformers 4.56+ (windowed 4.57+)")
    model = any_model(family)
    named = copy.deepcopy(model)
    named.config._attn_implementation = patchkit.ATTENTION_NAME
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    want = model.generate(**kw)
    torch._dynamo.reset()
    counters.clear()
    patchkit.register_attention(backend="sdpa", strict=True)
    try:
        with pytest.raises(Exception, match=r"strict=True\): a compiled forward was given a 4D mask"):
            named.generate(**kw, compile_config=compile_config)
        torch._dynamo.reset()
        counters.clear()
        patchkit.register_attention(backend="sdpa", strict=False)
        state = attention_interface.route_state()
        got = named.generate(**kw, compile_config=compile_config)
        # the prefill, both layers, on the varlen path; the compiled decode step's two layers aside, as traced
        assert state.calls == 2 and set(state.stepped_aside) == {"compiled_4d_mask"}, state.stepped_aside
        graphs = counters["stats"]["unique_graphs"]
        again = named.generate(**kw, compile_config=compile_config)
        assert counters["stats"]["unique_graphs"] == graphs >= 1, "generate() did not compile, or compiled again"
        assert sum(counters["graph_break"].values()) == 0
    finally:
        patchkit.register_attention(backend="auto", strict=False)
    assert torch.equal(got, want) and torch.equal(again, want)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
def test_a_compiled_model_given_its_own_4d_mask_under_the_name_alone_is_said(fullgraph):
    """attn_implementation="patchkit" alone, compiled, given a caller's 4D mask (two documents, block-diagonal): the
    graph hands it to transformers' attention as the unnamed model runs it, counted per layer and said once as
    `compiled_4d_mask` (before, unsaid and uncounted; eagerly it steps aside as custom_4d_mask)."""
    import copy

    from patchkit.hooks.name import attention_interface

    if Version(transformers.__version__) < Version(FAMILIES_FROM):
        pytest.skip("the registered name's mask interface: transformers 4.53+")
    model = any_model("llama", "sdpa").eval()  # (eager adds a boolean mask to its scores: it would mask nothing)
    named = copy.deepcopy(model)
    named.set_attn_implementation(patchkit.ATTENTION_NAME)
    ids = torch.randint(3, 90, (2, 12))
    blocks = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    blocks[5:, :5] = False  # a second document from position 5
    mask4d = blocks.expand(2, 1, 12, 12)
    torch._dynamo.reset()
    patchkit.register_attention(backend="sdpa")
    state = attention_interface.route_state()
    state.warned = {key for key in state.warned if "compiled_4d_mask" not in key}  # said once a process: again here
    before = state.stepped_aside.get("compiled_4d_mask", 0)
    compiled = torch.compile(named, backend="eager", fullgraph=fullgraph)
    try:
        with torch.no_grad():
            with pytest.warns(RuntimeWarning, match=r"\(compiled_4d_mask\)"):
                got = compiled(input_ids=ids, attention_mask=mask4d, use_cache=False).logits
            want = model(input_ids=ids, attention_mask=mask4d, use_cache=False).logits
        assert state.stepped_aside.get("compiled_4d_mask", 0) - before == model.config.num_hidden_layers
    finally:
        patchkit.register_attention(backend="auto", strict=False)  # a fresh route state for later tests
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


COMPILED_STEPS: dict = {}  # (unpad, layers, family) -> compiled_training_step's counts, measured once for all tests


def compiled_training_step(unpad: str, layers: int, family: str = "llama") -> dict:
    """A padded training step (forward and backward) of a patched `layers`-layer model of `family`, compiled (the
    eager backend, each graph's runs counted): the graph breaks met compiling it, the graphs compiled, and how many
    compiled graphs the second step ran (a graph break splits the frame it is in, so breaks in each layer's path show
    there)."""
    if (unpad, layers, family) in COMPILED_STEPS:
        return COMPILED_STEPS[unpad, layers, family]
    from families import family_model
    from torch._dynamo.utils import counters

    runs = []

    def eager_counting(graph: torch.fx.GraphModule, example_inputs: list):
        def run(*args):
            runs.append(graph)
            return graph.forward(*args)

        return run

    model = (tiny_model(layers=layers) if family == "llama" else family_model(family, layers=layers)).train()
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    torch._dynamo.reset()
    counters.clear()
    with patchkit.apply_patch("llama2" if family == "llama" else family, backend="sdpa", unpad=unpad) as handle:
        # eager first: process-wide lookups patchkit fills on first use (routing's per-config-class fields) are then
        # filled, else whichever depth compiles first in the process recompiles once more in its second step
        model(input_ids=ids, attention_mask=mask, labels=labels)
        compiled = torch.compile(model, backend=eager_counting)
        for _ in range(2):
            runs.clear()
            compiled(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        assert handle.layers_patched == layers
    COMPILED_STEPS[unpad, layers, family] = dict(breaks=sum(counters["graph_break"].values()),
                                                 graphs=counters["stats"]["unique_graphs"], runs=len(runs),
                                                 reasons=dict(counters["graph_break"]))
    torch._dynamo.reset()
    return COMPILED_STEPS[unpad, layers, family]


@pytest.mark.parametrize("unpad", ["model", "attention"])
def test_compiling_a_deeper_patched_model_meets_no_more_graph_breaks(unpad):
    """The graph breaks dynamo meets compiling a patched training step (the metadata's host reads, and the rest) do
    not come once per layer: 2 and 4 layers meet as many, and compile as many graphs. Measured (torch 2.13,
    transformers 5.24): 14 breaks, 8 graphs (unpad='model'); 28 breaks, 17 graphs (unpad='attention').
    Every layer runs the same code, compiled once, so this count misses breaks inside each layer's path: the next
    tests count those."""
    shallow, deep = compiled_training_step(unpad, 2), compiled_training_step(unpad, 4)
    assert (deep["breaks"], deep["graphs"]) == (shallow["breaks"], shallow["graphs"]), (shallow, deep)


def test_a_compiled_step_reads_tensors_on_the_host_only_inside_patchkits_planning_calls():
    """Planning a patched forward reads tensors on the host (labels at padding, real-token counts, which rows are
    labelled). In a compiled step those reads run inside the planning calls that dynamo leaves to Python
    (`torch.compiler.disable`): one graph break at each call. Read in a traced frame, each read broke the graph, and
    dynamo traced every function the rest of the frame called as a frame of its own. Measured at 2 layers (torch 2.13,
    transformers 5.24): 33 breaks, 19 graphs and 17 run per step before, 14, 8 and 7 since; unpatched, 1 graph."""
    step = compiled_training_step("model", 2)
    host_reads = {reason.splitlines()[0]: n for reason, n in step["reasons"].items()
                  if any(words in reason for words in ("depends on input Tensor data", "Tensor.item()",
                                                       "dependent on the data of Tensor"))}
    assert not host_reads, host_reads
    assert step["graphs"] <= 8, step


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # Gemma2: a window and softcap
def test_each_layer_of_a_compiled_training_step_runs_as_one_graph(family):
    """No graph break inside a decoder layer (unpad='model', the default): two more layers run at most two more
    compiled graphs. The layer reads its route from the mask it is handed, not the forward's contextvar, the model
    type by a plain read, the real-token count from a field (Python 3.11's cached_property takes an RLock); each of
    those broke every layer into 5 graphs (LLaMA: 24 at 2 layers, 34 at 4). A window and softcap (Gemma2)
    included. Before the mask interface (4.48-4.52) the whole forward is one graph: 13 at any depth."""
    if family != "llama" and Version(transformers.__version__) < Version(FAMILIES_FROM):
        pytest.skip(f"family patches need transformers >= {FAMILIES_FROM}")
    shallow, deep = compiled_training_step("model", 2, family), compiled_training_step("model", 4, family)
    assert deep["runs"] - shallow["runs"] <= 2, (shallow, deep)


GROWS = pytest.mark.xfail(strict=True, reason=(
    "unpad='attention': the first layer builds the metadata (host reads) in the attention call, which splits "
    "every layer's compiled frames: 23 graphs per step at 2 layers, 33 at 4. The unpatched model runs 1 at any depth"))


@pytest.mark.parametrize("unpad", ["model", pytest.param("attention", marks=GROWS)])
def test_a_compiled_training_step_runs_no_more_graphs_at_more_layers(unpad):
    """Graph breaks stay out of the hot path: the compiled graphs a steady-state training step runs do not grow with
    the number of layers (a break in the layer loop or the attention call splits every layer's graph). unpad='model'
    ran 16 graphs at 2 layers and 18 at 4 on transformers 4.53+ while the kernel path stacked k and v per layer and
    the model forward read packed documents itself; 14 at both depths since."""
    shallow, deep = compiled_training_step(unpad, 2), compiled_training_step(unpad, 4)
    assert deep["runs"] == shallow["runs"], (shallow, deep)


def test_compiled_training_on_new_document_lengths_compiles_nothing_new():
    """A compiled patched training loop over batches of other lengths (as every real loop has): on the sdpa backend
    the layer's graph was guarded on every document length (its per-document loop), so each batch compiled it again
    until dynamo's recompile limit ran it eagerly. Inside a graph the backend is now one op on `cu_seqlens`
    (`patchkit::varlen_sdpa`): after the first batches (dynamo makes the packed length dynamic) nothing compiles
    again, and every step's loss and gradients equal the unpatched model's."""
    from models import VOCAB
    from torch._dynamo.utils import counters

    from patchkit.backends import sdpa_op

    if not sdpa_op.served(0.0):
        pytest.skip("torch.library.custom_op: torch 2.4+")
    model = tiny_model(layers=2).train()
    batches, want = [], []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(3, VOCAB, (4, 24), generator=g)
        mask = (torch.arange(24)[None] < torch.randint(5, 25, (4, 1), generator=g)).long()
        batches.append(dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)))
        model.zero_grad(set_to_none=True)
        loss = model(**batches[-1]).loss
        loss.backward()
        want.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    graphs = []
    torch._dynamo.reset()
    counters.clear()
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True) as handle:
        compiled = torch.compile(model, backend="aot_eager")
        for step, (batch, (loss, grads)) in enumerate(zip(batches, want)):
            model.zero_grad(set_to_none=True)
            got = compiled(**batch).loss
            got.backward()
            graphs.append(counters["stats"]["unique_graphs"])
            torch.testing.assert_close(got, loss, atol=3e-6, rtol=1e-5)
            for (name, p), grad in zip(model.named_parameters(), grads):
                torch.testing.assert_close(p.grad, grad, atol=3e-6, rtol=1e-4, msg=f"step {step}: {name}")
        assert handle.check(model) == 2
    torch._dynamo.reset()
    assert graphs[2] == graphs[-1], f"unique graphs after each step: {graphs}"


def test_a_module_imported_between_compiled_steps_compiles_nothing_new():
    """The forward asked whether DeepSpeed's Ulysses module was in sys.modules; dynamo guards that read on the
    length of sys.modules, so any import anywhere (a Trainer's lazy imports, a logger) recompiled the patched forward,
    up to dynamo's recompile limit. The check now reads transformers' attention interface only. The loop reads the
    loss alone, so its forwards run the head fused with the loss; the first checks the fused head on the model's own
    logits and the second is the first fused one (dynamo compiles its frames then): from the second on, nothing new."""
    import sys
    import types

    from torch._dynamo.utils import counters

    model = tiny_model(kv_heads=2, layers=2).train()
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    torch._dynamo.reset()
    counters.clear()
    compiled_frames = []
    with patchkit.apply_patch("llama2", backend="sdpa"):
        compiled = torch.compile(model, backend="eager")
        for step in range(4):
            compiled(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            compiled_frames.append(counters["stats"]["unique_graphs"])  # not frames: a skipped frame counts there
            sys.modules[f"patchkit_test_fresh_{step}"] = types.ModuleType(f"patchkit_test_fresh_{step}")
    for step in range(4):
        del sys.modules[f"patchkit_test_fresh_{step}"]
    torch._dynamo.reset()
    assert compiled_frames[1] == compiled_frames[-1], f"graphs compiled after each step: {compiled_frames}"


COMPILE_SCRIPT = """
import sys, warnings
sys.path.insert(0, {tests!r})
import torch, patchkit
from models import labels_for, padded_batch, tiny_model
warnings.simplefilter("always")
model = tiny_model(kv_heads=2, layers=2).train()
ids, mask = padded_batch("mixed")
labels = labels_for(ids, mask)
if {way!r} == "registered name":
    patchkit.register_attention(backend="sdpa")
    model.set_attn_implementation("patchkit")
else:
    patchkit.apply_patch("llama2", backend="sdpa")
compiled = torch.compile(model, backend="eager")
for _ in range(2):
    compiled(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
model.eval()  # an eval forward makes its own cache (transformers 5.x, use_cache from the config)
with torch.no_grad():
    compiled(input_ids=ids, attention_mask=mask)
"""


@pytest.mark.parametrize("way", ["class patch", "registered name"])
def test_compiling_a_patched_model_warns_of_nothing_inside_patchkit(way):
    """Dynamo warned of `sys._getframe` (the frame walks for labels and generate()) and of a `functools.cache` call
    ("silent incorrectness") inside patchkit: the walks now run outside the trace, the cached answers are read
    before it or from plain memos (an eval forward's own cache too). A fresh process, as dynamo warns once per
    process."""
    import subprocess
    import sys
    from pathlib import Path

    script = COMPILE_SCRIPT.format(tests=str(Path(__file__).parent), way=way)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "_getframe" not in proc.stderr and "lru_cache" not in proc.stderr, proc.stderr[-2000:]


def test_a_compiled_hand_written_decode_loop_with_a_row_that_is_all_padding_equals_unpatched():
    """The compiled model's prefill into an empty cache with a row that is all padding reads that row's next token
    at padding, as the eager one does (`test_never_silent_generation`): it steps aside, named, and the loop's logits
    are unpatched's. The check reads the cache's length on the host: inside the compiled forward it runs where dynamo
    leaves patchkit's planning to Python, so it is made there too."""
    from models import dynamic_decode

    model = tiny_model(kv_heads=2).eval()
    ids, mask = padded_batch("left", batch=3, seq=14)
    mask[1] = 0
    with torch.no_grad():
        want = dynamic_decode(model, ids, mask, forwards=3)
        torch._dynamo.reset()
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match="decode loop.*a row that is all padding"):
                got = dynamic_decode(model, ids, mask, forwards=3, run=torch.compile(model, backend="eager"))
            assert handle.stepped_aside == {"right_padded_generation": 1}
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
