"""Where the varlen path cannot serve a forward exactly, transformers' own attention runs it: the same numbers as
unpatched, one warning per cause naming it and the fix, a count in the report; strict mode refuses instead."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import transformers
from families import FAMILIES, any_model, set_attention, static_cache_served
from models import padded_batch

import patchkit
from patchkit import PatchInputError
from patchkit.forward.masks import VarlenMask
from patchkit.hooks.install.routing import routed


def patch(family: str, way: str, model: torch.nn.Module, **kw):
    return patchkit.apply_patch(family, backend="sdpa", **kw) if way == "class" else patchkit.apply_patch(
        model=model, backend="sdpa", **kw)


def aside_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if "ran on transformers' attention, exact" in str(w.message)]


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("where", ["call", "config"])
def test_output_attentions_steps_aside_with_the_weights(family, way, where):
    """From the call or from the config: the weights come back equal to unpatched, never an empty tuple."""
    model = any_model(family)
    ids, mask = padded_batch("mixed")
    kw = {"output_attentions": True} if where == "call" else {}
    if where == "config":
        model.config.output_attentions = True
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, **kw)
        handle = patch(family, way, model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(input_ids=ids, attention_mask=mask, **kw)
            model(input_ids=ids, attention_mask=mask, **kw)
    assert handle.stepped_aside == {"output_attentions": 2} and handle.calls == 0
    (message,) = aside_messages(caught)
    assert "output_attentions=True" in message and "leave output_attentions off" in message
    handle.revert()
    assert len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.logits, want.logits)


@pytest.mark.skipif(not hasattr(transformers, "masking_utils") or not hasattr(
    transformers.masking_utils, "find_packed_sequence_indices"), reason="masks read packed documents: 4.5x+")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_padding_free_batch_without_a_cache_steps_aside_where_transformers_keeps_documents_apart(family):
    """Packed documents (position_ids restarting, no mask) with output_attentions: with use_cache=False transformers'
    mask keeps them apart, so the forward steps aside with unpatched numbers (it was refused); with a cache made
    (use_cache on), transformers would join them, and the refusal names use_cache=False among the fixes."""
    model = any_model(family)
    ids = torch.randint(3, 90, (2, 14), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([list(range(5)) + list(range(9)), list(range(8)) + list(range(6))])
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, output_attentions=True, use_cache=False)
        with patchkit.apply_patch(family if family != "llama" else "llama2", backend="sdpa") as handle:
            with pytest.warns(RuntimeWarning, match="output_attentions"):
                got = model(input_ids=ids, position_ids=positions, output_attentions=True, use_cache=False)
            assert handle.stepped_aside == {"output_attentions": 1} and handle.calls == 0
            with pytest.raises(PatchInputError, match="batch of packed documents.*pass use_cache=False"):
                model(input_ids=ids, position_ids=positions, output_attentions=True, use_cache=True)
    assert want.attentions[0][0, :, 5:, :5].abs().max() == 0  # transformers kept the documents apart
    torch.testing.assert_close(got.logits, want.logits)
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_callers_4d_mask_steps_aside_exactly(family):
    """A custom pattern (here: each row also hides key 2 from every query after it)."""
    model = any_model(family)
    ids, mask = padded_batch("right")
    causal = torch.ones(24, 24).tril().bool()
    custom = causal[None, None] & mask.bool()[:, None, None, :]
    custom[..., 3:, 2] = False
    additive = torch.zeros(custom.shape).masked_fill(~custom, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=additive).logits
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=additive).logits
            assert handle.stepped_aside == {"custom_4d_mask": 1}
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real])
    with patchkit.apply_patch(family, backend="sdpa", strict=True) as handle:  # strict: refused by its name
        with pytest.raises(PatchInputError, match=r"strict=True.*4D attention mask.*pass the 2D \[batch, seq\]"):
            model(input_ids=ids, attention_mask=additive)
        assert handle.calls == 0 and not handle.stepped_aside


def test_strict_refuses_output_attentions_naming_the_cause():
    model = any_model("mistral")
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("mistral", backend="sdpa", strict=True):
        with pytest.raises(PatchInputError, match="strict=True.*output_attentions=True.*leave output_attentions off"):
            model(input_ids=ids, attention_mask=mask, output_attentions=True)


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_static_cache_generation_of_every_family_runs_patched_and_equals_unpatched(family):
    """generate() hands the model its precomputed 4D masks (a dict per layer type for mixed families). Where they are
    exactly the 2D mask over the cache's keys, they are read back and the forward runs patched: from transformers
    4.57 for windowed families too (their StaticSlidingWindowLayers keep the window's last keys in order; the window
    bites here, 14 + 8 tokens against 5), from 4.56 for the rest. Before that every forward steps aside."""
    model = any_model(family, "sdpa")
    if False in (getattr(model, "_supports_static_cache", True), getattr(model, "_can_compile_fullgraph", True)):
        # transformers' own refusal (Mixtral before 4.56: the first attribute until 4.53, the second in 4.54-4.55)
        pytest.skip(f"{type(model).__name__} takes no static cache in transformers {transformers.__version__}")
    ids, mask = padded_batch("left", batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static",
              return_dict_in_generate=True, output_scores=True)
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch(backend="sdpa") as group:
        got = model.generate(input_ids=ids, **kw)
    if static_cache_served(family):
        assert group.calls > 0 and not group.stepped_aside
    else:  # every forward: the prefill and 7 decode steps
        assert group.calls == 0 and group.stepped_aside == {"custom_4d_mask": 8}, group.stepped_aside
    assert torch.equal(got.sequences, want.sequences)
    for step_got, step_want in zip(got.scores, want.scores):
        torch.testing.assert_close(step_got, step_want, atol=2e-5, rtol=1e-4)


def test_a_boolean_4d_mask_through_the_registered_name_steps_aside_exactly():
    """attn_implementation="patchkit" has no attention of the model's own: the family's eager attention serves a
    caller's 4D mask, sdpa's boolean format converted to eager's additive one."""
    model = any_model("qwen2", "sdpa")  # the implementation whose format a boolean mask is
    ids, mask = padded_batch("right")
    allowed = torch.ones(24, 24).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=allowed).logits
        patchkit.register_attention(backend="sdpa")
        try:
            named = set_attention(copy.deepcopy(model), patchkit.ATTENTION_NAME)
            got = named(input_ids=ids, attention_mask=allowed).logits
        finally:
            patchkit.register_attention(backend="auto")
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("pattern", ["causal_and_padding", "block_diagonal"])
def test_a_boolean_4d_mask_gives_what_the_loaded_attention_gives(attn, pattern):
    """transformers' eager attention adds the mask to its scores: a boolean one (True +1, False 0) masks nothing
    there. Patched, an eager model steps aside with the mask as given (same numbers, the cause named); an sdpa
    model, which reads a boolean mask as a mask, stays patched."""
    model = any_model("llama", attn)
    ids, mask = padded_batch("right", batch=2, seq=14)
    if pattern == "causal_and_padding":
        allowed = torch.ones(14, 14).tril().bool()[None, None] & mask.bool()[:, None, None, :]
    else:
        allowed = torch.block_diag(torch.ones(7, 7).tril(), torch.ones(7, 7).tril()).bool()[None, None].expand(
            2, 1, 14, 14)
        mask = torch.ones_like(mask)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = model(input_ids=ids, attention_mask=allowed).logits
        with patchkit.apply_patch(backend="sdpa") as group:
            got = model(input_ids=ids, attention_mask=allowed).logits
            aside, calls = group.stepped_aside, group.calls
    real = mask.bool()
    if attn == "eager":
        assert aside == {"bool_mask_on_eager": 1} and calls == 0
        (said,) = aside_messages(caught)
        assert "boolean 4D mask on eager attention" in said and "additive float 4D mask" in said
        torch.testing.assert_close(got, want)
    else:
        assert not aside and calls == 2
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


