"""Unpad once per model forward: the decoder runs on real tokens only, and the results equal unpatched eager."""

from __future__ import annotations

import pytest
import torch
from families import family_model
from models import cache_tensors, labels_for, needs_mask_interface, padded_batch, tiny_model

import patchkit
from patchkit.forward import context
from patchkit.hooks.generation.filled_cache import makes_own_cache


def layer_input_shapes(model) -> list[tuple[int, ...]]:
    """Record the hidden-state shape every decoder layer (and so every MLP and projection) receives."""
    shapes: list[tuple[int, ...]] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(patchkit.shape_free(lambda m, args, kw: shapes.append(tuple(
            (args[0] if args else kw["hidden_states"]).shape))), with_kwargs=True)
    return shapes


def step(model, ids, mask, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(got, want, got_g, want_g, mask):
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert got_g.keys() == want_g.keys()
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=2e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("patch,kv_heads", [("llama2", 4), ("llama2", 2), ("llama1", 4)])
@pytest.mark.parametrize("kind", ["right", "left", "mixed"])
@pytest.mark.parametrize("how", ["train_mode", "use_cache_false"])
def test_decoder_runs_on_real_tokens_and_matches_eager(patch, kv_heads, kind, how):
    model = tiny_model(kv_heads=kv_heads)
    kw = {"use_cache": False} if how == "use_cache_false" else {}
    if how == "train_mode":
        model.train()  # attention_dropout is 0.0: deterministic
    ids, mask = padded_batch(kind)
    want, want_g = step(model, ids, mask, **kw)
    shapes = layer_input_shapes(model)
    with patchkit.apply_patch(patch, backend="sdpa"):
        got, got_g = step(model, ids, mask, **kw)
    nnz = int(mask.sum())
    assert shapes == [(1, nnz, model.config.hidden_size)] * model.config.num_hidden_layers
    assert got.logits.shape == want.logits.shape
    assert_same(got, want, got_g, want_g, mask)


def test_rows_whose_positions_continue_each_other_stay_separate():
    """Row 0 ends at position 4 and left-padded row 1 starts at 5: packed, the positions run on unbroken.

    Documents must come from the mask, not from position restarts, or row 1 would attend to row 0.
    """
    model = tiny_model(kv_heads=2, seed=3)
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1] * 5 + [0] * 5, [0] * 5 + [1] * 5])
    want, want_g = step(model, ids, mask, use_cache=False)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got, got_g = step(model, ids, mask, use_cache=False)
    assert_same(got, want, got_g, want_g, mask)


def test_inputs_embeds_and_every_hidden_state_are_repadded():
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("mixed")
    real = mask.bool()
    embeds = model.model.embed_tokens(ids).detach().requires_grad_(True)

    def run():
        embeds.grad = None
        out = model.model(inputs_embeds=embeds, attention_mask=mask, use_cache=False, output_hidden_states=True)
        (out.last_hidden_state * mask[..., None]).sum().backward()  # an objective on real tokens only
        return out, embeds.grad.clone()

    want, want_grad = run()
    shapes = layer_input_shapes(model)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got, got_grad = run()
    assert shapes[0] == (1, int(mask.sum()), 64)
    assert len(got.hidden_states) == len(want.hidden_states)
    for g, w in zip(got.hidden_states, want.hidden_states):
        assert g.shape == w.shape
        torch.testing.assert_close(g[real], w[real], atol=2e-5, rtol=1e-4)
    assert got.last_hidden_state[~real].abs().max() == 0  # padding carries nothing
    torch.testing.assert_close(got_grad[real], want_grad[real], atol=2e-5, rtol=1e-3)
    assert got_grad[~real].abs().max() == 0


