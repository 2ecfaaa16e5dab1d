"""Never silently wrong across a patch's life: applied or reverted while a forward is in flight, and after it.

An instance-patched model whose attention is changed, that is copied, saved or garbage-collected, or that is patched
over a class patch: exact, or refused naming the cause."""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
import transformers
from families import set_attention
from models import labels_for, padded_batch, tiny_model

import patchkit
from patchkit import PatchInputError
from patchkit.hooks.install.routing import is_patched_forward


def test_revert_while_a_forward_is_in_flight_finishes_it_exactly():
    """Item 5: a revert from inside a forward crashed deep in torch with a VarlenMask type error. The forward's
    masks were made for patchkit, so its remaining layers finish on patchkit's attention; the next runs unpatched."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    hook = model.model.layers[0].register_forward_hook(patchkit.shape_free(lambda *a: handle.revert()))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    hook.remove()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)
    assert handle.calls == 2 and not handle.active
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert handle.calls == 2  # the next forward runs unpatched


def test_apply_while_a_forward_is_in_flight_finishes_it_on_transformers_attention():
    """The layers after the apply get transformers' own mask, so they run transformers' own attention: exact."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    hook = model.model.layers[0].register_forward_hook(patchkit.shape_free(
        lambda *a: patchkit.apply_patch("llama2", backend="sdpa") and None
    ))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    hook.remove()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    assert patchkit.active_patches()[0].calls == 0  # the next forward runs patched


def test_set_attn_implementation_after_an_instance_patch_names_the_cause():
    """Item 6: refused with the generic 4D-mask text, which named neither cause."""
    model = tiny_model()
    ids, mask = padded_batch("right")
    patchkit.apply_patch("llama2", model=model, backend="sdpa")
    set_attention(model, "sdpa")  # set_attn_implementation (4.56+), or the config field it sets
    with pytest.raises(PatchInputError, match=r"changed to 'sdpa' after patchkit patched it.*set_attn_implementation"):
        model(input_ids=ids, attention_mask=mask)


