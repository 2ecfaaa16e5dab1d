"""The bugs the property tests (tests/test_property.py) found, pinned as plain tests that name them.

They run under the property tests' fixtures (one torch thread, the registered name on the sdpa backend) and, like
them, are skipped without hypothesis.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from families import set_attention
from models import VOCAB, needs_mask_interface, static_cache, tiny_model
from property_cases import ATOL, RTOL
from property_check import one_thread, sdpa_route  # noqa: F401 (fixtures)

import patchkit
from patchkit.forward.masks import build_metadata

# The two bugs the properties found first, pinned as plain tests that name them.


def test_static_cache_decode_with_a_mask_over_every_slot_matches_eager():
    """Known bug (1): a StaticCache's 2D mask covers all max_cache_len slots (1 filled, 0 the unfilled tail).

    Decode steps must take their queries at the cache position, not from the mask's last q_len columns (the
    unfilled tail: the new token is taken for padding, wrong logits, no error). Found by
    test_static_cache_with_a_mask_over_every_slot_is_served_exactly_or_refused, shrunk to a one-token prefill
    into StaticCache(max_cache_len=2) with the mask [[1, 0]].
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 1, 1]])  # left padding, as generate() has it
    slots = 12
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            cache = static_cache(model, 2, slots)
            prefill = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache).logits
            steps = [
                model(input_ids=ids[:, t : t + 1], attention_mask=F.pad(mask[:, : t + 1], (0, slots - t - 1)),
                      past_key_values=cache).logits
                for t in (6, 7)
            ]
    real = mask.bool()
    torch.testing.assert_close(prefill[real[:, :6]], want[:, :6][real[:, :6]], atol=ATOL, rtol=RTOL)
    for t, got in zip((6, 7), steps):
        torch.testing.assert_close(got[:, 0], want[:, t], atol=ATOL, rtol=RTOL, msg=lambda m, t=t: f"decode {t}: {m}")


