"""Sparse attention (DeepSeek-V3.2's DSA, GLM-5's, A.X K2's, Hunyuan V4's, Mistral Large 4's, dots3's; Kolibri-1.1's):
served where no query sees more keys than its indexer keeps, stepped aside by name where one does; equal to
transformers' eager attention either way.

The indexer keeps each query's `index_topk` best-scored keys; a query that sees `index_topk` keys or fewer keeps all of
them. Here `index_topk` is small (8 or 10) so that one tiny batch has rows on both sides of it, and generation crosses
it: its early steps run patched, its later ones on transformers' attention, from the same cache.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from census import tiny_config
from models import assert_same, labels_for, padded_batch, step
from packaging.version import Version
from patchkit.patches import table

import patchkit
from patchkit.errors import PatchkitError
from patchkit.hooks.name import attention_interface

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.23"),
                                reason="the sparse-attention families are served on transformers 5.23+")
FAMILIES = sorted(set(table.SPARSE_INDEXERS) - set(table.WRAPPED_TEXT_MODELS))  # with a causal LM of their own


@pytest.fixture(autouse=True)
def _families_here(request):
    """A family this transformers does not have yet (Hunyuan V4 arrives after 5.16) is skipped by name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    wanted = request.node.callspec.params.get("model_type") if hasattr(request.node, "callspec") else None
    for model_type in [wanted] if wanted else ["deepseek_v32", "glm_moe_dsa"]:
        if model_type not in CONFIG_MAPPING:
            pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def tiny(model_type: str, topk: int, seed: int = 0, **fields) -> torch.nn.Module:
    """The census's tiny model of `model_type` with an indexer that keeps `topk` keys per query (and `fields` set)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    if hasattr(config, "index_topk"):  # not Qwen4-Exp's, whose budget is its own field
        config.index_topk = topk
    if model_type == "kolibri1_1":  # `topk` keys in all: one sink, one local, the rest its top-k, from a pool of 4
        fields = dict(index_topk=topk - 2, index_num_sink_tokens=1, index_num_local_tokens=1, index_compression=2,
                      index_pool_size=4, **fields)
    if model_type == "qwen4_exp_text":  # `topk` blocks of one key (of two: `test_qwen4_exp_pools_blocks_...`)
        fields = dict(indexer_budget=topk, indexer_compress_ratio=1) | fields
    if fields:
        config = type(config)(**{**config.to_dict(), **fields})
    if getattr(config, "indexer_types", None):  # GLM-5's and Hunyuan V4's later layers reuse an earlier one's top-k
        config.indexer_types = ["full", "shared"]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().train()


def scored(model: torch.nn.Module) -> list[int]:
    """A counter of the indexers' selections: DSA's score computations (their per-head weights are read for each
    one), Kolibri-1.1's key selections (it scores only the rows past its budget, and walks every row to find them)."""
    calls: list[int] = []
    for module in model.modules():
        if type(module).__name__ not in table.SPARSE_INDEXERS.values():
            continue
        if hasattr(module, "weights_proj"):
            module.weights_proj.register_forward_hook(patchkit.shape_free(lambda *_: calls.append(1)))
        elif hasattr(module, "select_tokens"):  # Kolibri-1.1's
            select = module.select_tokens
            module.select_tokens = lambda *a, _select=select, **k: calls.append(1) or _select(*a, **k)
        else:  # Qwen4-Exp's returns its selection's mask (a served forward's: patchkit's mask)
            module.register_forward_hook(
                patchkit.shape_free(lambda _m, _a, out: calls.append(1) if isinstance(out, torch.Tensor) else None))
    return calls


