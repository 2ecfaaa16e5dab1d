"""attn_implementation="patchkit" alone: a model is adopted where it gets the name, and its masks read its calls there.

The mask function must know what only the causal LM's call shows (a label predicted from padding steps aside). It
learns it from the LM's own adopted forward, however the LM is called (PEFT calls `.forward` directly, compile,
wrappers) and whichever way the model got the name; a model named where patchkit could not see it steps aside.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from models import labels_for, needs_mask_interface, padded_batch, tiny_config
from transformers import LlamaForCausalLM

import patchkit
from patchkit.errors import PatchInputError
from patchkit.hooks.name import attention_interface, named

pytestmark = needs_mask_interface


@pytest.fixture(autouse=True)
def sdpa_route():
    attention_interface.register(backend="sdpa")
    yield
    attention_interface.register(backend="auto", strict=False)


@pytest.fixture
def pair():
    """An unpatched model and an unnamed copy of it, built while patchkit watches."""
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_config(kv_heads=2))
    plain = LlamaForCausalLM(tiny_config(kv_heads=2))
    plain.load_state_dict(eager.state_dict())
    return eager, plain


def loss_of(model, ids, mask, labels):
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


@pytest.mark.parametrize("way", ["config field", "set_attn_implementation", "deepcopy, then config field"])
def test_labels_at_padding_step_aside_and_real_labels_run_patched_whichever_way_the_model_got_the_name(pair, way):
    eager, plain = pair
    if way == "set_attn_implementation":
        if not hasattr(plain, "set_attn_implementation"):
            pytest.skip("set_attn_implementation: transformers 4.54+")
        plain.set_attn_implementation("patchkit")
        model = plain
    else:
        model = copy.deepcopy(plain) if way.startswith("deepcopy") else plain
        model.config._attn_implementation = "patchkit"
    ids, mask = padded_batch("right")
    state = attention_interface.route_state()
    calls, aside = state.calls, dict(state.stepped_aside)
    with pytest.warns(RuntimeWarning, match="labels_from_padding"):
        got = loss_of(model, ids, mask, ids)
    torch.testing.assert_close(got, loss_of(eager, ids, mask, ids), atol=1e-6, rtol=1e-6)
    assert state.stepped_aside.get("labels_from_padding", 0) - aside.get("labels_from_padding", 0) == 2
    real = labels_for(ids, mask)
    torch.testing.assert_close(loss_of(model, ids, mask, real), loss_of(eager, ids, mask, real), atol=2e-5,
                               rtol=1e-4)
    assert state.calls - calls == 2  # the real labels' forward, both layers, patched


def test_peft_calling_the_lms_forward_directly_still_reports_labels_at_padding(pair):
    """PEFT's LoRA model calls the causal LM's `.forward` itself, past any module hook: the adopted forward is the
    instance's own, so it still sees the labels."""
    peft = pytest.importorskip("peft")
    eager, plain = pair
    plain.config._attn_implementation = "patchkit"
    lora = peft.get_peft_model(plain, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM"))  # B starts at 0: the same numbers
    ids, mask = padded_batch("right")
    with pytest.warns(RuntimeWarning, match="labels_from_padding"):
        got = loss_of(lora, ids, mask, ids)
    torch.testing.assert_close(got, loss_of(eager, ids, mask, ids), atol=1e-6, rtol=1e-6)


@pytest.mark.heavy  # torch.compile: make test-heavy
def test_a_compiled_named_model_steps_aside_for_labels_at_padding():
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_config(kv_heads=2, layers=1))  # one layer: dynamo traces less
    plain = copy.deepcopy(eager)
    plain.config._attn_implementation = "patchkit"
    compiled = torch.compile(plain, backend="eager")
    ids, mask = padded_batch("right")
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="labels_from_padding"):  # once: the second call is not warned again
        losses = [loss_of(compiled, ids, mask, ids) for _ in range(2)]
    want = loss_of(eager, ids, mask, ids)
    for got in losses:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_mask_interface
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_output_attentions_under_the_name_alone_steps_aside_onto_the_attention_it_had(attn):
    """output_attentions=True on a causal LM named 'patchkit': the weights varlen kernels never form come from the
    attention the model had before it was named, as unnamed (eager's weights; sdpa's none, as transformers gives
    them), counted per layer as `output_attentions` (before, it was refused). So does a base model called alone
    (also refused before); strict=True refuses both."""
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(tiny_config(kv_heads=2), attn_implementation=attn).eval()
    named_model = copy.deepcopy(plain)
    named_model.set_attn_implementation("patchkit")
    ids, mask = padded_batch("left")
    attention_interface.register(backend="sdpa")
    state = attention_interface.route_state()
    aside = state.stepped_aside.get("output_attentions", 0)
    with pytest.warns(RuntimeWarning, match=r"\(output_attentions\)"):
        got = named_model(input_ids=ids, attention_mask=mask, output_attentions=True)
    want = plain(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert state.stepped_aside.get("output_attentions", 0) == aside + 2  # both layers
    assert torch.equal(got.logits, want.logits)
    if attn == "eager":  # sdpa gives no weights, as transformers gives them (an empty tuple, or None before 5)
        assert len(got.attentions) == len(want.attentions) == 2
    else:
        assert not got.attentions and not want.attentions and type(got.attentions) is type(want.attentions)
    for g, w in zip(got.attentions or (), want.attentions or ()):
        assert torch.equal(g, w)
    aside = state.stepped_aside["output_attentions"]
    got = named_model.model(input_ids=ids, attention_mask=mask, output_attentions=True)  # a base model called alone
    want = plain.model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert state.stepped_aside["output_attentions"] == aside + 2
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    assert type(got.attentions) is type(want.attentions) and len(got.attentions or ()) == len(want.attentions or ())
    for g, w in zip(got.attentions or (), want.attentions or ()):
        assert torch.equal(g, w)
    attention_interface.register(backend="sdpa", strict=True)
    try:
        for call in (named_model, named_model.model):
            with pytest.raises(PatchInputError, match=r"output_attentions=True \(on the call or the config\)"):
                call(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        attention_interface.register(backend="sdpa")


@pytest.mark.heavy  # torch.compile: make test-heavy
@needs_mask_interface
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
def test_a_compiled_named_model_steps_aside_onto_the_attention_it_had(attn, fullgraph):
    """Compiled (a graph that may break, as the Trainer's torch_compile=True, or one graph), a forward stepped aside
    under the name alone runs the attention the model had before it was named, as uncompiled: left padding whose
    first real token is labelled, where eager and sdpa differ (before, the graph ran eager whatever the model had:
    4e-2 off an sdpa model's Trainer loss)."""
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(tiny_config(kv_heads=2, layers=1), attn_implementation=attn).train()
    named_model = copy.deepcopy(plain)
    named_model.set_attn_implementation("patchkit")
    compiled = torch.compile(named_model, backend="eager", fullgraph=fullgraph)
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)  # the first real token after left padding is labelled
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="compiled_fullgraph" if fullgraph else "labels_from_padding"):
        got = loss_of(compiled, ids, mask, labels)
    want = loss_of(plain, ids, mask, labels)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got.backward(), want.backward()
    for (name, p), q in zip(named_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    plain.set_attn_implementation("eager" if attn == "sdpa" else "sdpa")  # the two really differ here
    assert abs(loss_of(plain, ids, mask, labels).item() - want.item()) > 1e-4


@pytest.mark.heavy  # a fresh interpreter, torch.compile: make test-heavy
@needs_mask_interface
@pytest.mark.parametrize("first", ["padded", "no mask"])
def test_a_model_built_with_the_name_compiles_fullgraph_in_a_fresh_process(first):
    """A fresh interpreter, a model built with attn_implementation='patchkit', compiled with fullgraph=True: its first
    forward is traced, and patchkit's table is read when the name registers and the route's state is made when the
    model gets the name, not first in the graph (where dynamo refused the import, and the state's maker, which reads
    the machine, is not traced: both crashed). The logits at real tokens are sdpa's."""
    import subprocess
    import sys

    mask = "(ids != 0).long()" if first == "padded" else "None"
    code = (
        "import torch, patchkit\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "patchkit.register_attention(backend='sdpa')\n"
        "cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)\n"
        "torch.manual_seed(0)\n"
        "m = LlamaForCausalLM._from_config(cfg, attn_implementation='patchkit').eval()\n"
        "ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]])\n"
        f"mask = {mask}\n"
        "kw = dict(input_ids=ids, attention_mask=mask, use_cache=False) if mask is not None else dict(input_ids=ids)\n"
        "with torch.no_grad():\n"
        "    got = torch.compile(m, backend='eager', fullgraph=True)(**kw).logits\n"
        "    m.set_attn_implementation('sdpa')\n"
        "    want = m(**kw).logits\n"
        "real = torch.ones_like(ids).bool() if mask is None else mask.bool()\n"
        "print('off', (got - want)[real].abs().max().item())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert float(proc.stdout.split("off")[-1]) <= 1e-5, proc.stdout


@pytest.mark.parametrize("way", ["config field", "set_attn_implementation"])
def test_every_model_built_on_a_named_config_is_adopted(pair, way):
    """Two models on one config object (a policy and its reference, as RL scripts build them): naming one names the
    other (transformers writes the shared config), so both are adopted; the other's labels at padding step aside."""
    eager, plain = pair
    ref = LlamaForCausalLM(plain.config)
    ref.load_state_dict(eager.state_dict())
    if way == "set_attn_implementation":
        if not hasattr(plain, "set_attn_implementation"):
            pytest.skip("set_attn_implementation: transformers 4.54+")
        plain.set_attn_implementation("patchkit")
    else:
        plain.config._attn_implementation = "patchkit"
    assert ref.config._attn_implementation == "patchkit"
    ids, mask = padded_batch("right")
    real = labels_for(ids, mask)
    state = attention_interface.route_state()
    for model in (plain, ref):
        aside = state.stepped_aside.get("labels_from_padding", 0)
        got = loss_of(model, ids, mask, ids)  # (warned once, by the first)
        torch.testing.assert_close(got, loss_of(eager, ids, mask, ids), atol=1e-6, rtol=1e-6)
        assert state.stepped_aside["labels_from_padding"] - aside == 2
        torch.testing.assert_close(loss_of(model, ids, mask, real), loss_of(eager, ids, mask, real), atol=2e-5,
                                   rtol=1e-4)


def test_a_model_named_where_patchkit_could_not_see_it_steps_aside_exactly_and_strict_refuses(pair):
    """The config's internal field written directly (past the property patchkit watches): patchkit cannot read the
    model's calls, so the forward runs on transformers' attention, with one warning that names the fix."""
    eager, plain = pair
    plain.config._attn_implementation_internal = "patchkit"
    ids, mask = padded_batch("right")
    state = attention_interface.route_state()
    aside = state.stepped_aside.get("named_unseen", 0)
    with pytest.warns(RuntimeWarning, match=r"named_unseen.*set_attn_implementation"):
        got = plain(input_ids=ids, attention_mask=mask).logits
    want = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # padding positions too: transformers' own
    assert state.stepped_aside["named_unseen"] - aside == 2
    attention_interface.register(strict=True)
    with pytest.raises(patchkit.PatchkitError, match="could not see it"):
        plain(input_ids=ids, attention_mask=mask)


def test_an_adopted_model_pickles_as_transformers_own(pair):
    """A pickled model (torch.save of the whole model) holds nothing of patchkit's: it loads where patchkit is not
    installed, and runs unpatched until it is named again."""
    _, plain = pair
    plain.config._attn_implementation = "patchkit"
    assert named.adopted(plain.config) and "forward" in vars(plain)

    class WithoutPatchkit(pickle.Unpickler):
        def find_class(self, module, name):
            assert not module.startswith(("patchkit", "_patchkit")), f"the pickle needs {module}.{name}"
            return super().find_class(module, name)

    loaded = WithoutPatchkit(io.BytesIO(pickle.dumps(plain))).load()
    assert vars(loaded)["forward"].__func__ is LlamaForCausalLM.forward  # the class's own, bound
    assert not named.adopted(loaded.config)


def test_nothing_on_patchkits_path_reads_the_call_stack():
    """Decisions come from the calls patchkit wraps, never from frames up the stack; only the warnings' own line
    finder (`warn.py`), the build-time judgment of a model's parts (`unserved.py`), the proof that a causal LM's
    caller reads its loss alone (`loss_reader.py`, the HF Trainer's own step, and `caller_code.py`, a caller's own
    code: where they cannot prove it, the logits are returned as ever) and the check that a served language model
    runs inside a generative head no wrapper of patchkit's tells it about, or under a subclass's own forward that
    keeps its labels (`outer_caller.py`: it can only step aside), and TRL's trainers known to read the logits at
    padding (`padding_readers.py`: it only warns) read frames."""
    root = Path(patchkit.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if any(word in p.read_text() for word in ("_getframe", "f_back", "inspect.stack")))
    assert readers == ["hooks/decide/outer_caller.py", "hooks/forwards/unserved.py", "hooks/head/caller_code.py",
                       "hooks/head/loss_reader.py", "hooks/head/padding_readers.py", "warn.py"]


@needs_mask_interface
@pytest.mark.parametrize("loaded", ["built with the name (sdpa, the default)", "sdpa", "eager", "eager, then copied"])
def test_a_forward_stepped_aside_runs_the_attention_the_model_runs_without_the_name(loaded):
    """Labels predicted from left padding step a forward aside. transformers' eager and sdpa attention disagree at a
    padding query that sees no key, whose logits those labels read: the stepped-aside forward runs the attention the
    model had before it was named (transformers' default, sdpa, for one built with the name), mask and function,
    and gives its loss and gradients."""
    import warnings

    attn = "sdpa" if loaded.startswith("built") else loaded.split(",")[0]
    torch.manual_seed(0)
    plain = LlamaForCausalLM._from_config(tiny_config(kv_heads=2), attn_implementation=attn).train()
    torch.manual_seed(0)
    if loaded.startswith("built"):
        named_model = LlamaForCausalLM._from_config(tiny_config(kv_heads=2), attn_implementation="patchkit").train()
    else:
        named_model = copy.deepcopy(plain)
        named_model.set_attn_implementation("patchkit")
        if loaded.endswith("copied"):  # a copy of a named model steps aside onto the same attention
            named_model = copy.deepcopy(named_model)
    ids, mask = padded_batch("left")
    labels = ids.masked_fill(mask == 0, -100)  # the first real token after left padding is labelled
    attention_interface.register(backend="sdpa")
    state = attention_interface.route_state()
    aside = state.stepped_aside.get("labels_from_padding", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = named_model(input_ids=ids, attention_mask=mask, labels=labels).loss
    want = plain(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert state.stepped_aside.get("labels_from_padding", 0) > aside
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got.backward(), want.backward()
    for (name, p), q in zip(named_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    other = "eager" if attn == "sdpa" else "sdpa"  # the two really differ here: the test can tell them apart
    plain.set_attn_implementation(other)
    assert abs(plain(input_ids=ids, attention_mask=mask, labels=labels).loss.item() - want.item()) > 1e-4


def test_a_model_named_under_a_class_patch_makes_no_route_of_its_own(monkeypatch, pair):
    """`apply_patch(backend="sdpa")`, then a model built with attn_implementation="patchkit": the class patch's state
    runs its forwards, so the route's backend is not chosen, nor its fallback warned (it told a user who had passed
    backend='sdpa' that backend='sdpa' silences it). A family no class patch serves still gets the route made."""
    eager, _ = pair
    attention_interface.register(backend="auto")
    monkeypatch.setattr(attention_interface, "_state", None)
    monkeypatch.setattr(attention_interface, "_function", None)
    ids, mask = padded_batch("mixed")
    with patchkit.apply_patch("llama2", backend="sdpa") as handle:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            named = LlamaForCausalLM(named_config()).eval()
            named.load_state_dict(eager.state_dict())
            with torch.no_grad():
                logits = named(input_ids=ids, attention_mask=mask).logits
        assert [str(w.message) for w in caught if "patchkit" in str(w.message)] == []
        assert attention_interface._state is None and handle.layers_patched == 2
    with torch.no_grad():
        expected = eager.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
    with patchkit.apply_patch("mistral", backend="sdpa"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LlamaForCausalLM(named_config())
        assert attention_interface._state is not None
    said = [str(w.message) for w in caught if "attn_implementation='patchkit' runs on the exact sdpa" in str(w.message)]
    assert attention_interface._state.backend.name != "sdpa" or said  # the fix it names is the route's own
    assert all("patchkit.register_attention(backend='sdpa') silences it" in text for text in said)


def named_config():
    config = tiny_config(kv_heads=2)
    config._attn_implementation = "patchkit"
    return config
