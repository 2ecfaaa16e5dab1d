"""The launcher (`python -m patchkit.launch`, `patchkit run`): patch first, then the user's script, argv untouched."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import transformers
from entrypoints import clean_env, launch, patchkit_cli, tagged
from families import FAMILIES_FROM, served_here
from models import labels_for, padded_batch, tiny_model
from packaging.version import Version

import patchkit

# before 4.53 only LLaMA's patches exist: the launcher's default patch is LLaMA's, every other family is skipped by
# its transformers gate (the model runs unpatched, saying so)
FAMILIES = Version(transformers.__version__) >= Version(FAMILIES_FROM)

# A user's script: builds a tiny LLaMA *after* the launcher patched, runs a padded batch, checks the patch is live,
# then reverts and checks the unpatched logits are the same. Prints one JSON line for the test.
USER_SCRIPT = '''
import json, os, sys
import torch
import transformers
import patchkit

torch.manual_seed(0)
family = os.environ.get("FAMILY", "Llama")  # the class prefix: Llama, Mistral, ...
config = getattr(transformers, family + "Config")(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=int(os.environ.get("KV_HEADS", "2")), pad_token_id=0, attn_implementation="eager")
model = getattr(transformers, family + "ForCausalLM")(config).eval()
ids = torch.randint(3, 97, (3, 12))
mask = torch.ones(3, 12, dtype=torch.long)
mask[1, 8:] = 0   # right padding
mask[2, :5] = 0   # left padding
handles = [h for h in patchkit.active_patches() if h.spec.family == config.model_type]  # this model's patch
info = {"argv": sys.argv, "name": __name__, "patches": [h.name for h in handles],
        "backends": [h.backend for h in handles], "active": [h.name for h in patchkit.active_patches()]}
with torch.no_grad():
    patched = model(input_ids=ids, attention_mask=mask).logits
if handles:
    info["live_layers"] = handles[0].check(model)
    info["layers_run"] = handles[0].layers_patched
    handles[0].revert()
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
    info["max_diff_vs_eager"] = (patched - eager)[mask.bool()].abs().max().item()
print("RESULT " + json.dumps(info))
'''

SCRIPT_ARGS = ["--backend", "eager", "--strict", "-m", "x", "--", "--patch=llama1", "positional with space"]


@pytest.fixture
def user_script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(USER_SCRIPT)
    return path


def result_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tagged(proc.stdout, "RESULT")


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_launch_patches_before_the_script_and_leaves_its_argv_untouched(user_script, tmp_path):
    proc = launch("--backend", "sdpa", user_script, *SCRIPT_ARGS, cwd=tmp_path)
    info = result_of(proc)
    assert info["argv"] == [str(user_script), *SCRIPT_ARGS]
    assert info["name"] == "__main__"
    assert info["patches"] == ["llama2"] and info["backends"] == ["sdpa"]
    assert info["live_layers"] == 2 and info["layers_run"] == 2
    assert info["max_diff_vs_eager"] < 1e-5
    assert "patchkit.launch: rank 0/1 (single process): patch 'all' applied, backend 'sdpa'" in proc.stderr


@pytest.mark.heavy  # starts Python processes: make test-heavy
@pytest.mark.parametrize("family,patch", [("Mistral", "mistral"), ("Qwen3", "qwen3")])
def test_the_launcher_default_patches_whatever_family_the_script_loads(user_script, tmp_path, family, patch):
    if not hasattr(transformers, f"{family}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {family} (Qwen3: 4.51+)")
    proc = launch("--backend", "sdpa", user_script, env=clean_env(FAMILY=family), cwd=tmp_path)
    info = result_of(proc)
    if not FAMILIES:  # the family's patch is off here: its model runs unpatched, and the warnings say so and why
        assert info["patches"] == [] and info["active"] == ["llama2"]
        assert (f"(model_type '{patch}') runs unpatched, on transformers' own attention: its patch '{patch}' is off "
                f"here: transformers_version: FAILED (required transformers<6,>={FAMILIES_FROM}") in proc.stderr
        assert "WARNING: no attention layer ran through patch 'all'" in proc.stderr
        return
    assert info["patches"] == [patch] and info["live_layers"] == 2 and info["layers_run"] == 2
    assert info["max_diff_vs_eager"] < 1e-5 and "llama2" in info["active"]
    assert "2 attention layers ran through patch 'all'" in proc.stderr


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_patchkit_run_auto_falls_back_with_a_warning_naming_the_gate(user_script, tmp_path):
    proc = patchkit_cli("run", user_script, "a", "--b", cwd=tmp_path)
    info = result_of(proc)
    assert info["argv"] == [str(user_script), "a", "--b"]
    from patchkit.gates import probe_environment

    if probe_environment().flash_attn_error is None and probe_environment().cuda_available:
        pytest.skip("flash-attn usable here: auto picks flash_attn")
    assert info["backends"] == ["sdpa"]
    assert "RuntimeWarning" in proc.stderr and "flash_attn_installed: FAILED" in proc.stderr


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_environment_variables_choose_patch_and_backend(user_script, tmp_path):
    env = clean_env(PATCHKIT_PATCH="llama1", PATCHKIT_BACKEND="sdpa", KV_HEADS="4")  # llama1: no GQA
    proc = launch(user_script, env=env, cwd=tmp_path)
    info = result_of(proc)
    assert info["patches"] == ["llama1"] and info["backends"] == ["sdpa"] and info["live_layers"] == 2
    assert info["max_diff_vs_eager"] < 1e-5
    assert "patch 'llama1' applied, backend 'sdpa' (requested 'sdpa', strict=False)" in proc.stderr


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_strict_without_flash_attn_refuses_and_never_runs_the_script(user_script, tmp_path):
    from patchkit.gates import probe_environment

    if probe_environment().flash_attn_error is None and probe_environment().cuda_available:
        pytest.skip("flash-attn usable here")
    proc = launch("--strict", user_script, cwd=tmp_path)
    assert proc.returncode == 2
    assert "PatchGateError" in proc.stderr and "flash_attn_installed: FAILED" in proc.stderr
    assert "Nothing was patched" in proc.stderr
    assert "RESULT" not in proc.stdout


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_module_target_exit_code_and_rank_line(tmp_path):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import json, sys, patchkit\n"
        "print('RESULT ' + json.dumps({'argv': sys.argv[1:], 'name': __name__, "
        "'patches': [h.name for h in patchkit.active_patches()]}))\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    proc = launch("--backend", "sdpa", "-m", "userpkg.train", "3", "--help", env=env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    info = tagged(proc.stdout, "RESULT")
    assert info["argv"] == ["3", "--help"] and info["name"] == "__main__"
    if FAMILIES:
        assert info["patches"][:2] == ["llama2", "mistral"]
    else:
        assert info["patches"] == ["llama2"]
    assert "patchkit.launch: rank 1/2 (local 1): patch 'all' applied, backend 'sdpa'" in proc.stderr


# In-process runs of the same main() (fast): options, opt-out, bad values and usage errors.

PROBE = (
    "import json, sys, patchkit\n"
    "json.dump([[h.name, h.backend, h.options[2]] for h in patchkit.active_patches()], open(sys.argv[1], 'w'))\n"
)


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """Run launch.main() here: sys.argv/sys.path restored, patches reverted, PATCHKIT_* cleared, and the environment
    as it was after (the launcher exports its options for the processes the target starts: they must not leak into
    the tests after this one, which start interpreters of their own)."""
    import patchkit
    from patchkit.entry import launch as launch_module

    environment = dict(os.environ)
    for var in ("PATCHKIT_FLASH_ATTN", "PATCHKIT_PATCH", "PATCHKIT_BACKEND", "PATCHKIT_STRICT", "PATCHKIT_UNPAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script, out = tmp_path / "probe.py", tmp_path / "out.json"
    script.write_text(PROBE)

    def run(*options: str) -> list:
        assert launch_module.main([*options, str(script), str(out)]) == 0
        return json.loads(out.read_text())

    yield run
    patchkit.revert_patch()
    os.environ.clear()
    os.environ.update(environment)


def test_launcher_options_override_environment(in_process, monkeypatch):
    monkeypatch.setenv("PATCHKIT_PATCH", "llama1")
    monkeypatch.setenv("PATCHKIT_BACKEND", "flash_attn")
    monkeypatch.setenv("PATCHKIT_STRICT", "1")
    assert in_process("--patch", "llama2", "--backend", "sdpa", "--no-strict") == [["llama2", "sdpa", "model"]]


def test_environment_alone_chooses(in_process, monkeypatch):
    monkeypatch.setenv("PATCHKIT_PATCH", "llama")
    monkeypatch.setenv("PATCHKIT_BACKEND", "SDPA")
    assert in_process() == [["llama2", "sdpa", "model"]]


def every_family(got: list) -> set:
    """The (backend, unpad) every family was patched with; the default patches every family, LLaMA first (LLaMA
    alone before 4.53), and the families served from data whose modeling module an earlier test here imported."""
    names = [p["name"] for p in patchkit.available_patches() if p["name"] != "llama1"]
    every = sum(served_here(name) for name in names)
    assert got[0][0] == "llama2" and len([entry for entry in got if entry[0] in names]) == every
    return {tuple(entry[1:]) for entry in got}


def test_unpad_flag_overrides_environment(in_process, monkeypatch):
    monkeypatch.setenv("PATCHKIT_UNPAD", "attention")
    assert every_family(in_process("--backend", "sdpa")) == {("sdpa", "attention")}
    patchkit.revert_patch()  # the launcher leaves its patch applied for the script's lifetime
    assert every_family(in_process("--backend", "sdpa", "--unpad", "model")) == {("sdpa", "model")}


@pytest.mark.parametrize("how", ["env", "flag"])
def test_opt_out_runs_the_script_unpatched(in_process, monkeypatch, capsys, how):
    if how == "env":
        monkeypatch.setenv("PATCHKIT_FLASH_ATTN", "0")
    assert in_process(*(["--no-patch"] if how == "flag" else [])) == []
    assert "rank 0/1 (single process): not patched" in capsys.readouterr().err


@pytest.mark.parametrize(
    "var,value,allowed",
    [("PATCHKIT_BACKEND", "gpu", "auto, flash_attn, flash_attn_4, torch_varlen, sdpa"),
     ("PATCHKIT_PATCH", "gpt 2", "all, gemma, .*starcoder2, llama, or a served model_type"),
     ("PATCHKIT_FLASH_ATTN", "maybe", "1, true, yes, on"), ("PATCHKIT_STRICT", "2", "1, true, yes, on")],
)
def test_bad_environment_values_are_rejected_naming_the_variable(in_process, monkeypatch, capsys, var, value, allowed):
    import patchkit

    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exc:
        in_process()
    assert exc.value.code == 2
    assert re.search(f"{var}={value!r} is not valid; allowed values: {allowed}", capsys.readouterr().err)
    assert patchkit.active_patches() == []


@pytest.mark.skipif(not served_here("olmo"), reason="OLMo is served from 4.53")
def test_a_family_served_from_data_is_named_as_apply_patch_names_it(in_process, monkeypatch, capsys, tmp_path):
    """`apply_patch("olmo")` serves OLMo from data; `--patch olmo` and PATCHKIT_PATCH=olmo (or `olmo-2`'s hyphen
    spelling of a model type) do too: they once took only the families with a patch module. A name no family
    has fails before the script runs, naming the known ones."""
    from patchkit.entry.launch import main

    assert in_process("--patch", "olmo", "--backend", "sdpa") == [["olmo", "sdpa", "model"]]
    patchkit.revert_patch()
    monkeypatch.setenv("PATCHKIT_PATCH", "gpt-oss" if served_here("gpt_oss") else "olmo")
    assert in_process("--backend", "sdpa")[0][0] == ("gpt_oss" if served_here("gpt_oss") else "olmo")
    patchkit.revert_patch()
    monkeypatch.delenv("PATCHKIT_PATCH")
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')")
    with pytest.raises(SystemExit) as exc:
        main(["--patch", "bogus", str(script)])
    assert exc.value.code == 2 and "unknown patch 'bogus'; available patches: gemma" in capsys.readouterr().err
    assert patchkit.active_patches() == []


def test_usage_errors(tmp_path, capsys, monkeypatch):
    from patchkit.entry.launch import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    cases = [
        (["--backend", "sdpa"], 2, "no script given"), (["--bogus", "x.py"], 2, "unknown launcher option '--bogus'"),
        (["--backend", "gpu", "x.py"], 2, "invalid choice: 'gpu'"), (["--help"], 0, "SCRIPT.py | -m MODULE"),
    ]
    for argv, code, text in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        out = capsys.readouterr()
        assert exc.value.code == code and text in out.out + out.err, (argv, out)
    with pytest.raises(SystemExit, match="script not found"):
        main(["--no-patch", str(tmp_path / "missing.py")])
def test_a_command_on_path_runs_like_a_script_and_a_missing_one_fails_before_patching(in_process, tmp_path,
                                                                                        monkeypatch, capsys):
    """`patchkit run axolotl train cfg.yml`: a console script on PATH (a Python file pip wrote) runs patched as a
    script path would; a name that is neither a file nor a command fails at once, before the patch's imports."""
    from patchkit.entry import config
    from patchkit.entry import launch as launch_module

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    command = bin_dir / "probe-cli"
    command.write_text(f"#!/usr/bin/env python\n{PROBE}")
    command.chmod(0o755)
    (bin_dir / "shell-cli").write_text("#!/bin/sh\necho hi\n")
    (bin_dir / "shell-cli").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out.json"
    assert launch_module.main(["--backend", "sdpa", "probe-cli", str(out)]) == 0
    assert {backend for _, backend, _ in json.loads(out.read_text())} == {"sdpa"}  # patched before it ran
    patchkit.revert_patch()
    monkeypatch.setattr(config, "apply_from_args", lambda *a: pytest.fail("patched before the command was found"))
    with pytest.raises(SystemExit, match="'no-such-cli' is neither a file nor a command on PATH"):
        launch_module.main(["no-such-cli", "train"])
    with pytest.raises(SystemExit, match="'shell-cli' .* is not a Python script.*PATCHKIT_FLASH_ATTN=1"):
        launch_module.main(["shell-cli"])


