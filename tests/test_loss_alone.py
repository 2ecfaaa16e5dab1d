"""unpad="loss": a training forward with labels returns its loss alone, computed chunked over the labelled tokens
(`patchkit/forward/loss/cross_entropy.py`), with unpatched numbers; every other call is served as under
unpad="model"."""

from __future__ import annotations

import pytest
import torch
from models import completion_labels, padded_batch
from test_lm_head import FAMILIES, assert_same, batch, family, head_rows, step
from transformers.loss.loss_utils import ForCausalLMLoss

import patchkit
from patchkit.forward.loss import cross_entropy
from patchkit.forward.loss.cross_entropy import chunked_causal_lm_loss, chunked_cross_entropy
from patchkit.hooks.head import lm_head

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so every test crosses chunk boundaries (and a last, shorter chunk)."""
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", 3 * 50)
    monkeypatch.setattr(cross_entropy, "CACHE_ELEMENTS", 2 * 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("items", [None, 7, "tensor"])
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("weight", [3.0, -2.0])  # the gradient the loss receives: a negative one flips the sign last
def test_the_chunked_loss_is_transformers_causal_lm_loss(small_chunks, dtype, items, shifted, weight):
    torch.manual_seed(0)
    logits = (torch.randn(2, 11, 50) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 11))
    labels[0, :4] = -100
    num_items = torch.tensor(9) if items == "tensor" else items
    kwargs = dict(num_items_in_batch=num_items)
    if shifted:
        kwargs["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    want = ForCausalLMLoss(logits, labels, 50, **kwargs)
    want_grad, = torch.autograd.grad(want * weight, logits)
    got = chunked_causal_lm_loss(logits, labels, 50, **kwargs)
    got_grad, = torch.autograd.grad(got * weight, logits)
    assert got_grad.dtype == logits.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    ulp = 1e-5 if dtype == torch.float32 else 8e-3  # the gradient in float32, cast once: within a bfloat16 ulp
    torch.testing.assert_close(got_grad, want_grad, atol=1e-7, rtol=ulp)


def test_a_batch_without_labels_gives_torchs_nan_loss_and_zero_gradients(small_chunks):
    logits = torch.randn(5, 50, requires_grad=True)
    labels = torch.full((5,), -100)
    want = torch.nn.functional.cross_entropy(logits, labels)
    want_grad, = torch.autograd.grad(want, logits)
    got = chunked_cross_entropy(logits, labels)
    got_grad, = torch.autograd.grad(got, logits)
    assert torch.isnan(want) and torch.isnan(got)
    torch.testing.assert_close(got_grad, want_grad)


def test_a_label_outside_the_vocabulary_raises_as_cross_entropy_does():
    logits = torch.randn(3, 50)
    labels = torch.tensor([1, -100, 50])
    with pytest.raises(IndexError, match="out of bounds"):
        torch.nn.functional.cross_entropy(logits, labels)
    with pytest.raises(IndexError, match="Target 50 is out of bounds"):
        chunked_cross_entropy(logits, labels)


def loss_alone_step(model: torch.nn.Module, **inputs) -> tuple:
    """One training step under unpad="loss": its output, every gradient, the head's row counts, the patch's `heads`
    and its report."""
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
        rows = head_rows(model)
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads, rows, handle.heads, handle.report()


def labelled_rows(labels: torch.Tensor) -> int:
    """The rows the head runs on under unpad="loss": the labelled ones after the shift, and one zero row. (The hook
    `head_rows` counts by keeps the fused loss off: `test_fused_head.py` counts it otherwise.)"""
    return int((labels[..., 1:] != -100).sum()) + 1


def assert_grads(got: dict, want: dict, atol: float = 2e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=1e-3, msg=name)


@pytest.mark.parametrize("labels", ["every real token", "completion only"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_loss_alone_equals_unpatched(model_type, labels):
    """Loss and every gradient as unpatched (the families' softcap, logit scale, head bias and router loss), the
    head on the labelled tokens alone (a prompt's tokens and each row's last are not run through it), and no logits
    back."""
    model = family(model_type, **FAMILIES[model_type])
    inputs = batch(model)
    if labels == "completion only":
        inputs["labels"] = completion_labels(inputs["input_ids"], inputs["attention_mask"])
    want = step(model, **inputs)
    out, grads, rows, heads, report = loss_alone_step(model, **inputs)
    assert heads == {lm_head.LOSS_ONLY: 1}
    assert "1 forwards on real tokens (1 returned the loss alone, the head on the labelled tokens only)" in report
    assert "unpad:   loss (once per model forward, as 'model'; a training forward with labels returns" in report
    assert rows == [labelled_rows(inputs["labels"])]
    assert rows[0] < int(inputs["attention_mask"].sum())
    assert out.logits is None and "logits" not in out.keys()  # noqa: SIM118 - a ModelOutput
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    assert_grads(grads, want[2])
    if model_type == "mixtral":
        torch.testing.assert_close(out.aux_loss, want[3].aux_loss)


@pytest.mark.parametrize("how", ["eval", "no_labels"])
def test_forwards_that_are_not_a_training_loss_keep_their_logits(how):
    """Evaluation (the Trainer's prediction step reads logits) and forwards without labels return the (B, N, V)
    logits as under unpad="model"."""
    model = family("llama")
    inputs = batch(model)
    if how == "eval":
        model.eval()
    else:
        del inputs["labels"]
    want = step(model, **inputs) if how == "eval" else (None, model(**inputs).logits.detach())
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
        got = step(model, **inputs) if how == "eval" else (None, model(**inputs).logits.detach())
        assert handle.heads == {lm_head.REAL_TOKENS: 1}
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=2e-5, rtol=1e-4)
    if how == "eval":
        assert_same(got, want, inputs["attention_mask"])


def test_a_call_the_packed_row_cannot_serve_returns_its_logits_and_says_why():
    model = family("llama")
    inputs = {**batch(model), "return_dict": False}
    want = model(**inputs)
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
        got = model(**inputs)
        assert list(handle.heads) == ["a tuple output (return_dict=False)"]
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=2e-5, rtol=1e-4)


def smoothed(logits, labels, vocab_size=None, shift_labels=None, **kwargs):
    """A script's own causal-LM loss: label smoothing (`LOSS_MAPPING["ForCausalLM"]` replaced; it takes
    `shift_labels` as transformers' does)."""
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    logits, labels = logits.flatten(0, -2).float(), labels.flatten()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.1)


@pytest.mark.parametrize("where", ["fixed_cross_entropy", "torch's cross_entropy", "LOSS_MAPPING"])
def test_a_cross_entropy_a_script_set_in_transformers_place_is_the_one_that_runs(where, monkeypatch):
    """A script replaces what transformers' loss calls (`loss_utils.fixed_cross_entropy`, torch's `cross_entropy`,
    which Liger's `cross_entropy=True` replaces) or the loss itself: patchkit's own loss on the labelled rows ran
    plain cross-entropy in its place (4.6003 for the script's 4.5991), silently. The model's own loss runs now."""
    from transformers.loss import loss_utils

    plain = torch.nn.functional.cross_entropy

    def smoothing(*args, **kwargs):
        return plain(*args, **{**kwargs, "label_smoothing": 0.1})

    def fixed(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
        return plain(source, target, ignore_index=ignore_index, label_smoothing=0.1)

    if where == "fixed_cross_entropy":
        monkeypatch.setattr(loss_utils, "fixed_cross_entropy", fixed)
    elif where == "LOSS_MAPPING":
        monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", smoothed)
    else:
        monkeypatch.setattr(torch.nn.functional, "cross_entropy", smoothing)
    model = family("llama")
    inputs = batch(model)
    want = step(model, **inputs)
    out, grads, _, heads, _ = loss_alone_step(model, **inputs)
    assert lm_head.LOSS_ONLY not in heads and lm_head.FUSED not in heads, heads
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    assert_grads(grads, want[2])


@pytest.mark.parametrize("shift", [False, True])
def test_a_batch_its_base_model_keeps_hands_the_head_its_labelled_rows(shift):
    """Documents packed in one row (position_ids restarting, no mask) have no padding to skip: the base model keeps
    the row, and still hands the head its labelled rows alone (the prompts' tokens left out; the labels shifted
    by transformers, or by the caller as under context parallelism), with the loss and gradients of
    unpad="model"."""
    model = family("llama")
    ids, mask = padded_batch("mixed", batch=3, seq=16)
    real = mask.bool()
    labels = completion_labels(ids, mask)
    packed = dict(input_ids=ids[real].unsqueeze(0), labels=labels[real].unsqueeze(0),
                  position_ids=torch.cat([torch.arange(int(n)) for n in mask.sum(1)]).unsqueeze(0))
    if shift:
        packed["shift_labels"] = torch.nn.functional.pad(packed["labels"][:, 1:], (0, 1), value=-100)
    with patchkit.apply_patch(model=model, backend="sdpa", unpad="model"):
        want = step(model, **packed)
    out, grads, rows, heads, report = loss_alone_step(model, **packed)
    assert heads == {lm_head.LOSS_ONLY: 1}
    assert "(1 returned the loss alone, the head on the labelled tokens only)" in report
    assert out.logits is None and rows == [labelled_rows(packed["labels"])] and rows[0] < ids[real].numel()
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-6, rtol=1e-6)
    assert_grads(grads, want[2], atol=2e-6)


def test_a_forward_stepped_aside_still_runs_its_head_on_the_labelled_rows_alone():
    """A forward whose attention steps aside (here the caller's own 4D mask, a window of 4 keys that no 2D mask says:
    transformers' attention serves it) keeps
    its padded batch, and its head and loss still run on the labelled rows alone: the prompts' tokens and padding are
    not run through the head, and the loss and every gradient are transformers' own."""
    model = family("llama")
    inputs = batch(model)
    mask = inputs["attention_mask"]
    inputs["labels"] = completion_labels(inputs["input_ids"], mask)
    n = mask.shape[1]
    window = torch.tril(torch.ones(n, n, dtype=torch.bool)) & torch.triu(torch.ones(n, n, dtype=torch.bool), -3)
    seen = window & mask.bool()[:, None, None, :]
    inputs["attention_mask"] = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    want = step(model, **inputs)
    out, grads, rows, heads, report = loss_alone_step(model, **inputs)
    assert "forwards stepped aside to transformers' own attention: 1 (custom_4d_mask)" in report
    assert heads == {lm_head.LOSS_ONLY: 1} and rows == [labelled_rows(inputs["labels"])]
    assert out.logits is None
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-6, rtol=1e-6)
    assert_grads(grads, want[2], atol=2e-6)