def test_tuple_outputs_are_repadded():
    model = tiny_model()
    ids, mask = padded_batch("right")
    want = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got = model.model(input_ids=ids, attention_mask=mask, use_cache=False, return_dict=False)
    assert isinstance(got, tuple) and got[0].shape == want.shape
    torch.testing.assert_close(got[0][mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_model_unpad(reentrant):
    model = tiny_model(kv_heads=2)
    model.train()
    ids, mask = padded_batch("left")
    want, want_g = step(model, ids, mask)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    shapes = layer_input_shapes(model)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got, got_g = step(model, ids, mask)
    assert shapes and all(s[0] == 1 for s in shapes)
    assert_same(got, want, got_g, want_g, mask)


def _greedy_from(model, cache, ids, mask, first):
    """generate() continuing from a prefill's cache: the prompt, the token `first` after it, 6 more greedy tokens."""
    ids = torch.cat([ids, first], 1)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, pad_token_id=0)


@needs_mask_interface
@pytest.mark.parametrize("family, patch", [("llama", "llama2"), ("mistral", "mistral"), ("qwen2", "qwen2"),
                                           ("gemma3_text", "gemma3_text")])
def test_an_eval_forward_that_keeps_a_cache_runs_packed_and_returns_transformers_cache(family, patch):
    """The HF Trainer's evaluation step: eval mode, config.use_cache, no cache given, labels. The model would make a
    DynamicCache itself (sliding layers where the config has a window); patchkit makes the same one, runs the
    decoder on the packed row and fills the cache padded: the loss, the logits and every layer's keys and values at
    real positions are the unpatched model's, and generate() continues from that cache with the same tokens."""
    model = tiny_model(kv_heads=2, seed=5) if family == "llama" else family_model(family, seed=1)
    assert model.config.use_cache
    ids, mask = padded_batch("left", batch=3, seq=14)
    labels = labels_for(ids, mask)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels)
        shapes = layer_input_shapes(model)
        with patchkit.apply_patch(patch, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=mask, labels=labels)
            assert not handle.stepped_aside
    assert shapes == [(1, int(mask.sum()), model.config.hidden_size)] * model.config.num_hidden_layers  # packed
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    ours, theirs = got.past_key_values, want.past_key_values
    assert type(ours) is type(theirs) and "update" not in vars(ours)
    layer_types = [[type(layer) for layer in getattr(c, "layers", ())] for c in (ours, theirs)]  # 4.56+
    assert layer_types[0] == layer_types[1]
    assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1]
    for ours_kv, theirs_kv in zip(cache_tensors(ours), cache_tensors(theirs), strict=True):
        for o, t in zip(ours_kv, theirs_kv):
            assert o.shape == t.shape  # a sliding layer keeps the last window - 1 columns
            kept = real[:, -o.shape[2]:]
            torch.testing.assert_close(o.transpose(1, 2)[kept], t.transpose(1, 2)[kept], atol=2e-5, rtol=1e-4)
    first = want.logits[:, -1:].argmax(-1)
    expected = _greedy_from(model, theirs, ids, mask, first)
    with patchkit.apply_patch(patch, backend="sdpa"):
        assert torch.equal(_greedy_from(model, ours, ids, mask, first), expected)


