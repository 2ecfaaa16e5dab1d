"""Opt in without editing the script: PATCHKIT_FLASH_ATTN=1 alone, and attn_implementation="patchkit" unimported.

Each test runs a user's script (tests/user_scripts, which never import patchkit) in a fresh interpreter, so the
startup hook that patchkit-startup.pth installs at interpreter start is what is under test.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from entrypoints import REPO, clean_env, run, spy_of
from models import needs_mask_interface, needs_set_attn_implementation

import _patchkit_startup

pytestmark = pytest.mark.heavy  # each test starts Python processes: make test-heavy

SCRIPTS = REPO / "tests" / "user_scripts"
APPLIED = "patch 'all' applied to every family patchkit serves in this process"


def script(name: str, *args: str) -> list:
    return [sys.executable, SCRIPTS / name, *args]


def run_both(*jobs: tuple[list, dict]) -> list[subprocess.CompletedProcess]:
    """Run a few user scripts side by side (each is a fresh interpreter: imports dominate)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: run(job[0], cwd=SCRIPTS, env=clean_env(**job[1])), jobs))


def test_the_pth_file_is_installed_next_to_the_packages():
    dirs = [Path(d) for d in site.getsitepackages()]
    found = [d / "patchkit-startup.pth" for d in dirs if (d / "patchkit-startup.pth").is_file()]
    assert found, f"patchkit-startup.pth is not in {dirs}: reinstall patchkit (`pip install -e .`), see setup.py"
    assert found[0].read_text() == "import _patchkit_startup; _patchkit_startup.install()\n"


@pytest.mark.parametrize(
    "value,expected",
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("false", False), ("no", False),
     ("off", False), ("", False), (None, False), ("maybe", None)],
)
def test_values_of_the_variable(value, expected):
    environ = {} if value is None else {"PATCHKIT_FLASH_ATTN": value}
    assert _patchkit_startup.requested(environ) is expected


def test_a_process_that_never_imports_transformers_pays_nothing_heavy():
    probe = ("import json, sys; print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'transformers', 'patchkit')), '_patchkit_startup' in sys.modules, "
             "any(getattr(f, '__name__', '') == 'PostImportFinder' for f in sys.meta_path)]))")
    for env in ({}, {"PATCHKIT_FLASH_ATTN": "1"}):
        proc = run([sys.executable, "-c", probe], env=clean_env(**env))
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == [[], True, True], env
        assert proc.stderr == ""


def test_env_alone_patches_an_hf_trainer_script_that_asks_for_flash_attention_2(tmp_path):
    """Items 1 and 2 together: the usual GPU script, run unmodified on a machine without flash-attn."""
    from patchkit.gates import probe_environment

    if probe_environment().flash_attn_error is None:
        pytest.skip("flash-attn imports here: transformers loads flash_attention_2 itself")
    patched, control = run_both(
        (script("train_trainer.py", "--attn", "flash_attention_2", "--output_dir", str(tmp_path / "a")),
         {"PATCHKIT_FLASH_ATTN": "1"}),
        (script("train_trainer.py", "--attn", "sdpa", "--output_dir", str(tmp_path / "b")), {}),
    )
    got, want = spy_of(patched), spy_of(control)
    assert want["padded_attention"] > 0 and want["padded_masks"] > 0 and not want["patchkit_imported"]
    assert got["padded_attention"] == 0 and got["padded_masks"] == 0, got
    assert got["patches"] == [["llama2", "sdpa", 4]] and got["impl"] == "patchkit"  # 2 steps x 2 layers
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    err = patched.stderr
    assert err.count(APPLIED) == 1 and "patchkit: PATCHKIT_FLASH_ATTN=1, rank 0/1 (single process)" in err
    assert err.count("attn_implementation='flash_attention_2' for LlamaForCausalLM is served by patchkit's "
                     "'sdpa' backend") == 1


def test_a_bad_value_ends_the_process_at_the_family_import_in_one_line_naming_the_variable():
    proc = run(script("forward.py"), cwd=SCRIPTS, env=clean_env(PATCHKIT_FLASH_ATTN="maybe"))
    assert proc.returncode != 0 and "SPY" not in proc.stdout
    assert proc.stderr.startswith("patchkit: PATCHKIT_FLASH_ATTN='maybe' is not valid; allowed values: 1, true, yes, "
                                  "on"), proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr  # one line, not 32


