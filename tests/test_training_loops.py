"""What real training loops pass and read: labels at padding, right-padded generate(), dynamic RoPE, seq_idx,
shift_labels, a framework's own `model.forward`. Each is exact against the unpatched model or refused by name."""

from __future__ import annotations

import functools
import inspect
import types
import warnings

import pytest
import torch
import transformers as tf
from families import any_model
from models import VOCAB, labels_for, padded_batch

import patchkit
from patchkit import PatchInputError


def loss_and_grads(model, **batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def aside_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "ran on transformers' attention, exact" in str(w.message)]


@pytest.mark.parametrize("way", ["class", "instance"])
@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("gemma", "eager")])
def test_labels_at_padding_step_aside_exactly_warned_once_and_counted(family, attn, way):
    """labels = input_ids (a script that forgets -100): the loss reads logits at padding positions."""
    model = any_model(family, attn).train()
    ids, mask = padded_batch("right")
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids)
    want = loss_and_grads(model, **batch)
    handle = patchkit.apply_patch(family, backend="sdpa") if way == "class" else patchkit.apply_patch(
        model=model, backend="sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loss_and_grads(model, **batch)
        loss_and_grads(model, **batch)
    (message,) = aside_warnings(caught)
    assert "predicted from a padding position" in message and "-100" in message
    assert caught[0].filename == __file__  # the user's line
    assert handle.stepped_aside == {"labels_from_padding": 2} and "2 (labels_from_padding)" in handle.report()
    handle.revert()
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_labels_at_padding_under_checkpointing_step_aside_in_the_recompute_too():
    model = any_model("mistral", "sdpa").train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    ids, mask = padded_batch("right")
    want = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=ids)
    with patchkit.apply_patch("mistral", backend="sdpa") as handle:
        got = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=ids)
        assert handle.calls == 0 and handle.stepped_aside == {"labels_from_padding": 1}
    torch.testing.assert_close(got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=name)


def test_strict_refuses_labels_at_padding_naming_the_cause_and_the_fix():
    model = any_model("llama").train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
        with pytest.raises(PatchInputError, match="strict=True.*predicted from a padding position.*-100"):
            model(input_ids=ids, attention_mask=mask, labels=ids)
        labels = ids.masked_fill(mask == 0, -100)
        model(input_ids=ids, attention_mask=mask, labels=labels)  # -100 at padding: served, no refusal


