"""A training loop of the user's own that reads the loss alone (`hooks/head/caller_code.py`): its forwards run the
head fused with the loss and return no logits, with the unpatched loop's losses and trained weights; a loop whose
code reads anything else of the output gets the logits as before."""

from __future__ import annotations

import contextlib
import functools
import pdb
import sys
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from test_lm_head import family
from test_trainer_loss_alone import rows_of

import patchkit
from patchkit.hooks.head import caller_code, lm_head, loss_reader

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")


class Output(dict):
    __getattr__ = dict.__getitem__


class Reader:
    """A stand-in LM whose call records whether its caller's code reads the loss alone."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, *args: Any, **kwargs: Any) -> Output:
        self.seen.append(caller_code.reads_loss_alone_at(sys._getframe(1)))
        return Output(loss=torch.ones((), requires_grad=True), logits=torch.ones(1))


class Walker(Reader):
    """A stand-in LM that records whether the frames above it, helpers that return its output included, read the
    loss alone."""

    def __call__(self, *args: Any, **kwargs: Any) -> Output:
        self.seen.append(loss_reader.reads_loss_alone(sys._getframe(1)))
        return Output(loss=torch.ones((), requires_grad=True), logits=torch.ones(1))


def helper(model, batch):
    return model(**batch)


def helper_of_a_helper(model, batch):
    return helper(model, batch)


def generator(model, batch):
    yield 1
    return model(**batch)


def through_a_helper(model, batch):
    outputs = helper(model, batch)
    return outputs.loss


def through_two_helpers(model, batch):
    return helper_of_a_helper(model, batch)[0]


def through_a_lambda(model, batch):
    step = lambda b: model(**b)  # noqa: E731
    return step(batch).loss


def through_a_helper_then_logits(model, batch):
    outputs = helper(model, batch)
    return outputs.loss, outputs.logits


def helper_kept(model, batch):
    outputs = helper(model, batch)
    return outputs


def stored_helper(model, batch):
    outputs = model(**batch)
    print(outputs.loss)  # a look at its loss on the way
    return outputs


def through_a_stored_helper(model, batch):
    return stored_helper(model, batch).loss


def through_a_stored_helper_then_logits(model, batch):
    return stored_helper(model, batch).logits


def helper_in_a_branch(model, batch, whole=True):
    outputs = model(**batch)
    if whole:
        return outputs
    return outputs.loss


def through_a_branching_helper(model, batch):
    return helper_in_a_branch(model, batch)["loss"]


def helper_that_reads_the_logits(model, batch):
    outputs = model(**batch)
    print(outputs.logits.shape)
    return outputs


def through_a_helper_that_reads_the_logits(model, batch):
    return helper_that_reads_the_logits(model, batch).loss


def through_a_generator(model, batch):
    steps = generator(model, batch)
    next(steps)
    try:
        next(steps)
    except StopIteration as stop:
        return stop.value.logits


def first_item(model, batch):
    return model(**batch)[0]


def through_map(model, batch):
    """`map` (C) calls the helper: the helper's caller's frame is this one, which reads the list `list` made."""
    outs = list(map(lambda b: model(**b), [batch]))
    outs[0].loss.backward()
    return outs[0].logits.argmax(-1)


def through_map_then_stored(model, batch):
    """`first = outs[0]` then `first.logits`: `outs` holds outputs, as where the field is read at once."""
    outs = list(map(lambda b: model(**b), [batch]))
    first = outs[0]
    first.loss.backward()
    return first["logits"].argmax(-1)


def first_item_stored(model, batch):
    """`loss = outputs[0]` then `loss.backward()`, as transformers' older examples write it: the loss."""
    outputs = model(**batch)
    loss = outputs[0]
    loss.backward()


def second_item(model, batch):
    return model(**batch)[1]


def false_item(model, batch):
    return model(**batch)[False]


def attribute(model, batch):
    return model(**batch).loss


def stored_then_read(model, batch):
    outputs = model(**batch)
    loss = outputs.loss
    loss.backward()


def subscript(model, batch):
    return model(input_ids=batch)["loss"] * 2


def in_a_loop(model, batch):
    for _ in range(2):
        outputs = model(**batch)
        (outputs.loss / 2).backward()
        del outputs


