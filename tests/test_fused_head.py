"""The fused head and loss of unpad="loss" (`forward/loss/linear_cross_entropy.py`, `hooks/head/fused_head.py`):
the numbers of the family's own head and transformers' loss, served only after the family's logits were checked."""

from __future__ import annotations

import pytest
import torch
from models import completion_labels, labels_for, padded_batch
from test_lm_head import family, step
from test_loss_alone import assert_grads
from transformers.loss.loss_utils import ForCausalLMLoss

import patchkit
from patchkit.forward.loss import linear_cross_entropy as lce
from patchkit.forward.loss.linear_cross_entropy import LogitTransform, linear_cross_entropy
from patchkit.hooks.head import fused_head, lm_head

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TRANSFORMS = {"plain": LogitTransform(), "multiply": LogitTransform(multiply=0.0625),
              "divide": LogitTransform(divide=8.0), "softcap": LogitTransform(softcap=3.0)}


def reference(hidden, weight, bias, labels, transform, **kw):
    """The unfused numbers: nn.Linear's head, the family's transform written out, transformers' loss."""
    z = torch.nn.functional.linear(hidden, weight, bias)
    if transform.multiply is not None:
        z = z * transform.multiply
    if transform.divide is not None:
        z = z / transform.divide
    if transform.softcap is not None:
        z = torch.tanh(z / transform.softcap) * transform.softcap
    return ForCausalLMLoss(z[None], None, weight.shape[0], shift_labels=labels[None], **kw)


def small_chunks(monkeypatch) -> None:
    """Chunks of a few rows (a frozen head) and of a few vocabulary columns (a head that trains), a last, shorter
    one among them."""
    for name, value in (("CHUNK_ELEMENTS", 5 * 70), ("BALANCE_ELEMENTS", 5 * 70), ("MIN_ROWS", 1),
                        ("CACHE_ELEMENTS", 23 * 16), ("MIN_COLUMNS", 1)):
        monkeypatch.setattr(lce, name, value)


def head_case(monkeypatch, dtype: torch.dtype, head: str) -> tuple:
    """(hidden rows, the head's weight and bias, labels with ignored rows among them) in `dtype`, in small chunks, the
    gradients written as `head` says: "frozen" (a weight and bias without gradients), "held" (in the forward, as a
    float32 head's) or "recomputed" (in the backward, as a bfloat16 head's)."""
    small_chunks(monkeypatch)
    monkeypatch.setattr(lce, "HOLD_DTYPES", (torch.float32, torch.bfloat16) if head == "held" else ())
    torch.manual_seed(0)
    hidden = torch.randn(23, 16).to(dtype).requires_grad_()
    weight = (torch.randn(70, 16) / 2).to(dtype).requires_grad_(head != "frozen")
    bias = torch.randn(70).to(dtype).requires_grad_(head != "frozen")
    labels = torch.randint(0, 70, (23,))
    labels[[2, 9, 10]] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("items", [None, 40])