def within_topk() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 10, 9 and 3 real tokens in 16 columns (padded on either side): with index_topk=10 transformers' indexer
    picks 10 of each query's 16 columns, and every real key a query sees is among them."""
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    mask[0] = 0
    mask[0, :10] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_batch_within_topk_runs_patched_and_scores_nothing(model_type):
    model = tiny(model_type, topk=10)
    ids, mask = within_topk()
    calls = scored(model)
    want = step(model, ids, mask)
    assert calls, "the unpatched indexer scored no key"
    calls.clear()
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:
        got = step(model, ids, mask)
    assert handle.calls > 0 and not handle.stepped_aside
    assert not calls, "the indexer scored keys in a served forward"
    assert_same(got, want, mask)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_row_past_topk_steps_aside_by_name_and_strict_refuses(model_type):
    model = tiny(model_type, topk=8)
    ids, mask = within_topk()  # its first row sees 10 keys at its last token, more than 8
    want = step(model, ids, mask)
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:
        got = step(model, ids, mask)
    assert handle.stepped_aside == {"sparse_attention": 1}
    assert_same(got, want, mask)
    with patchkit.apply_patch(model_type, backend="sdpa", strict=True):
        with pytest.raises(PatchkitError, match="index_topk"):
            step(model, ids, mask)
    assert_same(step(model, ids, mask), want, mask)  # the refusal left the model as it was


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "kolibri1_1"])
def test_packed_documents_within_topk_run_patched_in_a_longer_row(model_type):
    """Packed documents of 7, 5 and 8 tokens (position_ids restarting, no mask): each within index_topk=8 though the
    row holds 20; equal to each document run alone unpatched."""
    model = tiny(model_type, topk=8).eval()
    lengths = [7, 5, 8]
    ids = torch.randint(3, model.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=doc, use_cache=False).logits
                           for doc in ids.split(lengths, dim=1)], dim=1)
        with patchkit.apply_patch(model_type, backend="sdpa") as handle:
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert handle.calls > 0 and not handle.stepped_aside
    torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-4)


def dots3(topk: int) -> torch.nn.Module:
    """dots3's text model as its checkpoint lays it out: DSA layers among sliding-window ones (window 4), the sliding
    ones with their own head count and sizes (`per_layer_config`, from its `swa_*` fields)."""
    from transformers import AutoModelForCausalLM

    fields = {k: v for k, v in tiny_config("dots3_note_text").to_dict().items()
              if k not in ("rope_parameters", "per_layer_config")}
    fields.update(index_topk=topk, num_hidden_layers=3, sliding_window=4, mlp_layer_types=["dense", "sparse", "sparse"],
                  layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
                  swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16, swa_kv_lora_rank=8,
                  swa_head_dim=12, swa_qk_nope_head_dim=8, swa_v_head_dim=8)
    config = type(tiny_config("dots3_note_text"))(**fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().train()
    assert [layer.self_attn.num_heads for layer in model.model.layers] == [4, 2, 4]
    return model


def test_dots3_with_its_sliding_layers_trains_and_generates_as_transformers():
    """Its base model builds its masks in lambdas (found there: before, the audio tower's was taken for its mask
    builder and nothing ran patched) and its indexers read `mask[:, 0]`. A padded step within index_topk=10 runs
    patched and scores nothing; generation past index_topk=4 runs its decode steps on the selected keys, its sliding
    layers on their window, with transformers' tokens and logits."""
    model = dots3(topk=10)
    ids, mask = within_topk()
    calls = scored(model)
    want = step(model, ids, mask)
    calls.clear()
    with patchkit.apply_patch("dots3_note_text", backend="sdpa") as handle:
        got = step(model, ids, mask)
    assert handle.calls == 3 and not handle.stepped_aside and not calls
    assert_same(got, want, mask)
    model = dots3(topk=4).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size)
    with torch.no_grad():
        want, want_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        with patchkit.apply_patch("dots3_note_text", backend="sdpa") as handle:
            got, got_logits = generate_scores(model, ids, mask, max_new_tokens=8)
    assert handle.stepped_aside == {"sparse_attention": 1} and handle.calls >= 7 * 3  # the prefill aside
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)