def test_an_eval_forward_given_use_cache_false_or_a_past_is_not_given_a_cache():
    """Only a forward that keeps a cache gets one: use_cache=False returns none; a cache with a past stays per-layer."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("left")
    shapes = layer_input_shapes(model)
    with torch.no_grad(), patchkit.apply_patch("llama2", backend="sdpa"):
        assert model(input_ids=ids, attention_mask=mask, use_cache=False).past_key_values is None
        past = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1]).past_key_values
        shapes.clear()
        model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=past)
    assert past.get_seq_length() == ids.shape[1]
    assert shapes == [(ids.shape[0], 1, 64)] * 2  # a decode step: the padded batch, not a packed row


def test_training_mode_keeps_a_cache_only_when_asked():
    """In train mode a config's default use_cache (every Trainer step) makes no cache; use_cache=True is kept, as
    transformers keeps it (a caller may feed it to the next step): filled padded from the unpadded forward, or (an
    era whose own cache patchkit has not read) made by the model on the per-layer path."""
    model = tiny_model().train()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    seen = layer_input_shapes(model)
    with patchkit.apply_patch("llama2", backend="sdpa"), torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).past_key_values is None
        got = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    if makes_own_cache(model.model):  # an era whose own cache patchkit read: the unpadded forward fills it padded
        assert seen[-1] == (1, int(mask.sum()), 64)
    real = mask.bool()
    for (k, v), (wk, wv) in zip(cache_tensors(got), cache_tensors(want)):
        torch.testing.assert_close(k.transpose(1, 2)[real], wk.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.transpose(1, 2)[real], wv.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)


def test_unpad_attention_mode_keeps_padded_shapes_and_matches():
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("mixed")
    want, want_g = step(model, ids, mask, use_cache=False)
    shapes = layer_input_shapes(model)
    with patchkit.apply_patch("llama2", backend="sdpa", unpad="attention") as handle:
        got, got_g = step(model, ids, mask, use_cache=False)
        assert "unpad:   attention" in handle.report()
    assert shapes == [tuple(ids.shape) + (64,)] * 2
    assert_same(got, want, got_g, want_g, mask)


def test_bad_unpad_mode_is_refused_and_patches_nothing():
    original = type(tiny_model().model).forward
    with pytest.raises(ValueError, match="unknown unpad mode 'layers'; choose one of model, attention"):
        patchkit.apply_patch("llama2", backend="sdpa", unpad="layers")
    assert type(tiny_model().model).forward is original and not patchkit.active_patches()


def test_instance_patch_unpads_only_that_model():
    model, other = tiny_model(kv_heads=2), tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    mine, theirs = layer_input_shapes(model), layer_input_shapes(other)
    want, want_g = step(model, ids, mask, use_cache=False)
    mine.clear()
    with patchkit.apply_patch("llama2", backend="sdpa", model=model):
        got, got_g = step(model, ids, mask, use_cache=False)
        other(input_ids=ids, attention_mask=mask, use_cache=False)
    assert mine[0][0] == 1 and theirs[0] == tuple(ids.shape) + (64,)
    assert_same(got, want, got_g, want_g, mask)


def test_packed_context_is_reset_when_the_forward_raises():
    model = tiny_model()
    ids, mask = padded_batch("right")
    def boom(module, args):
        assert context.current().plan.packed is not None  # inside the packed forward
        raise RuntimeError("boom")

    hook = model.model.layers[1].register_forward_pre_hook(patchkit.shape_free(boom))
    with patchkit.apply_patch("llama2", backend="sdpa"):
        with pytest.raises(RuntimeError, match="boom"):
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        hook.remove()
        assert context.current().plan is context.NO_PLAN
        # and the next forward (padded, with a cache) is not mistaken for a packed one
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    want = model(input_ids=ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(out.logits[mask.bool()], want.logits[mask.bool()], atol=2e-5, rtol=1e-4)


def test_caller_position_ids_are_carried_into_the_packed_row():
    """RoPE only sees distances, so default positions cannot tell; strided positions can."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("mixed")
    positions = torch.arange(ids.shape[1]).mul(3).expand_as(ids)
    want, want_g = step(model, ids, mask, use_cache=False, position_ids=positions)
    with patchkit.apply_patch("llama2", backend="sdpa"):
        got, got_g = step(model, ids, mask, use_cache=False, position_ids=positions)
    assert_same(got, want, got_g, want_g, mask)


def test_output_attentions_steps_aside_from_the_packed_path_too():
    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False, output_attentions=True)
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=mask, use_cache=False, output_attentions=True)
            assert handle.stepped_aside == {"output_attentions": 1}
    for a, b in zip(got.attentions, want.attentions, strict=True):
        torch.testing.assert_close(a, b)


def test_all_padding_batch_without_a_cache_does_not_crash():
    model = tiny_model().train()
    ids, mask = torch.randint(3, 90, (2, 8)), torch.zeros(2, 8, dtype=torch.long)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert logits.shape == (2, 8, 97) and torch.isfinite(logits).all()
    assert handle.calls == model.config.num_hidden_layers