def in_a_comprehension(model, batch):
    return [model(**batch).loss for _ in range(2)]


def logits_read_later(model, batch):
    outputs = model(**batch)
    loss = outputs.loss
    return loss + outputs.logits.sum()


def returned(model, batch):
    return model(**batch)


def stored_and_returned(model, batch):
    outputs = model(**batch)
    return outputs


def in_a_closure(model, batch):
    outputs = model(**batch)
    return lambda: outputs.loss


def read_by_locals(model, batch):
    outputs = model(**batch)
    locals()
    return outputs.loss


def on_an_attribute(model, batch):
    holder = Output()
    holder.out = model(**batch)
    return holder.out.loss


def unpacked(model, batch):
    loss, logits = model(**batch, return_dict=False)
    return loss


def stacked(model, batch):
    outputs = model(**batch)
    return torch.stack([outputs.loss])  # an attribute named `stack`, not inspect's


def reads_its_frame(model, batch):
    outputs = model(**batch)
    sys._getframe(0)
    return outputs.loss


def builtins_locals(model, batch):
    import builtins
    outputs = model(**batch)
    builtins.locals()
    return outputs.loss


def builtins_eval(model, batch):
    import builtins
    outputs = model(**batch)  # noqa: F841 (read by the eval)
    return builtins.eval("outputs.loss")


def asserted(model, batch):
    outputs = model(**batch)
    loss = outputs.loss
    assert loss is not None  # pytest rewrites it to read `@py_builtins.locals()`
    return loss


def evaluated(model, batch):
    outputs = model(**batch)
    model.eval = lambda: None
    model.eval()  # an attribute named `eval`, not the builtin
    return outputs.loss


def in_a_list(model, batch):
    outputs = model(**batch)
    return [outputs][0].loss


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    outputs = model(**inputs)
    loss = outputs.loss
    return (loss, outputs) if return_outputs else loss


def compute_loss_if(self, model, inputs, return_outputs=False):
    outputs = model(**inputs)
    if return_outputs:
        return outputs.loss, outputs
    return outputs.loss


def compute_loss_guard_stored(self, model, inputs, return_outputs=False):
    outputs = model(**inputs)
    return_outputs = bool(return_outputs)
    return (outputs.loss, outputs) if return_outputs else outputs.loss


def compute_loss_not(self, model, inputs, return_outputs=False):
    outputs = model(**inputs)
    if not return_outputs:
        return outputs.loss
    return outputs.loss, outputs


@pytest.mark.parametrize("code, return_outputs, reads", [
    (compute_loss, False, True), (compute_loss, True, False), (compute_loss_if, False, True),
    (compute_loss_if, True, False), (compute_loss_guard_stored, False, False), (compute_loss_not, False, False)])
def test_a_trainer_subclass_reads_the_loss_alone_where_return_outputs_is_false(code: Callable, return_outputs, reads):
    """`(loss, outputs) if return_outputs else loss`, a Trainer subclass's compute_loss: the branch that reads the
    outputs does not run while `return_outputs` is False and never stored (a guard it reassigns, or a branch taken
    when it is False, are not read past)."""
    model = Reader()
    code(None, model, {}, return_outputs=return_outputs)
    assert model.seen == [reads]


@pytest.mark.parametrize("code, reads", [
    (attribute, True), (stored_then_read, True), (subscript, True), (in_a_loop, True), (in_a_comprehension, True),
    (logits_read_later, False), (returned, False), (stored_and_returned, False), (in_a_closure, False),
    (read_by_locals, False), (on_an_attribute, False), (unpacked, False), (in_a_list, False), (stacked, True),
    (reads_its_frame, False), (builtins_locals, False), (builtins_eval, False), (asserted, False), (evaluated, True)])
def test_the_callers_code_reads_the_loss_alone_only_where_nothing_else_of_the_output_is_read(code: Callable, reads):
    model = Reader()
    try:
        code(model, {})
    except (RuntimeError, KeyError, ValueError, TypeError):
        pass  # the stand-in's output is read as the code reads it: what it records was recorded before
    assert model.seen and set(model.seen) == {reads}, (code.__name__, model.seen)


