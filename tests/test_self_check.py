"""A transformers newer than CI has passed: said once, and each family checks itself before its first forward.

The newer version is faked by lowering the newest tested one (`self_check.TESTED_TRANSFORMERS`). A failing check
is made real, not stubbed: the patched path loses the cache argument (what transformers 5.24's rename of
`past_key_values` to `cache` did to patchkit 0.1), so a patched left-padded generate() would crash, and with the
check the family steps aside and generates exactly what transformers does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import warnings
from typing import Optional

import pytest
import torch
import transformers
from families import FAMILIES, family_model, served_here
from models import padded_batch, tiny_model

import patchkit
from patchkit.hooks.decide import plan, self_check, self_check_lm
from patchkit.hooks.forwards import model_forward

OPTIONS = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
NEW_ENOUGH = int(transformers.__version__.split(".")[0]) >= 5  # the table serves transformers 5.x's families


@pytest.fixture
def newer(monkeypatch):
    """The installed transformers counts as newer than the newest tested; every verdict forgotten before and after."""
    monkeypatch.setattr(self_check, "TESTED_TRANSFORMERS", "5.0.0")
    monkeypatch.delenv(self_check.TESTED_ENV, raising=False)  # CI's newest-release leg names its version there
    self_check.forget()
    yield
    self_check.forget()


@pytest.fixture
def cache_lost(monkeypatch):
    """The patched model forward knows the cache by its old name only, `past_key_values` (patchkit 0.1 on
    transformers 5.24, which renamed it `cache`): it makes a cache of its own beside generate()'s."""
    for module in (model_forward, plan):
        monkeypatch.setattr(module, "given_cache", lambda arguments, extra=None: arguments.get("past_key_values"))
    monkeypatch.setattr(model_forward, "cache_parameter", lambda parameters: "past_key_values")
    monkeypatch.setattr(model_forward, "check_one_cache", lambda arguments: None)


def test_a_newer_transformers_is_announced_once_with_the_newest_tested(newer):
    with pytest.warns(RuntimeWarning) as record:
        with patchkit.apply_patch("llama2", backend="sdpa"), patchkit.apply_patch("mistral", backend="sdpa"):
            pass
    said = [str(w.message) for w in record if "is newer than the newest release" in str(w.message)]
    assert said == [f"patchkit: transformers {transformers.__version__} is newer than the newest release patchkit was "
                    "tested with (5.0.0); each family checks itself on a tiny model before its first forward and "
                    "steps aside to transformers' own attention where it differs."]


def announcements(caught) -> list:
    return [w for w in caught if "is newer than the newest release" in str(w.message)]


def test_the_announcement_names_the_line_that_applies_the_patch_not_an_import(newer):
    """patchkit's attention is registered when a modeling module is imported (`import patchkit` first, or the startup
    hook): the announcement came from there and named the line that imported transformers' module. It now comes
    where patchkit starts to serve: the line that applies the patch."""

    from patchkit.hooks.name import attention_interface

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention_interface.register()  # what an import of a modeling module runs
    assert announcements(caught) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        handle = patchkit.apply_patch("llama2", backend="sdpa")
    handle.revert()
    (said,) = announcements(caught)
    assert (said.filename, said.lineno) == (__file__, line)


def test_under_the_name_alone_the_announcement_names_the_line_that_built_the_model(newer):

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, pad_token_id=0, attn_implementation="patchkit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        LlamaForCausalLM(config)
    (said,) = announcements(caught)
    assert (said.filename, said.lineno) == (__file__, line)


def test_the_tested_version_runs_no_check_and_a_verified_newer_one_is_named_by_env(monkeypatch):
    monkeypatch.delenv(self_check.TESTED_ENV, raising=False)
    self_check.untested.cache_clear()
    assert self_check.untested(self_check.TESTED_TRANSFORMERS) is None
    tested = re.escape(self_check.TESTED_TRANSFORMERS)
    with pytest.warns(RuntimeWarning, match=rf"transformers 99\.0\.0 is newer .* \({tested}\)"):
        assert self_check.untested("99.0.0") == "99.0.0"
    monkeypatch.setenv(self_check.TESTED_ENV, "99.0.0")  # a newer release its user (or CI's leg) verified
    self_check.untested.cache_clear()
    assert self_check.untested("99.0.0") is None and self_check.untested("99.0.1") == "99.0.1"
    self_check.untested.cache_clear()


