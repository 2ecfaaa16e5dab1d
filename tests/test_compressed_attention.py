"""DeepSeek-V4's compressed attention (`hooks/attention/compressed_kv.py`): each layer's keys are its sliding window's
and compressed entries (CSA: pooled pairs of tokens, its indexer keeping 3 a query; HCA: pooled fours), each query
seeing the entries its compressor's bias leaves it. Served on right-padded and packed batches and on unpadded
generation, equal to transformers' eager attention; a left-padded batch steps aside (its compressors pool padding).
"""

from __future__ import annotations

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
    want = step(lm, ids, mask)
    csa, hca = biases[0], biases[1]
    assert ((csa == 0).sum(-1) <= 3).all() and (csa == 0).sum(-1).max() == 3 and csa.shape[-1] == 12
    assert (hca[:, :, :3] == float("-inf")).all() and (hca[:, :, 3, 0] == 0).all() and (hca[:, :, -1] == 0).all()
    with patchkit.apply_patch("deepseek_v4", backend="sdpa") as handle:
        got = step(lm, ids, mask)
    assert handle.calls == LAYERS and not handle.stepped_aside, handle.report()
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
    gradient checkpointing turns it off; with one, transformers' own mask would join the documents)."""
    lm.zero_grad(set_to_none=True)
    out = lm(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_documents_run_patched_as_transformers_runs_them(checkpointing):
    """Documents of 9, 6 and 11 tokens in one row (position_ids restarting, no mask), as TRL's padding-free collator
    packs them: the window's keys stay within each document; the compressors pool the row by column and each query
    sees entries by its position, as in transformers' own run of the row (documents shorter than a window joined
    in an entry, which packing with DeepSeek-V4 gives unpatched too). Under gradient checkpointing the recompute runs
    each compressor again before its attention. patchkit says once that the documents' entries are pooled
    together."""
    lm = model()
    lengths = (9, 6, 11)
    ids = torch.randint(3, lm.config.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = packed_step(lm, ids, positions)
    with patchkit.apply_patch(model=lm, backend="sdpa") as handle, pytest.warns(RuntimeWarning, match="across its"):
        got = packed_step(lm, ids, positions)
    assert handle.calls == LAYERS * (2 if checkpointing else 1) and not handle.stepped_aside, handle.report()
    assert_same(got, want, torch.ones_like(ids))
    alone = torch.cat([lm(input_ids=doc, use_cache=False).logits for doc in ids.split(lengths, dim=1)], dim=1)
    assert (got[0] - alone.detach()).abs().max() > 1e-3  # later documents' queries saw the earlier ones' entries


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