def neat_packing_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """LLaMA-Factory's prepare_4d_attention_mask: document ids (0 = padding) -> an additive (B, 1, S, S) mask that
    lets each token see the earlier tokens of its own document only."""
    seq = doc_ids.shape[-1]
    same = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, None, :] != 0)
    allowed = same & torch.ones(seq, seq).tril().bool()
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_a_4d_mask_of_ones_and_zeros_steps_aside_as_transformers_adds_it(dtype):
    """A (B, 1, S, S) mask of 1 (attend) and 0: transformers adds it to the scores, so it masks nothing. patchkit
    read it as additive (0: attend), found each token blind to itself and served one-token documents: 0.28 off in
    logits, silently, strict too. Only 0 and masked (-1e4 and below) entries are read as a mask now."""
    model = any_model("llama")
    ids, mask = padded_batch("right")
    causal = torch.ones(24, 24).tril().bool()
    ones = (causal[None, None] & mask.bool()[:, None, None, :] | torch.eye(24, dtype=torch.bool)).to(dtype)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=ones).logits
        with patchkit.apply_patch("llama", backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=ones).logits
            assert handle.stepped_aside == {"custom_4d_mask": 1}
    torch.testing.assert_close(got, want)


def test_one_4d_mask_for_every_row_runs_as_transformers_broadcasts_it():
    """A (1, 1, S, S) causal mask over a batch of four: it was read as one row's documents and refused with a
    misleading cause (cu_seq_lens_q, PEFT's prompt tuning)."""
    model = any_model("llama", "sdpa")
    ids, _ = padded_batch("right")
    causal = torch.ones(24, 24).tril().bool()[None, None]
    additive = torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    for one in (causal, additive):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=one).logits
            with patchkit.apply_patch("llama", backend="sdpa") as handle:
                got = model(input_ids=ids, attention_mask=one).logits
                assert handle.calls == 2 and not handle.stepped_aside
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_block_diagonal_causal_4d_mask_runs_patched_as_packed_documents(family):
    """neat_packing without flash-attn: the varlen path serves it (documents as cu_seq_lens), the same loss and
    gradients as transformers' attention on the 4D mask, and nothing steps aside."""
    model = any_model(family, "sdpa").train()
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0], [1, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]])
    ids = torch.randint(3, 90, doc_ids.shape, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 0, 1, 2, 0, 0, 0]])
    labels = ids.masked_fill(doc_ids == 0, -100)
    batch = dict(input_ids=ids, attention_mask=neat_packing_mask(doc_ids), position_ids=positions, labels=labels)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run()
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got = run()
        assert handle.calls == 2 and not handle.stepped_aside
    real = doc_ids != 0
    torch.testing.assert_close(got[0][real], want[0][real], atol=3e-5, rtol=1e-4)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=3e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("longest", [5, 8], ids=["documents_fit_the_window", "documents_outrun_the_window"])
