"""What a new user reads and runs first: the README's names work as written, and the benchmark judges honestly."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from entrypoints import REPO, benchmarks_importable, run

BENCH = REPO / "benchmarks" / "bench.py"
USER_FACING = ["README.md", "benchmarks/README.md", "benchmarks/bench.py", "benchmarks/attention_kernels.py",
               *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def bench():
    with benchmarks_importable():
        spec = importlib.util.spec_from_file_location("bench_under_test", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.mark.heavy  # starts Python processes: make test-heavy
def test_patchkit_nn_is_reachable_after_import_patchkit_and_loads_lazily():
    probe = ("import sys, patchkit; lazy = 'patchkit.nn' not in sys.modules; "
             "print(lazy, patchkit.nn.VarlenSelfAttention.__name__)")
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "VarlenSelfAttention"]


def test_missing_attributes_still_raise_attribute_error():
    import patchkit

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        patchkit.nope  # noqa: B018


@pytest.mark.parametrize("path", USER_FACING)
def test_no_internal_references_a_user_cannot_follow(path):
    text = (REPO / path).read_text()
    for pattern in (r"issue \d", r"/work/", r"design pitfalls list", r"design/[\w-]+\.md"):
        assert not re.search(pattern, text), f"{path}: {pattern!r}"


def test_readme_python_requirement_matches_pyproject():
    """The user's install states patchkit's own floor; the 3.11 the suite's pinned transformers needs is the
    developer section's, not the install's."""
    minimum = re.search(r'requires-python = ">=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    readme = (REPO / "README.md").read_text()
    install = readme.split("## Install")[1].split("\n## ")[0]
    assert f"Python >= {minimum}" in install and "pip install" in install and "3.11" not in install
    assert "Python 3.11" in readme.split("## Developing patchkit")[1]


def recorder(bench, mode: str, mem_n: int):
    rec = bench.Recorder({"torch": "t", "transformers": "x", "patchkit": "p"}, "float32", "cpu", mode)
    for provider, rate in (("hf_eager", 100.0), ("hf_sdpa", 300.0), ("patchkit_sdpa", 600.0)):
        rec.add(provider, "train_padded", 0.5, [rate, rate], "tokens/s")
    rec.add("patchkit_sdpa", "train_padded_glue_share", 0.5, [9.0], "%")  # a toy model's large share
    rec.add("hf_sdpa", "prefill_decode", 0.5, [100.0, 100.0], "tokens/s")
    rec.add("patchkit_sdpa", "prefill_decode", 0.5, [90.0, 90.0], "tokens/s")
    rec.add("hf_sdpa", "long_peak_mem", mem_n, [1000.0], "MiB")
    rec.add("patchkit_sdpa", "long_peak_mem", mem_n, [700.0], "MiB")
    return {label: (got, verdict) for label, got, _, verdict in bench.ratio_table(rec)}


def test_quick_run_judges_no_target_it_cannot_measure(bench):
    table = recorder(bench, "quick", 1024)
    not_sized = "not judged (quick run; target is for the default run)"
    assert table["[MHA] padded train: patchkit_sdpa / hf_sdpa"] == ("2.00x", not_sized)
    assert table["[MHA] padded train: patchkit_sdpa / hf_eager"] == ("6.00x", not_sized)
    assert table["[MHA] patch glue share of the padded step"] == ("9.0%", not_sized)
    assert table["peak step memory N=1024: patchkit_sdpa / hf_sdpa"] == (
        "0.70x", "not judged (target is for N=8192; this run's largest N is 1024)")
    assert table["prefill+decode: patchkit_sdpa / hf_sdpa"] == ("0.90x", "info (no target)")
    assert not any(verdict in ("PASS", "MISS") for _, verdict in table.values())


def test_default_run_judges_each_target_it_measured(bench):
    table = recorder(bench, "default", 8192)
    assert table["[MHA] padded train: patchkit_sdpa / hf_sdpa"] == ("2.00x", "PASS")
    assert table["[MHA] padded train: patchkit_sdpa / hf_eager"] == ("6.00x", "PASS")
    assert table["[MHA] patch glue share of the padded step"] == ("9.0%", "MISS")
    assert table["peak step memory N=8192: patchkit_sdpa / hf_sdpa"] == ("0.70x", "MISS")  # target <= 0.5x
    assert table["prefill+decode: patchkit_sdpa / hf_sdpa"] == ("0.90x", "info (no target)")


def test_default_outputs_go_to_a_fresh_folder_never_the_tracked_results(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RUNS", tmp_path / "runs")
    first_csv, first_plots = bench.output_paths(None, None, None, False)
    first_csv.parent.mkdir(parents=True)
    second_csv, _ = bench.output_paths(None, None, None, False)
    assert first_csv.parent.parent == tmp_path / "runs" and first_plots == first_csv.parent
    assert second_csv.parent != first_csv.parent and first_csv.name == "results.csv"
    assert bench.output_paths(tmp_path / "o", None, None, True) == (tmp_path / "o" / "results.csv", None)
    assert bench.output_paths(None, tmp_path / "x.csv", tmp_path / "p", False) == (tmp_path / "x.csv", tmp_path / "p")
    assert bench.RESULTS not in (first_csv.parent, first_plots)


def test_bench_help_names_its_command_and_output(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"], prog="patchkit bench")
    out = capsys.readouterr().out
    assert out.startswith("usage: patchkit bench") and "benchmarks/runs/<date-time>" in out
