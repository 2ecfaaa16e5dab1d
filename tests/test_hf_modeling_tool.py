"""tools/hf_modeling_tests.py end to end on a tiny stand-in of transformers' test tree: the comparison it reports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "hf_modeling_tests.py"

# A family test file whose tests differ the ways the real ones can: one passes either way, two (one at module
# level, one in a class) read the patch's variable and fail patched (pass->fail the tool must report, with its
# message), one runs a padded forward (attention through the patch when patched), one skips.
FAMILY_TESTS = '''
import os

import pytest
import torch
import transformers


def test_passes_either_way():
    assert 1 + 1 == 2


def test_fails_patched():
    assert os.environ.get("PATCHKIT_FLASH_ATTN") is None, "patched run"


def test_padded_forward():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        assert model(input_ids=torch.randint(1, 64, (2, 8)), attention_mask=mask).logits.shape == (2, 8, 64)


def test_skips():
    pytest.skip("not on this machine")


class TestInAClass:  # transformers' own tests live in classes (LlamaModelTest)
    def test_fails_patched_too(self):
        assert os.environ.get("PATCHKIT_FLASH_ATTN") is None, "patched in a class"
'''


def test_the_tool_reports_what_patching_changes(tmp_path: Path) -> None:
    """Plain and patched runs, the re-run of the changed test, the probe's counters: one pass->fail, stable on
    re-run, with its message; the forward's attention counted through the patch; the report groups it by cause."""
    tree = tmp_path / "hf_tests"
    (tree / "tests/models/llama").mkdir(parents=True)
    (tree / "pytest.ini").write_text("[pytest]\n")
    (tree / "tests/models/llama/test_modeling_llama.py").write_text(textwrap.dedent(FAMILY_TESTS))
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(TOOL), "--tests-dir", str(tree), "--families", "llama", "--out", str(out), "-k", "",
         "--python", sys.executable, "--timeout", "300"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    family = json.loads((out / "results.json").read_text())["families"][0]
    assert (family["tests"], family["run_plain"], family["passed_plain"], family["passed_patched"]) == (5, 4, 4, 2)
    assert (family["pass_to_fail"], family["fail_to_pass"], family["other_changes"]) == (2, 0, 0)
    changed = {row["id"].split("::", 1)[1]: row for row in family["changed"]}  # ids as pytest takes them back
    assert changed.keys() == {"test_fails_patched", "TestInAClass::test_fails_patched_too"}
    assert all(row["repeats_on_rerun"] is True for row in changed.values())  # the re-run found both
    assert "patched run" in changed["test_fails_patched"]["patched_message"]
    assert family["patched_attention_tests"] == 1 and family["patched_calls"] >= 2  # two layers, one forward
    assert "test_fails_patched" in run.stdout and "patched run" in run.stdout