def test_neat_packing_under_the_trainer_on_a_windowed_family_equals_unpatched(longest, tmp_path):
    """The HF Trainer with gradient checkpointing on Mistral (window 5), LLaMA-Factory's neat_packing collator (a 4D
    block-diagonal mask). transformers applies no window over a 4D mask: documents longer than the window step
    aside (window_under_4d_mask), those that fit run patched; the per-step losses equal unpatched either way."""
    import transformers as tf

    lengths = [longest, 3, 2] if longest > 5 else [5, 3, 2]
    doc_ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(lengths)] + [torch.zeros(2, dtype=torch.long)])
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(2, dtype=torch.long)])
    gen = torch.Generator().manual_seed(5)
    rows = [dict(input_ids=torch.randint(3, 90, doc_ids.shape, generator=gen)) for _ in range(4)]

    def collate(batch: list) -> dict:
        ids = torch.stack([r["input_ids"] for r in batch])
        docs = doc_ids.expand(len(batch), -1)
        return dict(input_ids=ids, attention_mask=neat_packing_mask(docs), labels=ids.masked_fill(docs == 0, -100),
                    position_ids=positions.expand(len(batch), -1))

    def losses() -> list:
        model = any_model("mistral", "sdpa").train()
        args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                    learning_rate=1e-3, logging_steps=1, gradient_checkpointing=True, use_cpu=True,
                                    report_to=[], disable_tqdm=True, save_strategy="no", seed=0)
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    want = losses()
    with patchkit.apply_patch("mistral", backend="sdpa") as handle, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = losses()
        aside, calls = dict(handle.stepped_aside), handle.calls
    assert len(got) == len(want) == 2 and all(abs(g - w) < 1e-5 for g, w in zip(got, want)), (got, want)
    if longest > 5:  # every forward and every checkpoint recompute on transformers' attention, with one warning
        assert set(aside) == {"window_under_4d_mask"} and calls == 0
        assert len([m for m in aside_messages(caught) if "applies no sliding window" in m]) == 1
    else:
        assert aside == {} and calls > 0