@pytest.mark.parametrize("weight_of_loss", [1.0, -2.5])
@pytest.mark.parametrize("head", ["frozen", "held", "recomputed"])
def test_the_fused_loss_is_the_head_and_transformers_loss(monkeypatch, dtype, transform, items, weight_of_loss, head):
    """Loss and the gradients of the hidden rows, the head's weight and its bias, with ignored rows among them:
    written in the forward, row chunk by row chunk (a frozen head; `held`: one that trains, as in float32), or
    computed again in the backward, vocabulary slice by slice (`recomputed`: one that trains, as in bfloat16)."""
    hidden, weight, bias, labels = head_case(monkeypatch, dtype, head)
    inputs = (hidden,) if head == "frozen" else (hidden, weight, bias)
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want = reference(hidden, weight, bias, labels, TRANSFORMS[transform], **kw)
    want_grads = torch.autograd.grad(want * weight_of_loss, inputs)
    got = linear_cross_entropy(hidden, weight, bias, labels, TRANSFORMS[transform],
                               num_items_in_batch=kw.get("num_items_in_batch"))
    got_grads = torch.autograd.grad(got * weight_of_loss, inputs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 2e-3)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == w.dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4, msg=name)
        else:  # bfloat16 rounding of the logits' gradient, as two kernels round it: within a few ulps
            torch.testing.assert_close(g.float(), w.float(), atol=2e-3, rtol=3e-2, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", ["plain", "softcap"])
@pytest.mark.parametrize("head", ["frozen", "held", "recomputed"])
def test_a_learned_scale_per_vocabulary_entry_gets_its_gradient_from_the_fused_loss(monkeypatch, dtype, transform,
                                                                                  head):
    """Dory's head: its output in float32 times `logit_scale * factor`, a trained (V,) parameter in the model's dtype.
    The loss and the gradients of the rows, the weight, the bias and the scale's parameter are autograd's."""
    hidden, weight, bias, labels = head_case(monkeypatch, dtype, head)
    parameter = (0.02 + torch.rand(70) / 50).to(dtype).requires_grad_()
    inputs = (hidden, parameter) if head == "frozen" else (hidden, weight, bias, parameter)
    scale = lambda: parameter.float() * 50.0  # noqa: E731 - as DoryLMHead.forward makes it
    z = TRANSFORMS[transform].apply(torch.nn.functional.linear(hidden, weight, bias).float() * scale())
    want = ForCausalLMLoss(z[None], None, 70, shift_labels=labels[None])
    want_grads = torch.autograd.grad(want, inputs)
    got = linear_cross_entropy(hidden, weight, bias, labels, TRANSFORMS[transform], column_scale=scale())
    got_grads = torch.autograd.grad(got, inputs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)
        else:  # the bfloat16 casts of float32 sums taken in another order: an ulp
            torch.testing.assert_close(g.float(), w.float(), atol=2e-3, rtol=2e-2)


def test_a_second_backward_through_gradients_written_in_the_forward_is_refused_by_name():
    hidden = torch.randn(4, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, torch.randn(11, 8), None, torch.tensor([1, 2, -100, 3]))
    loss.backward(retain_graph=True)
    with pytest.raises(patchkit.PatchkitError, match=r"a second backward \(retain_graph=True\) through the LM head "
                       r"fused with its loss.*Fix: apply the patch with unpad='attention'"):
        loss.backward()


def test_gradients_computed_in_the_backward_take_a_second_backward_as_autograd_does(monkeypatch):
    """retain_graph=True: a head whose gradients are computed in the backward keeps its inputs, not its gradients,
    so a second backward adds the same gradients again, as nn.Linear's and cross_entropy's do."""
    monkeypatch.setattr(lce, "HOLD_DTYPES", ())
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    labels = torch.tensor([1, 2, -100, 3, 10, 0])
    grads = []
    for loss_of in (lambda: reference(hidden, weight, None, labels, TRANSFORMS["plain"]),
                    lambda: linear_cross_entropy(hidden, weight, None, labels)):
        hidden.grad = weight.grad = None
        loss = loss_of()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append((hidden.grad, weight.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def long_batch(model: torch.nn.Module, completion: bool = True) -> dict:
    """A padded batch long enough that the fused loss saves memory at the tiny models' width."""
    ids, mask = padded_batch("mixed", batch=4, seq=48)
    ids = ids.clamp(max=model.config.get_text_config().vocab_size - 1)
    labels = completion_labels(ids, mask) if completion else labels_for(ids, mask)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)


def labelled_rows(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != -100).sum())


def checked_rows(labels: torch.Tensor) -> int:
    """The rows the LM's own head runs on in the checking forward: the first labelled ones, the zero row, the
    probes (never every labelled row: the checking step holds no more than the fused steps)."""
    return min(fused_head.CHECK_ROWS, labelled_rows(labels)) + 1 + len(fused_head.PROBE_LOGITS)


def loss_alone_steps(model: torch.nn.Module, inputs: dict, steps: int = 2) -> tuple[list, dict, list]:
    """`steps` training steps under unpad="loss": each step's (loss, gradients), the patch's `heads` and the row
    counts the LM's own head saw (counted in its class's forward: a hook on the head would keep it unfused)."""
    got, rows, head = [], [], fused_head.saved_copy(model.get_output_embeddings())
    forward = type(head).forward

    def counted(self, x, *args, **kwargs):
        if self is head:
            rows.append(x.shape[:-1].numel())
        return forward(self, x, *args, **kwargs)

    with patchkit.apply_patch(model=model, backend="sdpa", unpad="loss") as handle, pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(head), "forward", counted)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            out = model(**inputs)
            out.loss.backward()
            assert out.logits is None
            got.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
        return got, dict(handle.heads), rows


