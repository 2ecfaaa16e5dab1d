"""attn_implementation="flash_attention_2" under the class patch on a machine where transformers cannot load flash-attn.

The request is served by patchkit (one warning naming the backend) for a model whose family an active class patch
serves, and only when transformers' own check refuses it; revert restores transformers' method (identity).
"""

from __future__ import annotations

import importlib.util
import warnings

import models
import pytest
import torch
import transformers
from entrypoints import REPO, clean_env, launch, spy_of
from families import FAMILIES_FROM
from models import needs_set_attn_implementation, padded_batch
from packaging.version import Version
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.modeling_utils import PreTrainedModel

import patchkit
from patchkit.gates import probe_environment
from patchkit.hooks.name import flash_request

# transformers >= 4.56 checks the request in this method, older versions in the classmethod
CHECK = next(n for n in ("_check_and_adjust_attn_implementation", "_check_and_enable_flash_attn_2")
             if n in vars(PreTrainedModel))
SERVED = "attn_implementation='flash_attention_2' for LlamaForCausalLM is served by patchkit's 'sdpa' backend"
NAME = flash_request.served_name()  # "patchkit" from transformers 4.53, "sdpa" before
FAMILIES = Version(transformers.__version__) >= Version(FAMILIES_FROM)  # before it only LLaMA's patches exist
pytestmark = pytest.mark.skipif(probe_environment().flash_attn_error is None,
                                reason="flash-attn imports here: transformers loads flash_attention_2 itself")


def tiny_config(attn_implementation: str = "eager") -> LlamaConfig:
    """tests/models.py's tiny LLaMA with another attn_implementation."""
    config = models.tiny_config()
    config._attn_implementation = attn_implementation
    return config


def build(model_class: type, config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = model_class(config)
    return model, [str(w.message) for w in caught if "flash_attention_2" in str(w.message)]


def test_without_the_patch_transformers_refuses():
    with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
        LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_2"))


def test_class_patch_serves_the_request_with_one_warning_and_matches_eager():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny_config()).eval()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    config = tiny_config(attn_implementation="flash_attention_2")
    model, messages = build(LlamaForCausalLM, config)
    model.load_state_dict(reference.state_dict())
    model.eval()
    assert len(messages) == 1 and SERVED in messages[0], messages
    assert "flash-attn unusable here: " in messages[0] and f"it loads as {NAME!r}." in messages[0]
    assert len(messages[0]) < 260, messages[0]  # transformers' whole refusal made it ~480 characters
    assert model.config._attn_implementation == NAME
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert handle.check(model) == 2 and handle.calls == 2
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


def mistral_config(attn_implementation: str) -> MistralConfig:
    return MistralConfig(vocab_size=models.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn_implementation)


def test_only_served_families_and_only_flash_attention_2_are_let_through():
    patchkit.apply_patch("llama2", backend="sdpa")
    with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
        build(MistralForCausalLM, mistral_config("flash_attention_2"))  # no Mistral patch active: unchanged
    with pytest.raises((ValueError, ImportError)):
        LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_9"))


def test_every_active_family_is_served_mistral_too():
    """`apply_patch()` patches every family: a Mistral script asking for flash_attention_2 runs through patchkit."""
    torch.manual_seed(0)
    reference = MistralForCausalLM(mistral_config("eager")).eval()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
    group = patchkit.apply_patch(backend="sdpa")
    if not FAMILIES:  # before 4.53 the group is LLaMA's alone: nothing serves Mistral, transformers' refusal stands
        assert group.model_types == ["llama"] and "mistral" in group.skipped
        with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
            build(MistralForCausalLM, mistral_config("flash_attention_2"))
        return
    model, messages = build(MistralForCausalLM, mistral_config("flash_attention_2"))
    model.load_state_dict(reference.state_dict())
    model.eval()
    assert len(messages) == 1, messages
    assert "for MistralForCausalLM is served by patchkit's 'sdpa' backend, exact" in messages[0]
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert group.check(model) == 2
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)
    group.revert()
    with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
        build(MistralForCausalLM, mistral_config("flash_attention_2"))


