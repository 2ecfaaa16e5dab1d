"""Opt-in by configuration: PatchArguments in HfArgumentParser, apply_from_args, and PATCHKIT_* variables."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
import warnings

import pytest
import torch
import transformers
from entrypoints import REPO, clean_env, run, spy_of
from families import FAMILIES_FROM, served_here
from models import padded_batch, tiny_model
from packaging.version import Version
from transformers import HfArgumentParser, TrainingArguments

import patchkit
from patchkit import PatchGateError
from patchkit.entry.config import PatchArguments, apply_from_args, apply_from_env
from patchkit.gates import probe_environment

FLASH_USABLE = probe_environment().flash_attn_error is None and probe_environment().cuda_available


@dataclasses.dataclass
class ModelArguments:
    model_name_or_path: str = dataclasses.field(default="tiny", metadata={"help": "checkpoint"})


@pytest.fixture(autouse=True)
def reverted(monkeypatch):
    """No PATCHKIT_* from the caller's shell; every patch reverted after the test."""
    for var in ("PATCHKIT_FLASH_ATTN", "PATCHKIT_PATCH", "PATCHKIT_BACKEND", "PATCHKIT_STRICT", "PATCHKIT_UNPAD"):
        monkeypatch.delenv(var, raising=False)
    yield
    patchkit.revert_patch()


def parse(*argv: str, tmp_path) -> tuple:
    parser = HfArgumentParser((ModelArguments, PatchArguments, TrainingArguments))
    return parser.parse_args_into_dataclasses([*argv, "--output_dir", str(tmp_path), "--report_to", "none"])


def test_fields_do_not_clash_with_training_arguments():
    ours = {f.name for f in dataclasses.fields(PatchArguments)}
    assert ours == {"flash_attn", "patch", "attn_backend", "patch_strict", "patch_unpad"}
    assert not ours & {f.name for f in dataclasses.fields(TrainingArguments)}
    assert all(f.metadata.get("help") for f in dataclasses.fields(PatchArguments))


def test_hf_argument_parser_opt_in_patches_and_matches_eager(tmp_path):
    _, patch_args, training_args = parse("--flash_attn", "--attn_backend", "sdpa", "--patch", "llama2",
                                         tmp_path=tmp_path)
    assert patch_args == PatchArguments(flash_attn=True, patch="llama2", attn_backend="sdpa", patch_strict=False)
    assert training_args.output_dir == str(tmp_path)
    model = tiny_model()
    ids, mask = padded_batch("mixed")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    handle = apply_from_args(patch_args)
    assert handle is not None and handle.backend == "sdpa" and handle.check(model) == 2
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    assert handle.layers_patched == 2
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=1e-4)


def test_hf_argument_parser_default_is_off(tmp_path):
    _, patch_args, _ = parse(tmp_path=tmp_path)
    assert patch_args.flash_attn is False
    assert apply_from_args(patch_args) is None
    assert patchkit.active_patches() == []


