"""Side-by-side benchmark of patchkit against HF eager/sdpa/flash_attention_2, so its claims are reproducible.

The command line and the orchestration live here; the inputs in `workloads.py`, the providers in `providers.py`,
the worker processes in `workers.py`, and the CSV, ratio table and plots in `report.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the tracked results of the documented run (README); written only with --out results
RUNS = HERE / "runs"  # every other run: a fresh folder per run (ignored by git)
sys.path.insert(0, str(HERE))  # the sibling modules, also when `patchkit bench` loads this file by path

from providers import HF_KERNELS, device_and_dtype, probe_providers  # noqa: E402
from report import TARGETS, Recorder, draw_plots, print_report, ratio_table, record_throughput  # noqa: E402
from workers import worker_memory, worker_throughput  # noqa: E402
from workloads import FLOOR, MODES, lognormal_lengths, padded_lengths, padding_fraction  # noqa: E402

__all__ = ["TARGETS", "Recorder", "main", "output_paths", "ratio_table", "run_suite"]  # what callers reach via bench


def run_worker(spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter; its last stdout line is the JSON result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}  # no provider patched by the env
    env.update(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(HERE.parent))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        killed = proc.returncode in (-9, 137)
        return {"error": ("killed (out of memory?)" if killed else "failed") + ": " + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def versions() -> dict[str, str]:
    import torch
    import transformers

    import patchkit

    return {"torch": torch.__version__, "transformers": transformers.__version__, "patchkit": patchkit.__version__}


def predict_quadratic(points: list[tuple[int, float]], n: int) -> Optional[float]:
    """Extrapolate memory from the last measured point, assuming (worst case) quadratic growth in N."""
    if not points:
        return None
    n0, m0 = points[-1]
    return m0 * (n / n0) ** 2


def mem_available_mib(device: Any = None) -> float:
    """Memory a step may still take: the GPU's free memory on CUDA, else the host's available memory."""
    if device is not None and device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0] / 2**20
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


PARTS = ("train", "decode", "pad", "mem")  # the padded/packed train step, prefill + decode, padding sweep, long N


def run_suite(
    mode: str, csv_path: Path, plots: Optional[Path], mem_cap_gib: float, log: Callable[[str], None],
    device_name: str = "auto", parts: tuple[str, ...] = PARTS, mem_lengths: Optional[list[int]] = None,
) -> Recorder:
    import torch

    sizes = MODES[mode]
    device, dtype = device_and_dtype(device_name)
    rec = Recorder(versions(), str(dtype).replace("torch.", ""), device.type, mode)
    ok, skipped = probe_providers(device)
    patch_providers = [p for p in ok if p.startswith("patchkit_")]
    hf = [p for p in ok if p.startswith("hf_")]
    log(f"{mode} mode on {device.type} ({dtype}), {torch.get_num_threads()} threads, {platform.processor() or ''}; "
        f"{rec.meta}")
    log(f"providers: {', '.join(ok)}; skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    for name, why in skipped.items():
        rec.skip(name, "all", "", "", why)

    base = {"model": sizes["model"], "reps": sizes["reps"], "decode_tokens": sizes["decode_tokens"],
            "device": device.type}
    lengths = lognormal_lengths(sizes["batch"], sizes["scale"])
    pf = padding_fraction(lengths)
    log(f"lognormal batch: lengths {lengths}, {sum(lengths)} real tokens, padding fraction {pf:.1%}")

    kv_list = ([sizes["model"]["heads"]] + ([2] if sizes["gqa"] else [])) if "train" in parts else []
    for kv in kv_list:
        tag = "" if kv == sizes["model"]["heads"] else f"_gqa{kv}"
        provs = [(p, "padded") for p in hf + patch_providers]
        provs += [(p, "packed_pos") for p in patch_providers] + [(p, "packed_cu") for p in patch_providers]
        provs += [(FLOOR, "packed_pos")]
        # HF's own padding-free path (DataCollatorWithFlattening's rows: position_ids, and with
        # return_flash_attn_kwargs the cu_seq_lens too): the fair yardstick for patchkit's packed rows
        provs += [(p, lay) for p in hf if p in HF_KERNELS for lay in ("packed_pos", "packed_cu")]
        if tag and "gqa_providers" in sizes:
            gqa = set(sizes["gqa_providers"]) | set(patch_providers)  # every patchkit backend that runs here
            provs = [(p, lay) for p, lay in provs if p in gqa and lay != "packed_cu"]
        t0 = time.time()
        res = run_worker({**base, "kind": "throughput", "workload": "train", "lengths": lengths, "kv_heads": kv,
                          "providers": provs, "glue": True})
        names = {f"{p}|{lay}": p for p, lay in provs if lay == "padded"}
        record_throughput(rec, res, f"train_padded{tag}", round(pf, 3), names)
        # packed rows land in their own workload names
        for r in rec.rows:
            if r["workload"].startswith(f"train_padded{tag}") and "|" in r["provider"]:
                p, lay = r["provider"].split("|")
                key = (r["provider"], r["workload"], str(r["x"]), r["unit"])
                r["provider"], r["workload"] = p, r["workload"].replace(f"train_padded{tag}", f"train_{lay}{tag}")
                rec.raw[(r["provider"], r["workload"], str(r["x"]), r["unit"])] = rec.raw.pop(key)
        log(f"train step (kv_heads {kv}) done in {time.time() - t0:.0f}s")
        rec.write_csv(csv_path)  # each part as it ends: a run cut short keeps it

    if sizes["decode"] and "decode" in parts:
        t0 = time.time()
        provs = [(p, "left") for p in hf + patch_providers]
        res = run_worker({**base, "kind": "throughput", "workload": "decode", "lengths": lengths,
                          "kv_heads": sizes["model"]["heads"], "providers": provs})
        record_throughput(rec, res, "prefill_decode", round(pf, 3), {f"{p}|left": p for p, _ in provs})
        log(f"prefill + {sizes['decode_tokens']}-token greedy decode done in {time.time() - t0:.0f}s")
        rec.write_csv(csv_path)  # each part as it ends: a run cut short keeps it

    t0 = time.time()
    for frac in sizes["pad_fracs"] if "pad" in parts else []:
        lens = padded_lengths(sizes["batch"], sizes["pad_len"], frac)
        provs = [(p, "padded") for p in hf + patch_providers]
        res = run_worker({**base, "kind": "throughput", "workload": "train", "lengths": lens,
                          "kv_heads": sizes["model"]["heads"], "providers": provs})
        record_throughput(rec, res, "train_pad_sweep", round(padding_fraction(lens), 3),
                          {f"{p}|padded": p for p, _ in provs})
        rec.write_csv(csv_path)  # each part as it ends: a run cut short keeps it
    log(f"padding sweep (max length {sizes['pad_len']}) done in {time.time() - t0:.0f}s")

    t0 = time.time()
    measured: dict[str, list[tuple[int, float]]] = {}
    for n in (mem_lengths or sizes["lengths"]) if "mem" in parts else []:
        for p in hf + patch_providers:
            if (p in HF_KERNELS and device.type != "cuda") or p not in sizes.get("mem_providers", [p]):
                continue
            pred = predict_quadratic(measured.get(p, []), n)
            cap = min(mem_cap_gib * 1024, mem_available_mib(device) - 2048)
            if pred is not None and pred > cap:
                why = f"predicted {pred / 1024:.1f} GiB (quadratic from the last N) > cap {cap / 1024:.1f} GiB"
                rec.skip(p, "long_peak_mem", n, "MiB", why)
                rec.add(p, "long_peak_mem_predicted", n, [pred], "MiB", note="extrapolated, not measured")
                continue
            res = run_worker({**base, "kind": "memory", "provider": p, "n": n, "kv_heads": sizes["model"]["heads"]})
            if "error" in res:
                rec.skip(p, "long_peak_mem", n, "MiB", res["error"])
                measured.setdefault(p, []).append((n, float("inf")))
                continue
            measured.setdefault(p, []).append((n, res["delta_mib"]))
            rec.add(p, "long_peak_mem", n, [res["delta_mib"]], "MiB",
                    note=f"step peak RSS {res['peak_mib']:.0f} MiB minus {res['base_mib']:.0f} MiB before the step")
            rec.add(p, "long_train", n, [res["real_tokens"] / res["seconds"]], "tokens/s", note="one step")
            rec.write_csv(csv_path)  # each part as it ends: a run cut short keeps it
    log(f"long-sequence memory sweep (batch 2, lengths N and N/2) done in {time.time() - t0:.0f}s")

    rec.write_csv(csv_path)
    if plots is not None:
        draw_plots(rec, plots, log)
    return rec


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def fresh_run_dir(root: Optional[Path] = None) -> Path:
    """A new folder for one run's CSV and plots: runs/<UTC date-time>[-N]."""
    root = RUNS if root is None else root
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def output_paths(out: Optional[Path], csv_path: Optional[Path], plots: Optional[Path],
                 no_plots: bool) -> tuple[Path, Optional[Path]]:
    """(CSV file, plots folder or None): each as given, else inside `out`, else inside a fresh run folder."""
    if out is None and (csv_path is None or (plots is None and not no_plots)):
        out = fresh_run_dir()
    csv_file = csv_path or out / "results.csv"  # type: ignore[operator]
    return csv_file, None if no_plots else (plots or out)


