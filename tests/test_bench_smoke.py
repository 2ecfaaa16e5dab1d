"""Smoke test of benchmarks/bench.py: its smallest mode runs end to end and writes well-formed CSV rows and plots."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # benchmark runs in their own processes: make test-heavy

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
COLUMNS = {"provider", "workload", "dtype", "x", "median", "min", "max", "unit", "device", "torch", "transformers",
           "patchkit", "timestamp"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    out = tmp_path_factory.mktemp("bench")
    csv_path = out / "results.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--csv", str(csv_path), "--plots", str(out)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return csv_path, out, proc.stdout


def test_csv_rows_have_columns_and_positive_numbers(smoke_run: tuple[Path, Path, str]) -> None:
    csv_path, _, _ = smoke_run
    with csv_path.open() as f:
        reader = csv.DictReader(f)
        assert COLUMNS <= set(reader.fieldnames or [])
        rows = list(reader)
    measured = [r for r in rows if r["median"] != ""]
    assert measured, "no measured rows"
    for r in measured:
        lo, mid, hi = float(r["min"]), float(r["median"]), float(r["max"])
        assert 0 < lo <= mid <= hi, r
        assert r["unit"] in ("tokens/s", "MiB", "%"), r
    got = {(r["provider"], r["workload"]) for r in measured}
    for want in [("hf_eager", "train_padded"), ("hf_sdpa", "train_padded"), ("patchkit_sdpa", "train_padded"),
                 ("patchkit_sdpa", "train_packed_pos"), ("patchkit_sdpa", "train_packed_cu"),
                 ("floor_perdoc_sdpa", "train_packed_pos"), ("patchkit_sdpa", "long_peak_mem")]:
        assert want in got, f"missing {want}"
    skipped = [r for r in rows if r["median"] == ""]
    assert all(r["note"].startswith("skipped: ") for r in skipped), skipped


def test_plots_and_ratio_table(smoke_run: tuple[Path, Path, str]) -> None:
    _, out, stdout = smoke_run
    for name in ("throughput_vs_padding.png", "memory_vs_seqlen.png"):
        assert (out / name).stat().st_size > 1000
    assert "target (benchmarks/README.md, Targets)" in stdout
    assert "padding fraction" in stdout
    table = stdout.split("target (benchmarks/README.md, Targets)")[1]
    assert "not judged (smoke run; target is for the default run)" in table
    assert "PASS" not in table and "MISS" not in table  # a toy run cannot earn or miss a target


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device: --device cuda would run")
def test_device_cuda_without_cuda_says_so_and_runs_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cuda", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("bench: --device cuda: no CUDA device here") and not any(tmp_path.iterdir())


def test_a_cuda_run_is_reported_against_hf_flash_attention_2_and_judged_by_no_cpu_target() -> None:
    """A CUDA run's ratios: the best patchkit backend that ran, every backend against HF's two, no PASS/MISS."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from report import Recorder, ratio_table
    finally:
        sys.path.remove(str(BENCH.parent))
    rec = Recorder({"torch": "2.13.0", "transformers": "5.23.0", "patchkit": "0.1.0"}, "bfloat16", "cuda")
    speeds = {"hf_eager": 1.0, "hf_sdpa": 2.0, "hf_flash_attention_2": 3.0, "patchkit_torch_varlen": 6.0,
              "patchkit_sdpa": 2.5}
    for provider, tokens in speeds.items():
        rec.add(provider, "train_padded", 0.557, [tokens, tokens], "tokens/s")
    rows = {label: (got, verdict) for label, got, _, verdict in ratio_table(rec)}
    assert rows["[MHA] padded train: patchkit_torch_varlen / hf_sdpa"] == (
        "3.00x", "not judged (cuda run; targets are for the CPU default run)")
    assert rows["[MHA] padded train: patchkit_torch_varlen / hf_flash_attention_2"] == ("2.00x", "info (no target)")
    assert rows["[MHA] padded train: patchkit_sdpa / hf_flash_attention_2"][0] == "0.83x"
    assert not any(verdict in ("PASS", "MISS") for _, verdict in rows.values())


