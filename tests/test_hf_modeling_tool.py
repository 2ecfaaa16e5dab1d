"""tools/hf_modeling_tests.py end to end on a tiny stand-in of transformers' test tree: the comparison it reports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # the tool runs pytest in its own processes: make test-heavy

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "hf_modeling_tests.py"

# A family test file whose tests differ the ways the real ones can: one passes either way, two (one at module
# level, one in a class) read the patch's variable and fail patched (pass->fail the tool must report, with its
# message), one runs a padded forward (attention through the patch when patched), one steps aside with patchkit's
# warning (labels predicted from padding), one skips, and one compares eager with sdpa, as transformers'
# test_eager_matches_sdpa_inference does: patched, both sides run patchkit.
FAMILY_TESTS = '''
import os

import pytest
import torch
import transformers


def test_passes_either_way():
    assert 1 + 1 == 2


def test_fails_patched():
    assert os.environ.get("PATCHKIT_FLASH_ATTN") is None, "patched run"


def padded_logits(attn="eager"):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config._attn_implementation = attn
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        return model(input_ids=torch.randint(1, 64, (2, 8)), attention_mask=mask).logits[mask.bool()]


def test_padded_forward():
    assert padded_logits().shape == (13, 64)


def test_labels_from_padding():  # patched: the forward steps aside with patchkit's warning
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    ids, mask = torch.randint(1, 64, (2, 8)), torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    assert model(input_ids=ids, attention_mask=mask, labels=ids).loss > 0


def test_eager_matches_sdpa_inference():
    torch.testing.assert_close(padded_logits("eager"), padded_logits("sdpa"), atol=1e-5, rtol=1e-4)


def test_skips():
    pytest.skip("not on this machine")


class TestInAClass:  # transformers' own tests live in classes (LlamaModelTest)
    def test_fails_patched_too(self):
        assert os.environ.get("PATCHKIT_FLASH_ATTN") is None, "patched in a class"
'''


def test_the_tool_reports_what_patching_changes(tmp_path: Path) -> None:
    """Plain and patched runs, the re-run of the changed test, the probe's counters: one pass->fail, stable on
    re-run, with its message; the forward's attention counted through the patch; the report groups it by cause;
    an eager-vs-sdpa comparison that passes patched is listed as vacuous (both sides ran patchkit).
    Two families at once (--jobs 2); the second's test file does not import (OPT's needs `timeout_decorator`),
    which the tool reports by name with a non-zero exit, never as a family where nothing changed. The second is
    named by its model_type, hyphenated (`modernbert-decoder`): its tests are found in transformers' folder."""
    tree = tmp_path / "hf_tests"
    (tree / "tests/models/llama").mkdir(parents=True)
    (tree / "tests/models/modernbert_decoder").mkdir(parents=True)
    (tree / "pytest.ini").write_text("[pytest]\n")
    (tree / "tests/models/llama/test_modeling_llama.py").write_text(textwrap.dedent(FAMILY_TESTS))
    (tree / "tests/models/modernbert_decoder/test_modeling_modernbert_decoder.py").write_text(
        "import not_installed_here_xyz\n\n\ndef test_never_collected():\n    pass\n")
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(TOOL), "--tests-dir", str(tree), "--families", "llama", "modernbert-decoder",
         "--out", str(out), "-k", "", "--python", sys.executable, "--timeout", "300", "--jobs", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    family, opt = json.loads((out / "results.json").read_text())["families"]
    assert "did not import in both runs: ModuleNotFoundError: No module named 'not_installed_here_xyz'" in opt["error"]
    assert ("modernbert_decoder: not run: tests/models/modernbert_decoder/test_modeling_modernbert_decoder.py did not "
            "import") in run.stdout
    assert (family["tests"], family["run_plain"], family["passed_plain"], family["passed_patched"]) == (7, 6, 6, 4)
    assert (family["pass_to_fail"], family["fail_to_pass"], family["other_changes"]) == (2, 0, 0)
    changed = {row["id"].split("::", 1)[1]: row for row in family["changed"]}  # ids as pytest takes them back
    assert changed.keys() == {"test_fails_patched", "TestInAClass::test_fails_patched_too"}
    assert all(row["repeats_on_rerun"] is True for row in changed.values())  # the re-run found both
    assert "patched run" in changed["test_fails_patched"]["patched_message"]
    assert family["patched_attention_tests"] == 2 and family["patched_calls"] >= 6  # two layers, three forwards
    # the warning pytest records after the test's protocol: in the test's record (the probe once wrote it too early)
    assert any("(labels_from_padding)" in w for w in family["patchkit_warnings"]), family["patchkit_warnings"]
    assert "test_fails_patched" in run.stdout and "patched run" in run.stdout
    # the comparison passed either way, but patched it compared patchkit with itself: listed apart, not as evidence
    assert [i.split("::", 1)[1] for i in family["vacuous_comparisons"]] == ["test_eager_matches_sdpa_inference"]
    assert "Passed, but vacuous" in run.stdout and "llama: tests/models/llama/" in run.stdout


