"""The HF Trainer's own steps read the loss alone (`hooks/head/loss_reader.py`): under unpad="model" (the default)
and "loss" its training steps and its evaluation without metrics run the fused head and return no logits, with the
unpatched Trainer's numbers; every caller that reads the logits gets them."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
from models import completion_labels, padded_batch
from packaging.version import Version
from test_lm_head import assert_trained_alike, family

import patchkit
from patchkit.hooks.head import lm_head

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")


def rows_of(model: torch.nn.Module) -> list[dict]:
    """8 mixed-padded rows with completion-only labels (each with a labelled token)."""
    ids, mask = padded_batch("mixed", batch=4, seq=16)
    ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
    ids = ids.clamp(max=model.config.get_text_config().vocab_size - 1)
    labels = completion_labels(ids, mask, prompt=2)
    return [dict(input_ids=i, attention_mask=m, labels=lab) for i, m, lab in zip(ids, mask, labels)]


def run(model: torch.nn.Module, unpad: Optional[str], tmp_path, trainer_class: Any = None,
        compute_metrics: Optional[Callable] = None, rows: Optional[list[dict]] = None, **arguments: Any) -> dict:
    """evaluate(), train 2 steps of 2 micro-batches, evaluate() again, under a patch with `unpad` (None: unpatched):
    both evaluations' metrics, the logged losses, the trained weights and the patch's `heads`. SGD: each weight moves by
    its gradient (AdamW's first steps move a weight by about the learning rate whatever its gradient's size, so
    float32's last-bit differences in a near-zero gradient, patchkit's attention against sdpa's, move it as far)."""
    import transformers as tf

    rows = rows or rows_of(model)
    args = tf.TrainingArguments(output_dir=str(tmp_path / str(unpad)), gradient_accumulation_steps=2,
                                optim="sgd", learning_rate=0.1, use_cpu=True, report_to=[], save_strategy="no",
                                logging_steps=1, seed=0, dataloader_num_workers=0, disable_tqdm=True, max_steps=2,
                                per_device_train_batch_size=2, per_device_eval_batch_size=4, **arguments)
    handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if unpad else None
    try:
        trainer = (trainer_class or tf.Trainer)(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                                                compute_metrics=compute_metrics)
        first = trainer.evaluate()
        trainer.train()
        last = trainer.evaluate()
        heads = dict(handle.heads) if handle else {}
        aside = dict(handle.stepped_aside) if handle else {}
    finally:
        if handle is not None:
            handle.revert()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return dict(evals=(first, last), trained=(losses, {n: p.detach().clone() for n, p in model.named_parameters()}),
                heads=heads, aside=aside)


def assert_evals_alike(got: dict, want: dict, *keys: str) -> None:
    for g, w in zip(got["evals"], want["evals"]):
        for key in ("eval_loss", *keys):
            assert g[key] == pytest.approx(w[key], abs=1e-5), (key, g, w)


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_5_text"])
def test_the_trainers_steps_and_evaluation_without_metrics_run_the_fused_head(tmp_path, unpad, model_type):
    """No compute_metrics: the Trainer's evaluation reads the loss alone (`prediction_loss_only`), as its training
    steps do. Both evaluations (the first checks the family's logits, in eval mode, before any training step) and
    the 4 micro-batches run the fused head; eval losses, training losses and trained weights equal unpatched
    (Gemma 2: its softcap inside the fused loss; Qwen 3.5: a base model that runs padded, its linear-attention layers
    mixing tokens outside attention, which unpads inside attention alone)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    want, got = (run(family(model_type), way, tmp_path) for way in (None, unpad))
    assert got["heads"] == {lm_head.FUSED: 2 * 2 + 4}  # 2 evaluations of 2 batches, 2 steps of 2 micro-batches
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])


@pytest.mark.parametrize("model_type, kept", [("llama", False), ("gemma3n_text", True)])
def test_the_trainers_evaluation_keeps_no_kv_cache_but_where_the_family_reads_it_back(tmp_path, monkeypatch,
                                                                                       model_type, kept):
    """The Trainer's evaluation reads the loss alone: its eval forwards keep no KV cache, which the config's use_cache
    would fill with every layer's keys and values for the batch (the 4.x Trainer leaves the config's use_cache on; from
    5.0 `TrainingArguments(use_cache=True)` sets it), but where KV-sharing layers read it back within the forward
    (Gemma 3n: `past_key_values.shared_layers` in transformers 4.53-5.0, whose numbers change without one). Each
    cache is counted as it is made; the losses and weights equal unpatched."""
    import transformers as tf
    from transformers.cache_utils import DynamicCache

    if model_type == "gemma3n_text" and Version(tf.__version__) < Version("5.0"):
        pytest.skip("Gemma 3n is served from data on transformers 5.x")
    sets_use_cache = "use_cache" in tf.TrainingArguments.__dataclass_fields__
    arguments = {"use_cache": True} if sets_use_cache else {}
    made: list = []
    init = DynamicCache.__init__
    monkeypatch.setattr(DynamicCache, "__init__", lambda cache, *a, **k: (made.append(1), init(cache, *a, **k))[1])
    want = run(family(model_type), None, tmp_path, **arguments)
    assert len(made) >= 2 * 2  # unpatched: one a batch of either evaluation (and, from 5.0, of each training step)
    made.clear()
    got = run(family(model_type), "model", tmp_path, **arguments)
    assert len(made) == (2 * 2 if kept else 0)
    assert got["heads"] == {lm_head.FUSED: 2 * 2 + 4}
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])


@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_the_trainers_compiled_steps_run_the_fused_head(tmp_path, model_type):
    """`torch_compile=True` (dynamo's eager backend here): the compiled model's frames lie between the Trainer and
    the LM; its steps and evaluations still read the loss alone, fused, with the unpatched compiled run's numbers
    (Qwen 3.5: a base model that runs padded)."""
    from torch._dynamo.utils import counters
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    compiled = dict(torch_compile=True, torch_compile_backend="eager")
    try:
        want, got = (run(family(model_type), way, tmp_path, **compiled) for way in (None, "model"))
    finally:
        torch._dynamo.reset()
        counters.clear()
    assert got["heads"] == {lm_head.FUSED: 2 * 2 + 4}
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])


def token_accuracy(prediction: Any) -> dict:
    """A compute_metrics that reads the logits: next-token accuracy over the labelled positions."""
    logits, labels = (torch.as_tensor(x) for x in (prediction.predictions, prediction.label_ids))
    if isinstance(prediction.predictions, tuple):
        logits = torch.as_tensor(prediction.predictions[0])
    picked, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    labelled = target != -100
    return {"accuracy": float((picked[labelled] == target[labelled]).float().mean())}


def test_an_evaluation_with_metrics_gets_the_logits(tmp_path):
    """compute_metrics reads the logits: the evaluation's forwards return them (the head on real tokens), and the
    accuracy they give equals unpatched; the training steps still read the loss alone."""
    want, got = (run(family("llama"), way, tmp_path, compute_metrics=token_accuracy) for way in (None, "model"))
    assert got["heads"] == {lm_head.REAL_TOKENS: 2 * 2, lm_head.FUSED: 4}
    assert_evals_alike(got, want, "eval_accuracy")
    assert_trained_alike(got["trained"], want["trained"])


def z_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An auxiliary loss on the real positions' logits (the square of their log-partition), as PaLM's z-loss."""
    return 1e-3 * logits.float().logsumexp(-1).square()[mask.bool()].mean()


class ZLossTrainer:
    """A Trainer subclass that reads the logits in its compute_loss (a z-loss on the log-partition), through the
    Trainer's own compute_loss (`super`) or by calling the model itself (`direct`)."""

    def __new__(cls, how: str) -> Any:
        import transformers as tf

        class Trainer(tf.Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                if how == "super":
                    loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
                else:
                    outputs = model(**inputs)
                    loss = outputs.loss
                loss = loss + z_loss(outputs.logits, inputs["attention_mask"])
                return (loss, outputs) if return_outputs else loss

        return Trainer


class LogitsWrapper(torch.nn.Module):
    """A model of the user's own around the causal LM: its forward reads the LM's logits (an auxiliary loss)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm, self.config = lm, lm.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> dict:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return {"loss": out.loss + z_loss(out.logits, attention_mask), "logits": out.logits}


@pytest.mark.parametrize("reader", ["compute_loss via super", "compute_loss calling the model", "model wrapper",
                                    "forward hook"])
def test_a_caller_that_reads_the_logits_gets_them(tmp_path, reader):
    """Whatever reads the logits between the Trainer and the LM, or instead of the Trainer's own compute_loss, gets
    them (the head on real tokens, none fused) and the unpatched numbers: a subclass's compute_loss, a model of the
    user's own around the LM, a forward hook on the model."""
    seen: list = []

    def build() -> torch.nn.Module:
        model = family("llama")
        if reader == "model wrapper":
            return LogitsWrapper(model)
        if reader == "forward hook":
            model.register_forward_hook(lambda module, args, out: seen.append(tuple(out.logits.shape)))
        return model

    extra: dict = {}
    if reader.startswith("compute_loss"):
        extra["trainer_class"] = ZLossTrainer("super" if "super" in reader else "direct")
    want = run(build(), None, tmp_path, **extra)
    unpatched = len(seen)
    got = run(build(), "model", tmp_path, **extra)
    assert got["heads"] == {lm_head.REAL_TOKENS: 2 * 2 + 4}
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])
    if reader == "forward hook":
        assert len(seen) == 2 * unpatched and seen[unpatched:] == seen[:unpatched]


