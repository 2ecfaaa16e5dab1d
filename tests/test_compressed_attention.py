"""DeepSeek-V4's compressed attention (`hooks/attention/compressed_kv.py`): each layer's keys are its sliding window's
and compressed entries (CSA: pooled pairs of tokens, its indexer keeping 3 a query; HCA: pooled fours), each query
seeing the entries its compressor's bias leaves it. Served on right-padded batches (unpadded at the model), packed
documents (each pooled alone) and unpadded generation, equal to transformers' eager attention; a left-padded batch
steps aside (its compressors pool padding).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import transformers
from census import tiny_lm
from models import assert_same, labels_for, step
from packaging.version import Version

import patchkit
from patchkit.errors import PatchkitError, PatchStateError
from patchkit.hooks.attention import compressed_kv, varlen
from patchkit.hooks.name import attention_interface

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.25")
                                or not hasattr(transformers, "DeepseekV4ForCausalLM"),
                                reason="DeepSeek-V4: transformers 5.25")
LAYERS = 3  # sliding, CSA, HCA


def model() -> torch.nn.Module:
    built, why = tiny_lm("deepseek_v4")
    assert built is not None, why
    return built


def right_padded(vocab: int, lengths: tuple[int, ...] = (24, 17, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lengths` real tokens, padded on the right (a training batch), with ids from 3 up."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=g)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def entry_biases(lm: torch.nn.Module) -> list[torch.Tensor]:
    """The bias each compressor makes in a forward, kept as a record (a forward hook on each compressor)."""
    biases: list[torch.Tensor] = []
    for layer in lm.model.layers:
        if layer.self_attn.compressor is not None:
            layer.self_attn.compressor.register_forward_hook(
                patchkit.shape_free(lambda _m, _a, out: biases.append(out[1])))
    return biases


def test_a_right_padded_step_runs_patched_with_each_querys_entries():
    """Logits and every gradient equal eager's; the CSA indexer kept 3 of up to 12 entries a query and the HCA layer
    hid the windows a query had not finished, and the compressors' forwards left nothing behind."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    biases = entry_biases(lm)
    tokens = []
    lm.model.layers[0].mlp.register_forward_hook(patchkit.shape_free(lambda _m, args, _o: tokens.append(
        args[0].shape[:-1].numel())))
    want = step(lm, ids, mask)
    csa, hca = biases[0], biases[1]
    assert ((csa == 0).sum(-1) <= 3).all() and (csa == 0).sum(-1).max() == 3 and csa.shape[-1] == 12
    assert (hca[:, :, :3] == float("-inf")).all() and (hca[:, :, 3, 0] == 0).all() and (hca[:, :, -1] == 0).all()
    with patchkit.apply_patch("deepseek_v4", backend="sdpa") as handle:
        got = step(lm, ids, mask)
    assert handle.calls == LAYERS and not handle.stepped_aside, handle.report()
    assert tokens[-1] == int(mask.sum()) < tokens[0]  # unpadded at the model: its experts see real tokens alone
    assert_same(got, want, mask)
    assert not any(compressed_kv.ENTRIES in vars(m) for m in lm.modules())


