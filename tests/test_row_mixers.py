"""Hybrids' token mixers (gated delta rule, Mamba, short convolutions) on the packed row, one padded row at a time.

Qwen3.5's and Qwen3-Next's linear-attention layers, Jamba's Mamba layers and LFM2's convolutions carry a state along
the sequence. They ran on the padded batch (patchkit unpadded inside attention alone), so every layer but attention
worked on padding. Now the base model runs on the packed row of real tokens and each mixer runs each padded row's
stretch of it alone: the numbers of the padded batch at its real tokens, with no work on padding.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import transformers
from census import PACKED, packed_rows, tiny_config
from models import labels_for, padded_batch
from packaging.version import Version
from test_lm_head import assert_same
from test_lm_head import step as lm_step

import patchkit
from patchkit.forward import documents
from patchkit.forward.documents import restart_lengths
from patchkit.hooks.forwards import mixer_rows
from patchkit.hooks.forwards.mixer_rows import row_groups

pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                                reason="the table's hybrids: transformers 5.24 (the census's)")

MIXERS = {"qwen3_5_text": "Qwen3_5GatedDeltaNet", "qwen3_next": "Qwen3NextGatedDeltaNet", "jamba": "JambaMambaMixer",
          "lfm2": "Lfm2ShortConv", "zaya": "ZayaCCAProjection", "qwen4_exp_text": "Qwen4ExpTextGatedDeltaNet"}


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


def test_the_groups_cost_least_and_cut_only_where_the_length_changes():
    """Against every cut of the sorted rows (dynamic programming over each row, the first version): the same least
    cost; rows of one length stay in one group."""
    import random

    def least(lengths: tuple[int, ...], call: int) -> int:
        ordered = sorted(lengths, reverse=True)
        best = [0] * (len(ordered) + 1)
        for j in range(1, len(ordered) + 1):
            best[j] = min(best[i] + call + (j - i) * ordered[i] for i in range(j))
        return best[-1]

    rng = random.Random(1)
    for _ in range(200):
        lengths = tuple(rng.choice((rng.randint(1, 9), rng.randint(1, 300))) for _ in range(rng.randint(1, 30)))
        call = rng.choice((0, 5, 128, 10**9))
        groups = row_groups(lengths, call)
        assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
        assert sum(call + len(g) * max(lengths[r] for r in g) for g in groups) == least(lengths, call)
        assert all(len({id(g) for g in groups if any(lengths[r] == n for r in g)}) == 1 for n in set(lengths))


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


def test_a_mixer_forward_wrapped_without_its_signature_runs_grouped_with_unpatched_numbers(monkeypatch):
    """A mixer whose forward a wrapper hides behind (self, *args, **kwargs), no `functools.wraps` (accelerate's hook
    wrapper in transformers' development tree, 2026-07): the rows still arrive, in the wrapper's **kwargs, and the
    padded step keeps the unpatched numbers (before, StopIteration on every padded forward)."""
    modeling = sys.modules[transformers.Qwen3_5ForCausalLM.__module__]
    mixer = getattr(modeling, MIXERS["qwen3_5_text"])
    inner = mixer.forward

    def hidden(self, *args, **kwargs):  # what the development tree's wrapper shows of the forward
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(mixer, "forward", hidden)
    model = hybrid("qwen3_5_text")
    ids, mask = padded_batch("left")
    want = step(model, ids, mask)
    with patchkit.apply_patch("qwen3_5_text", backend="sdpa") as handle:
        got = step(model, ids, mask)
        assert handle.calls > 0 and not handle.stepped_aside
    assert_same(got, want, mask)


@pytest.mark.parametrize("model_type", list(MIXERS))
def test_a_padding_hole_keeps_the_padded_layout_in_the_mixers(model_type):
    """A row with padding between real tokens: transformers' mixers run over the hole's columns (zeroed inputs, but a
    state that decays across them, a convolution window that spans them), which the packed row would drop (2e-2 off
    in Qwen3-Next's logits after the hole, 5e-4 in Jamba's gradients, silently). Such a batch keeps the padded layout
    in its layers, attention still patched, with the unpatched numbers."""
    model = hybrid(model_type)
    ids, mask = padded_batch("right")
    mask[0, 4:6] = 0  # a hole in the longest row: real, real, real, real, pad, pad, real ...
    ids = ids * mask
    labels = labels_for(ids, mask)
    labels[0, 6] = -100  # no label predicted from the hole's padding
    want = lm_step(model, input_ids=ids, attention_mask=mask, labels=labels)
    seen = mixers_see(model, model_type)
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:
        got = lm_step(model, input_ids=ids, attention_mask=mask, labels=labels)
        assert handle.calls > 0 and not handle.stepped_aside, handle.report()
    assert seen and {shape[:2] for shape in seen} == {tuple(ids.shape)}  # the padded batch, as transformers runs it
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


def test_documents_restart_where_a_position_is_not_the_previous_plus_one():
    """transformers' rule for packed rows with no mask (`find_packed_sequence_indices`), which its attention masks
    follow: a row's start, a restart, and a gap each begin a document."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 0, 1, 3, 4]])
    assert restart_lengths(positions, 2) == [3, 3, 2, 2, 2]
    assert restart_lengths(positions[:1], 3) == [3, 3] * 3  # (1, N) position_ids shared by every row


def documents_step(model: torch.nn.Module, weights: torch.Tensor, **inputs) -> tuple:
    """The packed rows' logits and gradients of `(logits * weights).sum()`, a loss of each token's logits alone."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits.view(weights.shape)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def each_document_alone(model: torch.nn.Module, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
    """The same, each document its own forward: what packed documents mean (flash_attention_2's contract)."""
    model.zero_grad(set_to_none=True)
    rows, total = [], 0
    for row, lengths in zip(range(len(ids)), PACKED):
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        logits = [model(input_ids=ids[row, a:b][None], use_cache=False).logits[0] for a, b in zip(starts, starts[1:])]
        rows.append(torch.cat(logits))
        total = total + (rows[-1] * weights[row]).sum()
    total.backward()
    return torch.stack(rows).detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_documents(model: torch.nn.Module, how: str) -> tuple[torch.Tensor, dict]:
    """Two rows of documents as padding-free collators hand them: `position_ids` restarting (TRL's), or one row with
    `cu_seq_lens_*` and `seq_idx` beside them (transformers' DataCollatorWithFlattening, TRL's padding-free)."""
    ids, positions = packed_rows()
    ids = ids.clamp(max=model.config.vocab_size - 1)
    if how == "position_ids":
        return ids, {"input_ids": ids, "position_ids": positions}
    lengths = torch.tensor([n for row in PACKED for n in row])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None].to(torch.int32)
    return ids, {"input_ids": ids.reshape(1, -1), "position_ids": positions.reshape(1, -1), "cu_seq_lens_q": cu,
                 "cu_seq_lens_k": cu, "max_length_q": int(lengths.max()), "max_length_k": int(lengths.max()),
                 "seq_idx": seq_idx}


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("model_type", list(MIXERS))
def test_packed_documents_run_each_document_from_a_zero_state(model_type, how):
    """A caller's packed documents (padding-free training): each document's mixers start from a zero state, as
    attention keeps the documents apart: the numbers of each document run alone, gradients included. Unpatched,
    transformers' torch path carries one state across the row's documents (or refuses `cu_seq_lens` without its CUDA
    kernels)."""
    model = hybrid(model_type)
    ids, inputs = packed_documents(model, how)
    weights = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    want = each_document_alone(model, ids, weights)
    if how == "position_ids":  # the test can fail: unpatched, the documents' states leak into each other
        with torch.no_grad():
            joined = model(**inputs, use_cache=False).logits
        assert (joined - want[0]).abs().max() > 1e-5
    seen = mixers_see(model, model_type)
    with patchkit.apply_patch(model_type, backend="sdpa") as handle:
        got = documents_step(model, weights, **inputs)
        assert handle.calls > 0 and not handle.stepped_aside
    assert seen and set(seen) == {(*inputs["input_ids"].shape, model.config.hidden_size)}
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)


