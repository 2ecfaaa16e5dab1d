"""`make gpu-truth` gets one shot on a lent GPU: every command it will run there must be accepted here first."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_carry  # noqa: E402
import gpu_truth  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side of the GPU run")


def test_every_benchmark_command_of_the_gpu_run_is_accepted_by_its_script(tmp_path):
    """Each benchmark part's GPU command line, run here, parses and ends with the script's no-CUDA line: a renamed
    flag or a script without `--device cuda` fails here, not in the device minutes."""
    benchmarks = [p for p in gpu_truth.parts(tmp_path) if "pytest" not in p.cmd]
    assert len(benchmarks) >= 6
    procs = [(p, subprocess.Popen(p.cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for p in benchmarks]
    for part, proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{part.name}: exit {proc.returncode}\n{out[-1500:]}"
        assert "no CUDA device here" in out, f"{part.name}: ran without saying there is no GPU\n{out[-1500:]}"
        assert "--device" in part.cmd and "cuda" in part.cmd


def test_a_rehearsal_runs_a_gpu_tests_part_and_writes_the_summary_and_archive(tmp_path, monkeypatch):
    """The dry run of the flash_attn test part: its `gpu` tests are collected and skip here, the summary says
    what ran and what was left out, and the archive holds the part's JUnit report."""
    monkeypatch.setattr(gpu_truth, "WORK", tmp_path / "work")  # its own (the tests run side by side)
    out = tmp_path / "out"
    code = gpu_truth.main(["--dry-run", "--only", "flash_attn", "--out", str(out), "--wheels", str(tmp_path / "x")])
    assert code == 0
    summary = (out / "summary.md").read_text()
    assert "rehearsal on CPU" in summary
    row = next(ln for ln in summary.splitlines() if ln.startswith("| gpu tests, flash_attn"))
    assert "| ok |" in row and "skipped" in row and "passed" not in row, row
    assert int(row.split(" skipped")[0].split()[-1]) >= 10, row
    assert summary.count("left out (--only)") == len(gpu_truth.parts(tmp_path)) - 1
    assert "## Goals (issues 44 and 57)" in summary and "| met |" not in summary  # no part timed anything
    with tarfile.open(out / "truth.tar.gz") as tar:
        assert "gpu-truth/tests_flash.xml" in tar.getnames()


# ---- the two device calls: flash-attn 4's 92 MB DSL wheel carried in two parts (tools/gpu_carry.py)


def fake_wheel(path: Path) -> Path:
    """A wheel as NVIDIA's are built (deflated members, a folder entry, a stored one, random and text bytes)."""
    import random
    import zipfile

    rng = random.Random(0)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("pkg/", (2026, 1, 12, 11, 11, 0)), b"")
        for i, data in enumerate([rng.randbytes(300_000), b"def f():\n    return 1\n" * 20_000, b"x" * 999]):
            info = zipfile.ZipInfo(f"pkg/m{i}.so", (2026, 1, 12, 11, 11, 2 * i))
            info.external_attr = 0o755 << 16
            z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED if i < 2 else zipfile.ZIP_STORED)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/m0.so,,\n", compress_type=zipfile.ZIP_DEFLATED)
    return path


def packed(tmp_path: Path, first: int) -> tuple[Path, Path, Path, dict]:
    wheel = fake_wheel(tmp_path / f"{gpu_carry.BIG}4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl")
    call1, call2 = tmp_path / ".gpu1", tmp_path / ".gpu"
    call1.mkdir(), call2.mkdir()
    return wheel, call1, call2, gpu_carry.pack(wheel, call1, call2, first)