def test_the_same_step_without_the_bias_would_differ(monkeypatch):
    """The test above can fail: with every entry seen by every query (the bias transformers' layer drops with a mask
    that is not a 4D tensor), the patched logits differ from eager's."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    want = step(lm, ids, mask)
    split = compressed_kv.split_entries

    def unbiased(*args):
        key, value, entries = split(*args)
        return key, value, entries if entries is None else entries._replace(bias=None)

    monkeypatch.setattr(varlen, "split_entries", unbiased)
    with patchkit.apply_patch(model=lm, backend="sdpa"):
        got = step(lm, ids, mask)
    real = mask.bool()
    assert (got[0][real] - want[0][real]).abs().max() > 1e-3


def packed_step(lm: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """`models.step` of one packed row as TRL's padding-free collator hands it: position_ids, no mask, no cache (TRL's
    gradient checkpointing turns it off; with one, transformers' own mask would join the documents), each document's
    first token unlabelled (no label crosses into it)."""
    lm.zero_grad(set_to_none=True)
    out = lm(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100), use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_documents_run_patched_each_as_it_runs_alone(checkpointing):
    """Documents of 9, 6 and 11 tokens in one row (position_ids restarting, no mask, no cache), as TRL's padding-free
    collator packs them: each document's window and entries are its own (its compressors pool each document in a row
    of its own), its logits and gradients those of the documents run alone, a padded batch of them. transformers'
    own run of the row pools entries across the documents (which patchkit does only where a cache keeps one state a
    row: below). Under gradient checkpointing the recompute runs each compressor again before its attention."""
    lm = model()
    lengths = (9, 6, 11)
    ids = torch.randint(3, lm.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(rows)
    for row, doc in enumerate(ids.split(lengths, dim=1)):
        rows[row, :doc.shape[1]], mask[row, :doc.shape[1]] = doc[0], 1
    alone = step(lm, rows, mask, use_cache=False)
    joined = packed_step(lm, ids, positions)
    with patchkit.apply_patch(model=lm, backend="sdpa") as handle:
        got = packed_step(lm, ids, positions)
    assert handle.calls == LAYERS * (2 if checkpointing else 1) and not handle.stepped_aside, handle.report()
    torch.testing.assert_close(got[0][0], alone[0][mask.bool()], atol=2e-5, rtol=1e-4)
    for name in alone[1]:
        torch.testing.assert_close(got[1][name], alone[1][name], atol=2e-5, rtol=1e-3, msg=name)
    assert (joined[0] - got[0]).abs().max() > 1e-3  # transformers' run of the row is not that


@pytest.mark.parametrize("way", ["patch", "name"])
def test_packed_documents_under_a_mask_of_ones_without_a_cache_step_aside_exactly(way):
    """A row whose position_ids restart but whose mask of ones joins its documents, with no cache: transformers pools
    the entries across the documents, each rotated from its own start; patchkit's compressors would pool each
    document alone. The forward steps aside as `joined_documents`, equal to transformers' (before, it was refused);
    with a cache the compressors pool by column in both, and it runs patched; strict=True refuses."""
    lm = model()
    ids = torch.randint(3, lm.config.vocab_size, (1, 15), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(9), torch.arange(6)])[None]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions)
    with torch.no_grad():
        want = {cache: lm(**inputs, use_cache=cache).logits for cache in (False, True)}
    if way == "name":
        attention_interface.register(backend="auto")
        attention_interface.register(backend="sdpa")
        lm.set_attn_implementation("patchkit")
        state = attention_interface.route_state()
    handle = patchkit.apply_patch(model=lm, backend="sdpa") if way == "patch" else contextlib.nullcontext(state)
    try:
        with torch.no_grad(), handle as handle:
            with pytest.warns(RuntimeWarning, match=r"\(joined_documents\)"):
                got = lm(**inputs, use_cache=False).logits
            assert handle.stepped_aside == {"joined_documents": 1 if way == "patch" else LAYERS}
            cached = lm(**inputs, use_cache=True).logits
            assert set(handle.stepped_aside) == {"joined_documents"}
    finally:
        attention_interface.register(backend="auto")
    torch.testing.assert_close(got, want[False], atol=0, rtol=0)
    torch.testing.assert_close(cached, want[True], atol=2e-5, rtol=1e-4)
    strict = model()
    with patchkit.apply_patch(model=strict, backend="sdpa", strict=True):
        with pytest.raises(PatchkitError, match="no attention_mask to keep the documents apart"):
            strict(**inputs, use_cache=False)


def test_packed_documents_behind_a_cache_run_as_transformers_runs_them():
    """An eval forward of the packed row with a cache (transformers' default): the compressors keep one state a row,
    so they pool it across its documents as transformers' do (its sliding window stays within each document, as
    transformers' own run without a cache keeps it); patchkit says so once."""
    lm = model().eval()
    lengths = (9, 6, 11)
    ids = torch.randint(3, lm.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        want = lm(input_ids=ids, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch(model=lm, backend="sdpa") as handle, pytest.warns(RuntimeWarning, match="across"):
            got = lm(input_ids=ids, position_ids=positions, use_cache=True).logits
    assert handle.calls == LAYERS and not handle.stepped_aside, handle.report()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_left_padded_batch_steps_aside_by_name_and_strict_refuses():
    """Left padding: transformers' compressors pool the padding columns' hidden states (what attention computed
    there) into entries the real queries see; varlen kernels compute nothing at padding. That forward runs on
    transformers' attention, named; strict refuses."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    ids, mask = ids.flip(1), mask.flip(1)
    want = step(lm, ids, mask)
    with patchkit.apply_patch(model=lm, backend="sdpa") as handle:
        got = step(lm, ids, mask)
    assert handle.stepped_aside == {"padding_into_mixer": 1}
    assert_same(got, want, mask)
    with patchkit.apply_patch(model=lm, backend="sdpa", strict=True):
        with pytest.raises(PatchkitError, match="DeepSeek-V4's compressed entries"):
            step(lm, ids, mask)


def test_generation_of_unpadded_prompts_runs_patched_step_by_step():
    """Greedy generation of two prompts of one length (no padding): the prefill and every decode step run patched on
    transformers' cache (its window's keys and the entries its compressors add as the tokens reach a window's end),
    the same tokens as eager, 12 new tokens (past three HCA windows)."""
    lm = model().eval()
    ids = torch.randint(3, lm.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        with patchkit.apply_patch(model=lm, backend="sdpa") as handle:
            got = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    assert handle.calls == LAYERS * 12 and not handle.stepped_aside, handle.report()
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), atol=1e-5, rtol=1e-4)


def test_the_registered_name_alone_serves_it():
    """`attn_implementation="patchkit"` with no patch applied: the compressors' bias reaches the attention all the
    same (the name wraps them on the model it serves)."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    want = step(lm, ids, mask)
    attention_interface.register(backend="sdpa")
    lm.set_attn_implementation(attention_interface.ATTENTION_NAME)
    try:
        got = step(lm, ids, mask)
    finally:
        lm.set_attn_implementation("eager")
        attention_interface.register(backend="auto")
    assert_same(got, want, mask)


def test_entries_whose_bias_never_reached_the_attention_are_refused(monkeypatch):
    """A compressor that no wrapper of patchkit's ran (its forward set back by someone after the patch): the layer's
    attention refuses the entries by name rather than let every query see every one."""
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as v4

    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    with patchkit.apply_patch("deepseek_v4", backend="sdpa"):
        for name in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor"):
            cls = getattr(v4, name)
            monkeypatch.setattr(cls, "forward", cls.forward.__wrapped__)
        with pytest.raises(PatchStateError, match="without the bias its compressor"):
            lm(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))


@pytest.mark.parametrize("backend", ["flash_attn", "flash_attn_4", "torch_varlen"])
def test_on_the_kernel_backends_its_compressed_layers_run_exactly(backend, monkeypatch):
    """In bf16 on each kernel backend (its recording double): the sliding layer's window reaches a kernel where the
    kernel takes its sinks (flash-attn 4), else runs on the exact path, said; the compressed layers (one softmax over
    the window's keys, the entries and the sinks) always run on the exact path. A training step and unpadded greedy
    generation give the numbers of patchkit's exact backend."""
    from test_kernel_census import DOUBLES, GATED

    lm = model().to(torch.bfloat16)
    ids, mask = right_padded(lm.config.vocab_size)
    prompts = ids[:2, :7]

    def run(**patch) -> tuple:
        with warnings.catch_warnings(record=True) as said, patchkit.apply_patch(model=lm, **patch) as handle:
            warnings.simplefilter("always")
            got = step(lm, ids, mask)
            with torch.no_grad():
                tokens = lm.eval().generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                            max_new_tokens=5, do_sample=False, pad_token_id=0)
            lm.train()
        assert not handle.stepped_aside, handle.report()
        return got, tokens, [str(w.message) for w in said]

    want, want_tokens, _ = run(backend="sdpa")
    fake = DOUBLES[backend](monkeypatch)
    got, tokens, said = run()
    assert fake.calls or any(why in text for why in GATED for text in said)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(got[0][mask.bool()], want[0][mask.bool()], atol=0, rtol=0)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=name)


