"""Packed rows (several documents per row, no attention_mask) never attend across documents and equal the documents
run alone; a 2D attention_mask is padding only, as in transformers, and its rows' documents attend to each other."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import transformers
from families import served_tiny, set_attention
from models import VOCAB, check_packed_rows, doc_ids, pack, separate_logits, tiny_model
from packaging.version import Version

import patchkit


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_rows_equal_documents_run_separately(use_cache, kv_heads):
    """Batch of 2 packed rows with padding positions; transformers 5.x makes a cache by default even here."""
    model, ids, pos, want = check_packed_rows(kv_heads, use_cache)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        no_mask = model(input_ids=ids[:1, :7], position_ids=pos[:1, :7], use_cache=use_cache).logits
    torch.testing.assert_close(no_mask[0, 4:7], want[1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_restarting_positions_under_a_2d_mask_attend_across_documents_as_in_transformers(attn):
    """LLaMA-Factory's plain packing: an all-ones (or padded) mask with restarting position_ids. transformers reads
    documents from position_ids only without a mask, so the documents see each other; patched, the same numbers."""
    model = set_attention(tiny_model(kv_heads=2, seed=7), attn)
    docs = doc_ids()
    rows = [[0, 1], [2, 3]]
    ids, pos, mask = pack(docs, rows)
    for m in (mask, torch.ones_like(mask)):
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=pos, attention_mask=m).logits
            with patchkit.apply_patch("llama2", backend="sdpa") as handle:
                got = model(input_ids=ids, position_ids=pos, attention_mask=m).logits
                assert handle.calls == 2 and not handle.stepped_aside
        torch.testing.assert_close(got[m.bool()], want[m.bool()], atol=2e-5, rtol=1e-4)


def test_unpatched_sdpa_leaks_across_documents_with_a_cache():
    """The pitfall patchkit fixes: transformers' own packing detection is skipped when a cache exists."""
    model = tiny_model(seed=7)
    docs = doc_ids()
    ids, pos, _ = pack(docs, [[0, 1]])
    want = separate_logits(model, docs)[1]
    with torch.no_grad():
        leaky = model(input_ids=ids, position_ids=pos, use_cache=True).logits[0, 4:]
        with patchkit.apply_patch("llama2", backend="sdpa"):
            ours = model(input_ids=ids, position_ids=pos, use_cache=True).logits[0, 4:]
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
    assert (leaky - want).abs().max() > 1e-3  # unpatched eager attends across the boundary


def test_cu_seq_lens_kwargs_define_documents():
    model = tiny_model(kv_heads=2, seed=8)
    docs = doc_ids(1)
    want = separate_logits(model, docs)
    ids = torch.cat(docs)[None]
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    # position_ids restart with the documents, as the kwargs say (test_cu_seq_lens_alone_define_documents_when_
    # positions_do_not_restart takes positions that do not)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
        logits = model(
            input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
            max_length_q=int(lengths.max()), max_length_k=int(lengths.max()), use_cache=False,
        ).logits[0]
    for got, exp in zip(torch.split(logits, lengths.tolist()), want):
        torch.testing.assert_close(got, exp, atol=2e-5, rtol=1e-4)


def test_data_collator_with_flattening_trains_like_separate_documents():
    collator_cls = pytest.importorskip("transformers").DataCollatorWithFlattening
    model = tiny_model(seed=9)
    docs = doc_ids(2)
    features = [{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs]
    batch = collator_cls(return_position_ids=True)(features)
    model.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for d in docs:  # per-document losses, weighted as the flattened loss weighs them (by target count)
        out = model(input_ids=d[None], labels=d[None])
        (out.loss * (len(d) - 1)).backward()
        loss_sum += out.loss.item() * (len(d) - 1)
    want_grad = model.lm_head.weight.grad.clone() / sum(len(d) - 1 for d in docs)
    model.zero_grad(set_to_none=True)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        out.loss.backward()
    assert out.loss.item() == pytest.approx(loss_sum / sum(len(d) - 1 for d in docs), rel=1e-5)
    torch.testing.assert_close(model.lm_head.weight.grad, want_grad, atol=1e-6, rtol=1e-4)


def test_packed_rows_without_padding_skip_the_gather_but_keep_the_documents():
    from patchkit.forward.masks import build_metadata

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    meta = build_metadata(None, 1, 9, 9, torch.device("cpu"), position_ids=pos)
    assert meta.packed and meta.indices_q is None and meta.indices_k is None
    assert meta.seqlens_q == [3, 2, 4] and meta.cu_seqlens_q.tolist() == [0, 3, 5, 9] and meta.max_seqlen_q == 4
    padded = build_metadata(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0, 0]]), 1, 9, 9, torch.device("cpu"), pos)
    assert padded.indices_q.tolist() == list(range(7)) and padded.seqlens_q == [7]  # a mask: padding only