def test_without_the_check_the_lost_cache_breaks_generate(cache_lost):
    """The control: the fault the next tests plant really breaks the patched path."""
    model = tiny_model()
    ids, mask = padded_batch("left")
    with patchkit.apply_patch("llama2", backend="sdpa"), pytest.raises(RuntimeError, match="Sizes of tensors"):
        model.generate(input_ids=ids, attention_mask=mask, **OPTIONS)  # the crash, word for word


def test_a_family_whose_check_fails_steps_aside_exactly_with_one_warning(newer, cache_lost):
    model = tiny_model()
    ids, mask = padded_batch("left")
    want = model.generate(input_ids=ids, attention_mask=mask, **OPTIONS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with patchkit.apply_patch("llama2", backend="sdpa") as handle:
            got = model.generate(input_ids=ids, attention_mask=mask, **OPTIONS)
            logits = model(input_ids=ids, attention_mask=mask).logits  # padding positions too: transformers' own
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, model(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
    # generate()'s 5 forwards and the plain one
    assert handle.stepped_aside == {"untested_transformers": OPTIONS["max_new_tokens"] + 1}
    assert handle.calls == 0  # no layer ran through the patch
    aside = [str(w.message) for w in record if "self-check" in str(w.message)]
    assert len(aside) == 1
    assert f"transformers {transformers.__version__} is newer than patchkit was tested with (5.0.0)" in aside[0]
    assert "LlamaModel's self-check there found: the patched run raised RuntimeError: Sizes of tensors" in aside[0]


def test_strict_mode_refuses_a_family_whose_check_fails(newer, cache_lost):
    model = tiny_model()
    ids, mask = padded_batch("left")
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True):
        with pytest.raises(patchkit.PatchInputError, match=r"strict=True.*LlamaModel's self-check there found"):
            model(input_ids=ids, attention_mask=mask)


@pytest.mark.heavy  # torch.compile: make test-heavy
@pytest.mark.parametrize("first", ["compiled", "uncompiled"])
def test_a_graph_traced_before_the_check_ran_steps_aside_as_unchecked_and_one_traced_after_is_served(newer, first):
    """The check cannot run inside a graph: a family whose first forward is traced (fullgraph) steps aside as
    `unchecked_in_graph`, exact, and is not said to have differed (before, it was `untested_transformers`, "the
    self-check differed"); one uncompiled forward first runs the check, and the graph traced after it is served."""
    torch._dynamo.reset()  # the verdict read while tracing is a constant of the graph
    model = tiny_model().eval()
    ids, mask = padded_batch("right")
    want = model(input_ids=ids, attention_mask=mask).logits
    with warnings.catch_warnings(record=True) as record, patchkit.apply_patch(model=model, backend="sdpa") as handle:
        warnings.simplefilter("always")
        if first == "uncompiled":
            model(input_ids=ids, attention_mask=mask)
        got = torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids, attention_mask=mask).logits
        aside, served = dict(handle.stepped_aside), handle.state.compiled  # compiled calls through the patch
    torch._dynamo.reset()
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-5)
    said = [str(w.message) for w in record if "patchkit" in str(w.message) and "(unchecked_in_graph)" in str(w.message)]
    assert not any("differed" in str(w.message) for w in record)
    if first == "compiled":
        assert aside == {"unchecked_in_graph": 1} and served == 0 and len(said) == 1
    else:
        assert aside == {} and served > 0 and not said


def test_the_registered_name_alone_steps_aside_where_the_check_fails(newer, monkeypatch):
    """attn_implementation='patchkit' with no patch: the check runs the tiny model under the name, and a fault in
    the name's attention (outputs scaled) makes its family step aside: the model's logits are transformers' own."""
    from patchkit.hooks.name import attention_interface

    patchkit.register_attention(backend="sdpa")
    model = tiny_model()
    ids, mask = padded_batch("right")
    want = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation(attention_interface.ATTENTION_NAME)
    served = attention_interface.function_for(attention_interface.route_state())
    monkeypatch.setattr(attention_interface, "_function", lambda *a, **k: (served(*a, **k)[0] * 1.01, None))
    with pytest.warns(RuntimeWarning, match="LlamaModel's self-check there found: training step outputs differ"):
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-5)


