"""Hybrids' token mixers (gated delta rule, Mamba, short convolutions) on the packed row, one padded row at a time.

Qwen3.5's and Qwen3-Next's linear-attention layers, Jamba's Mamba layers and LFM2's convolutions carry a state along
the sequence. They ran on the padded batch (patchkit unpadded inside attention alone), so every layer but attention
worked on padding. Now the base model runs on the packed row of real tokens and each mixer runs each padded row's
stretch of it alone: the numbers of the padded batch at its real tokens, with no work on padding.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from census import tiny_config
from models import labels_for, padded_batch
from packaging.version import Version
from test_lm_head import assert_same
from test_lm_head import step as lm_step

import patchkit
from patchkit.hooks.forwards import mixer_rows
from patchkit.hooks.forwards.mixer_rows import row_groups

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                                reason="the table's hybrids: transformers 5.24 (the census's)")

MIXERS = {"qwen3_5_text": "Qwen3_5GatedDeltaNet", "qwen3_next": "Qwen3NextGatedDeltaNet", "jamba": "JambaMambaMixer",
          "lfm2": "Lfm2ShortConv"}


def hybrid(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type)).train()


def mixers_see(model: torch.nn.Module, model_type: str) -> list:
    """The hidden states' shapes each mixer is called with (a shape-free observer: it keeps the packed row)."""
    seen = []

    @patchkit.shape_free
    def spy(module, args, kwargs):
        seen.append(tuple((args[0] if args else kwargs["hidden_states"]).shape))

    for module in model.modules():
        if type(module).__name__ == MIXERS[model_type]:
            module.register_forward_pre_hook(spy, with_kwargs=True)
    return seen


def step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    return lm_step(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))


def test_rows_are_grouped_by_length_where_a_call_costs_more_than_their_padding():
    """A call's fixed cost against the padding a group computes: long rows of different lengths alone, many short
    ones in one call; no call at all costs nothing: every row alone; a call that costs everything: one group."""
    lengths = (900, 30, 480, 25, 31, 470, 28)
    assert sorted(map(sorted, row_groups(lengths, 128))) == [[0], [1, 3, 4, 6], [2, 5]]
    assert sorted(map(sorted, row_groups(lengths, 0))) == [[r] for r in range(7)]
    assert row_groups(lengths, 10**9) == [[0, 2, 5, 4, 1, 6, 3]]  # longest first


@pytest.mark.parametrize("call", [0, 128, 10**9], ids=["each row alone", "grouped", "one call"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model_type", list(MIXERS))
def test_a_padded_training_step_runs_the_mixers_on_real_tokens_with_unpatched_numbers(model_type, side, call,
                                                                                        monkeypatch):
    """Every grouping of the rows (each alone; by length; all in one right-padded call with its mask) gives the
    padded batch's numbers, left padding too: the mixers never saw the padding before a row's first token."""
    monkeypatch.setitem(mixer_rows.CALL_TOKENS, "cpu", call)
    model = hybrid(model_type)
    ids, mask = padded_batch(side)
    want = step(model, ids, mask)
    seen = mixers_see(model, model_type)
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:
        got = step(model, ids, mask)
        assert handle.calls > 0 and not handle.stepped_aside
    assert seen and set(seen) == {(1, int(mask.sum()), model.config.hidden_size)}  # the packed row, never padded
    assert_same(got, want, mask)


@pytest.mark.parametrize("call", [0, 128], ids=["each row alone", "grouped"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba"])
def test_a_recomputed_checkpoint_splits_the_rows_again(model_type, call, monkeypatch):
    """The rows travel as the mixer's mask argument: a checkpointed layer recomputed in backward, outside the
    forward's context, runs the same groups again (one state across rows would change every gradient)."""
    monkeypatch.setitem(mixer_rows.CALL_TOKENS, "cpu", call)
    model = hybrid(model_type)
    ids, mask = padded_batch("left")
    want = step(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with patchkit.apply_patch(model_type, backend="sdpa"):
        got = step(model, ids, mask)
    assert_same(got, want, mask)


def test_an_instance_patch_wraps_the_models_mixers_and_revert_restores_them():
    model = hybrid("qwen3_5_text")
    mixers = [m for m in model.modules() if type(m).__name__ == MIXERS["qwen3_5_text"]]
    ids, mask = padded_batch("right")
    want = step(model, ids, mask)
    handle = patchkit.apply_patch(model=model, backend="sdpa")
    assert all("forward" in vars(m) for m in mixers)
    got = step(model, ids, mask)
    handle.revert()
    assert not any("forward" in vars(m) for m in mixers)
    assert_same(got, want, mask)
    assert_same(step(model, ids, mask), want, mask)  # after revert: transformers' mask and mixers again


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba"])
def test_generation_keeps_each_rows_state_in_the_cache_as_unpatched(model_type):
    """generate()'s prefill fills the recurrent states of each row, which the packed row does not hold: it keeps
    the padded layout (attention patched), quietly, and the tokens are the unpatched ones."""
    model = hybrid(model_type).eval()
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(input_ids=ids, attention_mask=mask, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing stepped aside
        with patchkit.apply_patch(model_type, backend="sdpa") as handle:
            got = model.generate(input_ids=ids, attention_mask=mask, **kw)
            assert handle.calls > 0 and not handle.stepped_aside
    assert torch.equal(got, want)


def test_an_eval_forward_that_keeps_its_cache_equals_unpatched():
    """use_cache in eval, no cache given: the model makes one with each row's recurrent state; the forward keeps
    the padded layout, and the cache continues a decode step as unpatched."""
    model = hybrid("qwen3_5_text").eval()
    ids, mask = padded_batch("left", batch=3, seq=14)
    nxt = torch.full((3, 1), 7)
    longer = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)

    def run() -> tuple:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            after = model(input_ids=nxt, attention_mask=longer, past_key_values=out.past_key_values)
        return out.logits, after.logits

    want = run()
    with patchkit.apply_patch("qwen3_5_text", backend="sdpa"):
        got = run()
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-4)


def test_a_compiled_model_runs_the_mixers_grouped_between_its_graphs():
    """torch.compile of the patched model (aot_eager: the Trainer's compile minus inductor's minutes): the groups run
    eagerly between compiled frames (their lengths are never a guard), and a left- and a right-padded batch give the
    unpatched numbers."""
    model = hybrid("qwen3_5_text")
    batches = [padded_batch("left"), padded_batch("right", seed=2)]
    want = [step(model, ids, mask) for ids, mask in batches]
    with patchkit.apply_patch("qwen3_5_text", backend="sdpa"):
        compiled = torch.compile(model, backend="aot_eager")
        got = [step(compiled, ids, mask) for ids, mask in batches]
    torch._dynamo.reset()
    for g, w, (_, mask) in zip(got, want, batches):
        assert_same((g[0], g[1], {k.replace("_orig_mod.", ""): v for k, v in g[2].items()}), w, mask)