@needs_set_attn_implementation
def test_set_attn_implementation_on_a_loaded_model_is_served_too():
    patchkit.apply_patch("llama2", backend="sdpa")
    model = LlamaForCausalLM(tiny_config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_attn_implementation("flash_attention_2")
    assert [SERVED in str(w.message) for w in caught].count(True) == 1
    assert model.config._attn_implementation == NAME


@pytest.mark.skipif(CHECK != "_check_and_adjust_attn_implementation", reason="the transformers >= 4.56 wrapper")
def test_where_transformers_accepts_the_request_nothing_changes():
    """A machine with a usable flash-attn: transformers' check passes, so its answer stands and nothing is said."""
    state = patchkit.apply_patch("llama2", backend="sdpa").state
    accepting = flash_request.make_check_and_adjust(lambda self, impl, *a, **k: impl, lambda cls: state)
    model = LlamaForCausalLM(tiny_config())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accepting(model, "flash_attention_2", is_init_check=True) == "flash_attention_2"


def test_revert_restores_transformers_method():
    before = vars(PreTrainedModel)[CHECK]
    handle = patchkit.apply_patch("llama2", backend="sdpa")
    assert vars(PreTrainedModel)[CHECK] is not before
    assert f"PreTrainedModel.{CHECK} (serves 'flash_attention_2')" in handle.report()
    handle.revert()
    assert vars(PreTrainedModel)[CHECK] is before
    with pytest.raises(ImportError):
        LlamaForCausalLM(tiny_config(attn_implementation="flash_attention_2"))


def test_instance_patch_leaves_the_check_alone():
    model = LlamaForCausalLM(tiny_config())
    before = vars(PreTrainedModel)[CHECK]
    patchkit.apply_patch(backend="sdpa", model=model)
    assert vars(PreTrainedModel)[CHECK] is before


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_the_launcher_runs_a_flash_attention_2_script_unmodified(tmp_path):
    """The issue's case: `patchkit run train.py` where train.py loads with attn_implementation="flash_attention_2"."""
    scripts = REPO / "tests" / "user_scripts"
    for name in ("forward.py", "attention_spy.py"):
        (tmp_path / name).write_text((scripts / name).read_text())
    proc = launch("--backend", "sdpa", tmp_path / "forward.py", "--attn", "flash_attention_2", cwd=tmp_path,
                  env=clean_env())
    spy = spy_of(proc)
    assert proc.stderr.count(SERVED) == 1
    masks_counted = importlib.util.find_spec("transformers.masking_utils") is not None  # transformers >= 4.53
    assert spy["padded_attention"] == 0 and spy["padded_masks"] == (0 if masks_counted else None)
    assert spy["patches"] == [["llama2", "sdpa", 2]] and spy["impl"] == NAME


@pytest.mark.skipif(CHECK != "_check_and_adjust_attn_implementation", reason="the transformers >= 4.56 wrapper")
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl_moe"])
def test_a_vision_language_model_asking_for_flash_attention_2_runs_images_as_unpatched(family):
    """The request reaches each part of the model: the rewrite gave 'patchkit' to the vision tower too, and the first
    forward with an image was refused, telling the user to stop naming patchkit for the whole model (they never
    did). The language model loads with patchkit's name and the vision tower with transformers' sdpa."""
    from families import family_model, served_here
    from test_qwen_vl import image_rows

    if not served_here(family):
        pytest.skip(f"patchkit's {family} patch does not serve this transformers")
    reference = family_model(family)
    config = reference.config
    config._attn_implementation = "flash_attention_2"
    with patchkit.apply_patch(backend="sdpa") as group:
        with pytest.warns(RuntimeWarning, match="vision or audio tower: transformers' 'sdpa'"):
            model = type(reference)(config).eval()
        model.load_state_dict(reference.state_dict())
        assert model.config.get_text_config()._attn_implementation == NAME
        assert model.config.vision_config._attn_implementation == "sdpa"
        batch = image_rows(model, left=False)
        with torch.no_grad():
            got = model(**batch).logits
        assert group.calls == config.get_text_config().num_hidden_layers and not group.stepped_aside
    with torch.no_grad():
        want = reference(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=3e-5, rtol=1e-4)