def test_rows_whose_positions_run_past_their_real_tokens_step_aside_by_name():
    """A right-padded batch with position_ids of the caller's that start past 0 (a continuation's offsets): a real
    query's position then reaches past its row's real tokens, and transformers' compressors let it see entries pooled
    from the padding columns after them (what attention computed there). That forward runs on transformers' attention,
    named, with its numbers; positions from 0 run patched (the tests above)."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    positions = (torch.arange(ids.shape[1]) + torch.tensor([[5], [2], [9]])) * mask
    want = step(lm, ids, mask, position_ids=positions)
    with patchkit.apply_patch(model=lm, backend="sdpa") as handle:
        got = step(lm, ids, mask, position_ids=positions)
        served = step(lm, ids, mask, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    assert handle.stepped_aside == {"padding_into_mixer": 1} and handle.calls == LAYERS, handle.report()
    assert_same(got, want, mask)
    assert_same(served, step(lm, ids, mask), mask)


@pytest.mark.parametrize("part", ["lm", "model"])
def test_rows_whose_positions_run_past_their_real_tokens_step_aside_under_the_name_alone(part):
    """The same offsets under `attn_implementation="patchkit"` with no patch, through the causal LM and through its
    base model called directly: the name's wrappers read the forward's position_ids (the mask interface is never
    handed them) and step aside with transformers' numbers; positions from 0 stay served."""
    lm = model()
    ids, mask = right_padded(lm.config.vocab_size)
    positions = (torch.arange(ids.shape[1]) + torch.tensor([[5], [2], [9]])) * mask

    def run(position_ids: torch.Tensor) -> torch.Tensor:
        if part == "lm":
            return step(lm, ids, mask, position_ids=position_ids)[0]
        return lm.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state

    want, plain = run(positions), run(torch.arange(ids.shape[1]).expand_as(ids))
    attention_interface.register(backend="sdpa")
    lm.set_attn_implementation(attention_interface.ATTENTION_NAME)
    state = attention_interface.route_state()
    aside, calls = state.stepped_aside.get("padding_into_mixer", 0), state.calls
    try:
        got = run(positions)
        assert state.stepped_aside.get("padding_into_mixer", 0) - aside == LAYERS, state.stepped_aside
        served = run(torch.arange(ids.shape[1]).expand_as(ids))
        assert state.calls - calls == LAYERS
    finally:
        lm.set_attn_implementation("eager")
        attention_interface.register(backend="auto")
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(served[real], plain[real], atol=2e-5, rtol=1e-4)


