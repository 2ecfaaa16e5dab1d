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

pytestmark = pytest.mark.heavy  # each test starts Python processes: make test-heavy

SCRIPT = '''
import json, os, subprocess, sys

mode = sys.argv[1]
if mode == "reexec":  # as axolotl's CLI re-executes itself under accelerate
    os.execv(sys.executable, [sys.executable, __file__, "train"])
if mode == "spawn":  # as a wrapper that starts its worker and waits
    sys.exit(subprocess.run([sys.executable, __file__, "train"]).returncode)
if mode in ("ranks", "idle-ranks"):  # as LLaMA-Factory re-launches itself under torchrun: two ranks, and waits
    child = "train" if mode == "ranks" else "idle"
    ranks = [subprocess.Popen([sys.executable, __file__, child],
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)]
    sys.exit(max(p.wait() for p in ranks))
if mode == "idle":  # a rank that imports a served family but runs no model
    from transformers import LlamaForCausalLM
    sys.exit(0)

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
    proc = launch("--backend", "sdpa", script, mode, cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = tagged(proc.stdout, "RESULT")
    assert result["calls"] == 2, proc.stderr[-3000:]  # one forward, two layers: in the process that trained
    assert result["logits"] == pytest.approx(unpatched["logits"], abs=2e-5)
    assert "patchkit.launch: rank 0/1 (single process): patch 'all' applied, backend 'sdpa'" in proc.stderr
    assert CHILD_LINE in proc.stderr and "backend 'sdpa'" in proc.stderr.split(CHILD_LINE)[1].splitlines()[0]
    assert not list(tmp_path.glob("patchkit-report-*"))  # the launcher's report file is gone, re-exec'd or not
    if mode == "spawn":  # the launcher's own process ran no model: its last line says where the patch went
        assert proc.stderr.splitlines()[-1] == (
            "patchkit.launch: rank 0/1 (single process): no attention layer ran in this process; 1 process it started "
            "ran attention layers through patch 'all' (2 calls; each says so in its own line)."
        )
        assert "WARNING" not in proc.stderr


def test_the_launchers_last_line_counts_the_ranks_the_command_started(script, tmp_path):
    """LLaMA-Factory re-launches itself under torchrun: both ranks reported their calls, then the launcher's own last
    line said "no attention layer ran through patch 'all' in this process ... it ran without patchkit"."""
    proc = launch("--backend", "sdpa", script, "ranks", cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"patchkit (PATCHKIT_FLASH_ATTN): rank {rank}/2 (local {rank}): 2 attention layers ran" in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "patchkit.launch: rank 0/1 (single process): no attention layer ran in this process; 2 processes it started "
        "ran attention layers through patch 'all' (4 calls; each says so in its own line)."
    ), proc.stderr[-3000:]
    assert "without patchkit" not in proc.stderr
    assert not list(tmp_path.glob("patchkit-report-*"))  # the report file the ranks wrote to is gone


def test_ranks_that_ran_no_model_leave_the_launchers_warning(script, tmp_path):
    proc = launch("--backend", "sdpa", script, "idle-ranks", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("patchkit.launch: rank 0/1 (single process): WARNING: no attention layer ran through patch "
                           "'all' in this process. No process it started ran one either"), proc.stderr[-3000:]


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


def test_a_launcher_forwards_what_its_processes_reported_to_the_launcher_in_front_of_it(tmp_path, monkeypatch):
    """`patchkit run wrapper.py` where the wrapper runs `torchrun -m patchkit.launch train.py`: the inner launcher's
    ranks report to it, and it hands their records on with its own, so the outer launcher's line counts them."""
    import io
    import os
    from types import SimpleNamespace

    from patchkit.entry.process_report import ENV_REPORT_TO, close_channel, open_channel, received, record, send

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv(ENV_REPORT_TO, raising=False)
    idle = SimpleNamespace(name="all", layers_seen=0, calls=0, stepped_aside={})
    real_pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: 11)  # the outer launcher's process
    outer, parent = open_channel()
    assert parent is None and os.environ[ENV_REPORT_TO] == outer
    monkeypatch.setattr(os, "getpid", lambda: 12)  # the inner launcher's, which the outer's command started
    inner, inner_parent = open_channel()
    assert inner_parent == outer and os.environ[ENV_REPORT_TO] == inner
    monkeypatch.setattr(os, "getpid", lambda: real_pid)
    rank = {"pid": -1, "rank": "rank 0/2 (local 0)", "patch": "all", "layers": 2, "calls": 60}
    send([rank, {**rank, "pid": -2, "rank": "rank 1/2 (local 1)"}], inner)
    children = received(inner)
    assert [c["calls"] for c in children] == [60, 60]
    send([{**record(idle), "pid": -3}, *children], inner_parent)
    close_channel(inner, inner_parent)
    assert os.environ[ENV_REPORT_TO] == outer and not os.path.exists(inner)
    stream = io.StringIO()
    from patchkit.entry.process_report import report_at_exit

    report_at_exit(idle, stream, ended_by=None, handed_down=True, children=received(outer))
    close_channel(outer, parent)
    assert ENV_REPORT_TO not in os.environ and not os.path.exists(outer)
    assert stream.getvalue().rstrip().endswith("no attention layer ran in this process; 2 processes it started ran "
                                               "attention layers through patch 'all' (120 calls; each says so in its "
                                               "own line).")


def test_a_new_launcher_removes_the_report_files_of_launchers_that_are_gone(tmp_path, monkeypatch):
    """A launcher killed (torchrun's SIGTERM when another rank fails) or ended by os._exit never closes its report
    file; the next launcher removes it, and leaves those of launchers still running and the one it inherited."""
    import os
    import subprocess
    import sys
    import tempfile

    from patchkit.entry.process_report import CHANNEL_PREFIX, ENV_REPORT_TO, close_channel, open_channel

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"{CHANNEL_PREFIX}{gone.pid}-abc.jsonl"
    running = tmp_path / f"{CHANNEL_PREFIX}{os.getppid()}-def.jsonl"
    inherited = tmp_path / f"{CHANNEL_PREFIX}{gone.pid}-ghi.jsonl"
    other = tmp_path / "patchkit-report-notes.txt"
    for path in (stale, running, inherited, other):
        path.write_text("")
    monkeypatch.setenv(ENV_REPORT_TO, str(inherited))
    channel, parent = open_channel()
    try:
        assert parent == str(inherited) and os.path.dirname(channel) == str(tmp_path)
        assert not stale.exists()
        assert running.exists() and inherited.exists() and other.exists() and os.path.exists(channel)
    finally:
        close_channel(channel, parent)
    assert not os.path.exists(channel) and os.environ[ENV_REPORT_TO] == str(inherited)