def test_qwen4_exp_pools_blocks_and_keeps_a_querys_last_incomplete_one():
    """Qwen4-Exp's QSA scores blocks of 2 pooled keys and keeps its budget of 8 keys in whole blocks, and the block
    of a query's last keys where it is incomplete: a query that sees 9 keys keeps all of them, so rows of 9 run
    patched, scoring nothing, and a row of 10 steps aside. Generation past a budget of 4 (5 keys) runs its decode
    steps on the blocks the indexer selects: transformers' tokens and logits, where a dense run's differ."""
    model = tiny("qwen4_exp_text", topk=8, indexer_budget=8, indexer_compress_ratio=2)
    ids, mask = within_topk()
    mask[0, 9] = 0  # rows of 9, 9 and 3 real tokens
    calls = scored(model)
    want = step(model, ids, mask)
    calls.clear()
    with patchkit.apply_patch("qwen4_exp_text", backend="sdpa") as handle:
        got = step(model, ids, mask)
        assert handle.calls > 0 and not handle.stepped_aside and not calls
        mask[0, 9] = 1
        step(model, ids, mask)
    assert handle.stepped_aside == {"sparse_attention": 1}
    assert_same(got, want, mask.index_put((torch.tensor(0), torch.tensor(9)), torch.tensor(0)))
    model = tiny("qwen4_exp_text", topk=4, indexer_budget=4, indexer_compress_ratio=2).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size)
    with torch.no_grad():
        want, want_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        with patchkit.apply_patch("qwen4_exp_text", backend="sdpa") as handle:
            got, got_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        _, dense_logits = generate_scores(tiny("qwen4_exp_text", topk=64).eval(), ids, mask, max_new_tokens=8)
    assert handle.stepped_aside == {"sparse_attention": 1} and handle.calls >= 7  # the prefill of 6 keys aside
    assert not torch.allclose(dense_logits, want_logits, atol=1e-3)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)


def generate_scores(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kw) -> tuple:
    """Greedy tokens and every step's logits."""
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


def left_padded_prompts(vocab: int, lengths: tuple[int, ...] = (6, 4, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(4))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, max(lengths) - n:] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generation_past_topk_runs_patched_on_the_keys_the_indexer_selects(model_type):
    """Left-padded prompts of 6, 4 and 2 tokens, 8 new tokens, index_topk=4: the prefill steps aside (its queries see
    up to 6 keys); every decode step runs patched, the indexer selecting 4 of each row's keys, which the attention
    gathers from the cache. The selection bites (a dense run differs), and the tokens and every step's logits are
    transformers' own."""
    model = tiny(model_type, topk=4).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size)
    calls = scored(model)
    with torch.no_grad():
        want, want_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        calls.clear()
        with patchkit.apply_patch(model_type, backend="sdpa") as handle:
            got, got_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        dense = tiny(model_type, topk=64).eval()
        _, dense_logits = generate_scores(dense, ids, mask, max_new_tokens=8)
    assert handle.stepped_aside == {"sparse_attention": 1}  # the prefill
    assert handle.calls >= 7 * handle.layers_patched > 0  # every decode step's layers
    assert calls, "no decode step ran the indexer's selection"
    assert not torch.allclose(dense_logits, want_logits, atol=1e-3)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generation_within_topk_scores_nothing_and_a_static_cache_past_it_steps_aside(model_type):
    """Prompts within index_topk=8 and 6 new tokens: patched throughout, the dynamic cache's steps past 8 keys on the
    selection. A static cache's steps past it step aside (its masks are transformers' own 4D ones): the same tokens."""
    model = tiny(model_type, topk=8).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, **kw)
        with patchkit.apply_patch(model_type, backend="sdpa") as handle:
            got = model.generate(input_ids=ids, attention_mask=mask, **kw)
        assert handle.calls > 0 and not handle.stepped_aside
        assert torch.equal(got, want)
        want = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **kw)
        with patchkit.apply_patch(model_type, backend="sdpa") as handle:
            got = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **kw)
    assert handle.stepped_aside.get("sparse_attention") == 3  # 9, 10 and 11 keys
    assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "kolibri1_1", "qwen4_exp_text"])
