"""`patchkit.report()`, where every step-aside warning points: the process's active patches and what ran under the
registered name alone, for a user who holds no handle."""

from __future__ import annotations

import warnings

import pytest
from families import set_attention
from models import labels_for, needs_mask_interface, padded_batch, tiny_model

import patchkit
from patchkit.hooks.name import attention_interface


@pytest.fixture
def fresh_name_route(monkeypatch):
    """The registered name's state as in a new process: none until its first forward (restored after)."""
    monkeypatch.setattr(attention_interface, "_state", None)
    monkeypatch.setattr(attention_interface, "_function", None)


@needs_mask_interface
def test_report_counts_what_the_warning_counts_under_the_name_alone(fresh_name_route):
    """attn_implementation="patchkit" gives no handle: the warning's "counted in patchkit.report()" must lead to a
    report that holds that count, and the forwards served beside it."""
    assert "no patch is active" in patchkit.report()
    model = set_attention(tiny_model(kv_heads=2), patchkit.ATTENTION_NAME)
    ids, mask = padded_batch("left", batch=2, seq=14)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, attention_mask=mask, labels=ids)  # labels at padding: steps aside
    (said,) = [str(w.message) for w in caught if "labels_from_padding" in str(w.message)]
    assert "counted in patchkit.report()" in said
    model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))  # served
    text = patchkit.report()
    assert "attn_implementation='patchkit'" in text and "labels_from_padding" in text
    assert "attention layers through it: 2 (2 calls)" in text and "stepped aside to transformers' attention: 2" in text


def test_report_holds_every_active_patch(fresh_name_route):
    """apply_patch() of every family and an instance patch beside it: both reports, each with its counts."""
    model, other = tiny_model(), tiny_model(seed=1)
    ids, mask = padded_batch("right", batch=2, seq=14)
    with patchkit.apply_patch(backend="sdpa") as group, patchkit.apply_patch(model=other, backend="sdpa") as one:
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
        other(input_ids=ids, attention_mask=mask)
        text = patchkit.report()
        assert group.report() in text and one.report() in text
        assert "1 output_attentions" in text
    assert "no patch is active" in patchkit.report()