def test_prepare_copies_the_testers_missing_testing_utils_constants(tmp_path: Path) -> None:
    """A later mirror's testers import a constant the installed transformers.testing_utils lacks (2026-08's
    causal_lm_tester.py: `_TEXT_MODEL_TESTER_DEFAULTS`, absent from 5.24.0): the assembled conftest defines it, copied
    from the mirror's testing_utils; names the installed version has are left alone."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from hf_tests_tree import testing_utils_shim
    finally:
        sys.path.remove(str(ROOT / "tools"))
    mirror, tests_dir = tmp_path / "mirror", tmp_path / "tree"
    (mirror / "src/transformers").mkdir(parents=True)
    (mirror / "src/transformers/testing_utils.py").write_text(
        "_MISSING_DEFAULTS = {'batch_size': 13, 'hidden_act': 'gelu'}\nrequire_torch = None\n")
    subprocess.run(["git", "init", "-q", str(mirror)], check=True)
    subprocess.run(["git", "-C", str(mirror), "add", "."], check=True)
    subprocess.run(["git", "-C", str(mirror), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m"],
                   check=True)
    (tests_dir / "tests").mkdir(parents=True)
    (tests_dir / "tests/causal_lm_tester.py").write_text(
        "from transformers.testing_utils import _MISSING_DEFAULTS, require_torch\n")
    shim = testing_utils_shim(tests_dir, mirror, "HEAD", sys.executable)
    assert "_testing_utils._MISSING_DEFAULTS = {'batch_size': 13, 'hidden_act': 'gelu'}" in shim
    assert "require_torch" not in shim


def test_a_tree_linked_to_another_environments_transformers_is_refused(tmp_path: Path) -> None:
    """A tree assembled from a removed environment keeps a dangling `src/transformers` link: every test file then
    fails to import alike in both modes and the comparison would report a family with nothing changed. The tool
    refuses it by name before running anything."""
    tree = tmp_path / "hf_tests"
    (tree / "tests/models/llama").mkdir(parents=True)
    (tree / "pytest.ini").write_text("[pytest]\n")
    (tree / "tests/models/llama/test_modeling_llama.py").write_text(textwrap.dedent(FAMILY_TESTS))
    (tree / "src").mkdir()
    (tree / "src/transformers").symlink_to(tmp_path / "gone/.venv/lib/python3.11/site-packages/transformers")
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, str(TOOL), "--tests-dir", str(tree), "--families", "llama", "--out", str(out),
         "--python", sys.executable],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "gone/.venv" in run.stderr and "run --prepare again" in run.stderr
    assert not out.exists()


def test_prepare_leaves_out_a_family_the_mirror_lacks_and_says_so(tmp_path: Path, capsys) -> None:
    """A family newer than the mirror (Ergo, 5.25, in a mirror of 2026-08): before, `git archive` failed on its
    pathspec and the whole tree failed to assemble with git's message swallowed; now that family is named and left
    out, and the others are taken."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from hf_tests_tree import git_tar, present
    finally:
        sys.path.remove(str(ROOT / "tools"))
    mirror = tmp_path / "mirror"
    (mirror / "tests/models/llama").mkdir(parents=True)
    (mirror / "tests/models/llama/test_modeling_llama.py").write_text("")
    subprocess.run(["git", "init", "-q", str(mirror)], check=True)
    subprocess.run(["git", "-C", str(mirror), "add", "."], check=True)
    subprocess.run(["git", "-C", str(mirror), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m"],
                   check=True)
    assert present(mirror, "HEAD", ("llama", "ergo")) == ("llama",)
    assert "ergo: not prepared: the mirror has no tests/models/ergo at HEAD" in capsys.readouterr().err
    with git_tar(mirror, "HEAD", ["tests/models/llama"]) as tar:
        assert [m.name for m in tar.getmembers() if m.isfile()] == ["tests/models/llama/test_modeling_llama.py"]
    with pytest.raises(SystemExit, match="did not match any files"):
        git_tar(mirror, "HEAD", ["tests/models/ergo"])