@pytest.mark.parametrize("topk, asides", [(10, False), (8, True)])
def test_the_registered_name_alone_serves_within_topk_and_steps_aside_past_it(topk, asides, model_type):
    """Past index_topk each call steps aside by that name: Kolibri-1.1's and Qwen4-Exp's layers overlay their
    selection on the mask as a new tensor, which lost its cause before (counted and warned as the caller's own 4D
    mask)."""
    model = tiny(model_type, topk=topk)
    ids, mask = within_topk()
    calls = scored(model)
    want = step(model, ids, mask)
    calls.clear()
    state = attention_interface.route_state()
    before, served = state.stepped_aside.get("sparse_attention", 0), state.calls
    custom = state.stepped_aside.get("custom_4d_mask", 0)
    model.set_attn_implementation("patchkit")
    try:
        got = step(model, ids, mask)
    finally:
        model.set_attn_implementation("eager")
    assert (state.stepped_aside.get("sparse_attention", 0) > before) == asides  # counted per layer call here
    assert state.stepped_aside.get("custom_4d_mask", 0) == custom
    assert (state.calls > served) != asides and bool(calls) == asides
    assert_same(got, want, mask)


def test_a_labelled_padded_batch_under_unpad_loss_equals_unpatched():
    """The loss alone (unpad="loss": the head fused with the loss on the labelled tokens) of a batch within topk."""
    model = tiny("deepseek_v32", topk=10)
    ids, mask = within_topk()
    labels = labels_for(ids, mask)
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    with patchkit.apply_patch("deepseek_v32", backend="sdpa", unpad="loss") as handle:
        got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert handle.calls > 0 and not handle.stepped_aside
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, asides", [(8, {}), (16, {"sparse_attention": 1})])
def test_fullgraph_compile_serves_rows_within_topk_in_the_graph_and_steps_aside_past_it(tokens, asides):
    """torch.compile(fullgraph=True): a graph cannot read a row's padding or documents, so its rows are counted by
    their columns; 8 within index_topk=10 run in the graph, 16 step aside by name. Equal to unpatched either way."""
    model = tiny("deepseek_v32", topk=10).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("deepseek_v32", backend="sdpa") as handle:
            got = torch.compile(model, fullgraph=True)(input_ids=ids, use_cache=False).logits
            compiled = handle.state.compiled
    torch._dynamo.reset()
    assert handle.stepped_aside == asides and compiled == (not asides)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_before_their_served_releases_they_are_refused_by_name(monkeypatch):
    """transformers before 5.23 laid out these layers otherwise (5.16's "deepseek_sparse_attention"): refused by
    name there, with the releases that serve them, not served unread."""
    from patchkit.errors import PatchTargetError
    from patchkit.hooks.install import registry

    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "5.16.1")  # the one loaded now
    monkeypatch.setattr(registry, "_TABLE_SPECS", {})
    with pytest.raises(PatchTargetError, match=r"sparse attention .* transformers>=5\.23"):
        table.spec("deepseek_v32")