# llama: a plain head; gemma2: softcap; cohere: logit_scale; granite: logits_scaling (divides); phi: a bias;
# falcon_h1: lm_head_multiplier; mixtral: the router's auxiliary loss added to the fused one; hyperclovax:
# logits_scaling, which multiplies there (the census's tiny configs set it to 4, as checkpoints set it); ergo: a
# float32 head (`FLOAT32_HEADS`); dory: a learned scale per vocabulary entry (`SCALED_HEADS`); modernbert-decoder:
# a module of its own before the head (dense, GELU, LayerNorm: `PRE_HEADS`), run on the labelled rows, its gradients too
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "cohere", "granite", "phi", "falcon_h1", "mixtral",
                                        "hyperclovax", "ergo", "dory", "modernbert-decoder"])
def test_after_its_logits_are_checked_a_family_runs_the_fused_head_with_unpatched_numbers(model_type):
    overrides = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if model_type == "mixtral" else {}
    model = family(model_type, **overrides)
    inputs = long_batch(model)
    want = step(model, **inputs)
    got, heads, rows = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2}  # checked and fused on the first step, fused on the second
    assert rows == [checked_rows(inputs["labels"]), 1]  # checked (a few rows, the probes), then one zero row
    assert_steps_as_unpatched(got, want)


@pytest.mark.parametrize("model_type", ["ergo", "dory"])
def test_a_head_with_a_forward_of_its_own_in_a_bfloat16_model_runs_fused(monkeypatch, model_type):
    """Ergo's vocabulary head (`ErgoLinearWithFP32Output`) rounds the rows to the weight's bfloat16, then multiplies in
    float32 with autocast off; Dory's (`DoryLMHead`) multiplies its output in float32 by a learned scale per
    vocabulary entry. Their own forwards write the labelled rows' (n, V) logits in float32 (Ergo's also keeps a
    float32 copy of the weight for the backward). Fused, the loss computes them a chunk at a time. Against the same
    patched steps with the family's own head on the labelled rows (the model's bfloat16 attention on real tokens sums
    in another order than unpatched, which is not the head's doing): the loss and every gradient, the scale's too."""
    from patchkit.hooks.forwards import lm_forward

    if not hasattr(__import__("transformers"), "ErgoForCausalLM"):
        pytest.skip("Ergo and Dory: transformers 5.25")
    model = family(model_type).to(torch.bfloat16)
    assert fused_head.head_of_its_own(model.lm_head) == type(model.lm_head).__name__
    inputs = long_batch(model)
    got, heads, rows = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2} and rows == [checked_rows(inputs["labels"]), 1]
    monkeypatch.setattr(lm_forward, "fused_head", lambda lm: None)
    want, own, _ = loss_alone_steps(model, inputs, steps=1)
    assert own == {lm_head.LOSS_ONLY: 1}
    for loss, grads in got:
        torch.testing.assert_close(loss, want[0][0], atol=1e-6, rtol=1e-6)
        assert grads.keys() == want[0][1].keys()
        for name, w in want[0][1].items():  # bfloat16 gradients: a float32 sum's rounding, one ulp
            torch.testing.assert_close(grads[name], w, atol=1e-6, rtol=8e-3, msg=name)