def test_the_registered_name_alone_finds_a_remote_code_family_to_check_by_its_config_class(newer, monkeypatch):
    """A model of remote code (its config class outside transformers' AutoModel table) under the name alone: the
    mask call finds the base model class of its config class among the loaded classes (no frame of the model is
    read), checks it, and the fault in the name's attention makes it step aside with transformers' own logits."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    from patchkit.hooks.name import attention_interface

    class RemoteConfig(LlamaConfig):
        model_type = "remote_llama"

    class RemoteModel(LlamaModel):
        config_class = RemoteConfig

    class RemoteForCausalLM(LlamaForCausalLM):
        config_class = RemoteConfig

    assert self_check.base_model_class(LlamaConfig) is LlamaModel
    assert self_check.base_model_class(RemoteConfig) is RemoteModel
    patchkit.register_attention(backend="sdpa")
    plain = tiny_model()
    model = RemoteForCausalLM(RemoteConfig(**plain.config.to_diff_dict()))
    model.load_state_dict(plain.state_dict())
    ids, mask = padded_batch("right")
    want = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = attention_interface.ATTENTION_NAME
    served = attention_interface.function_for(attention_interface.route_state())
    monkeypatch.setattr(attention_interface, "_function", lambda *a, **k: (served(*a, **k)[0] * 1.01, None))
    with pytest.warns(RuntimeWarning, match="RemoteModel is a family patchkit's census has not verified|"
                                            "RemoteModel's self-check there found: training step outputs differ"):
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=1e-5)


def test_every_family_passes_its_check_and_is_served_patched(newer):
    """Where patchkit is right (the suite's own verdict on this transformers), every family's check agrees: its
    forward runs through the patch, equal to unpatched, and the check's own runs leave the report's counts alone."""
    ids, mask = padded_batch("left")
    for family in ["llama2", *FAMILIES]:
        if family != "llama2" and not served_here(family):
            continue
        model = tiny_model() if family == "llama2" else family_model(family)
        want = model(input_ids=ids, attention_mask=mask).logits
        with patchkit.apply_patch(family, backend="sdpa") as handle:
            got = model(input_ids=ids, attention_mask=mask).logits
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        assert self_check._verdicts.get(type(base), "unchecked") is None, (family, self_check._verdicts)
        heads = [v for v in self_check.heads.values() if v not in (None, self_check_lm.NOT_CHECKED)]
        assert heads == [], (family, self_check.heads)  # a multimodal model's: on transformers' own, unchecked
        assert handle.stepped_aside == {} and handle.calls == model.config.get_text_config().num_hidden_layers
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=1e-4, msg=family)


def test_the_check_runs_once_per_family_and_process(newer, monkeypatch):
    """Its cost is recorded once per base model class (the README states it; benchmarks, not tests, time it)."""
    model = tiny_model()
    ids, mask = padded_batch("left")
    runs = []
    check = self_check.check_family
    monkeypatch.setattr(self_check, "check_family", lambda *a: runs.append(a[0]) or check(*a))
    with patchkit.apply_patch("llama2", backend="sdpa"):
        model(input_ids=ids, attention_mask=mask)
        tiny_model()(input_ids=ids, attention_mask=mask)
        model.generate(input_ids=ids, attention_mask=mask, **OPTIONS)
    assert runs == [type(model.model), type(model)]  # the base model's check, then its LM's head and loss check
    assert set(self_check.seconds) == set(runs) and min(self_check.seconds.values()) > 0


@pytest.mark.skipif(not hasattr(transformers, "BambaConfig"), reason="a Mamba-2 hybrid: transformers 4.53+")
def test_a_mamba_hybrids_check_model_derives_its_head_size_from_the_tiny_width():
    """Mamba-2 hybrids derive their Mamba head size from hidden_size when the config is built: a tiny copy made by
    setting fields kept the full width's head size, and the check's model failed unpatched (every unverified
    Mamba-2 hybrid then stepped aside). The tiny config is built again through its class."""
    config = transformers.BambaConfig(attn_layer_indices=[1, 5, 9])  # a user's hybrid: attention among Mamba layers
    tiny = self_check.tiny_config(config)
    assert tiny.hidden_size < config.hidden_size and tiny.mamba_d_head != config.mamba_d_head
    assert tiny.layer_types == ["linear_attention", "full_attention"]
    model = transformers.BambaForCausalLM(tiny).eval()
    ids, mask = padded_batch("right", batch=2)
    with torch.no_grad():
        assert model(input_ids=ids.clamp(max=tiny.vocab_size - 1), attention_mask=mask).logits.isfinite().all()


def test_a_config_whose_head_size_is_a_read_only_property_gets_a_tiny_copy_that_builds_and_runs():
    """Falcon's config derives `head_dim` from hidden_size and the head count (a property without a setter): the
    check's tiny copy set it and raised AttributeError, so the check's model "failed unpatched" and every such
    family stepped aside (seen on transformers 5.25, where Falcon reached the attention interface). It is derived
    from the tiny width now."""
    config = transformers.FalconConfig()  # multi-query, rotary
    tiny = self_check.tiny_config(config)
    assert tiny.head_dim == config.head_dim and tiny.hidden_size < config.hidden_size
    model = transformers.FalconForCausalLM(tiny).eval()
    ids, mask = padded_batch("right", batch=2)
    with torch.no_grad():
        assert model(input_ids=ids.clamp(max=tiny.vocab_size - 1), attention_mask=mask).logits.isfinite().all()


@pytest.mark.parametrize("layout", ["falcon_40b", "falcon_7b"])
def test_a_falcon_config_gets_a_tiny_copy_with_its_own_key_value_heads(layout):
    """Falcon's attention reads `num_kv_heads`, not the `num_key_value_heads` its config derives from it: the tiny
    copy of Falcon-40B's grouped layout (128 heads, 8 key/value groups) kept 8 groups of 2 heads and its model failed
    unpatched, so a Falcon-40B on a transformers newer than CI's would step aside on every forward."""
    grouped = dict(new_decoder_architecture=True, num_kv_heads=8) if layout == "falcon_40b" else dict(multi_query=True)
    config = transformers.FalconConfig(hidden_size=8192, num_attention_heads=128, num_hidden_layers=60, **grouped)
    tiny = self_check.tiny_config(config)
    assert tiny.num_attention_heads == 2 and tiny.num_key_value_heads == 1
    model = transformers.FalconForCausalLM(tiny).eval()
    ids, mask = padded_batch("right", batch=2)
    with torch.no_grad():
        assert model(input_ids=ids.clamp(max=tiny.vocab_size - 1), attention_mask=mask).logits.isfinite().all()


def check_of(config, patch: Optional[str] = None) -> Optional[str]:
    """The self-check's verdict on a model of `config` (a checkpoint's sizes), its family (`patch`, default its
    model_type's) patched as apply_patch() does: None where it passes."""
    from census import base_model_name

    from patchkit.hooks.install.registry import for_model_type

    base = getattr(transformers, base_model_name(config.model_type))
    with patchkit.apply_patch(patch or for_model_type(config.model_type).name, backend="sdpa") as handle:
        # as a first forward runs it: the check's own patched forwards do not check again (`_checking`)
        self_check.verdict_cause(base, config, torch.device("cpu"), torch.float32, handle.state)
        return self_check._verdicts[base]


@pytest.mark.skipif(not NEW_ENOUGH, reason="families served from data: transformers 5.x")
@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode", "ctrl"])
def test_a_config_with_dropout_under_another_name_passes_its_check(newer, model_type):
    """GPT-2's, GPT-BigCode's and CTRL's configs name their dropout `resid_pdrop` / `embd_pdrop` / `attn_pdrop` (0.1 in
    every checkpoint): the tiny copy kept it, the check's training step drew other dropout masks on the packed row
    than on the padded batch, and differed by 3-4, so on a transformers newer than CI's these families stepped aside
    on every forward."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    assert any(v > 0 for k, v in config.to_dict().items() if "pdrop" in k and isinstance(v, float))
    assert check_of(config) is None


@pytest.mark.skipif(not NEW_ENOUGH, reason="families served from data: transformers 5.x")
def test_a_width_under_another_name_is_cut_and_the_check_stays_small(newer):
    """GPT-J's width is `n_embd` (transformers maps hidden_size to it): rebuilding the tiny copy through its class
    counted `n_embd` among the fields derived from the width and kept the checkpoint's 4096, a check model of 1.6 GB
    that took 90 s on CPU."""
    config = transformers.GPTJConfig()
    tiny = self_check.tiny_config(config)
    assert tiny.n_embd == tiny.hidden_size <= 512 < config.n_embd
    assert check_of(config) is None


@pytest.mark.skipif(not hasattr(transformers, "BeamConfig"), reason="Beam: transformers 5.25")
def test_group_limited_routing_keeps_its_experts_in_the_tiny_copy(newer):
    """Group-limited routing (DeepSeek-V3's `n_group` / `topk_group`, here Beam's 8 groups): 4 experts in 8 groups left
    none a group, and the check's model failed unpatched, so such a family stepped aside on every forward."""
    config = transformers.BeamConfig()
    assert config.n_group > 1
    tiny = self_check.tiny_config(config)
    assert tiny.n_group == tiny.topk_group == 1
    assert check_of(config) is None


@pytest.mark.skipif(not NEW_ENOUGH, reason="families served from data: transformers 5.x")
@pytest.mark.parametrize("model_type", ["gemma3n_text", "minimax", "recurrent_gemma"])
def test_a_checkpoint_sized_config_of_a_family_with_its_own_cache_or_sharing_passes_its_check(newer, model_type):
    """Each failed its check's own unpatched run, so it stepped aside on every forward on a newer transformers:
    Gemma 3n's tiny copy kept 15 KV-sharing layers over its 2 (it keeps one now, over 3 layers); MiniMax refuses the
    DynamicCache the check handed its prefill (generate() hands it none, and it makes its own); RecurrentGemma's
    outputs carry no cache to decode on (its decode steps are left out)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert check_of(CONFIG_MAPPING[model_type]()) is None


@pytest.mark.skipif(not hasattr(transformers, "ZambaConfig"), reason="Zamba: transformers 4.46+")
def test_a_family_with_a_block_shared_across_its_layers_is_checked_on_a_few_layers_not_all(newer, monkeypatch):
    """Zamba ties one shared transformer block across its hybrid layers and refuses to build with only one. The
    2-layer copy (a Mamba layer, a hybrid one) would not build, and the check fell back to every layer of the
    checkpoint's 76 (35 s and 5 GB at a user's first forward on this machine). It now tries the first two layers of
    each type before every layer."""
    config = transformers.ZambaConfig()
    tiny = self_check.tiny_config(config, each_twice=True)
    assert tiny.num_hidden_layers == 4 < config.num_hidden_layers
    assert list(tiny.layers_block_type).count("hybrid") == 2
    built = []
    real = self_check.tiny_config
    monkeypatch.setattr(self_check, "tiny_config", lambda c, attention, **depth: built.append(depth) or real(
        c, attention=attention, **depth))
    assert check_of(config) is None
    assert built == [{}, {"each_twice": True}]


@pytest.mark.skipif(not NEW_ENOUGH, reason="families served from data: transformers 5.x")
@pytest.mark.parametrize("way_in", ["class", "instance", "name"])
def test_the_checks_own_forwards_warn_nothing_and_leave_the_users_warnings_to_come(newer, way_in):
    """The check's decode is left-padded. A RecurrentGemma model steps aside there (`padding_into_mixer`), and a user
    who padded on the right was told at their first forward that left padding ran on transformers' attention,
    "Fix: pad on the right". Its once-only warning was then spent, and the user's own left-padded forward later
    said nothing. The check's forwards now warn nothing and count nothing; the user's own forwards warn and count."""
    from census import tiny_lm

    from patchkit.hooks.name import attention_interface

    if way_in == "name":
        patchkit.register_attention(backend="sdpa")
    with warnings.catch_warnings(record=True) as record, contextlib.ExitStack() as stack:
        warnings.simplefilter("always")
        if way_in == "class":
            handle = stack.enter_context(patchkit.apply_patch("recurrent_gemma", backend="sdpa"))
        model, why = tiny_lm("recurrent_gemma")
        if model is None:
            pytest.skip(why)
        if way_in == "instance":
            handle = stack.enter_context(patchkit.apply_patch(model=model, backend="sdpa"))
        if way_in == "name":
            model.set_attn_implementation(attention_interface.ATTENTION_NAME)
            handle = attention_interface.route_state()
            forget = lambda: handle.warned.difference_update(  # noqa: E731 - the name's state outlives a test
                {key for key in handle.warned if key.startswith("aside:padding_into_mixer:")})
            forget()
            stack.callback(forget)
        before = dict(handle.stepped_aside)  # (the registered name's has other tests' counts)
        ids, right = padded_batch("right")
        model(input_ids=ids, attention_mask=right)
        assert self_check._verdicts.get(type(model.model), "unchecked") is None
        said = [str(w.message) for w in record if "padding_into_mixer" in str(w.message)]
        assert said == [] and handle.stepped_aside == before, said
        model(input_ids=ids, attention_mask=right.flip(-1))
        said = [str(w.message) for w in record if "padding_into_mixer" in str(w.message)]
        assert len(said) == 1 and "left padding" in said[0], said
        assert handle.stepped_aside.get("padding_into_mixer", 0) == before.get("padding_into_mixer", 0) + 1


@pytest.fixture
def loss_per_row(monkeypatch):
    """A release whose ForCausalLMLoss takes each row's mean, then the rows' (another normalization, as a changed
    `ForCausalLMLoss` would train on): patchkit's head on the packed row and its own fused loss take the tokens'."""
    from transformers.loss import loss_utils

    own = loss_utils.LOSS_MAPPING["ForCausalLM"]

    @functools.wraps(own)
    def per_row(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        rows = logits.float().transpose(1, 2)
        terms = torch.nn.functional.cross_entropy(rows, shift_labels, ignore_index=ignore_index, reduction="none")
        return (terms.sum(-1) / (shift_labels != ignore_index).sum(-1).clamp(min=1)).mean()

    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", per_row)


def trained(model, ids, mask, loss_alone: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One labelled training step's loss and gradients, read as a loop that reads the loss alone does (or not)."""
    from models import labels_for

    model.train()
    model.zero_grad(set_to_none=True)
    if loss_alone:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss
    else:
        out = model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask))
        loss = out.loss if out.logits is not None else None
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("loss_alone", [False, True])
def test_a_changed_causal_lm_loss_makes_the_head_and_loss_step_aside(newer, loss_per_row, monkeypatch, loss_alone):
    """The check compared the base model's hidden states alone: a release whose ForCausalLMLoss normalizes otherwise
    trained silently on patchkit's numbers (the packed row is one row; the fused loss is patchkit's own). The causal
    LM's head and loss check themselves now (as logits are read and as the loss alone is), and step aside by name."""
    model = tiny_model()
    ids, mask = padded_batch("mixed", seq=16)
    want = trained(model, ids, mask, loss_alone)
    monkeypatch.setattr(self_check, "TESTED_TRANSFORMERS", transformers.__version__)  # the control: unchecked,
    self_check.forget()  # the patched loss is patchkit's own
    with patchkit.apply_patch("llama2", backend="sdpa"):
        assert not torch.allclose(trained(model, ids, mask, loss_alone)[0], want[0])
    monkeypatch.setattr(self_check, "TESTED_TRANSFORMERS", "5.0.0")
    self_check.forget()
    with warnings.catch_warnings(record=True) as record, patchkit.apply_patch("llama2", backend="sdpa") as handle:
        warnings.simplefilter("always")
        got = trained(model, ids, mask, loss_alone)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=1e-6, rtol=1e-5)
    (line,) = [line for line in handle.report().splitlines() if "LM head and loss" in line]
    assert "1 on the padded batch: untested_transformers: transformers" in line, line
    said = [str(w.message) for w in record if "head and loss self-check" in str(w.message)]
    assert len(said) == 1 and "LlamaForCausalLM's head and loss self-check there found: loss" in said[0], said