def test_the_wheel_rebuilt_from_its_two_parts_has_the_original_bytes(tmp_path):
    """Packed as xz and split at a byte count, the parts rebuild the wheel byte for byte (sha256), each part in its
    call's folder; a part missing or altered is named, and nothing half-built is installed."""
    wheel, call1, call2, m = packed(tmp_path, first=40_000)
    parts = [call1 / m["parts"][0]["name"], call2 / m["parts"][1]["name"]]
    assert [p.stat().st_size for p in parts] == [40_000, m["xz_size"] - 40_000]
    assert not list(call2.glob("*.whl")) and "+" not in "".join(p.name for p in parts)
    rebuilt, what = gpu_carry.assemble(call2 / f"{wheel.stem}.json", [call1, call2], tmp_path / "out")
    assert rebuilt is not None and gpu_carry.sha256(rebuilt) == gpu_carry.sha256(wheel) == m["sha256"], what
    assert "the original's sha256" in what
    assert gpu_carry.assemble(call2 / f"{wheel.stem}.json", [call2], tmp_path / "o2") == (
        None, f"{wheel.name}: part {parts[0].name} not found (call 1 not run on this machine?)")
    parts[1].write_bytes(parts[1].read_bytes()[:-1] + b"\0")
    assert gpu_carry.assemble(call2 / f"{wheel.stem}.json", [call1, call2], tmp_path / "o3")[0] is None


def test_call_1_leaves_its_part_where_call_2_finds_it(tmp_path):
    """Call 1 checks and copies its part to /tmp (here a tmp folder); call 2, which carries only .gpu, finds it
    there and rebuilds the wheel: call 1's folder is not needed in call 2 (carrying it would remove it there)."""
    wheel, call1, call2, m = packed(tmp_path, first=100_000)
    parts_at = tmp_path / "tmp-carried"
    said = gpu_carry.stage1(parts_at, call1)
    assert said == f"{m['parts'][0]['name']} (100000 bytes, sha256 ok)"
    import shutil

    shutil.rmtree(call1)
    rebuilt, _ = gpu_carry.assemble(call2 / f"{wheel.stem}.json", [parts_at, call2], parts_at)
    assert rebuilt is not None and gpu_carry.sha256(rebuilt) == m["sha256"]
    code = gpu_truth.stage_one(tmp_path / "out", True, folder=tmp_path / "none", parts_at=parts_at)
    assert code == 0


def test_flash_attn_4_installs_only_with_its_dsl_wheel(tmp_path):
    names = ["transformers-5.24.0-py3-none-any.whl", "regex-1-cp312.whl", "flash_attn_4-4.0.0b36-py3-none-any.whl",
             "nvidia_cutlass_dsl-4.8.1-py3-none-any.whl", "nvidia_cutlass_dsl_libs_base-4.8.1-cp312.whl",
             "apache_tvm_ffi-0.1.15.post2-cp312.whl", "quack_kernels-0.6.5-py3-none-any.whl",
             "torch_c_dlpack_ext-0.1.5-cp312.whl"]
    wheels = [tmp_path / n for n in names]
    assert [w.name for w in gpu_carry.split_for_install(wheels, None)] == names[:2]
    big = tmp_path / f"{gpu_carry.BIG}4.8.1.whl"
    assert len(gpu_carry.split_for_install(wheels, big)) == len(names) + 1


def test_flash_attn_4s_cute_folder_replaces_flash_attn_2s_own(tmp_path):
    site, fa2 = tmp_path / "site", tmp_path / "site-packages" / "flash_attn"
    (site / "flash_attn" / "cute").mkdir(parents=True)
    (site / "flash_attn" / "cute" / "interface.py").write_text("fa4")
    (fa2 / "cute").mkdir(parents=True)
    (fa2 / "cute" / "interface.py").write_text("fa2's old copy")
    (fa2 / "cute" / "stale.py").write_text("")
    assert "copied" in gpu_carry.overlay_cute(fa2, site)
    assert sorted(p.name for p in (fa2 / "cute").iterdir()) == ["interface.py"]
    assert (fa2 / "cute" / "interface.py").read_text() == "fa4"