@pytest.mark.parametrize("kind", ["packed", "aside"])
def test_one_plan_per_forward_reaches_every_layer(monkeypatch, kind):
    """The base model's forward decides once (`plan_forward`) and every layer's attention runs under that plan: a
    padded batch unpadded at the model, or one whose labels sit on padding stepped aside; no layer decides again."""
    from patchkit.hooks.forwards import model_forward

    made, seen = [], []
    plan_forward = model_forward.plan_forward

    def counting(*args, **kwargs):
        made.append(plan_forward(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(model_forward, "plan_forward", counting)
    model = tiny_model(layers=3).train()  # a training forward: no cache to fill, in every era
    hooks = [layer.self_attn.register_forward_pre_hook(
        patchkit.shape_free(lambda *_: seen.append(context.current().plan)))
             for layer in model.model.layers]
    ids, mask = padded_batch("left")
    labels = ids if kind == "aside" else labels_for(ids, mask)  # ids: a label right after each left padding
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        if kind == "aside":
            with pytest.warns(RuntimeWarning, match="labels_from_padding"):
                model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        else:
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for hook in hooks:
        hook.remove()
    (plan,) = made
    assert seen == [plan] * 3
    if kind == "aside":
        assert plan.aside == "labels_from_padding" and handle.calls == 0
    else:
        assert plan.aside is None and plan.unpadded and plan.packed.batch == 1 and handle.calls == 3


@needs_mask_interface
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("kind", ["left", "right", "mixed"])
@pytest.mark.parametrize("empty_row", [False, True], ids=["every row real", "a row all padding"])
def test_a_sequence_classifier_scores_every_row_as_unpatched_an_all_padding_one_too(family, kind, empty_row):
    """A reward model or classifier (`*ForSequenceClassification`) reads one row's score at its last real token from
    the repadded hidden states: patched (strict), the scores, the loss and every gradient equal the unpatched model's.
    A row all padding (a rejected answer truncated away) is scored at a padding position, whose hidden state varlen
    kernels do not compute: that forward steps aside (`pooled_at_padding`), with the unpatched numbers too."""
    import transformers

    config = family_model(family).config if family != "llama" else tiny_model(kv_heads=2).config
    config.num_labels, config.pad_token_id = 3, 0
    classifier = getattr(transformers, f"{type(config).__name__.removesuffix('Config')}ForSequenceClassification", None)
    if classifier is None:
        pytest.skip(f"this transformers has no sequence classifier for {family}")  # Gemma 3's text one: 4.54+
    torch.manual_seed(0)
    model = classifier(config)
    ids, mask = padded_batch(kind, batch=4, seq=16)
    if kind == "mixed":
        mask[-1] = 1  # padded_batch's empty row: only where asked
    if empty_row:
        mask[-1] = 0
    ids = ids.masked_fill(mask == 0, 0)  # the padding token, which the classifier finds each row's end by
    labels = torch.tensor([0, 1, 2, 1])

    def scored() -> tuple:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = scored()
    with patchkit.apply_patch(model=model, backend="sdpa", strict=not empty_row) as handle:
        got = scored()
        assert handle.stepped_aside == ({"pooled_at_padding": 1} if empty_row else {})
        assert bool(handle.calls) != empty_row
    torch.testing.assert_close(got[0].logits, want[0].logits)
    torch.testing.assert_close(got[0].loss, want[0].loss)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=name)


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_the_report_names_the_mode_a_family_always_runs_in(unpad):
    """OPT counts its positions from the mask, so it always unpads inside attention only: the report's unpad line says
    that mode and what was asked (before, it named the mode asked for, which OPT never ran)."""
    import transformers
    from census import tiny_lm
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.0"):
        pytest.skip("families served from data: transformers 5.x")
    model, _ = tiny_lm("opt")
    ids, mask = padded_batch("mixed")
    with patchkit.apply_patch(model=model, backend="sdpa", strict=True, unpad=unpad) as handle:
        model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
        assert handle.calls and (f"unpad:   attention (in each attention layer; hidden states keep their padded "
                                 f"shape; the family's own mode, where {unpad!r} was asked") in handle.report()


def test_a_base_model_whose_own_forward_takes_position_ids_by_kwargs_runs_with_the_callers_positions():
    """A LlamaModel subclass whose forward names input_ids and the mask and passes the rest on by **kwargs, patched on
    the instance: the causal LM's position_ids (and use_cache) reach it by **kwargs. patchkit wrote its packed
    position_ids beside them (TypeError: multiple values), and read no position_ids the caller gave there."""
    from models import tiny_config
    from transformers import LlamaForCausalLM, LlamaModel

    class PassingModel(LlamaModel):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).eval()
    passing = PassingModel(model.config)
    passing.load_state_dict(model.model.state_dict())
    model.model = passing
    ids, mask = padded_batch("right")
    positions = (torch.arange(ids.shape[1]) + 3).expand_as(ids)  # not the default: read, or the logits differ
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert handle.calls == model.config.num_hidden_layers and not handle.stepped_aside
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