def test_right_padded_generate_under_a_sliding_window_steps_aside_for_every_step():
    """Every decode step's mask has the prompt's padding between real tokens, and the window (5) is shorter."""
    model = any_model("mistral", "sdpa")
    ids, mask = padded_batch("right", batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch("mistral", backend="sdpa") as handle:
        got = model.generate(input_ids=ids, **kw)
        assert handle.stepped_aside == {"right_padded_generation": 1, "window_over_padding_hole": 3}
    assert torch.equal(got, want)


@pytest.mark.parametrize("keep", [None, 0], ids=["default", "logits_to_keep=0"])
@pytest.mark.parametrize("family", ["llama", "gemma", "granite"])
def test_right_padded_generate_steps_aside_for_the_prefill_only(family, keep):
    """Whatever logits_to_keep says (generate() passes 1 unless told 0), the prefill into generate()'s cache reads a
    short row's next token at padding: it steps aside, and the decode steps run patched."""
    model = any_model(family, "sdpa")
    if keep is not None and "logits_to_keep" not in inspect.signature(model.forward).parameters:
        pytest.skip("this transformers names it num_logits_to_keep (before 4.50)")
    ids, mask = padded_batch("right", batch=3, seq=14)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True, **({} if keep is None else {"logits_to_keep": keep}))
    want = model.generate(input_ids=ids, **kw)
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got = model.generate(input_ids=ids, **kw)
        assert handle.stepped_aside == {"right_padded_generation": 1}
        assert handle.calls == 2 * 5  # the 5 decode steps after the prefill ran through the patch
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_plain_forward_keeping_the_last_logits_is_not_generation():
    """transformers' test_forward_with_logits_to_keep: logits_to_keep=1 equals the last column of the full logits
    (zeros at a padding column under unpad="model", as documented), both patched, nothing stepped aside."""
    model = any_model("qwen2", "sdpa")
    ids, mask = padded_batch("right")
    with torch.no_grad(), patchkit.apply_patch(backend="sdpa") as group:
        full = model(input_ids=ids, attention_mask=mask, logits_to_keep=0).logits
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
        assert group.calls == 4 and not group.stepped_aside
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.parametrize("family", ["llama-dynamic", "phi3-longrope"])
def test_dynamic_rope_on_a_right_padded_batch_keeps_the_padded_length(family):
    """The largest position (padding included) picks the frequencies: 40 > 32 originals, the longest real row 30."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    if family == "llama-dynamic":
        config = tf.LlamaConfig(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                **common)
        model = tf.LlamaForCausalLM(config)
    else:
        any_model("phi3")  # skips where transformers has no family patches
        factors = [1.0 + 0.1 * i for i in range(4)]  # head_dim 8, partial rotary 1.0: 4 frequencies
        config = tf.Phi3Config(max_position_embeddings=128, original_max_position_embeddings=32,
                               rope_scaling={"type": "longrope", "short_factor": factors,
                                             "long_factor": [2 * f for f in factors]}, **common)
        model = tf.Phi3ForCausalLM(config)
    model.eval()
    ids = torch.randint(3, VOCAB, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, 30:] = 0
    mask[1, 20:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with patchkit.apply_patch(model=model, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            assert handle.calls == 2
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_shift_labels_and_num_items_in_batch_pass_through_to_the_loss(unpad):
    """Context parallelism's pre-shifted labels and the Trainer's token count: the loss and every gradient."""
    model = any_model("qwen2", "sdpa").train()
    ids, mask = padded_batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shift,
                 num_items_in_batch=torch.tensor(int((shift != -100).sum())))
    want = loss_and_grads(model, **batch)
    with patchkit.apply_patch(backend="sdpa", unpad=unpad) as group:
        got = loss_and_grads(model, **batch)
        assert group.calls == 2
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)


def test_left_padded_rows_whose_shift_labels_skip_the_padding_are_served_whatever_labels_says():
    """Given shift_labels, transformers' loss reads them alone: `labels` only has to be a tensor for the model to
    compute a loss (a sequence-parallel script passes its shift_labels there too). Left-padded rows whose first real
    token is unlabelled take no term from padding, so the patch serves them, with the unpatched loss and gradients."""
    model = any_model("llama", "sdpa").train()
    ids, mask = padded_batch("left")
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(-1) == 1), -100)  # the first real token: predicted by padding
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=shift, shift_labels=shift)
    want = loss_and_grads(model, **batch)
    with patchkit.apply_patch(backend="sdpa") as group:
        got = loss_and_grads(model, **batch)
        assert group.calls == 2 and not group.stepped_aside, dict(group.stepped_aside)
    torch.testing.assert_close(got[0], want[0])
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)


def packed(lengths: list[int]) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    return dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                max_length_k=max(lengths), seq_idx=seq_idx)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_seq_idx_of_a_padding_free_batch_is_honoured_and_checked(family):
    """TRL's padding-free collator passes seq_idx with position_ids and cu_seq_lens: served exactly when they agree,
    refused by name when they do not."""
    model = any_model(family)
    batch = packed([6, 3, 7])
    lengths = [6, 3, 7]
    with torch.no_grad():
        want = torch.cat([model(input_ids=d).logits for d in batch["input_ids"].split(lengths, 1)], 1)
        with patchkit.apply_patch(family, backend="sdpa"):
            got = model(**batch).logits
            batch["seq_idx"] = torch.zeros_like(batch["seq_idx"])  # one document: disagrees
            with pytest.raises(PatchInputError, match=r"seq_idx names documents of lengths \[16\].*\[6, 3, 7\]"):
                model(**batch)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_instance_patch_wraps_the_forward_a_framework_set_and_revert_restores_it(family):
    """TRL 1.16 sets model.forward = MethodType(_fused_forward, model); the patch wraps that, not the class's."""
    model = any_model(family, "sdpa")
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def fused_forward(self, *args, fused_lm_head=False, **kwargs):
        out = original_forward(*args, **kwargs)
        if fused_lm_head:
            out.logits = out.logits.log_softmax(-1)
        return out

    model.forward = own = types.MethodType(fused_forward, model)
    ids, mask = padded_batch("left")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, fused_lm_head=True).logits
        handle = patchkit.apply_patch(model=model, backend="sdpa")
        got = model(input_ids=ids, attention_mask=mask, fused_lm_head=True).logits
        assert handle.calls == 2
    handle.revert()
    assert model.forward is own
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("way", ["class patch first", "instance patch after"])
@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_trls_fused_head_forward_gets_the_padded_hidden_states_it_reads(way, unpad):
    """TRL's `add_fused_lm_head` (SFTTrainer's, GRPO's, ...) sets a forward that wears the class forward's name
    (`functools.wraps`) but calls the base model itself and runs its own head on the padded hidden states. Under an
    instance patch that forward is what the patch wraps: it must not be handed the packed rows the family's own
    forward would take (TRL's shapes broke on them). Its loss, log-probs and gradients equal unpatched."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    ids, mask = padded_batch("right")

    def run(patched: bool) -> tuple:
        handle = patchkit.apply_patch("llama", backend="sdpa", unpad=unpad) if patched and way.startswith(
            "class") else None
        model = any_model("llama", "sdpa").train()
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        if patched and handle is None:
            handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad)
        try:
            out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask), fused_lm_head=True)
            out.loss.backward()
            return out, {n: p.grad for n, p in model.named_parameters()}, handle and handle.calls
        finally:
            if handle is not None:
                handle.revert()

    want, got = run(False), run(True)
    assert got[2] == 2  # both layers ran through the patch
    torch.testing.assert_close(got[0].loss, want[0].loss, atol=1e-5, rtol=1e-5)
    for field in ("log_probs", "entropy"):
        torch.testing.assert_close(getattr(got[0], field), getattr(want[0], field), atol=2e-5, rtol=1e-4)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=2e-5, rtol=1e-3, msg=name)


def test_trls_fused_head_set_after_a_class_patch_steps_aside_for_labels_predicted_from_padding():
    """TRL's fused-head forward set on a model built under a class patch runs in place of patchkit's wrapper: with
    left-padded rows labelled everywhere but at padding, each row's first token is predicted from padding, which the
    base model was not told of (other gradients, silently). Its call is read off its frame: that forward steps aside,
    counted, and the loss and gradients equal unpatched."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)

    def run(patched: bool) -> tuple:
        handle = patchkit.apply_patch("llama", backend="sdpa") if patched else None
        model = any_model("llama", "sdpa").train()
        trl_utils.add_fused_lm_head(model, outputs=("log_probs",))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            out.loss.backward()
            return out.loss, {n: p.grad for n, p in model.named_parameters()}, handle and dict(handle.stepped_aside)
        finally:
            if handle is not None:
                handle.revert()

    want, got = run(False), run(True)
    assert got[2] == {"labels_from_padding": 1}
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("unpad", ["model", "loss"])
def test_an_instance_patch_after_accelerators_prepare_runs_the_head_on_real_tokens(unpad):
    """`Accelerator(mixed_precision="bf16").prepare(model)` sets `model.forward` to its float32-output wrapper around
    torch's autocast decorator around the class forward (a custom accelerate loop; the Trainer's own). Patched after
    it, the head and loss still run on real tokens (they ran on the padded batch, reported as "computes its loss
    without transformers' loss_function"), and two training steps' losses and gradients equal unpatched."""
    accelerate = pytest.importorskip("accelerate")
    from patchkit.hooks.head import lm_head

    ids, mask = padded_batch("right")

    def run(patched: bool) -> tuple:
        state = accelerate.state.AcceleratorState
        state._reset_state(reset_partial_state=True)  # a process-wide singleton: another test's Accelerator set it
        model = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(any_model("llama", "sdpa").train())
        handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if patched else None
        try:
            steps = [loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
                     for _ in range(2)]
            return steps, handle and dict(handle.heads)
        finally:
            state._reset_state(reset_partial_state=True)
            if handle is not None:
                handle.revert()

    (want, _), (got, heads) = run(False), run(True)
    assert not lm_head.padded(heads), heads
    if unpad == "loss":
        assert heads == {lm_head.FUSED: 2}, heads  # both steps: the first one checks the head on its own logits
    for (loss, grads), (want_loss, want_grads) in zip(got, want):
        torch.testing.assert_close(loss, want_loss, atol=1e-2, rtol=1e-2)  # bfloat16 autocast both ways
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], atol=1e-2, rtol=5e-2, msg=name)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_trainers_evaluate_and_predict_run_packed_and_equal_unpatched(family, tmp_path):
    """Trainer.evaluate()/predict() call the model in eval mode with config.use_cache on and no cache: patchkit runs
    that forward packed (the decoder on real tokens) and returns what the unpatched model returns."""

    model = any_model(family, "sdpa")
    model.config.use_cache = True
    rows = []
    for kind in ("right", "left"):
        ids, mask = padded_batch(kind)
        rows += [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels_for(ids, mask))]
    args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, use_cpu=True, report_to=[],
                                disable_tqdm=True)
    trainer = tf.Trainer(model=model, args=args, eval_dataset=rows)
    want_loss = trainer.evaluate()["eval_loss"]
    want = trainer.predict(rows).predictions
    shapes = []
    layer = model.model.layers[0]
    hook = layer.register_forward_pre_hook(patchkit.shape_free(
        lambda _, args, kwargs=None: shapes.append(tuple(args[0].shape) if args else None)))
    with patchkit.apply_patch(family, backend="sdpa") as handle:
        got_loss = trainer.evaluate()["eval_loss"]
        got = trainer.predict(rows).predictions
        assert handle.calls > 0 and handle.stepped_aside == {}
    hook.remove()
    assert shapes and all(s is not None and s[0] == 1 for s in shapes)  # one packed row of real tokens per batch
    assert abs(got_loss - want_loss) < 1e-5
    real = torch.stack([r["attention_mask"] for r in rows]).bool()
    torch.testing.assert_close(torch.as_tensor(got)[real], torch.as_tensor(want)[real], atol=1e-4, rtol=1e-4)


