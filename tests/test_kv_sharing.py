"""KV-shared layers (Gemma 3n's, Gemma 4's): transformers slices their queries to `logits_to_keep` on the mask."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from census import tiny_lm
from models import padded_batch
from packaging.version import Version

import patchkit
from patchkit.errors import PatchInputError
from patchkit.forward.masks import VarlenMask

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.0"), reason="transformers 5.x")
SHARING = {"gemma3n_text": "Gemma3nForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}


@pytest.fixture(params=list(SHARING))
def shared_model(request) -> torch.nn.Module:
    """The census's tiny Gemma 3n or Gemma 4: its last (full-attention) layer reuses layer 0's keys and values."""
    if not hasattr(transformers, SHARING[request.param]):
        pytest.skip(f"no {SHARING[request.param]} in transformers {transformers.__version__}")
    model, why = tiny_lm(request.param)
    assert model is not None, why
    assert model.config.num_kv_shared_layers == 1
    return model.eval()


def greedy(model, ids, mask, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


def test_kv_shared_layers_generate_patched_with_unpatched_tokens_and_scores(shared_model):
    """The prefill (logits_to_keep=1: transformers slices the shared layers' queries) runs packed, every query
    computed and the base model's last one kept; the decode steps on the cache; strict: nothing stepped aside. Before,
    the slice indexed patchkit's mask and every forward raised PatchStateError."""
    model = shared_model
    ids, mask = padded_batch("left", batch=3, seq=14)
    want, want_logits = greedy(model, ids, mask)
    # Gemma 4's base model slices to the caller's logits_to_keep; Gemma 3n's takes no such argument (its LM slices)
    keep = {"logits_to_keep": 2} if "logits_to_keep" in inspect.signature(model.model.forward).parameters else {}
    base_want = model.model(input_ids=ids, attention_mask=mask, **keep).last_hidden_state[:, -2:]
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got, got_logits = greedy(model, ids, mask)
        static, _ = greedy(model, ids, mask, cache_implementation="static")  # its shared layers' DummyLayers
        base_got = model.model(input_ids=ids, attention_mask=mask, **keep).last_hidden_state
        assert handle.calls and not handle.stepped_aside
    assert torch.equal(got, want) and torch.equal(static, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)
    assert base_got.shape[1] == (2 if keep else ids.shape[1])  # the slice the caller asked for
    base_got = base_got[:, -2:]
    assert base_got.shape == base_want.shape == (3, 2, model.config.hidden_size)
    real = mask[:, -2:].bool()  # the last row's first kept position is padding: zeros there under patchkit
    torch.testing.assert_close(base_got[real], base_want[real], atol=2e-5, rtol=1e-4)


def test_kv_shared_layers_under_the_registered_name_alone_slice_the_mask(shared_model):
    """attn_implementation="patchkit" alone runs the padded batch: the mask's last queries are placed behind the
    others as if those were cached, with eager's tokens and per-step logits (strict)."""
    model = shared_model
    named = copy.deepcopy(model)
    named.set_attn_implementation(patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("left", batch=3, seq=14)
    want, want_logits = greedy(model, ids, mask)
    patchkit.register_attention(backend="sdpa", strict=True)
    try:
        got, got_logits = greedy(named, ids, mask)
    finally:
        patchkit.register_attention(backend="auto", strict=False)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)


def test_an_index_the_mask_cannot_place_names_it():
    """Every query, or the last ones, is a slice of the mask, and so is the head axis dropped (a sparse attention's
    indexer reads `mask[:, 0, :, :]`); any other index names the index and the model's own code, not a patch
    reverted mid-forward."""
    mask = VarlenMask(torch.ones(2, 6, dtype=torch.long))
    assert mask[:, :, slice(0, None), :] is mask
    assert mask[:, :, slice(-2, None), :].mask is mask.mask
    assert mask[:, 0, :, :] is mask
    for index in (0, (slice(None), slice(None), slice(0, 3), slice(None)), (slice(None), 1, slice(None), slice(None))):
        with pytest.raises(PatchInputError, match="the model's own code indexed patchkit's key-padding mask"):
            mask[index]
    static = VarlenMask(torch.ones(2, 6, dtype=torch.long), past_len=4, fixed_cache=True)
    with pytest.raises(PatchInputError, match="logits_to_keep=0"):
        static[:, :, slice(-1, None), :]


def test_kv_shared_layers_without_padding_and_on_packed_documents_keep_the_unpatched_numbers(shared_model):
    """An unpadded prompt (no packed row: the padded path) generates the unpatched tokens; packed documents
    (position_ids restarting, no cache) with logits_to_keep=1 give the last document's own last logits (computed
    for every query: a documents mask cannot be cut by query). Before: PatchStateError in both."""
    model = shared_model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    want, want_logits = greedy(model, ids, torch.ones_like(ids))
    packed, positions = ids[:1], torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    alone = model(input_ids=packed[:, 5:], logits_to_keep=1, use_cache=False).logits
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True) as handle:
        got, got_logits = greedy(model, ids, torch.ones_like(ids))
        documents = model(input_ids=packed, position_ids=positions, logits_to_keep=1, use_cache=False).logits
        assert not handle.stepped_aside
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-5, rtol=1e-4)
    assert documents.shape == alone.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(documents, alone, atol=2e-5, rtol=1e-4)