def test_a_family_whose_logits_are_not_the_fused_ones_keeps_its_own_head():
    """LLaMA's forward ignores `final_logit_softcapping`: with it set, the fused loss would softcap and LLaMA does
    not. The check on the first step finds it: LLaMA runs again on its base model's output (no layer runs twice),
    with its own head on every labelled row, as every later step does, with unpatched numbers."""
    model = family("llama", final_logit_softcapping=0.5)
    inputs = long_batch(model)
    want = step(model, **inputs)
    layers = []
    model.model.layers[0].register_forward_hook(patchkit.shape_free(lambda *_: layers.append(1)))
    got, heads, rows = loss_alone_steps(model, inputs, steps=3)
    assert heads == {lm_head.LOSS_ONLY: 3} and len(layers) == 3
    assert rows == [checked_rows(inputs["labels"])] + [labelled_rows(inputs["labels"]) + 1] * 3
    assert_steps_as_unpatched(got, want)


def zero3_stand_in(head: torch.nn.Linear) -> None:
    """DeepSpeed ZeRO-3's hold on a head, in one process, as its hooks hold it: outside the head's forward and backward
    its weight is an empty shard (its shape in `ds_shape`). A pre-forward hook gathers it (and releases it once its
    inputs' gradients are computed), a forward hook releases it and gathers it again before its output's backward.
    The hooks carry ZeRO-3's module, by which patchkit knows them (the real ones: test_deepspeed_zero.py)."""
    weight, full = head.weight, head.weight.data

    def release(*_) -> None:
        weight.data = full.new_empty(0)

    def gather(module, inputs) -> None:
        weight.data = full
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(release)

    def gather_before_backward(module, inputs, output) -> None:
        release()
        if output.requires_grad:
            output.register_hook(lambda _: gather(module, ()))

    for hook in (gather, gather_before_backward):
        hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    weight.ds_shape = full.shape
    release()
    head.register_forward_pre_hook(gather)
    head.register_forward_hook(gather_before_backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["gradients in the forward", "in the backward"])
def test_a_head_whose_weight_zero3_gathers_runs_fused_as_its_forward(dtype):
    """Under ZeRO-3 the head's weight exists only inside its forward (and its backward): the probes, the check and
    the fused loss run as the head's forward, so its hooks gather the weight for them, with unpatched numbers."""
    model = family("llama").to(dtype)
    inputs = long_batch(model)
    zero3_stand_in(model.lm_head)
    want = step(model, **inputs)
    got, heads, rows = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2} and rows == [checked_rows(inputs["labels"]), 1]
    assert model.lm_head.weight.numel() == 0  # released after every forward and backward
    assert_steps_as_unpatched(got, want, bf16=dtype == torch.bfloat16)