@pytest.mark.parametrize("mask_kind", [None, "right"])
def test_positions_with_gaps_are_one_document_not_many(mask_kind):
    """Only a position that does not increase starts a document: 0, 3, 6, ... is one sequence, as in eager."""
    model = tiny_model(kv_heads=2, seed=7)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12).mul(3).expand_as(ids)
    mask = None if mask_kind is None else torch.tensor([[1] * 12, [1] * 8 + [0] * 4])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("positions", ["arange", None])
@pytest.mark.parametrize("train,use_cache", [(True, False), (False, True)])
def test_cu_seq_lens_alone_define_documents_when_positions_do_not_restart(train, use_cache, positions):
    """cu_seq_lens_q/k (DataCollatorWithFlattening's flash kwargs) split documents whose positions never restart."""
    collator_cls = pytest.importorskip("transformers").DataCollatorWithFlattening
    model = tiny_model(kv_heads=2, seed=8)
    docs = doc_ids(1)
    want = separate_logits(model, docs)
    try:
        collator = collator_cls(return_flash_attn_kwargs=True, return_position_ids=False)
    except TypeError:
        pytest.skip("DataCollatorWithFlattening has no return_flash_attn_kwargs in this transformers")
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    ids = batch["input_ids"]
    pos = torch.arange(ids.shape[1])[None] if positions == "arange" else None
    model.train(train)
    with torch.set_grad_enabled(train), patchkit.apply_patch("llama2", backend="sdpa") as handle:
        out = model(**batch, position_ids=pos, use_cache=use_cache)
        assert handle.calls == 2 and not handle.stepped_aside
    assert (out.past_key_values is not None and out.past_key_values.get_seq_length() == ids.shape[1]) == use_cache
    for got, exp in zip(torch.split(out.logits[0].detach(), [len(d) for d in docs]), want):
        torch.testing.assert_close(got, exp, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not hasattr(__import__("transformers"), "masking_utils"), reason="masks read documents: 4.53+")
@pytest.mark.parametrize("family", ["gpt_bigcode", "persimmon", "ctrl", "llama4_text", "llama"])
def test_packed_documents_stay_apart_behind_an_eval_forwards_own_cache(family):
    """An eval forward makes a cache (use_cache from the config), and transformers' masks then find no packed
    documents: they attend to each other. patchkit's attention kept them apart from the position_ids its layers are
    handed; GPT-BigCode's, Persimmon's, CTRL's and Llama 4's layers are handed none and joined them (logits
    0.01-0.34 off), until their masks found the documents behind the empty cache too."""
    from census import document_logits, packed_rows

    model = served_tiny(family)
    ids, positions = packed_rows()
    want = document_logits(model, ids)
    with torch.no_grad():
        plain = model(input_ids=ids, position_ids=positions, use_cache=True)
        apart = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model(input_ids=ids, position_ids=positions, use_cache=True)
            assert handle.calls and not handle.stepped_aside
    torch.testing.assert_close(got.logits, want, atol=3e-4, rtol=1e-3)  # each document alone (Llama 4's 1.6e-4)
    if family == "llama4_text" and Version(transformers.__version__) < Version("5.23"):
        # transformers joins Llama 4's packed documents with no cache too (its chunked mask reads no documents:
        # 0.21-0.24 off each document alone on 5.0.0, 5.10.4 and 5.20.2; 5.23.0 keeps them apart); patchkit keeps
        # them apart, as its packed rows do in every family
        assert (apart - want).abs().max() > 1e-2
    else:
        assert (plain.logits - apart).abs().max() > 1e-3  # unpatched joins them behind its cache (and not without)
        torch.testing.assert_close(got.logits, apart, atol=2e-5, rtol=1e-4)  # as transformers with no cache
    assert got.past_key_values.get_seq_length() == ids.shape[1]  # the cache is returned, filled