def test_under_unpad_attention_the_trainer_keeps_the_logits(tmp_path):
    """unpad="attention" changes nothing at the model: the Trainer's forwards return their logits as unpatched."""
    want, got = (run(family("llama"), way, tmp_path) for way in (None, "attention"))
    assert got["heads"] == {}
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])


@pytest.mark.parametrize("setting, reads_loss", [
    ({}, True), ({"return_outputs": True}, False), ({"past_index": 0}, False),
    ({"compute_loss_func": len}, False), ({"label_smoother": len}, False)])
def test_the_trainers_own_settings_that_read_more_than_the_loss_keep_the_logits(setting, reads_loss):
    """The Trainer's compute_loss frame, as `loss_reader` reads it: a training step's call (return_outputs=False)
    reads the loss alone, unless the Trainer reads an output by position (`past_index`, 4.x: mems) or computes a loss
    of its own from the logits; return_outputs=True outside prediction_step hands the outputs to its caller."""
    from patchkit.hooks.head import loss_reader

    trainer = SimpleNamespace(args=SimpleNamespace(past_index=setting.get("past_index", -1)),
                              compute_loss_func=setting.get("compute_loss_func"),
                              label_smoother=setting.get("label_smoother"))
    caller = SimpleNamespace(f_code=SimpleNamespace(co_name="training_step", co_filename="elsewhere"), f_locals={})
    frame = SimpleNamespace(f_locals={"self": trainer, "return_outputs": setting.get("return_outputs", False)},
                            f_back=caller)
    assert loss_reader._reads_loss(frame) is reads_loss