def test_each_part_is_written_when_it_ends_and_no_row_twice(tmp_path: Path) -> None:
    """bench.py writes the CSV after every part (a GPU run cut off by its time limit kept nothing before)."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        from report import Recorder
    finally:
        sys.path.remove(str(BENCH.parent))
    rec = Recorder({"torch": "2.13.0", "transformers": "5.23.0", "patchkit": "0.1.0"}, "bfloat16", "cuda")
    path = tmp_path / "results.csv"
    rec.add("hf_sdpa", "train_padded", 0.5, [2.0], "tokens/s")
    rec.write_csv(path)
    first = path.read_text()
    assert "train_padded" in first
    rec.add("hf_sdpa", "train_pad_sweep", 0.25, [3.0], "tokens/s")
    rec.write_csv(path)
    rec.write_csv(path)
    with path.open() as f:
        rows = [(r["workload"], r["x"]) for r in csv.DictReader(f)]
    assert rows == [("train_padded", "0.5"), ("train_pad_sweep", "0.25")]


def test_the_smoke_run_wrote_each_row_once(smoke_run: tuple[Path, Path, str]) -> None:
    csv_path, _, _ = smoke_run
    with csv_path.open() as f:
        keys = [(r["provider"], r["workload"], r["x"], r["unit"], r["note"]) for r in csv.DictReader(f)]
    assert len(keys) == len(set(keys))


def test_parts_run_alone_and_a_wrong_part_is_refused(tmp_path: Path) -> None:
    """--parts mem runs only the long-sequence memory sweep (a GPU lent for minutes runs parts in separate calls)."""
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--parts", "mem", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (tmp_path / "results.csv").open() as f:
        workloads = {r["workload"] for r in csv.DictReader(f) if r["median"] != ""}
    assert workloads == {"long_peak_mem", "long_train"}
    bad = subprocess.run([sys.executable, str(BENCH), "--smoke", "--parts", "mem,bogus", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert bad.returncode == 2 and "bogus is not a part; the parts are train, decode, pad, mem" in bad.stderr


def test_families_benchmark_times_a_text_and_an_image_family(tmp_path: Path) -> None:
    """benchmarks/families.py at a tenth of its lengths: LLaMA gets padded and packed rows, Qwen3-VL (an image in
    every row, no packed row: TRL packs no vision data) a padded one, each against HF sdpa."""
    csv_path = tmp_path / "families.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "families.py"), "--families", "llama", "qwen3_vl", "--reps", "1",
         "--scale", "0.1", "--csv", str(csv_path)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with csv_path.open() as f:
        rows = {(r["family"], r["provider"]): float(r["real_tokens_per_s"]) for r in csv.DictReader(f)}
    assert set(rows) == {("llama", "hf_sdpa padded"), ("llama", "patchkit padded"), ("llama", "patchkit packed"),
                         ("qwen3_vl", "hf_sdpa padded"), ("qwen3_vl", "patchkit padded")}
    assert all(v > 0 for v in rows.values())


def test_the_family_decode_benchmark_times_a_step_with_sinks_and_a_plain_one(tmp_path: Path) -> None:
    """benchmarks/family_decode.py at a tenth of its lengths: GPT-OSS (sinks, HF eager) and LLaMA (HF sdpa), each
    patched beside HF, the same tokens (the script stops otherwise), a prefill and a step time each."""
    csv_path = tmp_path / "family_decode.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "family_decode.py"), "--families", "llama", "gpt_oss", "--reps", "1",
         "--scale", "0.1", "--new-tokens", "4", "--csv", str(csv_path)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with csv_path.open() as f:
        rows = {(r["family"], r["provider"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("llama", "hf_sdpa"), ("llama", "patchkit"), ("gpt_oss", "hf_eager"), ("gpt_oss", "patchkit")}
    assert all(float(r["prefill_s"]) > 0 and float(r["step_ms"]) > 0 and r["same_tokens"] == "1.0"
               for r in rows.values())


def test_the_mixer_groups_benchmark_times_each_call_cost(tmp_path: Path) -> None:
    """benchmarks/mixer_groups.py at a tenth of its lengths: Qwen3.5's step against HF sdpa at every row alone and
    at one call for all rows, on both batches; the calls a layer makes are row_groups' for each cost."""
    csv_path = tmp_path / "mixer_groups.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mixer_groups.py"), "--reps", "1", "--scale", "0.1", "--calls", "0",
         "1000000000", "--csv", str(csv_path)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with csv_path.open() as f:
        rows = {(r["batch"], r["provider"]): r for r in csv.DictReader(f)}
    providers = ["hf_sdpa padded", "patchkit call_tokens=0", "patchkit call_tokens=1000000000"]
    assert set(rows) == {(b, p) for b in ("lognormal", "short") for p in providers}
    assert all(float(r["real_tokens_per_s"]) > 0 for r in rows.values())
    assert rows["lognormal", "patchkit call_tokens=0"]["calls_per_layer"] == "8"  # 8 rows, every length its own
    assert rows["short", "patchkit call_tokens=1000000000"]["calls_per_layer"] == "1"


