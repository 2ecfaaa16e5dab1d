"""The launcher in front of a command that starts the real training process: the patch reaches that process.

axolotl's `axolotl train cfg.yml` re-executes itself under accelerate; other wrappers spawn their workers. The
launcher patched only its own process, so those trained unpatched while its log said the patch was applied. It now
hands its choice down (PATCHKIT_* variables, which the startup hook reads in each new interpreter); the process that
trains reports at exit, and a process that ended with an exception says so instead of "ran without patchkit".
"""

from __future__ import annotations

import sys

import pytest
from entrypoints import clean_env, launch, run, tagged

SCRIPT = '''
import json, os, subprocess, sys

mode = sys.argv[1]
if mode == "reexec":  # as axolotl's CLI re-executes itself under accelerate
    os.execv(sys.executable, [sys.executable, __file__, "train"])
if mode == "spawn":  # as a wrapper that starts its worker and waits
    sys.exit(subprocess.run([sys.executable, __file__, "train"]).returncode)

import torch
import transformers

if mode == "crash":  # the model class is imported (the startup hook patches it), then it cannot be loaded
    from transformers import LlamaForCausalLM
    raise RuntimeError("could not load the model: no such checkpoint")
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
model = transformers.LlamaForCausalLM(config).eval()
ids = torch.randint(3, 97, (2, 10))
mask = torch.ones(2, 10, dtype=torch.long)
mask[1, 6:] = 0
with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=mask).logits
patchkit = sys.modules.get("patchkit")
calls = sum(h.calls for h in patchkit.active_patches()) if patchkit else 0
print("RESULT " + json.dumps({"calls": calls, "logits": logits[mask.bool()].flatten()[:50].tolist()}), flush=True)
'''

CHILD_LINE = "patchkit (PATCHKIT_FLASH_ATTN): rank 0/1 (single process): 2 attention layers ran through patch 'all'"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def unpatched(script, tmp_path):
    proc = run([sys.executable, script, "train"], env=clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = tagged(proc.stdout, "RESULT")
    assert result["calls"] == 0
    return result


@pytest.mark.parametrize("mode", ["reexec", "spawn"])
def test_a_process_the_command_starts_trains_patched(mode, script, unpatched, tmp_path):
    proc = launch("--backend", "sdpa", script, mode, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = tagged(proc.stdout, "RESULT")
    assert result["calls"] == 2, proc.stderr[-3000:]  # one forward, two layers: in the process that trained
    assert result["logits"] == pytest.approx(unpatched["logits"], abs=2e-5)
    assert "patchkit.launch: rank 0/1 (single process): patch 'all' applied, backend 'sdpa'" in proc.stderr
    assert CHILD_LINE in proc.stderr and "backend 'sdpa'" in proc.stderr.split(CHILD_LINE)[1].splitlines()[0]
    if mode == "spawn":  # the launcher's own process ran no model: it says where the patch went
        assert "no attention layer ran through patch 'all' in this process. Processes it started inherited the " \
            "patch" in proc.stderr


def test_no_patch_is_handed_down_too(script, tmp_path):
    proc = launch("--no-patch", script, "reexec", cwd=tmp_path, env=clean_env(PATCHKIT_FLASH_ATTN="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tagged(proc.stdout, "RESULT")["calls"] == 0 and "attention layers ran" not in proc.stderr


@pytest.mark.parametrize("way", ["launcher", "env"])
def test_a_process_that_ends_with_an_exception_says_so_at_exit(way, script, tmp_path):
    if way == "launcher":
        proc = launch("--backend", "sdpa", script, "crash", cwd=tmp_path)
        who = "patchkit.launch"
    else:
        proc = run([sys.executable, script, "crash"], env=clean_env(PATCHKIT_FLASH_ATTN="1", PATCHKIT_BACKEND="sdpa"),
                   cwd=tmp_path)
        who = "patchkit (PATCHKIT_FLASH_ATTN)"
    assert proc.returncode != 0 and "RuntimeError: could not load the model" in proc.stderr
    assert (f"{who}: rank 0/1 (single process): the process ended with RuntimeError: could not load the model: no "
            "such checkpoint before any attention layer ran through patch 'all'.") in proc.stderr, proc.stderr[-3000:]
    assert "ran without patchkit" not in proc.stderr
