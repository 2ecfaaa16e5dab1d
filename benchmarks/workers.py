"""Worker side of the benchmark: one fresh process times providers round-robin, or measures one step's memory."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from providers import Provider, device_and_dtype, step_fn
from workloads import make_data, make_tokens


def current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak_rss() -> None:
    """Restart the resident set's high-water mark (VmHWM) from here: a forked child inherits its parent's, and
    ru_maxrss keeps it across exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_hwm_mib() -> float:
    """The resident set's high-water mark since it was last reset (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def step_peak_mib(step: Callable[[], Any]) -> tuple[float, Any]:
    """`step()`'s peak resident set above the set before it (MiB), and what it returned."""
    before = current_rss_mib()
    reset_peak_rss()
    result = step()
    return peak_hwm_mib() - before, result


def worker_json(argv: list[str]) -> dict[str, Any]:
    """`python *argv` in a fresh process, a benchmark's worker: no PATCHKIT_* from the environment (the benchmark
    decides what is patched), warnings off; the JSON of its last line of output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}
    env.update(PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_cli(doc: str, worker: Callable[..., dict[str, Any]],
              more: Optional[Callable[[argparse.ArgumentParser], None]] = None) -> Optional[argparse.Namespace]:
    """The command line of a benchmark whose rows each run `worker` in a fresh process: --vocab, --scale and --csv
    (`more` adds its own). Called as the worker (the hidden `--worker ARGS`, a JSON list), it runs
    `worker(*ARGS)`, prints its row's JSON and returns None."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--scale", type=float, default=1.0, help="every row's length times this (a smoke run)")
    if more is not None:
        more(parser)
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return None
    return args


def fresh_rows(script: str, worker_args: Iterable[list[Any]], describe: Callable[[dict[str, Any]], str],
               csv: Optional[Path]) -> list[dict[str, Any]]:
    """`script`'s worker in a fresh process per argument list, each row printed as `describe` says; the rows written
    to `csv` when it is given."""
    rows = []
    for args in worker_args:
        rows.append(worker_json([script, "--worker", json.dumps(args)]))
        print(describe(rows[-1]), flush=True)
    if csv is not None:
        from report import write_rows

        write_rows(csv, rows)
    return rows


def peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 / (1024 if sys.platform == "darwin" else 1)