def test_packed_documents_keep_apart_in_a_recomputed_checkpoint():
    model = hybrid("qwen3_5_text")
    ids, inputs = packed_documents(model, "position_ids")
    weights = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    want = each_document_alone(model, ids, weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with patchkit.apply_patch("qwen3_5_text", backend="sdpa"):
        got = documents_step(model, weights, **inputs)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)


def test_packed_documents_with_a_cache_run_the_mixers_as_transformers_and_say_so(monkeypatch):
    """A cache holds one recurrent state per row: with one, the mixers run across the row's documents as
    transformers runs them, and one warning names the fix; attention still keeps the documents apart, which is said
    once a process on its own (transformers' sdpa finds no documents behind a cache)."""
    monkeypatch.setattr(documents, "_said", set())  # said once a process: an earlier test may have said it
    model = hybrid("qwen3_5_text").eval()
    ids, inputs = packed_documents(model, "position_ids")
    with torch.no_grad():
        want = model(**inputs, use_cache=False).logits  # transformers: attention apart, the mixers' state across
    with patchkit.apply_patch("qwen3_5_text", backend="sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(**inputs, use_cache=True).logits
    said = [str(w.message) for w in caught if "patchkit" in str(w.message)]
    assert len(said) == 2 and "use_cache=False" in said[0] and "one document into the next" in said[0], said
    assert "are kept apart here" in said[1] and "KV cache" in said[1], said
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_packed_documents_run_apart_under_the_registered_name_alone():
    """`attn_implementation="patchkit"` with no patch applied (TRL's `model_init_kwargs`): adopted where it is
    built, the model's mixers run packed documents apart too (a deepcopy's as well), and a padded batch keeps
    transformers' mask there."""
    import patchkit.api  # noqa: F401 - registers the name and watches where models get it

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_5_text"),
                                                          attn_implementation="patchkit").train()
    mixers = [m for m in model.modules() if type(m).__name__ == MIXERS["qwen3_5_text"]]
    assert mixers and all("forward" in vars(m) for m in mixers)
    ids, inputs = packed_documents(model, "position_ids")
    weights = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(1))
    got = documents_step(model, weights, **inputs)
    copied = copy.deepcopy(model)  # a copy's parts are adopted too, its mixers' wrappers carried along
    assert torch.allclose(documents_step(copied, weights, **inputs)[0], got[0], atol=1e-6)
    model.set_attn_implementation("eager")
    want = each_document_alone(model, ids, weights)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)
    padded_ids, mask = padded_batch("left")
    want_padded = step(model, padded_ids, mask)
    model.set_attn_implementation("patchkit")
    assert_same(step(model, padded_ids, mask), want_padded, mask)