def test_the_launcher_applies_once_and_its_options_win(tmp_path):
    """The launcher reads the same variables itself; the startup hook stands down (no second patch, no clash)."""
    user = tmp_path / "user.py"
    user.write_text((SCRIPTS / "forward.py").read_text())
    (tmp_path / "attention_spy.py").write_text((SCRIPTS / "attention_spy.py").read_text())
    launch = [sys.executable, "-m", "patchkit.launch"]
    patched, opted_out = run_both(
        ([*launch, "--backend", "sdpa", "--unpad", "attention", user], {"PATCHKIT_FLASH_ATTN": "1"}),
        ([*launch, "--no-patch", user], {"PATCHKIT_FLASH_ATTN": "1"}),
    )
    got = spy_of(patched)
    assert got["padded_attention"] == 0 and got["patches"] == [["llama2", "sdpa", 2]]
    assert "patchkit.launch: rank 0/1 (single process): patch 'all' applied, backend 'sdpa'" in patched.stderr
    assert APPLIED not in patched.stderr
    off = spy_of(opted_out)
    assert off["padded_attention"] > 0 and off["patches"] == [] and APPLIED not in opted_out.stderr
    assert "not patched (PATCHKIT_FLASH_ATTN=0 or --no-patch)" in opted_out.stderr


EXPLICIT = '''
import patchkit, torch
from transformers.modeling_utils import PreTrainedModel
names = ("_check_and_adjust_attn_implementation", "_check_and_enable_flash_attn_2")  # >= 4.56, before
check = next(n for n in names if n in vars(PreTrainedModel))
before = vars(PreTrainedModel)[check]
handle = patchkit.apply_patch(backend="sdpa")           # imports every family's module: the startup hook fires inside
from transformers.models.llama import modeling_llama as ml
assert patchkit.active_patches() == list(handle), patchkit.active_patches()
assert patchkit.apply_from_env() is handle               # the variable asks for the same options: the same handle
try:
    patchkit.apply_patch(backend="sdpa", unpad="attention")
except patchkit.PatchkitError as exc:
    print("CLASH", exc)
handle.revert()
assert ml.LlamaAttention.forward.__qualname__ == "LlamaAttention.forward", ml.LlamaAttention.forward
assert vars(PreTrainedModel)[check] is before
print("OK")
'''