def test_the_peft_head_benchmark_fuses_trainable_tokens_with_the_unpatched_loss(monkeypatch) -> None:
    """benchmarks/peft_head.py's worker, in this process (a fresh process per row is for the peaks; each costs 13 s of
    imports here), at a small vocabulary and a tenth of its lengths, trainable tokens only: each provider a row with a
    peak, the unpatched loss, and the head fused only in `patchkit_loss`."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import peft_head
    import vocab

    import patchkit
    from patchkit.hooks.forwards import lm_forward

    monkeypatch.setitem(vocab.RESCALE, "by", vocab.RESCALE["by"])  # the worker sets it for its process
    fused_head, rows = lm_forward.fused_head, {}
    monkeypatch.setattr(lm_forward, "fused_head", fused_head)  # put back even where a row raises
    for provider in peft_head.PROVIDERS:
        rows[provider] = peft_head.worker("lora + trainable tokens", provider, 512, 0.1)
        lm_forward.fused_head = fused_head  # the unfused row turns fusing off for its process
        patchkit.revert_patch()  # and leaves its patch applied
    # at this size a step's peak is within the resident set's noise (it can read below zero): a number, no more
    assert len({r["loss"] for r in rows.values()}) == 1 and all(abs(r["peak_mib"]) < 1e6 for r in rows.values())
    fused = {p: "fused with the head" in r["heads"] for p, r in rows.items()}
    assert fused == {"hf_sdpa": False, "patchkit_loss_unfused": False, "patchkit_loss": True}


@pytest.mark.parametrize("loop", ["trainer", "custom"])
def test_the_trainer_head_benchmark_fuses_the_head_where_the_trainer_reads_the_loss_alone(monkeypatch, loop) -> None:
    """benchmarks/trainer_head.py's worker, in this process, at a small vocabulary and a tenth of its lengths: HF sdpa
    and patchkit give the same eval loss and their peaks, and only patchkit's steps ran fused, the Trainer's or the
    custom loop's (its third provider turns patchkit's reading of the caller off for the whole process: a fresh one,
    as the benchmark runs)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import trainer_head

    rows = {p: trainer_head.worker(p, 512, 0.1, "llama", loop) for p in ("hf_sdpa", "patchkit")}
    assert rows["hf_sdpa"]["eval_loss"] == rows["patchkit"]["eval_loss"]
    assert all(abs(r[k]) < 1e6 for r in rows.values() for k in ("eval_peak_mib", "train_peak_mib"))
    assert "fused with the head" in rows["patchkit"]["heads"] and rows["hf_sdpa"]["heads"] == "{}"