def through_a_cache(model, batch):
    """`functools.lru_cache` (C) keeps the helper's output for a later call that reads its logits."""
    @functools.cache
    def outputs_for(key):
        return model(**batch)

    outputs_for(0).loss.backward()
    return outputs_for(0).logits.argmax(-1)


def show(outputs):
    return outputs.logits.argmax(-1)


def through_map_to_a_function(model, batch):
    """`map` (C) collects the helper's output; the list's first item is handed to a function that reads its logits."""
    outs = list(map(lambda b: model(**b), [batch]))
    return show(outs[0])


def through_a_key_function(model, batch):
    """`min` (C) hands each output to a key function that reads its logits; this frame reads the loss alone."""
    best = min(map(lambda b: model(**b), [batch]), key=lambda o: o.logits.sum())
    return best.loss


def through_a_partial(model, batch):
    """`functools.partial` (C) passes the output on as it is."""
    step = functools.partial(helper, model)
    return step(batch).loss


def under_a_debugger(model, batch):
    """`pdb.set_trace()` shows this frame's locals, `outputs.logits` among them."""
    outputs = model(**batch)
    loss = outputs.loss
    if batch.get("debug"):
        pdb.set_trace()
    return loss


@pytest.mark.parametrize("code, reads", [
    (through_a_helper, True), (through_two_helpers, True), (through_a_lambda, True), (attribute, True),
    (through_a_helper_then_logits, False), (helper_kept, False), (through_a_generator, False), (first_item, True),
    (second_item, False), (false_item, False), (through_a_stored_helper, True),
    (through_a_stored_helper_then_logits, False), (through_a_branching_helper, True),
    (through_a_helper_that_reads_the_logits, False), (through_map, False), (through_map_then_stored, False),
    (first_item_stored, True), (through_a_cache, False), (through_map_to_a_function, False),
    (through_a_key_function, False), (through_a_partial, True), (under_a_debugger, False)])
def test_helpers_that_return_the_output_as_it_is_are_read_through(code: Callable, reads: bool):
    """A helper of the user's that returns the LM's output as it is (`return model(**batch)`, a lambda, a wrapper
    module's forward, or an `outputs` it reads nothing of but the loss before it returns it) hands it to its own
    caller, whose code is read instead; a generator's return reaches no plain caller. `outputs[0]` is the loss
    wherever one was computed (the first field set, a tuple's first item), but where a field is read of it: a list
    of outputs (`map`'s, whose C frame is not seen). A C function between a helper and its caller (a cache, `map`,
    `min`'s key function) may keep or read the output: that caller keeps the logits; `functools.partial` passes the
    output on. A debugger's `set_trace()` reads the frame's locals."""
    model = Walker()
    try:
        code(model, {})
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError):
        pass
    assert model.seen == [reads], (code.__name__, model.seen)


def train_then_evaluate(model, batches):
    for batch in batches:
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
    for batch in batches:
        outputs = model(**batch)
        predictions = outputs.logits
    return predictions


def read_in_a_handler(model, batches):
    try:
        outputs = model(**batches[0])
        loss = outputs.loss
        raise ValueError(loss)
    except ValueError:
        return outputs.logits


def read_in_the_next_iteration(model, batches):
    outputs = None
    for batch in batches:
        if outputs is not None:
            print(outputs.logits)
        outputs = model(**batch)
        outputs.loss.backward()


def evaluated_without_grad(model, batches):
    for batch in batches:
        outputs = model(**batch)
        outputs.loss.backward()
    for batch in batches:
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits
    return predictions


def evaluated_under_suppress(model, batches):
    for batch in batches:
        outputs = model(**batch)
        outputs.loss.backward()
    for batch in batches:
        with contextlib.suppress(KeyError):  # swallows: the old outputs could be read after the block
            outputs = model(**batch)
        predictions = outputs.logits
    return predictions


@pytest.mark.parametrize("code, reads", [
    (evaluated_without_grad, [caller_code.PATHS] * 2 + [False] * 2), (evaluated_under_suppress, [False] * 4),
    (train_then_evaluate, [caller_code.PATHS] * 2 + [False] * 2), (read_in_a_handler, [False]),
    (read_in_the_next_iteration, [False, False])])