@pytest.mark.parametrize("model_type", ["jamba", "qwen3_next"])
def test_a_family_unpadded_inside_attention_returns_the_loss_alone_too(model_type):
    """Hybrids (Mamba, linear attention) keep the padded batch at the model: their loss comes alone all the same,
    equal to unpatched."""
    model = family(model_type)
    inputs = batch(model)
    want = step(model, **inputs)
    out, grads, rows, heads, _ = loss_alone_step(model, **inputs)
    assert heads == {lm_head.LOSS_ONLY: 1} and rows == [labelled_rows(inputs["labels"])]
    assert out.logits is None
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    assert_grads(grads, want[2])


def compiled_steps(model: torch.nn.Module, batches: list[dict], fullgraph: bool = False) -> tuple[list, dict, list]:
    """Training steps of `model` compiled (the eager backend) under unpad="loss", one per batch: each step's (loss,
    logits, gradients), the patch's `heads`, and the graphs compiled so far after each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    got, graphs = [], []
    try:
        with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle:
            compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
            for inputs in batches:
                model.zero_grad(set_to_none=True)
                out = compiled(**inputs)
                out.loss.backward()
                got.append((out.loss.detach(), out.logits,
                            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
                graphs.append(counters["stats"]["unique_graphs"])
            return got, dict(handle.heads), graphs
    finally:
        torch._dynamo.reset()


# gemma2: its softcap inside the fused loss; mixtral: the router's auxiliary loss added to the fused one; "llama,
# unchecked": a softcap in the config that LLaMA's forward ignores, so the first step's check fails and the LM runs
# again with its own head
@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral", "llama, unchecked"])
def test_under_torch_compile_the_loss_alone_runs_fused_with_unpatched_numbers(model_type):
    """torch.compile(model) (graph breaks allowed; the Trainer's torch_compile=True): the causal LM's ask of its base
    model, and the fused head and loss, run eagerly between the compiled frames; its layers compile. The loss and
    every gradient equal unpatched, no logits come back, every step runs fused (the first checks), and a steady
    step compiles nothing: not the third on the same batch, nor the fifth on a batch of other lengths."""
    unchecked = model_type.endswith("unchecked")
    model = family("llama", final_logit_softcapping=0.5) if unchecked else family(model_type, **FAMILIES[model_type])
    ids, mask = padded_batch("right", batch=3, seq=20)
    ids = ids.clamp(max=model.config.vocab_size - 1)
    other = dict(input_ids=ids, attention_mask=mask, labels=completion_labels(ids, mask), use_cache=False)
    inputs = batch(model)
    inputs["labels"] = completion_labels(inputs["input_ids"], inputs["attention_mask"])
    want = [step(model, **b) for b in (inputs, other)]
    got, heads, graphs = compiled_steps(model, [inputs] * 3 + [other] * 2)
    assert heads == {lm_head.LOSS_ONLY if unchecked else lm_head.FUSED: 5}
    assert graphs[1] == graphs[2] and graphs[3] == graphs[4], graphs
    for (loss, logits, grads), w in zip(got, [want[0]] * 3 + [want[1]] * 2):
        assert logits is None
        torch.testing.assert_close(loss, w[0], atol=1e-5, rtol=1e-5)
        assert grads.keys() == w[2].keys()
        for name in w[2]:
            torch.testing.assert_close(grads[name], w[2][name], atol=2e-5, rtol=1e-3, msg=name)


def test_in_a_graph_that_may_not_break_the_loss_comes_with_its_logits_and_says_so():
    """torch.compile(model, fullgraph=True): no eager step between frames, so the LM's head and loss run in the graph
    as transformers' own and return their logits; the loss is unchanged, and one warning says so."""
    model = family("llama")
    inputs = batch(model)
    want = step(model, **inputs)
    with pytest.warns(RuntimeWarning, match=r"unpad='loss' under torch.compile\(fullgraph=True\)") as said:
        got, heads, _ = compiled_steps(model, [inputs] * 2, fullgraph=True)
    assert sum("unpad='loss'" in str(w.message) for w in said) == 1 and heads == {}
    loss, logits, grads = got[-1]
    assert_same((loss, logits.detach(), grads), want, inputs["attention_mask"])


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_next"])
def test_the_loss_alone_under_gradient_checkpointing_equals_unpatched(model_type):
    """Each layer recomputed in the backward (non-reentrant, transformers' default) on the packed row or the padded
    batch: the loss alone and every gradient as unpatched, checkpointed alike."""
    model = family(model_type)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = batch(model)
    want = step(model, **inputs)
    out, grads, _, heads, _ = loss_alone_step(model, **inputs)
    assert sum(heads.values()) == 1 and set(heads) <= {lm_head.LOSS_ONLY, lm_head.LOSS_ONLY_KEPT}
    assert out.logits is None
    torch.testing.assert_close(out.loss.detach(), want[0], atol=1e-5, rtol=1e-5)
    assert_grads(grads, want[2])


def test_a_batch_without_a_single_label_runs_the_head_on_one_zero_row():
    """A micro-batch whose labels are all -100 (a long prompt cut before its answer): one zero row runs the head,
    and the loss over the Trainer's `num_items_in_batch` (0 here) and every gradient (zero) equal unpatched."""
    model = family("llama")
    inputs = batch(model)
    inputs.update(labels=torch.full_like(inputs["labels"], -100), num_items_in_batch=torch.tensor(5))
    want = step(model, **inputs)
    out, grads, rows, heads, _ = loss_alone_step(model, **inputs)
    assert heads == {lm_head.LOSS_ONLY: 1} and rows == [1]
    torch.testing.assert_close(out.loss.detach(), want[0])
    assert_grads(grads, want[2], atol=0)