def test_a_hole_beside_generation_positions_is_one_document():
    """Known bug (3): mask [1,0,1,1,1,1] with the generation convention's positions [0,1,1,2,3,4] is one sequence.

    A document restarts where a real token's position does not increase over the previous *real* token's; the
    padding position beside it (filled with 1) must not count, or the row is split into [1] + [4] tokens and the
    second part stops seeing the first. Found by test_single_forward_is_served_exactly_or_refused, shrunk to the
    mask [[1, 0, 1]] with positions [[0, 1, 1]].
    """
    mask = torch.tensor([[1, 0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert positions.tolist() == [[0, 1, 1, 2, 3, 4]]
    assert build_metadata(mask, 1, 6, 6, torch.device("cpu"), positions).seqlens_q == [5]
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=ATOL, rtol=RTOL)


# Found by the properties beyond the two known bugs.


def test_static_cache_without_a_mask_matches_eager():
    """No attention_mask with a StaticCache: all max_cache_len slots reach the kernel as keys, bottom-right causal.

    The queries then sit at the end of the slots and attend to the unfilled (zero) ones: wrong logits, no error.
    Shrunk by test_static_cache_with_a_past_plus_q_len_mask_is_served_exactly_or_refused to one token into
    StaticCache(max_cache_len=2).
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"):
            cache = static_cache(model, 2, 8)
            got = torch.cat([model(input_ids=ids[:, :3], past_key_values=cache).logits]
                            + [model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits for t in (3, 4)], 1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@needs_mask_interface
@pytest.mark.parametrize("mask_len", ["past_plus_q_len", "every_slot"])
def test_registered_route_serves_a_static_cache(mask_len):
    """attn_implementation="patchkit" receives all max_cache_len slots from transformers' attention and never trims.

    A past + q_len mask is refused as if past columns had been prepended ("attention_mask has shape (1, 1) but ...
    2 keys"); a mask over every slot gives wrong logits like known bug (1).
    """
    model = tiny_model(seed=11, kv_heads=2, heads=4, hidden=32, layers=2)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 5, [0, 1, 1, 1, 1]])
    slots = 8
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        set_attention(model, patchkit.ATTENTION_NAME)
        cache = static_cache(model, 2, slots)
        got = []
        for start, stop in ((0, 3), (3, 4), (4, 5)):
            step_mask = mask[:, :stop] if mask_len == "past_plus_q_len" else F.pad(mask[:, :stop], (0, slots - stop))
            got.append(model(input_ids=ids[:, start:stop], attention_mask=step_mask, past_key_values=cache).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(got, 1)[real], want[real], atol=ATOL, rtol=RTOL)


# Found by running the properties on transformers 4.48.3 and 4.52.4 (the era sweep); fixed since.


@pytest.mark.parametrize("variant", ["no_mask", "output_attentions"])
def test_a_training_forward_asked_for_a_cache_keeps_it_and_the_next_step_is_exact(variant):
    """Every version, before the fix: in training mode, a prefill with use_cache=True, then one more token fed with
    the prefill's past_key_values, as unpatched transformers serves it (it keeps a DynamicCache in training).

    patchkit kept no KV cache in training even when asked, so the prefill handed back past_key_values=None. With no
    mask the next token then attended to itself alone (logits off by 0.19, no error); with output_attentions=True
    (stepped aside) the same on 4.48-5.0, and a RuntimeError inside transformers' eager attention on 5.23. An asked
    for cache is now kept (`_keep_no_cache_in_training`); a config's default use_cache still makes none.
    """
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    ids, mask = torch.tensor([[37, 24, 44]]), torch.tensor([[1, 1, 1]])
    kw = {"output_attentions": True} if variant == "output_attentions" else {}
    masks = (None, None) if variant == "no_mask" else (mask[:, :2], mask)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the step-aside warning, and 4.57's about output_attentions
            first = model(input_ids=ids[:, :2], attention_mask=masks[0], use_cache=True, **kw)
            assert first.past_key_values is not None
            second = model(input_ids=ids[:, 2:], attention_mask=masks[1], past_key_values=first.past_key_values,
                           use_cache=True, **kw)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), want, atol=ATOL, rtol=RTOL)


def test_a_4d_mask_under_gradient_checkpointing_keeps_its_documents():
    """Transformers 4.48.3 before the fix (4.52.4 and later passed): a caller's 4D block-diagonal mask (two
    documents of 2) with gradient checkpointing in training mode.

    patchkit turns the 4D mask into cu_seq_lens kwargs and drops the mask (`take_documents`), but 4.48's
    LlamaModel calls `_gradient_checkpointing_func(decoder_layer.__call__, ...)` without **flash_attn_kwargs: the
    attention got neither mask nor cu_seq_lens and the documents attended to each other (logits off by 0.23, no
    error). The documents now ride the mask object (`documents_metadata`), as a checkpoint's recompute does.
    """
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, doc = torch.tensor([[37, 24, 50, 8]]), torch.tensor([0, 0, 1, 1])
    allowed = torch.ones(4, 4).tril().bool() & (doc[:, None] == doc[None, :])
    four_d = torch.zeros(1, 1, 4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=four_d, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = model(input_ids=ids, attention_mask=four_d, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_restarting_positions_under_a_causal_4d_mask_and_checkpointing_stay_one_document():
    """The converse of the test above (transformers 4.48-4.51, before the fix): a plain causal 4D mask (one
    document) with position_ids restarting at 0, gradient checkpointing on. patchkit turned the mask into
    cu_seq_lens that 4.48's checkpointed layers never got, and the layers, given no mask, split the row at the
    restart: two documents where transformers serves one. The documents now ride the mask object."""
    model = tiny_model(seed=11, kv_heads=4, heads=4, hidden=32, layers=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, positions = torch.tensor([[37, 24, 50, 8]]), torch.tensor([[0, 1, 0, 1]])
    causal = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4).tril().bool(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=causal, position_ids=positions, use_cache=False).logits
        with patchkit.apply_patch("llama2", backend="sdpa"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            got = model(input_ids=ids, attention_mask=causal, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