def test_in_process_split_keeps_script_options(monkeypatch):
    from patchkit.entry.launch import build_parser, split_argv

    parser = build_parser("t")
    options, target = split_argv(["--patch=llama1", "--strict", "s.py", "--patch", "x", "-m", "y"], parser)
    assert options == ["--patch=llama1", "--strict"]
    assert (target.script, target.module, target.args) == ("s.py", None, ["--patch", "x", "-m", "y"])
    options, target = split_argv(["-mpkg.mod", "--strict"], parser)
    assert (options, target.module, target.args) == ([], "pkg.mod", ["--strict"])
    assert sys.argv  # untouched by splitting


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_the_launcher_reports_at_exit_how_many_layers_ran(user_script, tmp_path):
    proc = launch("--backend", "sdpa", str(user_script))
    assert result_of(proc)["layers_run"] == 2
    assert "2 attention layers ran through patch 'all'" in proc.stderr
    idle = tmp_path / "idle.py"
    idle.write_text("import sys\nprint('no model here')\nsys.exit(0)\n")
    proc = launch("--backend", "sdpa", str(idle))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WARNING: no attention layer ran through patch 'all'" in proc.stderr


@pytest.mark.heavy  # torch.compile: make test-heavy
def test_the_exit_line_says_compiled_calls_are_not_counted():
    """Under torch.compile the layers are counted by their marks but the calls are not: the exit line said "0
    calls" and no more."""
    import io

    import torch

    from patchkit.entry.process_report import report_at_exit

    torch._dynamo.reset()  # else an earlier test's compiles may leave this frame past its recompile limit: run eagerly
    model = torch.compile(tiny_model(hidden=32, layers=1), backend="eager")  # dynamo traces the same; no C++ build
    ids = torch.randint(3, 90, (2, 8))
    with patchkit.apply_patch(backend="sdpa") as group, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
        stream = io.StringIO()
        report_at_exit(group, stream)
    assert "attention layers ran through patch 'all' (0 calls; compiled calls are not counted" in stream.getvalue()