@pytest.mark.parametrize("family", ["gpt_bigcode", "llama"])
def test_positions_with_gaps_behind_a_cache_stay_one_document(family):
    """Behind a cache a position that does not increase starts a document, as patchkit's attention reads them:
    0, 3, 6, ... stays one sequence there, as transformers runs it behind its cache."""
    model = served_tiny(family)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12).mul(3).expand_as(ids)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=True).logits
        with patchkit.apply_patch(model=model, backend="sdpa"):
            got = model(input_ids=ids, position_ids=positions, use_cache=True).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_document_restarts_compare_real_tokens_only():
    """A restart is read between real tokens, padding skipped: [0, 1, 1, 2] under [1, 0, 1, 1] is one document (the
    padding's 1 is never compared), and [0, 1, 1, 0, 1] under [1, 1, 0, 1, 1] two (0 after 1)."""
    from patchkit.forward.documents import document_lengths

    for real, positions, want in (([[1, 0, 1, 1]], [[0, 1, 1, 2]], [3]), ([[1, 1, 0, 1, 1]], [[0, 1, 1, 0, 1]], [2, 2]),
                                  ([[1, 1, 1], [0, 1, 1]], [[0, 1, 0], [5, 0, 1]], [2, 1, 2])):
        real = torch.tensor(real, dtype=torch.bool)
        indices = torch.nonzero(real.reshape(-1)).flatten()
        assert document_lengths(real, indices, torch.tensor(positions)).tolist() == want


KEPT_APART = [("llama", "eval, the config's cache"), ("llama", "training"), ("gpt_oss", "eval, no cache"),
              ("qwen3_next", "training"), ("deepseek_v4", "eval, no cache")]


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.23"), reason="5.x makes a cache in training too")
@pytest.mark.parametrize("family, how, way", [(*case, "patch") for case in KEPT_APART]  # under the name alone a
                         + [(*case, "name") for case in KEPT_APART if case[0] != "qwen3_next"]  # training forward
                         + [("gpt_oss", "eval, no cache", "class")])  # keeps the cache the config asks for, in which