@pytest.mark.parametrize("why", ["a forward hook on the head", "a head of another class"])
def test_a_head_the_fused_loss_cannot_read_runs_the_familys_own(why):
    """A hook on the head that is not ZeRO-3's (it may change the logits) or a head that is not a plain nn.Linear (a
    quantized head, a subclass): the family's own head."""
    model = family("llama")
    inputs = long_batch(model)
    if why == "a forward hook on the head":
        # marked: it reads no shape, so the head runs on the labelled rows (unmarked, on the padded batch: it may read
        # the layout, `test_module_hooks.py`); it may change the logits all the same
        model.lm_head.register_forward_hook(patchkit.shape_free(lambda m, i, o: o * 1.0))
    elif why == "a head of another class":
        class Head(torch.nn.Linear):
            pass

        head = Head(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        head.weight = model.lm_head.weight
        model.lm_head = head
    want = step(model, **inputs)
    got, heads, _ = loss_alone_steps(model, inputs)
    assert heads == {lm_head.LOSS_ONLY: 2}
    assert_steps_as_unpatched(got, want)


@pytest.mark.parametrize("tuning", ["full", "full in bfloat16", "full in bfloat16, head tied", "lora",
                                    "lora training the head", "lora training tokens",
                                    "lora training tokens, head tied", "lora on the head",
                                    "lora on the head in bfloat16"])
def test_a_full_or_a_lora_fine_tune_runs_the_fused_head_on_any_batch(tuning):
    """Four labelled tokens in the batch (a short completion), a head that trains (the full fine-tune; in bfloat16
    its gradients are computed in the backward) or a frozen one (PEFT's LoRA on the attention, whose head stays a
    plain nn.Linear; or a copy of it that trains, PEFT's `modules_to_save`, as adding tokens needs; or the rows of a
    few tokens, PEFT's `trainable_token_indices`; or LoRA on the head too, its adapters in float32 beside a bfloat16
    head as PEFT casts them): fused from the first step, with unpatched loss and gradients.
    Tied (Gemma 2's head is its embedding): the head's gradient computed in the backward adds to the embedding's."""
    model = family("gemma2" if "tied" in tuning else "llama")
    bf16 = "bfloat16" in tuning
    if bf16:
        model = model.to(torch.bfloat16)
    if tuning.startswith("lora"):
        peft = pytest.importorskip("peft")
        saved = ["lm_head", "embed_tokens"] if tuning == "lora training the head" else None
        tokens = {"embed_tokens": [3, 5, 8], **({} if "tied" in tuning else {"lm_head": [3, 5, 8]})}
        targets = ["q_proj", "v_proj"] + (["lm_head"] if "on the head" in tuning else [])
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, target_modules=targets, modules_to_save=saved,
            trainable_token_indices=tokens if "tokens" in tuning else None))
        if "on the head" in tuning:  # its B drawn, not zero: the head's LoRA term counts from the first step
            torch.manual_seed(1)
            torch.nn.init.normal_(model.get_output_embeddings().lora_B["default"].weight, std=0.5)
    head, embeddings = (fused_head.saved_copy(m) for m in (model.get_output_embeddings(), model.get_input_embeddings()))
    head, embeddings = (getattr(m, "base_layer", m).weight for m in (head, embeddings))  # trainable tokens' bases
    assert head.requires_grad == (tuning == "lora training the head" or tuning.startswith("full"))
    assert ("tied" in tuning) == (head is embeddings)
    inputs = long_batch(model)
    inputs["labels"] = torch.full_like(inputs["labels"], -100)
    inputs["labels"][0, 5:9] = inputs["input_ids"][0, 5:9]
    want = step(model, **inputs)
    got, heads, rows = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2}
    assert rows == [checked_rows(inputs["labels"]), 1]
    assert_steps_as_unpatched(got, want, bf16=bf16)


def assert_steps_as_unpatched(got: list, want: tuple, bf16: bool = False) -> None:
    """Each fused step's loss and gradients (`loss_alone_steps`) as the unpatched step's (`step`): to float32's
    noise, or in bfloat16 as `assert_bf16_alike` holds them."""
    for loss, grads in got:
        if bf16:
            assert_bf16_alike(loss, grads, want)
            continue
        torch.testing.assert_close(loss, want[0], atol=1e-5, rtol=1e-5)
        assert_grads(grads, want[2])


def assert_bf16_alike(loss: torch.Tensor, grads: dict, want: tuple) -> None:
    """bfloat16: the attention sums in another order (real tokens against padded rows): each gradient within 2% of
    its own largest entry (the head's: within 0.4% measured)."""
    torch.testing.assert_close(loss, want[0], atol=1e-5, rtol=1e-2)
    assert grads.keys() == want[2].keys()
    for name, w in want[2].items():
        assert float((grads[name].float() - w.float()).abs().max()) <= 0.02 * float(w.float().abs().max()), name