def test_from_python_3_11_each_path_from_the_call_is_read(code: Callable, reads: list):
    """Python 3.11+ (an exception table, so every path is read off the code): a training loop and an evaluation in one
    function that both name their output `outputs` (accelerate's examples) are told apart, also where the evaluation
    runs under `torch.no_grad()`, which never swallows an exception; an exception handler, a block that can swallow
    one (`contextlib.suppress`) or the next iteration that reads the logits keeps them. Before 3.11, any read of the
    name anywhere keeps them."""
    model = Reader()
    try:
        code(model, [{}, {}])
    except (RuntimeError, KeyError, ValueError, TypeError):
        pass
    assert model.seen == reads


def test_a_python_whose_bytecode_is_unread_keeps_the_logits(monkeypatch):
    """On a Python newer than the rules were read against, no caller's code is trusted: a loop that reads the loss
    alone, directly or through a helper, keeps the logits."""
    monkeypatch.setattr(caller_code, "KNOWN", False)
    model = Walker()
    attribute(model, {})
    through_a_helper(model, {})
    assert model.seen == [False, False]


def test_module_level_code_keeps_the_logits():
    """A script's top level stores its output in a global, which any function can read."""
    model = Reader()
    exec(compile("outputs = model(x=1)\nloss = outputs.loss\n", "<script>", "exec"), {"model": model})
    assert model.seen == [False]


def loss_alone(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    outputs = model(**batch)
    loss = outputs.loss
    return loss


def loss_and_logits(model: torch.nn.Module, batch: dict, seen: list) -> torch.Tensor:
    outputs = model(**batch)
    seen.append(tuple(outputs.logits.shape))
    return outputs.loss


def train(model: torch.nn.Module, unpad: Optional[str], reads_logits: bool = False, prepare: Callable = None,
          compiled: bool = False, step: Callable = loss_alone) -> dict:
    """A loop of the user's own: 2 SGD steps on 4 rows each, then an evaluation under no_grad, patched with `unpad`
    (None: unpatched). `prepare` wraps the model and its optimizer (accelerate)."""
    rows = rows_of(model)
    batches = [{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]} for i in (0, 4)]
    model.train()
    handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if unpad else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    runner, backward = model, (lambda loss: loss.backward())
    if prepare is not None:
        runner, optimizer, backward = prepare(model, optimizer)
    if compiled:
        runner = torch.compile(runner, backend="eager")
    losses, seen = [], []
    try:
        for batch in batches:
            optimizer.zero_grad()
            loss = loss_and_logits(runner, batch, seen) if reads_logits else step(runner, batch)
            backward(loss)
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            evals = [runner(**batch).loss.item() for batch in batches]
        heads = dict(handle.heads) if handle else {}
    finally:
        if handle is not None:
            handle.revert()
        if compiled:
            torch._dynamo.reset()
    return dict(losses=losses, evals=evals, heads=heads, seen=seen,
                weights={n: p.detach().clone() for n, p in model.named_parameters()})


