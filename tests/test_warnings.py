"""patchkit's warnings as a person reads them: short, and attributed to the line of the user's own code."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from entrypoints import clean_env, run
from fakes import env, install_flash_double
from models import needs_mask_interface, padded_batch, tiny_config, tiny_model
from transformers import LlamaForCausalLM

import patchkit
from patchkit import gates
from patchkit.backends.choice import MAX_WARNING_CHARS
from patchkit.entry.doctor import doctor, format_report
from patchkit.hooks.name import attention_interface
from patchkit.warn import is_internal, user_frame

NO_GPU = dict(flash_attn_version=None, flash_attn_error="not installed (No module named 'flash_attn')",
              cuda_available=False, device_name=None, compute_capability=None)


def caught(fn) -> list[warnings.WarningMessage]:
    """Every warning `fn()` raised (all of them, not once per location)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return [w for w in record if issubclass(w.category, RuntimeWarning) and "patchkit" in str(w.message)]


def test_the_fallback_warning_is_one_short_line_and_the_report_keeps_every_gate(monkeypatch):
    """What runs, the first reason, where to read more; the four failed gates with their fixes stay in the report."""
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**NO_GPU))
    record = caught(lambda: patchkit.apply_patch("llama2"))
    assert len(record) == 1
    text = str(record[0].message)
    assert len(text) <= MAX_WARNING_CHARS and "\n" not in text, (len(text), text)
    assert text.startswith("patchkit: patch 'llama2' runs on the exact sdpa backend")
    assert "not flash_attn: flash_attn_installed: FAILED" in text and "Fix: `patchkit doctor`" in text
    assert "not torch_varlen: cuda_available: FAILED" in text and MAX_WARNING_CHARS <= 200
    assert "compute_capability" not in text  # each better backend's first reason only
    report = patchkit.active_patches()[0].report()
    failed = [g for g in patchkit.active_patches()[0].gates if not g.passed]
    assert {g.name for g in failed} >= {"flash_attn_installed", "flash_attn_version", "cuda_available",
                                        "compute_capability"}
    for gate in failed:
        assert gate.describe() in report and "Fix: " in gate.describe()


def test_doctor_lists_every_gate_of_every_backend(monkeypatch):
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**NO_GPU))
    data = doctor()
    text = format_report(data, verbose=True)  # `patchkit doctor --verbose`; the default is one line per patch
    llama2 = next(p for p in data["patches"] if p["name"] == "llama2")
    names = [(g["backend"], g["name"]) for g in llama2["gates"]]
    assert ("flash_attn", "flash_attn_installed") in names and ("flash_attn", "compute_capability") in names
    assert ("torch_varlen", "torch_varlen_api") in names and ("torch_varlen", "cuda_available") in names
    for g in llama2["gates"]:
        assert gates.GateResult(**g).describe() in text


def test_apply_patch_warning_names_this_file(monkeypatch):
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**NO_GPU))
    record = caught(lambda: patchkit.apply_patch("llama2"))
    assert len(record) == 1
    assert record[0].filename == __file__, record[0].filename


def test_a_per_call_warning_names_the_line_that_ran_the_model(monkeypatch):
    install_flash_double(monkeypatch)
    model = tiny_model()  # fp32: the flash_attn backend casts q/k/v with one warning, deep inside the forward
    ids, mask = padded_batch("right")
    with patchkit.apply_patch("llama2"):
        record = caught(lambda: model(input_ids=ids, attention_mask=mask))
    assert [w.filename for w in record] == [__file__]


@needs_mask_interface
@pytest.mark.parametrize("load", ["from_config", "from_pretrained"])
def test_registered_name_warning_names_this_file(monkeypatch, tmp_path, load):
    """attn_implementation="patchkit": the backend is chosen when a model gets the name (on the host, before a first
    forward that dynamo may trace), many frames inside transformers' loading."""
    monkeypatch.setattr(gates, "probe_environment", lambda: env(**NO_GPU))
    attention_interface.register(backend="sdpa")
    attention_interface.register(backend="auto")  # a fresh route: its backend is chosen again
    if load == "from_pretrained":
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_config()).save_pretrained(tmp_path)
    name = attention_interface.ATTENTION_NAME
    try:
        if load == "from_config":
            record = caught(lambda: LlamaForCausalLM._from_config(tiny_config(), attn_implementation=name))
        else:
            record = caught(lambda: LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation=name))
        assert not caught(lambda: attention_interface.route_state())  # said once
    finally:
        attention_interface.register(backend="sdpa")
        attention_interface.register(backend="auto")
    assert len(record) == 1
    assert record[0].filename == __file__, record[0].filename
    assert str(record[0].message).startswith("patchkit: attn_implementation='patchkit' runs on the exact sdpa backend")


def test_what_counts_as_internal():
    prefixes = (f"{patchkit.__path__[0]}/", f"{torch.__path__[0]}/")
    assert is_internal(patchkit.__file__, prefixes, ())
    assert is_internal("<frozen importlib._bootstrap>", prefixes, ())
    assert not is_internal(__file__, prefixes, ())
    assert not is_internal("<string>", prefixes, ())  # python -c is the user's code
    sites = ("/venv/lib/python3.11/site-packages/",)
    assert is_internal("/venv/lib/python3.11/site-packages/trl/trainer/sft_trainer.py", prefixes, sites)  # a framework
    assert user_frame(sys._getframe()).f_code.co_filename == __file__


USER_SCRIPT = """\
import torch
from transformers import LlamaConfig, LlamaForCausalLM  # line 2: PATCHKIT_FLASH_ATTN applies the patch here

config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, pad_token_id=0)
LlamaForCausalLM(config)(input_ids=torch.ones(1, 4, dtype=torch.long))
"""


@pytest.mark.heavy  # make test-heavy
def test_the_startup_hook_and_the_launcher_name_the_users_script(tmp_path):
    """Without a GPU both fall back with a warning: the variable's at the import line, the launcher's at line 1."""
    if gates.probe_environment().cuda_available:
        pytest.skip("a CUDA device: the backend may not fall back here")
    script = tmp_path / "user_train.py"
    script.write_text(USER_SCRIPT)
    by_env = run([sys.executable, script], env=clean_env(PATCHKIT_FLASH_ATTN="1"), cwd=tmp_path)
    by_launcher = run([sys.executable, "-m", "patchkit.launch", script], cwd=tmp_path)
    for proc, line in ((by_env, 2), (by_launcher, 1)):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"{script}:{line}: RuntimeWarning: patchkit:" in proc.stderr, proc.stderr[-2000:]
        assert "patchkit/" not in proc.stderr.split("RuntimeWarning")[0].splitlines()[-1]
        message = proc.stderr.split("RuntimeWarning: ")[1].splitlines()[0]  # every family's patch, one short line
        assert message.startswith("patchkit: patch 'all' runs on the exact sdpa backend (not flash_attn: ")
        assert len(message) <= MAX_WARNING_CHARS <= 200 and "mistral" not in message, message
