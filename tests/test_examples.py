"""Run the nn and LoRA examples as a user would (subprocess, quick mode) and check what they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # each test starts Python processes: make test-heavy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    """Run examples/<name> with the test interpreter; fail with its output when the exit code is not 0."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=180,
        cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_transformer_block_example():
    out = run_example("transformer_block.py", "--quick")
    assert re.search(r"training: loss [\d.]+ -> [\d.]+ \(decreasing\)", out), out
    for label in ("causal", "bidirectional"):
        line = next(row for row in out.splitlines() if row.startswith(f"check {label} "))
        assert "max |output diff|" in line and "max |grad diff|" in line and line.endswith("OK"), line
    assert "memory at N=1024" in out
    assert re.search(r"\(B,1,N,N\) bool mask \+ SDPA .* peak RSS \+\s*[\d.]+ MiB", out), out
    assert re.search(r"VarlenSelfAttention \(cu_seqlens, no mask\)\s+peak RSS \+\s*[\d.]+ MiB", out), out
    assert out.rstrip().endswith("all checks passed")


def test_lora_example():
    pytest.importorskip("peft", reason="examples/lora.py needs peft (pip install peft)")
    out = run_example("lora.py", "--quick")
    assert "model built in torch.bfloat16; torch default dtype back to torch.float32" in out
    assert "cast_for_training: 7 modules now torch.bfloat16: embed_tokens, layers.0.input_layernorm" in out
    match = re.search(r"initial loss: patched ([\d.]+), unpatched ([\d.]+)", out)
    assert match and abs(float(match[1]) - float(match[2])) < 3e-2, out
    losses = [float(x) for x in re.findall(r"step\s+\d+/3\s+loss ([\d.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0], out
    assert "patchkit patch 'llama2'" in out and "attention layers through the patch: 2 (6 calls)" in out
    assert out.rstrip().endswith("lora example: OK")