def test_deepcopy_of_an_instance_patched_model_is_patched_and_reverted_with_it():
    """Item 7: the copy stayed patched after revert_patch(), and nothing could revert it."""
    model = tiny_model()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    handle = patchkit.apply_patch("llama2", model=model, backend="sdpa")
    twin = copy.deepcopy(model)
    assert handle.check(twin) == 2
    with torch.no_grad():
        got = twin(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    patchkit.revert_patch()
    modules = [*twin.modules(), *model.modules()]
    assert not any(is_patched_forward(vars(m).get("forward")) for m in modules if "forward" in vars(m))
    # every instance-level method is gone from the copy too: attention, the base model's and the LM's forward
    assert [type(m).__name__ for m in modules if "forward" in vars(m)] == []
    assert twin.config._attn_implementation == model.config._attn_implementation == "eager"
    with torch.no_grad():
        after = twin(input_ids=ids, attention_mask=mask).logits  # the reverted copy runs as the unpatched model
    torch.testing.assert_close(after[real], want[real], atol=2e-5, rtol=1e-4)


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_a_saved_instance_patched_model_loads_and_runs_without_patchkit(tmp_path):
    import subprocess

    model = tiny_model()
    ids, mask = padded_batch("mixed")
    patchkit.apply_patch("llama2", model=model, backend="sdpa")
    torch.save({"model": model, "ids": ids, "mask": mask}, tmp_path / "model.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids, attention_mask=mask).logits, tmp_path / "want.pt")
    script = (
        "import sys, torch; sys.modules['patchkit'] = None  # patchkit cannot be imported here\n"
        f"d = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "with torch.no_grad(): got = d['model'](input_ids=d['ids'], attention_mask=d['mask']).logits\n"
        f"want = torch.load({str(tmp_path / 'want.pt')!r}); real = d['mask'].bool()\n"
        "torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4); print('LOADED', "
        "d['model'].config._attn_implementation)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED eager" in done.stdout


def test_a_pickled_instance_patched_model_loaded_under_a_class_patch_keeps_none_of_it():
    """A model pickled while instance-patched (torch.save of the whole model) and loaded while a class patch was
    active held that class patch's forward on the instance: after the class patch's revert its LM still handed the
    head the packed row, and the loss failed against the padded labels. It loads with the class's own method, by
    builtins alone (no patchkit needed to load it)."""
    import io
    import pickle

    from models import labels_for

    model = tiny_model()
    ids, mask = padded_batch("left")
    labels = labels_for(ids, mask)
    want = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    with patchkit.apply_patch("llama2", model=model, backend="sdpa"):
        blob = pickle.dumps(model)

    class WithoutPatchkit(pickle.Unpickler):
        def find_class(self, module, name):
            assert not module.startswith(("patchkit", "_patchkit")), f"the pickle needs {module}.{name}"
            return super().find_class(module, name)

    with patchkit.apply_patch(backend="sdpa"):
        loaded = WithoutPatchkit(io.BytesIO(blob)).load()
    assert not any(is_patched_forward(vars(m).get("forward")) for m in loaded.modules() if "forward" in vars(m))
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss, want)


def test_a_collected_model_leaves_no_handle():
    model = tiny_model()
    patchkit.apply_patch("llama2", model=model.model, backend="sdpa")  # a submodule: the patch binds to it
    assert len(patchkit.active_patches()) == 1
    del model
    gc.collect()
    assert patchkit.active_patches() == []


@pytest.mark.parametrize("revert_class_first", [True, False])
def test_an_instance_patch_over_a_class_patch_counts_its_own_forwards(revert_class_first):
    """A class patch, a model built under it, then an instance patch on that model: its forwards ran through both
    wrappers and were counted on the class handle, even after the class patch was reverted (the instance patch had
    wrapped the class's patched forward), while the instance handle said 0 calls and 0 layers. The instance patch
    now wraps transformers' own forward: its handle counts every forward, the class handle none, exact throughout."""
    ids, mask = padded_batch("right")
    model = tiny_model()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    cls = patchkit.apply_patch("llama2", backend="sdpa")
    instance = patchkit.apply_patch(model=model, backend="sdpa")
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask).logits
        assert instance.layers_patched == model.config.num_hidden_layers and cls.calls == 0
        (cls if revert_class_first else instance).revert()
        second = model(input_ids=ids, attention_mask=mask).logits
    (instance if revert_class_first else cls).revert()
    layers = model.config.num_hidden_layers
    assert cls.calls == (0 if revert_class_first else layers)  # the class patch serves the model once alone
    assert instance.calls == (2 * layers if revert_class_first else layers)
    real = mask.bool()
    for got in (first, second):
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert not is_patched_forward(model.model.forward)


@pytest.mark.parametrize("model_type", ["opt", "moshi", "gemma4_unified_text"])
def test_an_instance_patch_over_a_class_patch_finds_the_mask_builder_of_a_family_served_from_data(model_type):
    """A family served from data is read from its modeling code at apply time: which class's forward builds the
    masks. Under a class patch (`PATCHKIT_FLASH_ATTN=1`'s, then the script's `apply_patch(model=...)`), that forward
    was patchkit's and read nothing: Moshi's depth decoder was taken for its mask builder and the instance patch
    raised that it found no such module with attention layers; OPT's outer model was taken for its decoder (Gemma4
    Unified's multimodal model for its text model) and the instance patch installed on it served no layer (the class
    patch did, the instance handle counted 0 calls)."""
    from census import tiny_lm

    from patches.table import serves_here

    if not serves_here():
        pytest.skip("the table serves transformers 5.x")
    torch.manual_seed(0)
    reference, why = tiny_lm(model_type)
    if reference is None:
        pytest.skip(why)
    ids, mask = padded_batch("left")  # the census models have the same 97-token vocabulary
    with torch.no_grad():
        want = reference.eval()(input_ids=ids, attention_mask=mask).logits
    with patchkit.apply_patch(backend="sdpa") as every:
        model, _ = tiny_lm(model_type)
        model.load_state_dict(reference.state_dict())
        with patchkit.apply_patch(model=model.eval(), backend="sdpa") as instance:
            with torch.no_grad():
                got = model(input_ids=ids, attention_mask=mask).logits
            assert instance.calls == instance.layers_patched >= 1 and every.calls == 0, instance.report()
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


def test_every_family_served_from_data_reads_the_same_classes_under_a_class_patch():
    """What the table reads of each family's modeling code (attention, mask builder, causal LM) is the same with
    every family class-patched as without: a patched forward is read through to transformers' own."""
    from patches import table

    if not table.serves_here():
        pytest.skip("the table serves transformers 5.x")
    found = {t: table.find_classes(t) for t in sorted(table.VERIFIED)}
    with patchkit.apply_patch(backend="sdpa"):
        patched = {t: table.find_classes(t) for t in found}
    assert {t: c for t, c in patched.items() if c != found[t]} == {}


def test_patching_a_peft_wrapper_of_a_patched_model_is_the_same_patch_and_reverts_in_any_order():
    """apply_patch(model=base), PEFT's wrapper around it, apply_patch(model=peft_model): the second handle saved the
    first's wrapper as the LM's original forward, so reverting the first, then the second, left a stale wrapper on
    the model (training forwards failed, logits 6.9e-6 off). A model inside or around one patched already is that
    patch: the same handle, one revert."""
    peft = pytest.importorskip("peft")
    model = tiny_model(kv_heads=2)
    first = patchkit.apply_patch(model=model, backend="sdpa")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    second = patchkit.apply_patch(model=wrapped, backend="sdpa")
    assert second is first
    with pytest.raises(patchkit.PatchkitError, match="already applied to this model"):
        patchkit.apply_patch(model=wrapped, backend="sdpa", unpad="attention")
    first.revert()
    second.revert()
    assert not any(is_patched_forward(m.forward) for m in wrapped.modules())
    assert all("forward" not in vars(m) for m in model.modules()), "an instance forward was left behind"


class OwnLossLM(transformers.LlamaForCausalLM):
    """A user's causal LM that computes its loss from the logits itself, passing no labels to the class's forward."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-1]
            out.loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        return out


def test_a_subclass_computing_its_own_loss_from_the_logits_steps_aside_for_its_labels_at_padding():
    """Under a class patch, the subclass calls the patched forward through `super()` without its labels: the labels
    predicted from left padding were unseen, and the loss (from logits at padding positions, which varlen kernels
    never compute) was silently other. The subclass's call is now read; real labels still run patched."""
    ids, mask = padded_batch("left")
    naive, real = ids.masked_fill(mask == 0, -100), labels_for(ids, mask)
    torch.manual_seed(0)
    plain = OwnLossLM(tiny_model().config).train()

    def step(model, labels):
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    want = {"naive": step(plain, naive), "real": step(plain, real)}
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        patched = OwnLossLM(plain.config).train()
        patched.load_state_dict(plain.state_dict())
        with pytest.warns(RuntimeWarning, match="labels_from_padding"):
            got = step(patched, naive)
        assert handle.stepped_aside == {"labels_from_padding": 1}
        for a, b in zip(got, want["naive"]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        calls = handle.calls
        for a, b in zip(step(patched, real), want["real"]):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        assert handle.calls > calls and handle.stepped_aside == {"labels_from_padding": 1}


class TargetsLM(transformers.LlamaForCausalLM):
    """nanoGPT's naming: the labels of its own loss are `targets`."""

    def forward(self, input_ids=None, attention_mask=None, targets=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if targets is not None:
            logits = out.logits[:, :-1]
            out.loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten())
        return out


TargetsLM.forward.__module__ = None  # as a class exec() defines without a __name__: read, not crashed on


@pytest.mark.parametrize("way", ["class", "instance"])
def test_a_subclass_naming_its_labels_targets_steps_aside_for_them_at_padding(way):
    """A subclass whose own loss reads `targets` (nanoGPT's name), predicted from left padding: its labels were read
    by the name `labels` alone, and the instance patch trained on padding logits (loss 4.5872 for 4.5940, head
    gradient 26% off); a forward whose `__module__` is None crashed the frame reading."""
    ids, mask = padded_batch("left")
    naive = ids.masked_fill(mask == 0, -100)
    torch.manual_seed(0)
    plain = TargetsLM(tiny_model().config).train()

    def step(model):
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, targets=naive).loss
        loss.backward()
        return loss.detach(), model.lm_head.weight.grad.clone()

    want = step(plain)
    with patchkit.apply_patch("llama2" if way == "class" else None, model=plain if way == "instance" else None,
                              backend="sdpa") as handle:
        patched = plain
        if way == "class":
            patched = TargetsLM(plain.config).train()
            patched.load_state_dict(plain.state_dict())
        got = step(patched)
        assert handle.stepped_aside == {"labels_from_padding": 1}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", None], ids=["one family", "every family"])
def test_a_with_block_under_a_reverted_handle_is_refused_not_run_unpatched(name):
    """`with handle:` after `handle.revert()` ran its block unpatched without a word; an unknown name is a
    PatchkitError (and a ValueError, as it was)."""
    handle = patchkit.apply_patch(name, backend="sdpa")
    handle.revert()
    with pytest.raises(patchkit.PatchkitError, match="reverted.*applies it again"):
        with handle:
            pass
    with pytest.raises(patchkit.PatchkitError, match="unknown patch 'lama'") as refused:
        patchkit.apply_patch("lama", backend="sdpa")
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize("name", ["llama", None], ids=["one family", "every family"])
def test_a_with_block_nested_in_another_keeps_the_outer_blocks_patch(name):
    """`with apply_patch():` inside another (or inside a script's own apply_patch()) returns the same patch: the
    inner block's exit reverted it, and the rest of the outer block ran unpatched, without a word."""
    model = tiny_model(kv_heads=2)
    ids, mask = padded_batch("right")
    outer = patchkit.apply_patch(name, backend="sdpa")
    try:
        with patchkit.apply_patch(name, backend="sdpa") as inner:
            assert inner is outer
        assert outer.active
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert outer.calls > 0
    finally:
        outer.revert()
    assert not outer.active and not patchkit.active_patches()
    with patchkit.apply_patch(name, backend="sdpa") as first:
        with patchkit.apply_patch(name, backend="sdpa"):
            pass
        assert first.active
    assert not first.active


def test_an_instance_patch_bound_again_as_a_method_is_refused_by_name_and_reverts():
    """accelerate's unwrap_model(keep_fp32_wrapper=False) binds what it cannot strip as a method of the model:
    patchkit's patch then got the model as its input ids (a TypeError naming neither). Refused naming the fix; the
    revert leaves what that unwrapping would have: the forward under the instance's wrapper (its `__wrapped__`),
    here the class's, not the wrapper it stripped."""
    import functools
    import types

    model = tiny_model()
    ids, mask = padded_batch("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    inner = type(model).forward
    model.forward = types.MethodType(functools.wraps(inner)(lambda self, *a, **k: inner(self, *a, **k)), model)
    handle = patchkit.apply_patch(model=model, backend="sdpa")  # over a mixed-precision wrapper's forward
    model.forward = types.MethodType(model.forward, model)  # as accelerate's extract_model_from_parallel does
    with pytest.raises(patchkit.PatchkitError, match="bound to it again.*apply_patch\\(model=...\\) after unwrapping"):
        model(input_ids=ids, attention_mask=mask)
    handle.revert()
    assert "forward" not in vars(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, want)