def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description="patchkit vs HF attention: real tokens/s, peak memory, "
                                     "patch glue. Writes results.csv and the plots to a fresh folder "
                                     "(benchmarks/runs/<date-time>) unless --out, --csv or --plots say where.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the big sweep (N up to 16384; for bigger machines)")
    size.add_argument("--quick", action="store_true", help="a 1-2 minute smoke run (targets shown, not judged)")
    size.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # toy model, seconds (tests)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.csv and the plots (default: a new benchmarks/runs/<date-time>; "
                        "--out benchmarks/results updates the documented results)")
    parser.add_argument("--csv", type=Path, default=None, help="CSV to append rows to (default OUT/results.csv)")
    parser.add_argument("--plots", type=Path, default=None, help="directory for the PNG plots (default OUT)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--mem-cap-gib", type=float, default=18.0, help="skip configs predicted to need more")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda: bf16 on the GPU with hf_flash_attention_2 and _4, hf_sdpa and patchkit's "
                        "flash_attn_4, flash_attn, torch_varlen and sdpa backends (each that cannot run is skipped "
                        "with the reason); cpu: fp32; "
                        "auto (default): cuda when a CUDA device is present")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which parts to run, comma-separated (default all): train (padded and packed train "
                        "step), decode (prefill + greedy decode), pad (padding sweep), mem (long-sequence memory); "
                        "a GPU machine lent for minutes runs them in separate calls")
    parser.add_argument("--mem-lengths", default=None,
                        help="the memory part's N, comma-separated (default: the mode's, e.g. 2048 to 32768 on cuda)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:  # the benchmark decides per provider what is patched; PATCHKIT_FLASH_ATTN must not patch HF's providers
        from patchkit.entry.autostart import stand_down

        stand_down("benchmarks/bench.py")
    except ImportError:
        pass
    if args.worker:
        spec = json.loads(args.worker)
        fn = worker_throughput if spec["kind"] == "throughput" else worker_memory
        print(json.dumps(fn(spec)))
        return 0
    if args.device == "cuda" and not cuda_available():
        import torch

        print(f"bench: --device cuda: no CUDA device here (torch {torch.__version__}); nothing was run. Run it on a "
              "GPU machine, or without --device for the CPU benchmark.", flush=True)
        return 0
    mode = "full" if args.full else "quick" if args.quick else "smoke" if args.smoke else "default"
    if mode == "default" and (args.device == "cuda" or (args.device == "auto" and cuda_available())):
        mode = "cuda"  # the CPU default's toy model would time the host's launch overhead, not the GPU
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts: {', '.join(unknown) or 'nothing'} is not a part; the parts are {', '.join(PARTS)}")
    csv_path, plots = output_paths(args.out, args.csv, args.plots, args.no_plots)
    start = time.time()
    mem_lengths = [int(n) for n in args.mem_lengths.split(",")] if args.mem_lengths else None
    rec = run_suite(mode, csv_path, plots, args.mem_cap_gib, lambda s: print(s, flush=True), args.device, parts,
                    mem_lengths)
    print_report(rec, lambda s: print(s, flush=True))
    print(f"\n{len(rec.rows)} rows appended to {csv_path}; total {time.time() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