def test_hf_argument_parser_rejects_a_bad_backend(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--flash_attn", "true", "--attn_backend", "gpu", tmp_path=tmp_path)
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_dataclass_validates_when_built_in_code():
    allowed_backends = "auto, flash_attn, flash_attn_4, torch_varlen, sdpa"
    with pytest.raises(ValueError, match=rf"attn_backend='gpu' is not valid; allowed values: {allowed_backends}"):
        PatchArguments(flash_attn=True, attn_backend="gpu")
    allowed = r"all, gemma, .*llama1, llama2, mistral, .*qwen3, .*smollm3, starcoder2, llama, or a served model_type"
    with pytest.raises(ValueError, match=rf"patch='gpt 2' is not valid; allowed values: {allowed}"):
        PatchArguments(patch="gpt 2")
    from patchkit.names import patch_names

    assert [PatchArguments(patch=name.upper()).patch for name in patch_names()] == patch_names()
    assert PatchArguments(flash_attn="yes", attn_backend="SDPA").attn_backend == "sdpa"


def test_a_family_served_from_data_is_a_patch_name_as_in_apply_patch():
    """PatchArguments(patch="olmo") and PATCHKIT_PATCH=olmo apply the patch `apply_patch("olmo")` does (they once
    refused every family without a module of its own); one no transformers serves is refused when applied."""
    if not served_here("olmo"):
        pytest.skip("OLMo is served from 4.53")
    handle = apply_from_args(PatchArguments(flash_attn=True, patch="OLMo", attn_backend="sdpa"))
    assert handle.name == "olmo" and handle.spec.model_types[0] == "olmo"
    handle.revert()
    handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa", "PATCHKIT_PATCH": "olmo"})
    assert handle.name == "olmo"
    handle.revert()
    with pytest.raises(ValueError, match="unknown patch 'bert'; .* is an encoder"):
        apply_from_args(PatchArguments(flash_attn=True, patch="bert", attn_backend="sdpa"))
    assert patchkit.active_patches() == []


def test_a_bad_patch_name_under_the_startup_hook_ends_the_process_in_one_line():
    env = clean_env(PATCHKIT_FLASH_ATTN="1", PATCHKIT_PATCH="bogus")
    proc = run([sys.executable, "-c", "from transformers import LlamaForCausalLM\nprint('IMPORTED')"], env=env)
    assert proc.returncode == 1 and "IMPORTED" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("patchkit: PATCHKIT_PATCH: unknown patch 'bogus'; available patches:"), proc.stderr


def test_apply_from_args_accepts_any_namespace_and_a_model():
    class Namespace:
        flash_attn, patch, attn_backend, patch_strict = True, "llama2", "sdpa", False

    model, other = tiny_model(), tiny_model()
    handle = apply_from_args(Namespace(), model=model)
    assert handle.check(model) == 2
    with pytest.raises(patchkit.PatchTargetError):
        handle.check(other)  # an instance patch does not leak


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_env_opt_in(monkeypatch, value):
    monkeypatch.setenv("PATCHKIT_FLASH_ATTN", value)
    monkeypatch.setenv("PATCHKIT_BACKEND", "sdpa")
    monkeypatch.setenv("PATCHKIT_PATCH", "llama1")
    handle = apply_from_env()
    assert (handle.name, handle.backend, handle.options) == ("llama1", "sdpa", ("sdpa", False, "model"))
    assert patchkit.active_patches() == [handle]


@pytest.mark.parametrize("value", [None, "0", "false", "off", ""])
def test_env_not_opted_in_returns_none(monkeypatch, value):
    if value is not None:
        monkeypatch.setenv("PATCHKIT_FLASH_ATTN", value)
    monkeypatch.setenv("PATCHKIT_BACKEND", "sdpa")
    assert apply_from_env() is None
    assert patchkit.active_patches() == []


def test_env_unpad_attention_reaches_the_patch():
    handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa", "PATCHKIT_UNPAD": "attention"})
    assert handle.options == ("sdpa", False, "attention") and {h.state.unpad for h in handle} == {"attention"}
    handle.revert()
    handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa"})
    assert handle.options[2] == "model" and {h.state.unpad for h in handle} == {"model"}


def test_env_mapping_argument_instead_of_os_environ():
    handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa"})
    assert handle.name == "all" and handle.backend == "sdpa"
    if Version(transformers.__version__) >= Version(FAMILIES_FROM):
        assert "mistral" in handle.model_types
    else:  # only LLaMA's patches exist before 4.53: every family is requested, the others skipped by their gate
        assert handle.model_types == ["llama"] and "mistral" in handle.skipped
    handle.revert()
    handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa", "PATCHKIT_PATCH": "llama"})
    assert handle.name == "llama2" and handle.backend == "sdpa"


@pytest.mark.parametrize(
    "var,value,message",
    [
        ("PATCHKIT_FLASH_ATTN", "maybe", "PATCHKIT_FLASH_ATTN='maybe' is not valid; allowed values: 1, true, yes, on"),
        ("PATCHKIT_BACKEND", "cuda",
         "PATCHKIT_BACKEND='cuda' is not valid; allowed values: auto, flash_attn, flash_attn_4, torch_varlen, sdpa"),
        ("PATCHKIT_PATCH", "gpt 2", "PATCHKIT_PATCH='gpt 2' is not valid; allowed values: all, gemma, .*, llama, or"),
        ("PATCHKIT_PATCH", "bogus", "unknown patch 'bogus'; available patches: gemma, .*or a decoder model_type"),
        ("PATCHKIT_STRICT", "sometimes", "PATCHKIT_STRICT='sometimes' is not valid; allowed values: 1, true"),
        ("PATCHKIT_UNPAD", "layers", "PATCHKIT_UNPAD='layers' is not valid; allowed values: model, attention"),
    ],
)
def test_env_bad_values_name_the_variable(var, value, message):
    env = {"PATCHKIT_FLASH_ATTN": "1", var: value}
    with pytest.raises(ValueError) as exc:
        apply_from_env(env)
    assert re.search(message, str(exc.value)), str(exc.value)
    assert patchkit.active_patches() == []


@pytest.mark.skipif(FLASH_USABLE, reason="flash-attn usable here: no fallback happens")
def test_env_auto_falls_back_with_warning_and_strict_refuses():
    with pytest.warns(RuntimeWarning, match="flash_attn_installed: FAILED"):
        handle = apply_from_env({"PATCHKIT_FLASH_ATTN": "1"})
    assert handle.backend == "sdpa"
    handle.revert()
    with pytest.raises(PatchGateError, match="Nothing was patched"):
        apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_STRICT": "1"})
    assert patchkit.active_patches() == []


TRAIN_SCRIPT = '''
import dataclasses, json
import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainingArguments
import patchkit
from patchkit.entry.config import PatchArguments, apply_from_args

@dataclasses.dataclass
class ModelArguments:
    hidden: int = 64

model_args, patch_args, training_args = HfArgumentParser(
    (ModelArguments, PatchArguments, TrainingArguments)).parse_args_into_dataclasses()
handle = apply_from_args(patch_args)  # before the model is built
config = LlamaConfig(vocab_size=97, hidden_size=model_args.hidden, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
model = LlamaForCausalLM(config)
mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
model(input_ids=torch.randint(3, 97, (2, 8)), attention_mask=mask)
print("RESULT " + json.dumps({"patch": handle and handle.name, "backend": handle and handle.backend,
                              "layers": handle and handle.layers_patched, "lr": training_args.learning_rate}))
'''


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_a_users_training_script_opts_in_from_its_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    proc = run([sys.executable, script, "--flash_attn", "true", "--attn_backend", "sdpa", "--patch", "llama1",
                "--hidden", "32", "--learning_rate", "3e-4", "--output_dir", tmp_path / "out", "--report_to", "none"],
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[7:]) == {"patch": "llama1", "backend": "sdpa", "layers": 2, "lr": 3e-4}


def test_warning_free_when_sdpa_requested():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert apply_from_env({"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa"}).backend == "sdpa"


@dataclasses.dataclass
class FastChatTrainingArguments(TrainingArguments):
    """FastChat train_lora.py's TrainingArguments: its own `flash_attn` flag (and a few other fields)."""

    cache_dir: str = dataclasses.field(default=None)
    model_max_length: int = dataclasses.field(default=512)
    flash_attn: bool = False


def test_patch_arguments_next_to_a_script_with_its_own_flag_clash_at_parser_build():
    """Why PatchOptions exists: the README's PatchArguments path fails for FastChat-style scripts."""
    with pytest.raises(argparse.ArgumentError, match="conflicting option strings: --flash_attn"):
        HfArgumentParser((ModelArguments, FastChatTrainingArguments, PatchArguments))


def test_patch_options_compose_with_the_scripts_own_flash_attn(tmp_path):
    parser = HfArgumentParser((ModelArguments, FastChatTrainingArguments, patchkit.PatchOptions))
    common = ["--output_dir", str(tmp_path), "--report_to", "none"]
    _, training_args, opts = parser.parse_args_into_dataclasses(
        ["--flash_attn", "True", "--attn_backend", "sdpa", "--patch_unpad", "attention", *common])
    assert training_args.flash_attn is True and opts == patchkit.PatchOptions(attn_backend="sdpa",
                                                                              patch_unpad="attention")
    assert {f.name for f in dataclasses.fields(patchkit.PatchOptions)} == {"patch", "attn_backend", "patch_strict",
                                                                            "patch_unpad"}
    handle = apply_from_args(training_args, opts)  # flash_attn from the script's arguments, the rest from ours
    assert (handle.name, handle.options) == ("all", ("sdpa", False, "attention"))
    handle.revert()
    _, training_args, opts = parser.parse_args_into_dataclasses(["--attn_backend", "sdpa", *common])
    assert apply_from_args(training_args, opts) is None and patchkit.active_patches() == []


def test_apply_from_args_reads_each_field_from_the_first_source_that_has_it():
    class Script:
        flash_attn, attn_backend = True, "sdpa"

    opts = patchkit.PatchOptions(attn_backend="flash_attn", patch="llama1")
    handle = apply_from_args(Script(), opts)  # attn_backend from Script (first), patch from opts
    assert (handle.name, handle.backend) == ("llama1", "sdpa")


def test_apply_from_args_still_takes_a_model_positionally():
    model = tiny_model()
    handle = apply_from_args(PatchArguments(flash_attn=True, attn_backend="sdpa"), model)
    assert handle.check(model) == 2 and handle.key == ("model", id(model))
    with pytest.raises(TypeError, match="one model, as model="):
        apply_from_args(PatchArguments(flash_attn=True), model, model=model)


FASTCHAT_SCRIPT = '''
import dataclasses, sys
import torch, transformers
import attention_spy
import patchkit

@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):   # FastChat train_lora.py's
    model_max_length: int = 512
    flash_attn: bool = False

parser = transformers.HfArgumentParser((TrainingArguments, patchkit.PatchOptions))
training_args, patch_opts = parser.parse_args_into_dataclasses()
patchkit.apply_from_args(training_args, patch_opts)      # was: if training_args.flash_attn: replace_llama_attn...()
attention_spy.install()
config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
model = transformers.LlamaForCausalLM(config)
mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
model(input_ids=torch.randint(3, 97, (2, 8)), attention_mask=mask).logits.sum().backward()
attention_spy.report()
'''


@pytest.mark.heavy  # make test-heavy
def test_a_fastchat_style_script_with_its_own_flag_runs_patched(tmp_path):
    (tmp_path / "train_lora.py").write_text(FASTCHAT_SCRIPT)
    (tmp_path / "attention_spy.py").write_text((REPO / "tests" / "user_scripts" / "attention_spy.py").read_text())
    proc = run([sys.executable, tmp_path / "train_lora.py", "--flash_attn", "True", "--attn_backend", "sdpa",
                "--output_dir", tmp_path / "out", "--report_to", "none"], cwd=tmp_path)
    spy = spy_of(proc)
    masks_counted = importlib.util.find_spec("transformers.masking_utils") is not None  # transformers >= 4.53
    assert spy["padded_attention"] == 0 and spy["padded_masks"] == (0 if masks_counted else None)
    assert spy["patches"] == [["llama2", "sdpa", 2]]


@pytest.mark.parametrize(
    "var,value,allowed",
    [("PATCHKIT_BACKEND", "flashh", "auto, flash_attn, flash_attn_4, torch_varlen, sdpa"),
     ("PATCHKIT_FLASH_ATTN", "maybe", "1, true, yes, on"), ("PATCHKIT_UNPAD", "layers", "model, attention"),
     ("PATCHKIT_PATCH", "gpt 2", "all, gemma, "), ("PATCHKIT_STRICT", "2", "1, true, yes, on"),
     ("PATCHKIT_TESTED_TRANSFORMERS", "five", "a transformers version such as")],
)
def test_a_bad_variable_fails_import_patchkit_in_one_line_with_the_hook_off(var, value, allowed):
    env = clean_env(**{var: value})  # PATCHKIT_FLASH_ATTN unset (except its own case): the startup hook is off
    proc = run([sys.executable, "-c", "import patchkit\nprint('IMPORTED')"], env=env)
    assert proc.returncode == 1 and "IMPORTED" not in proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"patchkit: {var}={value!r} is not valid; allowed values: {allowed}"), proc.stderr