def smoothed_cross_entropy(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A compute_loss_func of a user's own: causal cross-entropy from the logits, shifted as transformers shifts."""
    logits = outputs.logits[:, :-1].flatten(0, 1).float()
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100,
                                             label_smoothing=0.1)


@pytest.mark.parametrize("setting", ["label_smoothing_factor", "compute_loss_func", "compute_loss override"])
def test_the_trainers_own_loss_from_logits_predicting_from_left_padding_steps_aside(tmp_path, setting):
    """With label smoothing or a compute_loss_func, the Trainer pops the labels and computes the loss from the
    logits (and so does a subclass's compute_loss, transformers' recipe): the LM saw no labels, so the first real
    token's label, predicted from left padding, was read from patchkit's padding logits (losses 4.5786/4.5394 for
    4.5772/4.5511, weights 3e-2 apart). The Trainer's labels are read off its frame: those forwards step aside,
    and train and evaluate as unpatched."""
    model = family("llama")
    ids, mask = padded_batch("left", batch=4, seq=16)
    rows = [dict(input_ids=i, attention_mask=m, labels=i.masked_fill(m == 0, -100)) for i, m in zip(ids, mask)]
    arguments = {"label_smoothing_factor": 0.1} if setting == "label_smoothing_factor" else {}
    trainer_class = None
    if setting == "compute_loss_func":
        import transformers as tf

        class Trainer(tf.Trainer):
            def __init__(self, **kwargs: Any) -> None:
                super().__init__(**kwargs, compute_loss_func=smoothed_cross_entropy)

        trainer_class = Trainer
    if setting == "compute_loss override":  # transformers' recipe for a loss of one's own
        import transformers as tf

        class Trainer(tf.Trainer):
            def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False,
                             num_items_in_batch: Any = None) -> Any:
                labels = inputs.pop("labels")
                outputs = model(**inputs)
                loss = smoothed_cross_entropy(outputs, labels)
                return (loss, outputs) if return_outputs else loss

        trainer_class = Trainer
    want = run(copy.deepcopy(model), None, tmp_path, trainer_class, rows=rows, **arguments)
    got = run(model, "model", tmp_path, trainer_class, rows=rows, **arguments)
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])
    assert set(got["aside"]) == {"labels_from_padding"}