@pytest.mark.parametrize("indexers", [["full", "full"], ["full", "shared"]])
def test_mistral_large_4_inside_its_multimodal_model_with_shared_keys(indexers):
    """Mistral Large 4's language model (no causal LM of its own: served inside MistralLarge4ForConditionalGeneration,
    `apply_patch(model=...)`), its second layer reading the first layer's latent keys (`kv_source_layers`: "store",
    then "reuse_but_indexer" with an indexer of its own, or "reuse" with the first one's top-k). A padded step within
    index_topk=10 runs patched; so does greedy generation across it, its later steps on the keys the indexer selects.
    Equal to unpatched."""
    from census import tiny_wrapper

    if "mistral_large4" not in importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING:
        pytest.skip("no Mistral Large 4 in this transformers")
    base, why = tiny_wrapper("mistral_large4")
    assert base is not None, why
    config = base.config
    text = config.get_text_config()
    text.kv_source_layers, text.indexer_types, text.no_rope_layers, text.index_topk = [0, 0], indexers, [1, 1], 10
    torch.manual_seed(0)
    model = type(base)._from_config(config, attn_implementation="eager").float().train()
    assert text.kv_sharing_modes[0] == "store" and text.kv_sharing_modes[1].startswith("reuse")
    ids, mask = within_topk()
    ids = ids.clamp(max=text.vocab_size - 1)
    want = step(model, ids, mask)
    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        got = step(model, ids, mask)
    assert handle.calls > 0 and not handle.stepped_aside
    assert_same(got, want, mask)
    prompts = torch.randint(3, text.vocab_size, (3, 8), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.zeros_like(prompts)
    for row, n in enumerate((8, 5, 2)):
        prompt_mask[row, 8 - n:] = 1
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.eval()
    with torch.no_grad():
        want_tokens = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kw)
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got_tokens = model.generate(input_ids=prompts, attention_mask=prompt_mask, **kw)
    assert handle.calls > 0 and not handle.stepped_aside
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "kolibri1_1", "qwen4_exp_text"])
def test_generation_past_topk_under_the_registered_name_alone(model_type):
    """attn_implementation="patchkit" alone (GLM-5, its second layer reusing the first one's top-k): transformers hands
    the attention function the indexer's top-k as `indices=`; decode steps gather those keys, the prefill past
    index_topk=4 runs transformers' attention with them merged into its mask. Kolibri-1.1's second sparse layer
    selects from its first one's pool, handed on through patchkit's mask. Tokens and logits as unpatched."""
    model = tiny(model_type, topk=4).eval()
    ids, mask = left_padded_prompts(model.config.vocab_size)
    state = attention_interface.route_state()
    with torch.no_grad():
        want, want_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        calls = state.calls
        model.set_attn_implementation("patchkit")
        try:
            got, got_logits = generate_scores(model, ids, mask, max_new_tokens=8)
        finally:
            model.set_attn_implementation("eager")
    layers = sum(type(m).__name__.endswith("Attention") and hasattr(m, "o_proj") for m in model.modules())
    assert state.calls - calls >= 7 * layers > 0  # every decode step's attention layers
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "kolibri1_1"])
@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn_4", "torch_varlen"])
def test_generation_past_topk_on_the_kernel_backends(backend, model_type, monkeypatch):
    """DeepSeek-V3.2 and Kolibri-1.1 in half precision on each kernel backend (its recording double, `fakes.py`): the
    decode steps' gathered keys reach the kernel, and the tokens are those of patchkit's exact backend."""
    from test_kernel_census import DOUBLES

    heads = dict(qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=8, v_head_dim=16)  # the kernels' multiples of 8
    # Kolibri-1.1 in fp16: its tiny bf16 logits tie at bf16's resolution (top-two margins of 0.008), where eager and
    # sdpa already pick other tokens
    dtype = torch.bfloat16 if model_type == "deepseek_v32" else torch.float16
    model = tiny(model_type, topk=4, **(heads if model_type == "deepseek_v32" else {})).eval().to(dtype)
    ids, mask = left_padded_prompts(model.config.vocab_size, (4, 3, 2))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        with patchkit.apply_patch(model_type, backend="sdpa"):
            want = model.generate(input_ids=ids, attention_mask=mask, **kw)
        fake = DOUBLES[backend](monkeypatch)
        with patchkit.apply_patch(model_type) as handle:
            got = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert handle.backend in (backend, "flash_attn") and not handle.stepped_aside and fake.calls
    assert torch.equal(got, want)