def test_the_prepared_head_benchmark_fuses_the_head_only_where_accelerates_wrappers_are_read(monkeypatch) -> None:
    """benchmarks/prepared_head.py's worker, in this process as the PEFT one's, at a small vocabulary and a tenth of its
    lengths: each provider a row with a peak, the unpatched loss, and the head fused only in `patchkit_loss` (the
    wrappers read through)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import prepared_head
    import vocab
    from accelerate.state import AcceleratorState

    import patchkit
    from patchkit.hooks.install import forward_source

    monkeypatch.setitem(vocab.RESCALE, "by", vocab.RESCALE["by"])
    mixed_precision, rows = forward_source._mixed_precision, {}
    monkeypatch.setattr(forward_source, "_mixed_precision", mixed_precision)
    try:
        for provider in prepared_head.PROVIDERS:
            AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton, one per row's process
            rows[provider] = prepared_head.worker(provider, 512, 0.1)
            forward_source._mixed_precision = mixed_precision  # the wrapped row stops reading accelerate's wrappers
            patchkit.revert_patch()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    # at this size a step's peak is within the resident set's noise (it can read -0.3 MiB): a number, no more
    assert len({r["loss"] for r in rows.values()}) == 1 and all(abs(r["peak_mib"]) < 1e6 for r in rows.values())
    fused = {p: "fused with the head" in r["heads"] for p, r in rows.items()}
    assert fused == {"hf_sdpa": False, "patchkit_loss_wrapped": False, "patchkit_loss": True}


FRESH_SCRIPT = '''"""A benchmark of fresh-process rows, its worker a stand-in."""
import os
import sys

sys.path.insert(0, {benchmarks!r})
from workers import fresh_cli, fresh_rows


def worker(name, vocab, scale):
    return {{"name": name, "vocab": vocab, "scale": scale, "pid": os.getpid(), "parent": os.getppid()}}


args = fresh_cli(__doc__, worker)
if args is not None:
    fresh_rows(__file__, ([n, args.vocab, args.scale] for n in ("a", "b")), lambda r: f"row {{r['name']}}", args.csv)
'''


def test_fresh_process_rows_run_each_worker_alone_and_write_its_csv(tmp_path: Path) -> None:
    """The machinery of the head benchmarks (peft_head, prepared_head, trainer_head), whose workers the tests above call
    in-process: each row's worker in its own process, its arguments through --worker, the rows in the CSV."""
    script, csv_path = tmp_path / "fresh.py", tmp_path / "fresh.csv"
    script.write_text(FRESH_SCRIPT.format(benchmarks=str(ROOT / "benchmarks")))
    proc = subprocess.run([sys.executable, str(script), "--vocab", "512", "--scale", "0.1", "--csv", str(csv_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["row", "a", "row", "b"]
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["name"], r["vocab"], r["scale"]) for r in rows] == [("a", "512", "0.1"), ("b", "512", "0.1")]
    parents = {r["parent"] for r in rows}  # two workers, each a child of the benchmark, not the benchmark itself
    assert len({r["pid"] for r in rows}) == 2 and len(parents) == 1 and not parents & {r["pid"] for r in rows}


def tenth_scale_rows(benchmark: str, tmp_path: Path) -> list[dict]:
    """The CSV rows of benchmarks/`benchmark`.py run at a tenth of its lengths, one timed round."""
    csv_path = tmp_path / f"{benchmark}.csv"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{benchmark}.py"), "--reps", "1", "--scale", "0.1", "--csv",
         str(csv_path)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    with csv_path.open() as f:
        return list(csv.DictReader(f))


def test_the_image_blocks_benchmark_times_gemma3_and_paligemma_with_images_patched_and_aside(tmp_path: Path) -> None:
    """benchmarks/image_blocks.py at a tenth of its lengths: every model and provider a row; patchkit's steps run
    patched (none stepped aside), its `patchkit_aside` stand-in of the code before image blocks steps aside every
    step."""
    rows = {(r["model"], r["provider"]): r for r in tenth_scale_rows("image_blocks", tmp_path)}
    assert set(rows) == {(m, p) for m in ("gemma3", "paligemma")
                         for p in ("hf_sdpa", "hf_eager", "patchkit_aside", "patchkit")}
    assert all(float(r["real_tokens_per_s"]) > 0 for r in rows.values())
    for model in ("gemma3", "paligemma"):  # warm-up + 1
        assert rows[model, "patchkit"]["stepped_aside"] == "0" and rows[model, "patchkit_aside"]["stepped_aside"] == "2"


def test_the_cross_attention_benchmark_times_mllama_in_both_unpad_modes(tmp_path: Path) -> None:
    """benchmarks/cross_attention.py at a tenth of its lengths: every provider a row, patchkit's steps patched in both
    unpad modes (none stepped aside)."""
    rows = {r["provider"]: r for r in tenth_scale_rows("cross_attention", tmp_path)}
    assert set(rows) == {"hf_sdpa", "hf_eager", "patchkit_attention", "patchkit"}
    assert all(float(r["real_tokens_per_s"]) > 0 for r in rows.values())
    assert rows["patchkit"]["stepped_aside"] == rows["patchkit_attention"]["stepped_aside"] == "0"


def test_the_continuous_batching_benchmark_times_generate_batch_patched_and_aside(tmp_path: Path) -> None:
    """benchmarks/continuous_batching.py at a tenth of its lengths: both workloads, every provider a row with HF
    sdpa's tokens; patchkit's steps run patched, its `patchkit_aside` stand-in of the code before steps aside."""
    rows = tenth_scale_rows("continuous_batching", tmp_path)
    assert sorted(r["provider"] for r in rows) == sorted(["hf_sdpa", "hf_eager", "patchkit_aside", "patchkit"] * 2)
    assert all(float(r["real_tokens_per_s"]) > 0 and r["same_tokens"] == "True" for r in rows)
    assert all(r["stepped_aside"] == "0" for r in rows if r["provider"] == "patchkit")
    assert all(int(r["stepped_aside"]) > 0 for r in rows if r["provider"] == "patchkit_aside")