def test_under_autocast_the_fused_head_runs_in_autocasts_dtype():
    """A float32 model under bfloat16 autocast (the Trainer's bf16=True): the head runs in bfloat16 as nn.Linear
    does there; the loss and gradients equal unpatched within bfloat16 rounding."""
    model = family("llama")
    inputs = long_batch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step(model, **inputs)
        got, heads, _ = loss_alone_steps(model, inputs)
    assert heads == {lm_head.FUSED: 2}
    for loss, grads in got:
        torch.testing.assert_close(loss, want[0], atol=1e-2, rtol=1e-2)
        assert_grads(grads, want[2], atol=2e-2)


def test_a_label_outside_the_vocabulary_raises_as_cross_entropy_does():
    with pytest.raises(IndexError, match="Target 11 is out of bounds"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(11, 8), None, torch.tensor([1, -100, 11]))


@pytest.mark.parametrize("head", ["frozen", "trains"])
def test_float16_gradients_under_a_gradient_scalers_factor_are_not_flushed_to_zero(head):
    """fp16 training scales the loss (GradScaler: 65536) so that the logits' gradient, cast to float16, does not
    underflow: the factor must reach each logit's gradient before its cast, as autograd applies it. A gradient
    written in the forward, unscaled, would flush a softmax of 1e-9 over 4000 items to zero."""
    torch.manual_seed(0)
    hidden = (torch.randn(12, 16) * 4).half().requires_grad_()
    weight = torch.randn(70, 16).half().requires_grad_(head == "trains")
    labels = torch.randint(0, 70, (12,))
    items = torch.tensor(4000)
    inputs = (hidden, weight) if head == "trains" else (hidden,)
    want = torch.autograd.grad(reference(hidden, weight, None, labels, TRANSFORMS["plain"],
                                         num_items_in_batch=items) * 65536.0, inputs)
    got = torch.autograd.grad(linear_cross_entropy(hidden, weight, None, labels, num_items_in_batch=items) * 65536.0,
                              inputs)
    for g, w in zip(got, want):
        assert int((w != 0).sum()) > int((w == 0).sum())  # the scaled gradients are there to be kept
        torch.testing.assert_close(g.float(), w.float(), atol=1e-3, rtol=2e-2)


@pytest.mark.parametrize("fam, attribute", [("cohere", "logit_scale"), ("falcon_h1", "model.lm_head_multiplier")])
def test_a_logit_scale_the_lms_forward_reads_off_itself_is_read_there_when_changed_after_the_check(fam, attribute):
    """Cohere's forward multiplies its logits by `self.logit_scale`, Falcon-H1's by `self.model.lm_head_multiplier`:
    copied from the config when built. Changed on the model after the first (checking) step, the fused loss kept the
    config's (Cohere's loss 4.5756 for 4.5832, every gradient off, silently); it now reads them where the forward
    does, and checks the head again."""
    import copy

    from census import tiny_lm

    model, _ = tiny_lm(fam)
    model = model.float().train()
    ref = copy.deepcopy(model)
    ids, mask = padded_batch("right", batch=3, seq=16)
    ids = ids % model.config.vocab_size
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))

    def train_step(m: torch.nn.Module) -> tuple[torch.Tensor, dict]:
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss  # the loss alone: fused
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    with patchkit.apply_patch(model=model, backend="sdpa") as handle:
        train_step(model), train_step(ref)
        *path, last = attribute.split(".")
        for m in (model, ref):
            holder = m
            for name in path:
                holder = getattr(holder, name)
            setattr(holder, last, getattr(holder, last) * 3.0)
        (got, got_grads), (want, want_grads) = train_step(model), train_step(ref)
        assert handle.heads.get(lm_head.FUSED) == 2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