def test_strict_mode_refuses_a_causal_lm_whose_head_and_loss_check_differs(newer, loss_per_row):
    model = tiny_model()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="sdpa", strict=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(patchkit.PatchInputError, match=r"strict=True.*LlamaForCausalLM's head and loss self-check"):
            trained(model, ids, mask, loss_alone=False)


def sliding_window_overlay(sliding_window: int):
    """transformers' sliding overlay (by its name, which patchkit reads) of a release whose window is one key wider."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window - 1

    inner_mask.__module__ = "transformers.masking_utils"  # patchkit knows transformers' mask functions by it
    return inner_mask


def test_a_second_config_of_a_checked_class_is_checked_on_its_own(newer, monkeypatch):
    """The verdict was kept per base model class: a Mistral without a sliding window checked first passed, and a
    Mistral with one, under a release whose sliding-window mask is one key wider, was served unchecked and differed.
    A verdict is kept per class and what of the config the tiny copy takes."""
    from transformers import MistralConfig, MistralForCausalLM, masking_utils

    monkeypatch.setattr(masking_utils, "sliding_window_overlay", sliding_window_overlay)
    ids, mask = padded_batch("right", seq=16)
    models = []
    for window in (None, 6):
        torch.manual_seed(0)
        models.append(MistralForCausalLM(MistralConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=window, pad_token_id=0, attn_implementation="eager")))
    want = [m(input_ids=ids, attention_mask=mask).logits for m in models]
    with patchkit.apply_patch("mistral", backend="sdpa") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [m(input_ids=ids, attention_mask=mask).logits for m in models]
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=1e-5, rtol=1e-4)  # no window: served
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # its own check differed: transformers' own
    assert handle.stepped_aside == {"untested_transformers": 1}
    assert self_check._verdicts[type(models[0].model)].startswith("training step outputs differ")


@pytest.fixture
def positions_from_the_mask(monkeypatch):
    """A release whose GPT-2 counts its default position_ids from the mask (a left-padded row's first token at 0),
    where the tested ones count them from the first column: patchkit's packed rows keep the tested default (RoPE
    families see no difference: only GPT-2's absolute positions tell)."""
    from transformers import GPT2Model

    own = GPT2Model.forward
    signature = inspect.signature(own)

    @functools.wraps(own)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        named, mask = bound.arguments, bound.arguments.get("attention_mask")
        cache = named.get("cache", named.get("past_key_values"))
        if named.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and (
                cache is None or cache.get_seq_length() == 0):
            named["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        named = dict(named)
        return own(named.pop("self"), **named, **named.pop("kwargs", {}))

    monkeypatch.setattr(GPT2Model, "forward", forward)


def test_a_changed_default_of_position_ids_under_left_padding_is_found(newer, positions_from_the_mask):
    """The check's training step was padded on the right alone, where both defaults agree: a left-padded training
    batch was served on the old default, silently. One of the check's rows is padded on the left now."""
    from census import tiny_lm

    model, why = tiny_lm("gpt2")
    if model is None:
        pytest.skip(why)
    ids, mask = padded_batch("left")
    ids = ids.clamp(max=model.config.vocab_size - 1)
    want = model(input_ids=ids, attention_mask=mask).logits
    with patchkit.apply_patch(model=model, backend="sdpa") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    assert handle.stepped_aside == {"untested_transformers": 1}


def test_the_check_compares_against_the_attention_the_users_model_runs(newer, monkeypatch):
    """The reference was eager whatever the user's model ran: a release that changes sdpa alone (its scale) passed
    the check, and a model on sdpa (from_pretrained's default) was served on other numbers than its own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def scaled(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * 1.25
        return own(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", scaled)
    model = tiny_model()
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch("right")
    want = model(input_ids=ids, attention_mask=mask).logits
    with patchkit.apply_patch("llama2", backend="sdpa") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert handle.stepped_aside == {"untested_transformers": 1}


def test_a_half_precision_model_is_checked_in_float32(newer, monkeypatch):
    """The check ran in the model's dtype, where bfloat16's tolerance (5e-2) let a 5% change of eager attention's
    scale pass: it runs in float32 now (the tiny model is tiny), where it differs."""
    from transformers.models.llama import modeling_llama

    own = modeling_llama.eager_attention_forward

    def scaled(module, query, key, value, attention_mask, scaling, **kwargs):
        return own(module, query, key, value, attention_mask, scaling * 1.05, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", scaled)
    model = tiny_model(dtype=torch.bfloat16)
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2", backend="sdpa") as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, attention_mask=mask)
    assert handle.stepped_aside == {"untested_transformers": 1}
    assert self_check._verdicts[type(model.model)].startswith("training step outputs differ")
