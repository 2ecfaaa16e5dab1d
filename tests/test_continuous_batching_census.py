"""Continuous batching over every family patchkit serves: each tiny causal LM's `generate_batch()` patched, every
step through patchkit's layers, the unpatched tokens and log-probabilities; a family whose continuous batching does
not run unpatched (transformers' own limits: recurrent or convolution layers, caches it does not page) is skipped
with what transformers said."""

from __future__ import annotations

import pytest
from census import causal_lm_types, tiny_lm
from families import set_attention
from test_continuous_batching import assert_patched, assert_same_requests, batch_run, cb_config

import patchkit
from patchkit.hooks.install.registry import served_model_types

pytestmark = pytest.mark.skipif(cb_config is None,
                                reason="continuous batching with its own config: transformers 5.x")


def served_causal_lms() -> list[str]:
    served = served_model_types()
    return [t for t in causal_lm_types() if t in served]


@pytest.mark.parametrize("model_type", served_causal_lms())
def test_continuous_batching_of_every_served_family_runs_patched_as_unpatched(model_type: str) -> None:
    model, why = tiny_lm(model_type)
    if model is None:
        pytest.skip(why)
    model.eval()
    try:
        set_attention(model, "sdpa")
    except ValueError:  # no sdpa (GPT-OSS): eager, which continuous batching runs as "paged|eager"
        pass
    try:
        want = batch_run(model)
    except Exception as unpatched:  # noqa: BLE001 - whatever transformers raises, unpatched
        pytest.skip(f"continuous batching does not run {model_type} unpatched: {str(unpatched)[:160]}")
    with patchkit.apply_patch(backend="sdpa") as group:
        got = batch_run(model)
        aside, calls = dict(group.stepped_aside), group.calls
    assert_same_requests(got, want, atol=1e-4)
    assert_patched(aside, calls)