def test_the_two_calls_name_their_own_folders_and_fit_the_limit(tmp_path):
    """The printed calls: call 1 `make gpu-truth-stage1` carrying .gpu1 only, call 2 `make gpu-truth` carrying .gpu
    only, both git-ignored (else they would travel in every call); a call over 64 MiB with the repo is flagged.
    With the sizes fetched on 2026-11-29 (repo 2.3 MB, sdist 8.5 MB, xz 75.3 MB of the 92.0 MB wheel, 36.3 MB of
    other wheels, the sdist again) call 1 is filled to the margin and call 2 keeps room."""
    repo = gpu_carry.repo_bytes()
    sdist, xz, rest = 8_453_127, 75_258_884, 22_812_251 + 10_164_113
    call1 = sdist + (gpu_carry.LIMIT - gpu_carry.MARGIN - repo - sdist - 8192)
    call2 = rest + xz - (call1 - sdist)
    assert repo + call1 <= gpu_carry.LIMIT - gpu_carry.MARGIN
    first, second, note = gpu_carry.plan(repo, call1, call2)
    assert first.startswith('call 1: run(command="make gpu-truth-stage1", carry=[".gpu1"], timeout_s=120)')
    assert second.startswith('call 2: run(command="make gpu-truth", carry=[".gpu"], timeout_s=600)')
    assert "OVER" not in first + second and repo + call2 < gpu_carry.LIMIT - 8 * 2**20
    assert "OVER THE LIMIT by 1.0 MiB" in gpu_carry.plan(repo, gpu_carry.LIMIT - repo + 2**20, 0)[0]
    ignored = subprocess.run(["git", "check-ignore", ".gpu/x.whl", ".gpu1/x.whl"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert ignored == [".gpu/x.whl", ".gpu1/x.whl"]
    make = (ROOT / "Makefile").read_text()
    assert "gpu-truth-stage1:\n\t$(GPU_PYTHON) tools/gpu_truth.py --stage 1\n" in make
    for folder in (gpu_carry.STAGE1, gpu_carry.CARRY):  # where a fetch ran here: the real sizes
        if gpu_carry.manifests(folder):
            assert repo + gpu_carry.folder_bytes(folder) <= gpu_carry.LIMIT, folder


def test_no_timed_part_runs_while_flash_attn_2_builds(tmp_path):
    """The parts that time nothing come first (they run while the build holds the cores); every later part waits
    for the build; the flash-attn 4 benchmarks are the bench parts that take a provider list."""
    steps = gpu_truth.parts(tmp_path)
    waits = [p.needs_flash or p.timed for p in steps]
    assert waits == sorted(waits) and not any(p.timed for p in steps if not (p.needs_flash or p.timed))
    assert [p.name for p in steps if not p.timed][:2] == ["gpu tests, torch_varlen and sdpa", "gpu tests, flash-attn 4"]
    import providers

    assert "flash_attn_4" in providers.PATCHKIT_BACKENDS and "hf_flash_attention_4" in providers.HF_KERNELS


def test_a_rehearsal_runs_the_flash_attn_4_tests_part(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_truth, "WORK", tmp_path / "work")
    out = tmp_path / "out"
    assert gpu_truth.main(["--dry-run", "--only", "flash-attn 4", "--out", str(out), "--wheels", str(tmp_path)]) == 0
    row = next(ln for ln in (out / "summary.md").read_text().splitlines() if ln.startswith("| gpu tests, flash-attn 4"))
    assert "| ok |" in row and "skipped" in row and "passed" not in row, row


# ---- the goals table (tools/gpu_truth_goals.py), on CSVs as the parts write them


def write(path: Path, rows: list[dict]) -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def bench(provider: str, workload: str, median: object, x: float = 0.643, note: str = "") -> dict:
    return dict(provider=provider, workload=workload, x=x, median=median, unit="tokens/s", note=note)


def fabricated_run(work: Path) -> None:
    """A run where HF flash_attention_2 did not load (its skipped row), flash-attn 4 ran on both sides, the
    padding sweep reached 50%, decode and families ran; GQA's glue share is missing."""
    skipped = "skipped: ImportError: flash_attn_2_cuda not importable"
    write(work / "train" / "results.csv", [
        bench("hf_flash_attention_2", "all", "", x="", note=skipped),
        bench("hf_flash_attention_4", "train_padded", 100), bench("patchkit_flash_attn_4", "train_padded", 180),
        bench("hf_flash_attention_4", "train_packed_pos", 100), bench("patchkit_flash_attn_4", "train_packed_pos", 90),
        bench("hf_flash_attention_4", "train_packed_cu", 100), bench("patchkit_flash_attn_4", "train_packed_cu", 120),
        bench("patchkit_torch_varlen", "train_packed_cu", 95),
        bench("patchkit_flash_attn_4", "train_padded_glue_share", 3.2),
    ])
    write(work / "pad" / "results.csv", [
        bench(p, "train_pad_sweep", m, x=x) for x in (0.0, 0.497)
        for p, m in (("hf_flash_attention_4", 100), ("patchkit_flash_attn_4", 160), ("patchkit_flash_attn", 140))
    ])
    write(work / "decode.csv", [dict(provider=p, kv_heads=16, window="", median_s=s) for p, s in (
        ("hf_sdpa", 1.3), ("hf_flash_attention_4", 1.0), ("patchkit_flash_attn_4", 0.9))])
    write(work / "families.csv", [dict(family="gpt_oss", provider=p, median_s=s, backend=b, note=n) for p, s, b, n in (
        ("hf_eager padded", 0.30, "eager", ""), ("hf_flash_attention_2 padded", "", "flash_attention_2", skipped),
        ("hf_flash_attention_4 padded", 0.20, "flash_attention_4", ""), ("patchkit padded", 0.12, "flash_attn_4", ""),
        ("patchkit packed", 0.08, "flash_attn_4", ""))])


def goal(rows: list[str], start: str) -> list[str]:
    """The cells (goal, measured, bound, verdict) of the one row whose goal starts with `start`."""
    found = [r for r in rows if r.startswith(f"| {start}")]
    assert len(found) == 1, (start, found)
    return [c.strip() for c in found[0].strip("|").split(" | ")]


def test_the_goals_are_read_from_the_parts_csvs_met_missed_or_not_measured(tmp_path):
    """Each issue 57 goal from the CSV its part writes: flash-attn 4 like for like (patchkit_flash_attn_4 judged,
    the other backends info), decode from decode.csv's seconds, GPT-OSS against the fastest HF provider that ran,
    the glue share as a ceiling; a goal without numbers says why and is never met."""
    from gpu_truth_goals import goals

    fabricated_run(tmp_path)
    rows = goals(tmp_path)
    assert rows[:2] == ["| goal | measured | bound | verdict |", "|---|---|---|---|"]
    fa4 = "hf_flash_attention_4"
    assert goal(rows, f"padding sweep ~50%: patchkit_flash_attn_4 / {fa4}")[1:] == ["1.60x", ">= 1.50x", "met"]
    assert goal(rows, f"padding sweep ~50%: patchkit_flash_attn / {fa4}")[1:] == ["1.40x", "-", "info"]
    assert goal(rows, f"MHA packed_pos rows: patchkit_flash_attn_4 / {fa4}")[1:] == ["0.90x", ">= 1.00x", "MISSED"]
    assert goal(rows, f"MHA packed_cu rows: patchkit_flash_attn_4 / {fa4}")[1:] == ["1.20x", ">= 1.00x", "met"]
    assert goal(rows, f"MHA packed_cu rows: patchkit_torch_varlen / {fa4}")[1:] == ["0.95x", "-", "info"]
    assert goal(rows, f"decode, dynamic cache, kv 16: patchkit_flash_attn_4 / {fa4}")[1:] == [
        "1.11x", ">= 1.20x", "MISSED"]
    oss = goal(rows, "GPT-OSS padded step")
    assert oss[1:] == ["1.67x", ">= 1.50x", "met"]
    assert "patchkit (flash_attn_4) / HF's best, hf_flash_attention_4 (of hf_eager, hf_flash_attention_4" in oss[0]
    assert "hf_flash_attention_2 skipped: ImportError" in oss[0]
    assert goal(rows, "MHA glue share of the padded step: patchkit_flash_attn_4")[1:] == ["3.2%", "<= 5.0%", "met"]
    gqa = goal(rows, "GQA glue share of the padded step: patchkit_flash_attn_4")
    assert gqa[1:3] == ["-", "<= 5.0%"]
    assert gqa[3] == "not measured: no patchkit_flash_attn_4 train_padded_gqa2_glue_share row in train/results.csv"
    # HF flash_attention_2 skipped by the probe: its goals say so (patchkit_flash_attn_4 judged, the one that ran)
    cu2 = goal(rows, "MHA packed_cu rows: patchkit_flash_attn_4 / hf_flash_attention_2")
    assert cu2[1:] == ["-", ">= 1.00x", "not measured: hf_flash_attention_2 skipped: ImportError: flash_attn_2_cuda "
                                        "not importable"]
    assert goal(rows, "padding sweep ~75%: patchkit_flash_attn_4 / hf_flash_attention_4")[3] == (
        "not measured: no patchkit_flash_attn_4 train_pad_sweep row near 75% in pad/results.csv "
        "(rows at x = 0.0, 0.497 only)")
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert (cells[1] == "-") == cells[3].startswith("not measured: "), row


def test_a_run_without_the_parts_csvs_measures_no_goal(tmp_path):
    """Nothing written (every part cut, or a rehearsal's CPU rows only): every goal with a bound is not measured,
    each naming the file its part did not write; none is met."""
    from gpu_truth_goals import goal_rows

    rows = goal_rows(tmp_path)
    assert rows and all(g.value is None and g.verdict.startswith("not measured: ") for g in rows)
    assert {g.why.split()[0] for g in rows} == {"train/results.csv", "pad/results.csv", "decode.csv", "families.csv"}
    assert sum(g.bound is not None for g in rows) >= 14


def test_families_times_hf_flash_attention_4_and_the_gpt_oss_goal_reads_hf_best(tmp_path, monkeypatch):
    """benchmarks/families.py's HF kernels on GPT-OSS, with CPU stand-ins for what loads on the GPU: HF
    flash_attention_4 (here the eager model) is timed beside HF eager, flash_attention_2 failing on its first step is
    a skipped row with its reason; the GPT-OSS goal reads those rows and sets patchkit against the faster HF one."""
    import copy
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_families", ROOT / "benchmarks" / "families.py")
    fam = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fam)  # not `import families`: tests/families.py holds that name

    def fails(**kw):
        raise RuntimeError("flash_attention_2 takes no s_aux")

    def stand_in(reference, device, name):
        model = copy.deepcopy(reference)
        if name == fam.FA2:
            model.forward = fails
        return model, ""

    monkeypatch.setattr(fam, "hf_kernel_model", stand_in)
    rows = fam.measure("gpt_oss", fam.lognormal_lengths(4, 0.05), 1, torch.device("cpu"), fam.Budget(None))
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"hf_eager padded", "hf_flash_attention_4 padded", "hf_flash_attention_2 padded",
                       "patchkit padded", "patchkit packed"}
    assert by["hf_flash_attention_4 padded"]["median_s"] > 0
    skipped = by["hf_flash_attention_2 padded"]
    assert skipped["backend"] == "flash_attention_2" and skipped["median_s"] == ""
    assert skipped["note"] == "skipped: RuntimeError: flash_attention_2 takes no s_aux"
    write(tmp_path / "families.csv", rows)
    from gpu_truth_goals import Run

    oss = Run(tmp_path).gpt_oss()
    best = min(("hf_eager", "hf_flash_attention_4"), key=lambda p: by[f"{p} padded"]["median_s"])
    assert oss.value == pytest.approx(by[f"{best} padded"]["median_s"] / by["patchkit padded"]["median_s"])
    assert f"HF's best, {best} (of hf_eager, hf_flash_attention_4; hf_flash_attention_2 skipped: RuntimeError" in (
        oss.label)