def measure_glue(provider: Provider, run: Callable[[], None], reps: int = 3) -> float:
    """Seconds per step spent in patch glue: metadata builds (timed in place) + gathers/repads (replayed fwd+bwd).

    On CUDA each piece is timed between synchronizations: the metadata's time holds no GPU work queued before it
    (its first host read would wait for it: the H100 run's padded shares, 8.7% MHA and 17.3% GQA, were timed so),
    and the replay times kernels, not their launches. Every place that builds metadata or unpads is counted: once
    per model forward (`plan.unpad_plan` and `model_forward`'s unpad and repad, the caller-made documents of
    `step_aside.documents_metadata`, and the packed position_ids' documents read by the registered mask function,
    `attention_interface`'s `sequence_ids_metadata`) and inside attention.
    """
    import torch

    import patchkit.forward.masks as pm
    import patchkit.hooks.attention.attend as pa
    import patchkit.hooks.decide.plan as pp
    import patchkit.hooks.decide.step_aside as psa
    import patchkit.hooks.forwards.model_forward as pmu
    import patchkit.hooks.name.attention_interface as pai

    calls: list[tuple[str, tuple, Any, tuple]] = []
    meta_time = [0.0]
    cuda = next(provider.model.parameters()).device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    orig_gather, orig_pad, orig_build = pa.unpad_rows, pa.pad_input, pm.build_metadata

    def gather(x: Any, indices: Any) -> Any:
        calls.append(("gather", tuple(x.shape), indices, ()))
        return orig_gather(x, indices)

    def pad(hidden: Any, indices: Any, batch: int, seqlen: int) -> Any:
        calls.append(("pad", tuple(hidden.shape), indices, (batch, seqlen)))
        return orig_pad(hidden, indices, batch, seqlen)

    def timed(orig: Callable[..., Any]) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            sync()  # on CUDA the GPU work queued before (embeddings) is not the metadata's: its own reads sync once
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            sync()
            meta_time[0] += time.perf_counter() - t0
            return out
        return build

    build, documents = timed(orig_build), timed(pai.sequence_ids_metadata)
    hooks = [(pa, "unpad_rows", gather), (pa, "pad_input", pad), (pm, "build_metadata", build),
             (pmu, "unpad_rows", gather), (pmu, "pad_input", pad), (pp, "build_metadata", build),
             (psa, "build_metadata", build), (pai, "sequence_ids_metadata", documents)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in hooks]
    for mod, name, fn in hooks:
        setattr(mod, name, fn)
    try:
        with provider:
            run()
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    dtype = next(provider.model.parameters()).dtype
    device = next(provider.model.parameters()).device

    def replay() -> float:
        sync()
        t0 = time.perf_counter()
        for kind, shape, indices, extra in calls:
            x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
            if kind == "gather":
                y = orig_gather(x, indices)
            else:
                y = orig_pad(x, indices, *extra)
            y.backward(torch.ones_like(y))
        sync()  # on CUDA the kernels' time, not their launches'
        return time.perf_counter() - t0

    replay()
    sync()
    alloc = time.perf_counter()
    # random inputs cost time that the real step does not spend: subtract their allocation
    for _, shape, _, _ in calls:
        torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    sync()
    alloc = time.perf_counter() - alloc
    return meta_time[0] + max(0.0, statistics.median(replay() for _ in range(reps)) - alloc)


def worker_throughput(spec: dict[str, Any]) -> dict[str, Any]:
    """Round-robin timed runs of several providers on one workload, in this one process."""
    import torch

    device, dtype = device_and_dtype(spec.get("device"))
    cfg = spec["model"]
    docs = make_tokens(spec["lengths"], cfg["vocab"])
    real = sum(spec["lengths"]) + (len(docs) * spec["decode_tokens"] if spec["workload"] == "decode" else 0)
    entries = []
    for name, layout in spec["providers"]:
        prov = Provider(name, cfg, spec["kv_heads"], device, dtype)
        data = make_data(layout, docs, device)
        entries.append((name, layout, prov, step_fn(prov, spec["workload"], data, spec["decode_tokens"])))
    times: dict[str, list[float]] = {f"{n}|{lay}": [] for n, lay, _, _ in entries}
    for rep in range(spec["reps"] + 1):  # rep 0 is the warm-up
        for name, layout, prov, run in entries:
            with prov:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            if rep:
                times[f"{name}|{layout}"].append(dt)
    glue = {}
    if spec.get("glue"):
        for name, layout, prov, run in entries:
            if prov.backend and spec["workload"] == "train":
                glue[f"{name}|{layout}"] = measure_glue(prov, run)
    return {"times": times, "real_tokens": real, "glue": glue, "peak_mib": peak_rss_mib()}


def worker_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """One provider, one long padded batch (lengths N and N/2): peak memory of a forward + backward step."""
    import torch

    device, dtype = device_and_dtype(spec.get("device"))
    cfg = spec["model"]
    n = spec["n"]
    lengths = [n, n // 2]
    docs = make_tokens(lengths, cfg["vocab"])
    name, layout = spec["provider"], "padded"
    prov = Provider(name, cfg, spec["kv_heads"], device, dtype)
    data = make_data(layout, docs, device)
    run = step_fn(prov, "train", data, 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = current_rss_mib()
    with prov:
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mib()
    return {"peak_mib": peak, "base_mib": base, "delta_mib": max(0.0, peak - base), "seconds": dt,
            "real_tokens": sum(lengths)}