def test_an_explicit_apply_with_the_variable_set_patches_once(tmp_path):
    path = tmp_path / "explicit.py"
    path.write_text(EXPLICIT)
    proc = run([sys.executable, path], env=clean_env(PATCHKIT_FLASH_ATTN="1", PATCHKIT_BACKEND="sdpa"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "OK" and APPLIED not in proc.stderr
    assert "is already applied to the llama classes; call its handle's revert()" in proc.stdout


HOOK_FIRST = '''
import transformers.models.llama.modeling_llama      # the startup hook applies the class patch here
import patchkit
handle = patchkit.active_patches()[0]
print("ORIGIN", handle.origin)
try:
    patchkit.apply_patch(backend="sdpa", unpad="attention")
except patchkit.PatchkitError as exc:
    print("CLASH", exc)
'''


def test_a_different_explicit_apply_after_the_variable_applied_says_where_the_patch_came_from(tmp_path):
    path = tmp_path / "hook_first.py"
    path.write_text(HOOK_FIRST)
    proc = run([sys.executable, path], env=clean_env(PATCHKIT_FLASH_ATTN="true", PATCHKIT_BACKEND="sdpa"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    origin = "applied when a served family's modeling module was imported, because PATCHKIT_FLASH_ATTN is on"
    assert f"ORIGIN {origin}" in proc.stdout
    assert (f"patch 'llama2' (backend='sdpa', strict=False, unpad='model') is already applied to the llama classes "
            f"({origin}); call its handle's revert()") in proc.stdout
    assert proc.stderr.count(APPLIED) == 1


@needs_mask_interface
def test_registered_name_works_without_importing_patchkit():
    """Item 3: attn_implementation="patchkit" (a TRL model_init_kwargs, a config.json) with patchkit only installed.

    The control run is transformers' default (sdpa) with PATCHKIT_FLASH_ATTN=0: off means off.
    """
    patched, control = run_both((script("forward.py", "--attn", "patchkit"), {}),
                                (script("forward.py"), {"PATCHKIT_FLASH_ATTN": "0"}))
    got, want = spy_of(patched), spy_of(control)
    assert want["impl"] == "sdpa" and want["padded_attention"] > 0 and want["padded_masks"] > 0
    assert not want["patchkit_imported"] and APPLIED not in control.stderr
    assert got["impl"] == "patchkit" and got["padded_attention"] == 0 and got["padded_masks"] == 0
    assert got["marks"] == {"loaded": True}  # loading a model with the name imports patchkit, which adopts it (its
    # mask function then reads the causal LM's call from the model's own wrapper, not the stack)
    assert got["patchkit_imported"] and got["patches"] == []  # the registered route: no global patch
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert "Specified `attn_implementation" not in patched.stderr


@needs_set_attn_implementation
def test_set_attn_implementation_in_a_process_that_never_imports_patchkit_is_adopted_and_reads_labels():
    """The name given after loading, by `set_attn_implementation`, with patchkit only installed: the startup hook
    imports patchkit there, which adopts the model, so labels at padding step aside (transformers' attention, the
    control's loss): the model's own call told the masks. (A model so named that patchkit never saw would step
    aside as `named_unseen`.)"""
    aside, control = run_both(
        (script("forward.py", "--set-attn", "patchkit", "--labels-at-padding"), {}),
        (script("forward.py", "--labels-at-padding"), {"PATCHKIT_FLASH_ATTN": "0"}))
    got, want = spy_of(aside), spy_of(control)
    assert got["marks"] == {"loaded": False} and got["patchkit_imported"]  # set_attn_implementation imported it
    assert got["padded_attention"] > 0 and "(labels_from_padding)" in aside.stderr
    assert "named_unseen" not in aside.stderr
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)


@needs_mask_interface
def test_registered_name_without_the_startup_hook_is_transformers_generic_error():
    """`python -S` skips .pth files: the hook is what makes the name work (the README says so)."""
    code = ("import sys; sys.path[:0] = " + repr([p for p in sys.path if p]) + "\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32, "
            "num_attention_heads=2, vocab_size=16, attn_implementation='patchkit'))\n")
    proc = run([sys.executable, "-S", "-c", code])
    assert proc.returncode != 0 and 'Specified `attn_implementation="patchkit"` is not supported' in proc.stderr


FROM_DATA = '''
import peft                                          # imports BLOOM's modeling module: no patch yet
import patchkit, torch, transformers as tf
print("BEFORE", len(patchkit.active_patches()))
config = tf.OlmoConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
torch.manual_seed(0)
model = tf.OlmoForCausalLM(config)                   # the first model: the patch, with OLMo's family from data
ids = torch.randint(3, 97, (2, 8))
mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
handle = next(h for h in patchkit.active_patches() if h.name == "olmo")
print("OLMO", handle.calls, handle.stepped_aside, round(loss.item(), 6))
'''


@needs_mask_interface
def test_the_variable_serves_a_family_from_data_from_its_first_model(tmp_path):
    """OLMo has no module in patches/: PATCHKIT_FLASH_ATTN=1 applies the patch when the first model is built (an
    import alone, as peft's of BLOOM, applies nothing), and OLMo's family with it; the loss equals unpatched."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.0"):
        pytest.skip("families from data: transformers 5.x")
    path = tmp_path / "from_data.py"
    path.write_text(FROM_DATA)
    plain = FROM_DATA.split("handle =")[0] + "print('LOSS', round(loss.item(), 6))\n"
    patched, unpatched = run_both(([sys.executable, path], {"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa"}),
                                  ([sys.executable, "-c", plain], {}))
    assert patched.returncode == 0, patched.stderr[-3000:]
    assert "BEFORE 0" in patched.stdout and "OLMO 2 {} " in patched.stdout, patched.stdout
    loss = patched.stdout.split("OLMO 2 {} ")[1].split()[0]
    assert f"LOSS {loss}" in unpatched.stdout, unpatched.stdout + unpatched.stderr[-2000:]


EXPLICIT_AFTER_ANOTHER_IMPORT = '''
import transformers.models.bloom.modeling_bloom      # another family's import: the variable waits for a model
import patchkit, torch, transformers as tf
handle = patchkit.apply_patch("llama2", backend="sdpa", unpad="attention")   # the script's own options
model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4))
print("ACTIVE", [(h.name, h.options) for h in patchkit.active_patches()])
'''


def test_an_explicit_apply_after_another_familys_import_keeps_its_options(tmp_path):
    """With the variable on, an import of a family without a module (peft imports BLOOM's) arms the patch for the
    first model; the script's own apply_patch before that model wins, and building it runs once through each hook
    (the armed one under patchkit's own had called back into it without end)."""
    path = tmp_path / "explicit_after.py"
    path.write_text(EXPLICIT_AFTER_ANOTHER_IMPORT)
    proc = run([sys.executable, path], env=clean_env(PATCHKIT_FLASH_ATTN="1", PATCHKIT_BACKEND="sdpa"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ACTIVE [('llama2', ('sdpa', False, 'attention'))]" in proc.stdout, proc.stdout