def test_the_exit_line_says_where_the_head_and_loss_ran():
    """The launcher's and the env var's one line at exit named the attention layers alone: where the LM head and
    loss ran (on real tokens, fused with the loss) was in `patchkit.report()` only."""
    import io

    from patchkit.entry.process_report import report_at_exit
    from patchkit.hooks.head import lm_head

    model = tiny_model(hidden=32, layers=1).train()
    ids, mask = padded_batch("right")
    with patchkit.apply_patch(backend="sdpa") as group:
        model(input_ids=ids, attention_mask=mask, labels=labels_for(ids, mask)).loss.backward()
        stream = io.StringIO()
        report_at_exit(group, stream)
    line = stream.getvalue().strip()
    assert group.heads == {lm_head.FUSED: 1}
    assert line.endswith("(1 calls, backend 'sdpa'); LM head and loss: 1 forwards on real tokens (1 returned the "
                         "loss alone, the head on the labelled tokens only; 1 fused with the loss)"), line


@pytest.mark.parametrize("reverted", [False, True])
def test_the_exit_line_counts_the_scripts_own_instance_patch(reverted, monkeypatch):
    """A script under the launcher (or the env var) that patches its own model, `apply_patch(model=...)`: its layers
    ran through patchkit, yet the exit line warned that the script ran without it. It names the script's own
    patches and what ran through them, the one that ended with the script's `with` block too."""
    import io

    import torch

    from patchkit import handles
    from patchkit.entry.process_report import report_at_exit

    monkeypatch.setattr(handles, "REVERTED", {})
    model = tiny_model(hidden=32, layers=2)
    ids, mask = padded_batch("left")
    group = patchkit.apply_patch(backend="sdpa")  # the launcher's, before the script built its model
    try:
        own = patchkit.apply_patch(model=model, backend="sdpa")
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        if reverted:
            own.revert()
        stream = io.StringIO()
        report_at_exit(group, stream)
        own.revert()
    finally:
        group.revert()
    line = stream.getvalue().strip()
    assert "WARNING" not in line and line.endswith(
        "no attention layer ran through patch 'all'; the script's own patches ran 'llama2': 2 attention layers "
        "(2 calls)."), line


def test_the_exit_line_of_a_process_whose_every_forward_stepped_aside_names_that_not_the_script(monkeypatch):
    """A rank whose every forward stepped aside (labels predicted from padding) was told that its script ran no
    forward of a served model, or that its attention was replaced; it says what happened."""
    import io

    from patchkit import handles
    from patchkit.entry.process_report import report_at_exit

    monkeypatch.setattr(handles, "REVERTED", {})
    model = tiny_model(hidden=32, layers=2)
    ids, mask = padded_batch("left")
    with patchkit.apply_patch(backend="sdpa") as group:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()  # every label, padding's too
        stream = io.StringIO()
        report_at_exit(group, stream)
    line = stream.getvalue().strip()
    assert line.endswith("WARNING: every forward through patch 'all' in this process stepped aside to transformers' "
                         "attention (1 labels_from_padding), so none ran patched; each cause's warning names its "
                         "fix."), line