@pytest.mark.parametrize("model_type, field", [("jamba", "mamba_proj_bias"), ("lfm2", "conv_bias")])
def test_a_mixer_input_projection_with_a_bias_steps_aside_under_left_padding_alone(model_type, field):
    """A hybrid whose mixer input projection has a bias (Bamba's, Falcon-H1's, Jamba's `mamba_proj_bias`, LFM2's
    `conv_bias`, ...): transformers zeroes the padding's hidden states before it, so the bias reaches a left-padded
    row's first real tokens through the short convolution, where a varlen row has none (silently off before). Left
    padding steps aside (`padding_into_mixer`) with unpatched numbers; right padding still runs patched."""
    torch.manual_seed(0)
    config = tiny_config(model_type)
    setattr(config, field, True)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():  # a trained checkpoint's biases are not zero
        for name, p in model.named_parameters():
            if name.endswith("in_proj.bias"):
                p.uniform_(-1, 1)
    for side, aside in (("left", {"padding_into_mixer": 1}), ("right", {})):
        ids, mask = padded_batch(side)
        want = step(model, ids, mask)
        with patchkit.apply_patch(model_type, backend="sdpa") as handle, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = step(model, ids, mask)
            assert dict(handle.stepped_aside) == aside, side
        assert_same(got, want, mask)