# a hybrid's mixers carry their state (`test_census`); a class patch's wrapper is not the forward whose masks are read
def test_documents_kept_apart_where_transformers_joins_them_are_said_once(family, how, way, monkeypatch):
    """Where transformers' own sdpa or eager run of the call lets the caller's packed documents see each other (a
    cache made in an eval forward or, 5.x, in training; GPT-OSS's masks, which are handed no position_ids; a hybrid's
    mixers, one state along the row), patchkit keeps them apart, as flash_attention_2 does: each document's numbers
    alone, said once by a warning that names how transformers joins them, by a patch and under
    attn_implementation="patchkit" alone. A call that transformers keeps apart too gives its numbers and says
    nothing."""
    from census import document_logits, packed_rows

    from patchkit.forward import documents
    from patchkit.hooks.decide.plan import masks_miss_positions
    from patchkit.hooks.name import attention_interface

    monkeypatch.setattr(documents, "_said", set())
    model = served_tiny(family).train(how == "training")
    ids, positions = packed_rows()
    if family == "deepseek_v4":  # its compressors pool a packed row by document where the batch is that one row
        ids, positions = ids[:1], positions[:1]
    alone = document_logits(model, ids)

    def run(**kw) -> torch.Tensor:
        if how.endswith("no cache"):
            kw.setdefault("use_cache", False)
        with torch.set_grad_enabled(how == "training"):
            return model(input_ids=ids, position_ids=positions, **kw).logits

    loaded = model.config._attn_implementation
    with contextlib.ExitStack() as stack:
        if way != "name":
            masks_miss_positions.cache_clear()  # read from the family's forward, not the class patch's wrapper
            target = {"model": model} if way == "patch" else {"name": family}
            handle = stack.enter_context(patchkit.apply_patch(**target, backend="sdpa"))
        else:
            attention_interface.register(backend="sdpa")
            state = attention_interface.route_state()
            before = dict(state.stepped_aside)
            set_attention(model, attention_interface.ATTENTION_NAME)
        if family == "llama":  # its masks find the documents where no cache is made: nothing to say
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                torch.testing.assert_close(run(use_cache=False), alone, atol=3e-4, rtol=1e-3)
        with pytest.warns(RuntimeWarning, match="packed documents .* are kept apart"):
            got = run()
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            run()
        if way != "name":
            assert handle.calls and not handle.stepped_aside
        else:
            assert state.stepped_aside == before
    set_attention(model, loaded)
    assert not [w for w in again if "kept apart" in str(w.message)]  # once
    torch.testing.assert_close(got, alone, atol=3e-4, rtol=1e-3)
    assert (run() - alone).abs().max() > 1e-3  # unpatched, transformers joins them


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.23"), reason="GPT-OSS's masks: 5.x")
def test_gpt_oss_packed_rows_behind_a_cache_name_its_masks_not_the_cache(monkeypatch):
    """GPT-OSS's masks are handed no position_ids, cache or none: the warning of an eval forward with the config's
    cache told the user that use_cache=False has transformers find the documents, which it does not."""
    from census import packed_rows

    from patchkit.forward import documents

    monkeypatch.setattr(documents, "_said", set())
    model = served_tiny("gpt_oss").eval()
    ids, positions = packed_rows()
    with patchkit.apply_patch(model=model, backend="sdpa"), torch.no_grad():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            model(input_ids=ids, position_ids=positions)
    said = [str(w.message) for w in said if "kept apart" in str(w.message)]
    assert len(said) == 1 and "not handed this family's position_ids" in said[0] and "use_cache" not in said[0], said


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.25"), reason="DeepSeek-V4: transformers 5.25")
def test_deepseek_v4s_packed_rows_in_a_batch_of_several_give_transformers_numbers_and_say_nothing():
    """Two packed rows of DeepSeek-V4 with no cache: transformers keeps their documents apart in attention, as patchkit
    does, and pools its compressed entries along each row, as patchkit does where the batch holds more than one row.
    Its numbers, and no word of documents kept apart."""
    from census import packed_rows

    model = served_tiny("deepseek_v4").eval()
    ids, positions = packed_rows()
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        with warnings.catch_warnings(record=True) as said, patchkit.apply_patch(model=model, backend="sdpa"):
            warnings.simplefilter("always")
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert not [w for w in said if "kept apart" in str(w.message)]


def _documents(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, cu


def test_cu_seq_lens_beside_a_mask_of_ones_are_kept_apart_and_said():
    """cu_seq_lens_* beside an attention mask of ones: transformers' flash_attention_2 drops a mask with no padding and
    keeps the documents apart, as patchkit does; its sdpa reads the mask alone and joins them, so it is said (it was
    silent). The numbers are each document's alone."""
    model = tiny_model()
    lengths = [5, 1, 4, 2]
    ids, positions, cu = _documents(lengths)
    want = torch.cat(separate_logits(model, ids[0].split(lengths)))[None]  # each document alone, on every era
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=torch.ones_like(ids), **flash).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    said = [str(w.message) for w in caught if "kept apart" in str(w.message)]
    assert said and "read the mask beside the cu_seq_lens" in said[0] and "no cu_seq_lens_* to join" in said[0]


def test_cu_seq_lens_beside_a_padded_mask_follow_the_mask_as_transformers():
    """cu_seq_lens_* beside a mask with padding: transformers' sdpa, eager and flash_attention_2 all read the mask
    alone. So does patchkit (it refused the call)."""
    model = tiny_model().train()
    ids, mask = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4)), torch.ones(2, 12).long()
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12)
    want = model(input_ids=ids, attention_mask=mask, labels=labels, **flash)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = model(input_ids=ids, attention_mask=mask, labels=labels, **flash)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-5, rtol=1e-5)


def test_position_ids_and_cu_seq_lens_naming_other_documents_are_refused():
    """position_ids restarting at other places than cu_seq_lens_q's documents: transformers' sdpa keeps the former
    apart, its flash_attention_2 the latter. patchkit followed the latter silently; it now refuses, naming both."""
    model = tiny_model()
    ids, positions, _ = _documents([5, 1, 4, 2])
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    with patchkit.apply_patch("llama2", backend="sdpa"), pytest.raises(patchkit.PatchkitError,
                                                                      match=r"\[5, 1, 4, 2\].*\[6, 6\]"):
        model(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
              max_length_k=6, use_cache=False)
