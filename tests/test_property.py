"""Property: every input is served exactly (equal to unpatched eager on real tokens) or refused with PatchkitError.

Hypothesis draws one `Case`: a batch (right, left, mixed padding, holes inside a row, all-padding rows, no padding,
or packed rows of several documents, batch 1 to 3), a position_ids convention (None, the generation convention
`mask.cumsum(-1) - 1` with padding filled by 1, arange with padding positions kept; packed rows restart at 0, their
padding holding 0, 1 or continued positions, optionally with cu_seq_lens_q/k), a cache (none, use_cache left to the
model, a DynamicCache passed in or made by the model and handed on, a StaticCache whose 2D mask covers past + q_len
columns or every max_cache_len slot; prefill, then chunks and decode steps), train or eval mode (gradient
checkpointing in training), MHA, GQA or MQA, input_ids or inputs_embeds, the mask's dtype, and the route into
patchkit (class patch with unpad "model" or "attention", instance patch, the registered attn_implementation).

The reference is the unpatched eager model with the same weights: the same call in one forward (chunks and decode
steps must add up to the single pass), and for packed rows each document run alone (unpatched transformers may
let packed documents attend across each other; that is its bug, not the reference). In training mode the loss
(labels exclude padding and positions predicted from padding or from another document) and every parameter's
gradient must match too.

A `patchkit.PatchkitError` is accepted only where `refusable` says the input cannot be served; any other refusal,
any other exception, and any mismatch fail. Profiles (tests/conftest.py): 200 derandomized examples per property
by default (CI-reproducible), 1000 random ones with --runslow. The cases are drawn in tests/property_cases.py and
checked in tests/property_check.py; tests/test_property_regressions.py pins the bugs the properties found first.
"""

from __future__ import annotations

from property_cases import SINGLE, cases, given
from property_check import check, one_thread, sdpa_route  # noqa: F401 (fixtures)


@given(case=cases(SINGLE))
def test_single_forward_is_served_exactly_or_refused(case):
    """No cache kept (use_cache=False) or use_cache left to the model: logits, and in training loss and grads."""
    check(case)


@given(case=cases(("dynamic", "implicit")))
def test_dynamic_cache_prefill_and_decode_are_served_exactly_or_refused(case):
    """A DynamicCache (passed in, or made by the model and handed on): prefill, chunks and decode steps whose logits
    add up to the single pass."""
    check(case)


@given(case=cases(("static_short",)))
def test_static_cache_with_a_past_plus_q_len_mask_is_served_exactly_or_refused(case):
    """A StaticCache, its 2D mask over past + q_len columns (or no mask at all): prefill, chunks, decode steps."""
    check(case)


@given(case=cases(("static_full",)))
def test_static_cache_with_a_mask_over_every_slot_is_served_exactly_or_refused(case):
    """A StaticCache, its 2D mask over all max_cache_len slots (1 filled real, 0 padding and the unfilled tail)."""
    check(case)