def assert_alike(got: dict, want: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5), (got["losses"], want["losses"])
    assert got["evals"] == pytest.approx(want["evals"], abs=1e-5), (got["evals"], want["evals"])
    assert got["seen"] == want["seen"]
    for name in want["weights"]:
        torch.testing.assert_close(got["weights"][name], want["weights"][name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("unpad", ["model", "loss"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_5_text"])
def test_a_loop_that_reads_the_loss_alone_runs_the_fused_head_with_unpatched_numbers(unpad, model_type):
    """`outputs = model(**batch)`, then `outputs.loss` alone: both training steps and both evaluation forwards run the
    head fused with the loss (Gemma 2: its softcap in the fused loss; Qwen 3.5: a base model that runs padded)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"no {model_type} in this transformers")
    want, got = (train(family(model_type), way) for way in (None, unpad))
    assert got["heads"] == {lm_head.FUSED: 4}
    assert_alike(got, want)


def test_a_trainer_subclass_whose_compute_loss_calls_the_model_runs_its_training_steps_fused(tmp_path):
    """A Trainer subclass's compute_loss that calls the model itself and reads `outputs.loss`, returning the outputs
    only where asked: its training steps (return_outputs=False) run the head fused with the loss; its evaluations ask
    for the outputs and get the logits. Eval losses, training losses and trained weights equal unpatched."""
    import transformers as tf
    from test_lm_head import assert_trained_alike
    from test_trainer_loss_alone import assert_evals_alike, run

    class Trainer(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            loss = outputs.loss
            return (loss, outputs) if return_outputs else loss

    want, got = (run(family("llama"), way, tmp_path, trainer_class=Trainer) for way in (None, "model"))
    assert got["heads"] == {lm_head.FUSED: 2 * 2, lm_head.REAL_TOKENS: 2 * 2}
    assert_evals_alike(got, want)
    assert_trained_alike(got["trained"], want["trained"])


def test_a_loop_that_reads_the_logits_gets_them():
    """The same loop reading `outputs.logits` too: its training forwards keep the logits (the head on real tokens),
    with the unpatched shapes and numbers; its evaluation, which reads the loss alone, runs fused."""
    want, got = (train(family("llama"), way, reads_logits=True) for way in (None, "model"))
    assert got["heads"] == {lm_head.REAL_TOKENS: 2, lm_head.FUSED: 2}
    assert_alike(got, want)


def train_and_evaluate(model: torch.nn.Module, batches: list, optimizer: torch.optim.Optimizer) -> tuple:
    """accelerate's nlp_example's shape: training and evaluation in one function, both naming their output
    `outputs`; the evaluation reads the logits."""
    model.train()
    losses = []
    for batch in batches:
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    logits = []
    for batch in batches:
        with torch.no_grad():
            outputs = model(**batch)
        logits.append(outputs.logits)
    return losses, logits


def test_a_function_that_trains_then_evaluates_the_logits_runs_its_training_steps_fused():
    """From Python 3.11 the training steps of such a function run fused and its evaluation gets the logits (before,
    every forward of the function keeps them); losses, weights and evaluated logits equal unpatched."""

    def run(unpad: Optional[str]) -> tuple:
        model = family("llama")
        rows = rows_of(model)
        batches = [{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]} for i in (0, 4)]
        handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if unpad else None
        try:
            losses, logits = train_and_evaluate(model, batches, torch.optim.SGD(model.parameters(), lr=0.1))
            return losses, logits, [b["attention_mask"].bool() for b in batches], dict(handle.heads) if handle else {}
        finally:
            if handle is not None:
                handle.revert()

    want, got = run(None), run("model")
    fused = 2 if caller_code.PATHS else 0
    assert got[3] == {k: v for k, v in {lm_head.FUSED: fused, lm_head.REAL_TOKENS: 4 - fused}.items() if v}
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    for g, w, real in zip(got[1], want[1], got[2]):
        torch.testing.assert_close(g[real], w[real], atol=2e-5, rtol=1e-4)


def accelerated(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    import accelerate

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # another test's Accelerator set it
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator.backward


class LitModel(torch.nn.Module):
    """A PyTorch Lightning module's shape (its transformers example): `forward` returns the LM's output as it is, and
    `training_step` reads `outputs[0]`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: dict) -> torch.Tensor:
        outputs = self(**batch)
        return outputs[0]


def forward_pass(model: torch.nn.Module, batch: dict, losses: list) -> Any:
    """A script's helper: runs the model, notes its loss, returns the output."""
    outputs = model(**batch)
    losses.append(outputs.loss.item())
    return outputs


def lightning(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    return LitModel(model), optimizer, lambda loss: loss.backward()


@pytest.mark.parametrize("way", ["accelerate", pytest.param("compiled", marks=pytest.mark.heavy), "lightning",
                                 "helper"])
def test_a_loop_through_accelerate_a_compiled_model_or_a_module_of_its_own_runs_the_fused_head(way):
    """accelerate's prepared model and its `backward`, `torch.compile(model)` (dynamo's eager backend), a module of
    the user's whose forward returns the LM's output (Lightning's shape, reading `outputs[0]`), or a helper that
    notes the loss and returns the output: their frames pass the output on, and the loop's forwards run fused with
    the unpatched numbers. Compiled, the fused forward's check of the cache (`filled_cache.cache_is_storage`) is
    traced without dynamo's warning."""
    if way == "accelerate":
        pytest.importorskip("accelerate")
    options = {"accelerate": dict(prepare=accelerated), "compiled": dict(compiled=True),
               "lightning": dict(prepare=lightning, step=lambda runner, batch: runner.training_step(batch)),
               "helper": dict(step=lambda runner, batch: forward_pass(runner, batch, []).loss)}[way]
    want = train(family("llama"), None, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(family("llama"), "model", **options)
    assert got["heads"] == {lm_head.FUSED: 4}
    assert_alike(got, want)
    # dynamo traces patchkit's reads of the model's class without its "silent incorrectness" warning
    assert not [w for w in caught if "lru_cache" in str(w.message)]


def run_clm_no_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Any,
                       train_batches: list, eval_batches: list) -> tuple:
    """The training and evaluation loops of transformers' `examples/pytorch/language-modeling/run_clm_no_trainer.py`,
    as that script writes them (one function; `outputs` in both; gradient accumulation through accelerate)."""
    total_loss = 0
    losses_seen = []
    model.train()
    for step, batch in enumerate(train_batches):  # noqa: B007 (as the script writes it)
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            losses_seen.append(loss.item())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    losses = []
    for step, batch in enumerate(eval_batches):  # noqa: B007
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(len(batch["input_ids"]))))
    losses = torch.cat(losses)
    eval_loss = torch.mean(losses)
    return losses_seen, eval_loss.item(), total_loss.item()


def test_transformers_run_clm_no_trainer_loop_runs_fused_with_unpatched_numbers():
    """transformers' own accelerate example, its loops as written: every training micro-batch (under
    `accelerator.accumulate`, a with block whose manager could swallow an exception: the variable is stored again
    before any later read) and every evaluation forward (under `torch.no_grad()`, read by `outputs.loss` after the
    block) runs the head fused with the loss; losses, eval loss and trained weights equal unpatched."""
    accelerate = pytest.importorskip("accelerate")

    def run(unpad: Optional[str]) -> tuple:
        model = family("llama")
        rows = rows_of(model)
        batches = [{k: torch.stack([r[k] for r in rows[i:i + 2]]) for k in rows[0]} for i in (0, 2, 4, 6)]
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared, optimizer = accelerator.prepare(model, optimizer)
        handle = patchkit.apply_patch(model=model, backend="sdpa", unpad=unpad) if unpad else None
        try:
            numbers = run_clm_no_trainer(prepared, optimizer, accelerator, batches, batches[:2])
            return numbers, dict(handle.heads) if handle else {}, {n: p.detach().clone()
                                                                    for n, p in model.named_parameters()}
        finally:
            if handle is not None:
                handle.revert()

    (want, _, want_weights), (got, heads, got_weights) = run(None), run("model")
    fused = 6 if caller_code.PATHS else 0
    assert heads == {k: v for k, v in {lm_head.FUSED: fused, lm_head.REAL_TOKENS: 6 - fused}.items() if v}
    assert [*got[0], *got[1:]] == pytest.approx([*want[0], *want[1:]], abs=1e-5)
    for name, weight in want_weights.items():
        torch.testing.assert_close(got_weights[name], weight, atol=2e-5, rtol=1e-4, msg=name)


def cached_steps(model: torch.nn.Module, batches: list) -> tuple:
    """A loop that reads each step's loss alone through a cached helper, then the first step's logits from the cache."""
    @functools.cache
    def outputs_for(i):
        return model(**batches[i])

    losses = []
    for i in range(len(batches)):
        loss = outputs_for(i).loss
        loss.backward()
        losses.append(loss.item())
    return losses, outputs_for(0).logits.detach()


def test_a_helpers_output_kept_by_a_cache_keeps_its_logits():
    """`functools.lru_cache` around a helper that returns the LM's output: the loop reads `.loss` alone, then the cached
    output's logits. The cache (a C function) is between them, so the logits are kept (they were None: a crash)."""
    import copy

    model = family("llama")
    rows = rows_of(model)
    batches = [{k: torch.stack([r[k] for r in rows[i:i + 4]]) for k in rows[0]} for i in (0, 4)]
    plain = copy.deepcopy(model).train()
    want = cached_steps(plain, batches)
    with patchkit.apply_patch(model=model.train(), backend="sdpa"):
        got = cached_steps(model, batches)
    assert got[0] == pytest.approx(want[0], abs=1e-5)
    real = batches[0]["attention_mask"].bool()
    torch.testing.assert_close(got[1][real], want[1][real], atol=1e-5, rtol=1e-5)