def chunked_loss_and_grads(model, ids, mask, labels, name) -> tuple[torch.Tensor, dict]:
    """A long sequence fed in two chunks, the second behind the first's cache (the mask past + new wide)."""
    model.zero_grad(set_to_none=True)
    first = model(input_ids=ids[:, :10], attention_mask=mask[:, :10], labels=labels[:, :10], use_cache=True)
    second = model(input_ids=ids[:, 10:], attention_mask=mask, labels=labels[:, 10:], use_cache=True,
                   **{name: first.past_key_values})
    (first.loss + second.loss).backward()
    return (first.loss + second.loss).detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}


@pytest.mark.parametrize("labels_at_padding", [True, False])
def test_a_chunk_behind_a_past_with_labels_at_padding_steps_aside_exactly(labels_at_padding):
    """A training loop that feeds a right-padded sequence in chunks with the cache: its second chunk's labels read
    logits at padding. The check compared labels with the mask only when their widths agreed (the mask is past + new
    wide), so gradients came out 5.6e-2 off, silently; now that chunk steps aside, and the -100 one runs patched."""
    from models import CACHE

    model = any_model("llama", "sdpa").train()
    ids, mask = padded_batch("right")  # rows end in padding inside the second chunk
    labels = ids if labels_at_padding else ids.masked_fill(mask == 0, -100)
    want = chunked_loss_and_grads(model, ids, mask, labels, CACHE)
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        got = chunked_loss_and_grads(model, ids, mask, labels, CACHE)
        assert handle.stepped_aside == ({"labels_from_padding": 2} if labels_at_padding else {})  # both chunks
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
