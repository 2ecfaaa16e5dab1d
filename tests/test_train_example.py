"""Run the FastChat-style pair (examples/train_mem.py, examples/train.py) as a user would and compare the losses."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # each test starts Python processes: make test-heavy

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
COMMON = [
    "--use_cpu", "--report_to", "none", "--max_steps", str(STEPS), "--logging_steps", "1", "--seed", "42",
    "--per_device_train_batch_size", "4", "--dataloader_num_workers", "0", "--save_strategy", "no",
    "--disable_tqdm", "true",
]
RUNS = {
    "unpatched": ("train.py", []),
    "patched": ("train_mem.py", []),
    "packed": ("train_mem.py", ["--packing"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[float]]]:
    """The three runs started together (one thread each): name -> (stdout + stderr, per-step logged losses)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = {}
    for name, (script, extra) in RUNS.items():
        out_dir = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, str(ROOT / "examples" / script), "--output_dir", str(out_dir), *COMMON, *extra]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs[name] = (proc, out_dir)
    results = {}
    for name, (proc, out_dir) in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} run exited {proc.returncode}\n{out}"
        history = json.loads((out_dir / "trainer_state.json").read_text())["log_history"]
        results[name] = (out, [h["loss"] for h in history if "loss" in h])
    return results


def check_patched(out: str) -> None:
    """The patch report was printed: sdpa backend (no GPU here) and a nonzero layer count."""
    assert "patchkit patch 'llama2'" in out, out
    assert re.search(r"^\s*backend: sdpa \(requested 'auto'", out, re.M), out
    layers = re.search(r"attention layers through the patch: (\d+) \((\d+) calls\)", out)
    assert layers and int(layers[1]) > 0 and int(layers[2]) > 0, out


def test_train_mem_patched_matches_unpatched_train(runs):
    out, losses = runs["patched"]
    check_patched(out)
    assert re.search(r"padding tokens seen: \d+ of \d+ \((?!0\.0%)[\d.]+%, right padding\)", out), out
    final = float(re.search(r"final train loss: (\S+)", out)[1])
    assert math.isfinite(final)
    ref_out, ref = runs["unpatched"]
    assert "patchkit: not patched" in ref_out, ref_out
    assert len(losses) == len(ref) == STEPS and all(map(math.isfinite, losses)), (losses, ref)
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses, ref)), (losses, ref)


def test_packing_patched_equals_padded(runs):
    """Same examples, same order: one packed row must give the padded batch's loss (no cross-example attention)."""
    out, losses = runs["packed"]
    check_patched(out)
    assert "padding tokens seen: 0 of" in out and "packed)" in out, out
    _, padded = runs["unpatched"]
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    assert abs(losses[0] - padded[0]) < 1e-4, (losses, padded)
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses, padded)), (losses, padded)