def _create_causal_mask(model: torch.nn.Module, mask: torch.Tensor, **extra) -> object:
    """transformers' create_causal_mask for `model`'s config, with the argument names of the installed version."""
    masking_utils = pytest.importorskip("transformers.masking_utils", reason="masks by interface: transformers 4.53+")
    params = inspect.signature(masking_utils.create_causal_mask).parameters
    embeds = torch.zeros(*mask.shape, model.config.hidden_size)
    kw = {"config": model.config, "attention_mask": mask, "past_key_values": None,
          "input_embeds" if "input_embeds" in params else "inputs_embeds": embeds}
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(mask.shape[1])
    return masking_utils.create_causal_mask(**kw, **extra)


@pytest.mark.parametrize("extra", ["or_mask_function", "and_mask_function"])
def test_a_mask_pattern_beyond_causal_gets_transformers_mask_and_attention(extra):
    """A pattern a key-padding mask cannot express (here: keys 0-3 seen by every query, as an image prefix, or
    key 2 hidden) in a routed forward: transformers' own mask and attention, exact, counted by its cause."""
    model = any_model("llama")
    ids, mask = padded_batch("right")
    pattern = {"or_mask_function": lambda b, h, q, k: k < 4, "and_mask_function": lambda b, h, q, k: k != 2}[extra]
    layer = model.model.layers[0].self_attn
    hidden = torch.randn(*ids.shape, model.config.hidden_size)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        want_mask = _create_causal_mask(model, mask, **{extra: pattern})
        want = layer(hidden, cos_sin, want_mask)[0]
        with patchkit.apply_patch("llama", backend="sdpa") as handle, routed(model.config, handle.state):
            plain = _create_causal_mask(model, mask)
            got_mask = _create_causal_mask(model, mask, **{extra: pattern})
            got = layer(hidden, cos_sin, got_mask)[0]
            assert handle.stepped_aside == {"custom_mask_pattern": 1} and handle.calls == 0
    assert isinstance(plain, VarlenMask)
    torch.testing.assert_close(got_mask, want_mask)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(transformers.__version__ < "4.53", reason="masks through the mask interface: 4.53+")
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_mask_pattern_beyond_causal_in_a_forward_unpadded_at_the_model_reruns_padded_aside(family, monkeypatch):
    """A mask transformers asks for beyond causal (a bidirectional span, a caller's and_mask_function) inside a forward
    patchkit unpadded at the model: transformers' mask over the packed row would join its documents, so the forward
    reruns padded on transformers' attention, counted, and equals unpatched."""
    from models import labels_for

    from patchkit.hooks.name import attention_interface

    model = any_model(family).train()
    ids, mask = padded_batch("mixed")
    model.zero_grad()
    want = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    want.loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(attention_interface, "beyond_causal", lambda function, chunks=False: True)
    handle = patchkit.apply_patch(family if family != "llama" else "llama2", backend="sdpa")
    model.zero_grad()
    with pytest.warns(RuntimeWarning, match="beyond causal and padding"):
        got = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
    got.loss.backward()
    assert handle.stepped_aside == {"custom_mask_pattern": 1}
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=2e-5, rtol=1e-3)
    handle.revert()