def test_a_cache_kept_over_right_padding_steps_aside_so_a_loop_continuing_it_is_exact():
    """A hand-written loop: an eval prefill of right-padded rows that keeps its cache, then each row's next token
    appended after its padding. That token sees every entry in the cache, the ones pooled from the padding too; had
    the prefill run patched, they would hold what varlen kernels compute there (nothing), not transformers' values.
    The prefill steps aside (`cache_over_padding`); the same forward with labels, or use_cache=False, runs patched."""
    lm = model().eval()
    ids, mask = right_padded(lm.config.vocab_size, (16, 11, 6))
    last = mask.sum(-1) - 1

    def loop() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
            token = out.logits[torch.arange(len(ids)), last].argmax(-1, keepdim=True)
            step = lm(input_ids=token, attention_mask=torch.cat([mask, torch.ones_like(token)], -1),
                      position_ids=last[:, None] + 1, past_key_values=out.past_key_values, use_cache=True)
        return out.logits, step.logits

    want = loop()
    with patchkit.apply_patch(model=lm, backend="sdpa") as handle:
        got = loop()
        assert handle.stepped_aside.get("cache_over_padding") == 1, handle.report()
        with torch.no_grad():
            lm(input_ids=ids, attention_mask=mask, use_cache=False)
            lm(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    assert handle.calls == 2 * LAYERS and handle.stepped_aside.get("cache_over_padding") == 1, handle.report()
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-4)


def test_a_checkpointed_right_padded_step_says_nothing_of_packed_documents():
    """The rows of a right-padded batch unpadded at the model are laid out as documents for the compressors, in the
    forward and again in the checkpoint's recompute (where no forward's plan is in reach): no caller's documents, so
    no word of them."""
    lm = model()
    lm.gradient_checkpointing_enable()
    ids, mask = right_padded(lm.config.vocab_size)
    with warnings.catch_warnings(record=True) as said, patchkit.apply_patch(model=lm, backend="sdpa") as handle:
        warnings.simplefilter("always")
        lm(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()
    assert handle.calls == 2 * LAYERS and not handle.stepped_aside, handle.report()
    assert not [w for w in said if "kept apart" in str(w.message)]
