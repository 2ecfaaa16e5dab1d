"""Side-by-side benchmark of patchkit against HF eager/sdpa/flash_attention_2, so its claims are reproducible."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # the tracked results of the documented run (README); written only with --out results
RUNS = HERE / "runs"  # every other run: a fresh folder per run (ignored by git)
# patchkit's performance targets (ratio bounds, glue share in %), stated for the default run's workloads and for
# N = 8192 (benchmarks/README.md, "Targets")
TARGETS = {"padded_vs_sdpa": 1.4, "padded_vs_eager": 2.5, "packed_vs_sdpa": 2.0, "floor_vs_packed": 1.1,
           "glue_share": 5.0, "mem_vs_sdpa": 0.5, "mem_vs_eager": 0.1}
TARGET_MODES = ("default", "full")  # the modes whose workloads the throughput and glue targets are stated for
TARGET_MEM_N = 8192  # the sequence length the memory targets are stated for
CSV_COLUMNS = [
    "provider", "workload", "dtype", "x", "median", "min", "max", "unit", "reps", "device", "torch", "transformers",
    "patchkit", "threads", "timestamp", "note",
]
# The realistic mix: lognormal(log 300, 0.9) lengths, seed 32, clipped to [16, 2048].
LOGNORMAL = {"median": 300, "sigma": 0.9, "seed": 32, "min": 16, "max": 2048}
MODEL = {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 688, "vocab": 4096}
PAD = 0
HF_PROVIDERS = {"hf_eager": "eager", "hf_sdpa": "sdpa", "hf_flash_attention_2": "flash_attention_2"}
FLOOR = "floor_perdoc_sdpa"  # packed rows, attention per document by plain SDPA calls, no patch

# Sizes per mode. reps: timed runs after one warm-up per provider; providers run round-robin within a run.
MODES: dict[str, dict[str, Any]] = {
    "smoke": {  # the test suite's mode: a toy model, seconds
        "model": {"hidden": 64, "layers": 1, "heads": 4, "intermediate": 128, "vocab": 128}, "reps": 1,
        "batch": 4, "scale": 0.1, "decode_tokens": 4, "pad_fracs": [], "pad_len": 64, "lengths": [128],
        "gqa": False, "decode": False, "mem_providers": ["patchkit_sdpa"],
    },
    "quick": {
        "model": MODEL, "reps": 2, "batch": 8, "scale": 0.5, "decode_tokens": 8, "pad_fracs": [0.0, 0.5],
        "pad_len": 256, "lengths": [512, 1024], "gqa": False, "decode": True,
    },
    "default": {
        "model": MODEL, "reps": 5, "batch": 8, "scale": 1.0, "decode_tokens": 32, "pad_fracs": [0.0, 0.25, 0.5, 0.75],
        "pad_len": 512, "lengths": [1024, 2048, 4096, 8192], "gqa": True, "decode": True,
        "gqa_providers": ["hf_sdpa", "patchkit_sdpa", FLOOR],  # eager and packed_cu on GQA only with --full
    },
    "full": {
        "model": MODEL, "reps": 7, "batch": 8, "scale": 1.0, "decode_tokens": 32,
        "pad_fracs": [0.0, 0.25, 0.5, 0.625, 0.75, 0.875], "pad_len": 1024,
        "lengths": [512, 1024, 2048, 4096, 8192, 16384], "gqa": True, "decode": True,
    },
}


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def lognormal_lengths(batch: int, scale: float = 1.0) -> list[int]:
    """The fixed-seed realistic mix (median ~300, max 2048, ~55% padding at batch 8), optionally scaled."""
    import torch

    g = torch.Generator().manual_seed(LOGNORMAL["seed"])
    raw = torch.exp(torch.randn(batch, generator=g) * LOGNORMAL["sigma"] + math.log(LOGNORMAL["median"]))
    lens = raw.round().clamp(LOGNORMAL["min"], LOGNORMAL["max"]).long().tolist()
    return [max(4, round(n * scale)) for n in lens]


def padded_lengths(batch: int, max_len: int, pad_frac: float) -> list[int]:
    """One row of `max_len`, the others spread around the mean that gives `pad_frac` padding overall."""
    others = (batch * (1 - pad_frac) * max_len - max_len) / max(batch - 1, 1)
    width = max(0.0, min(0.5, max_len / max(others, 1) - 1))  # +-50% around the mean, narrower near max_len
    spread = [1 - width + 2 * width * i / max(batch - 2, 1) for i in range(batch - 1)]  # mean 1.0
    return [max_len] + [int(min(max_len, max(1, round(others * s)))) for s in spread]


def padding_fraction(lengths: list[int]) -> float:
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


def make_tokens(lengths: list[int], vocab: int, seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def padded_batch(docs: list[Any], left: bool = False) -> tuple[Any, Any, Any]:
    """input_ids, 2D mask, labels (-100 on padding) for a right- (or left-) padded batch."""
    import torch

    n = max(len(d) for d in docs)
    ids = torch.full((len(docs), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(docs), n, dtype=torch.long)
    for row, d in enumerate(docs):
        sl = slice(n - len(d), n) if left else slice(0, len(d))
        ids[row, sl] = d
        mask[row, sl] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def packed_row(docs: list[Any]) -> dict[str, Any]:
    """All documents in one row, as DataCollatorWithFlattening builds it (positions restart, -100 at starts)."""
    import torch

    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    lens = torch.tensor([len(d) for d in docs], dtype=torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "cu": cu, "max_len": int(lens.max())}


# ----------------------------------------------------------------------------------------------------------------
# Models and providers (worker side)


def device_and_dtype() -> tuple[Any, Any]:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def build_model(cfg: dict[str, int], kv_heads: int, attn: str, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=kv_heads,
        max_position_embeddings=32768, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


_FLOOR_LENGTHS: list[int] = []


def floor_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Optional[float] = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
    """Plain per-document SDPA on a packed row (B = 1): the cost floor of varlen attention, no patch glue."""
    import torch.nn.functional as F

    outs, start = [], 0
    gqa = key.shape[1] != query.shape[1]
    for n in _FLOOR_LENGTHS:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(
            query[:, :, sl], key[:, :, sl], value[:, :, sl], is_causal=True, scale=scaling, enable_gqa=gqa
        ))
        start += n
    import torch

    return torch.cat(outs, dim=2).transpose(1, 2), None


def register_floor() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(FLOOR, floor_attention)


class Provider:
    """One way of running the model: an HF attention implementation, patchkit with a backend, or the floor."""

    def __init__(self, name: str, cfg: dict[str, int], kv_heads: int, device: Any, dtype: Any) -> None:
        self.name = name
        self.backend = name.split("_", 1)[1] if name.startswith("patchkit_") else None
        attn = HF_PROVIDERS.get(name, FLOOR if name == FLOOR else "sdpa")
        if name == FLOOR:
            register_floor()
        self.model = build_model(cfg, kv_heads, attn, device, dtype)
        self.handle: Any = None

    def __enter__(self) -> Provider:
        if self.backend:
            import patchkit

            self.handle = patchkit.apply_patch("llama2", backend=self.backend, strict=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.revert()
            self.handle = None


def step_fn(provider: Provider, workload: str, data: dict[str, Any], decode_tokens: int) -> Callable[[], None]:
    """A closure running one timed unit of work (a train step, or prefill + greedy decode)."""
    import torch

    model = provider.model
    if workload == "decode":
        model.eval()

        def run() -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=data["input_ids"], attention_mask=data["attention_mask"], max_new_tokens=decode_tokens,
                    min_new_tokens=decode_tokens, do_sample=False, pad_token_id=PAD,
                )
        return run

    model.train()
    kwargs = {k: v for k, v in data.items() if k not in ("docs",)}

    def run() -> None:
        global _FLOOR_LENGTHS
        _FLOOR_LENGTHS = data["docs"]
        model(**kwargs).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def make_data(kind: str, docs: list[Any], device: Any) -> dict[str, Any]:
    """Model inputs for a data layout: padded (2D mask), left-padded (generation), packed by positions or cu_seqlens."""
    lens = [len(d) for d in docs]
    if kind in ("padded", "left"):
        ids, mask, labels = padded_batch(docs, left=kind == "left")
        out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    else:
        p = packed_row(docs)
        out = {"input_ids": p["input_ids"], "position_ids": p["position_ids"], "labels": p["labels"]}
        if kind == "packed_cu":
            out.update(cu_seq_lens_q=p["cu"], cu_seq_lens_k=p["cu"], max_length_q=p["max_len"],
                       max_length_k=p["max_len"])
    out = {k: v.to(device) if hasattr(v, "to") else v for k, v in out.items()}
    out["docs"] = lens
    return out


def current_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 / (1024 if sys.platform == "darwin" else 1)


def measure_glue(provider: Provider, run: Callable[[], None], reps: int = 3) -> float:
    """Seconds per step spent in patch glue: metadata builds (timed in place) + gathers/repads (replayed fwd+bwd).

    Both places that unpad are counted: once per model forward (`model_unpad`) and inside attention.
    """
    import torch

    import patchkit.attention as pa
    import patchkit.masks as pm
    import patchkit.model_unpad as pmu

    calls: list[tuple[str, tuple, Any, tuple]] = []
    meta_time = [0.0]
    orig_gather, orig_pad, orig_build = pa.unpad_rows, pa.pad_input, pm.build_metadata

    def gather(x: Any, indices: Any) -> Any:
        calls.append(("gather", tuple(x.shape), indices, ()))
        return orig_gather(x, indices)

    def pad(hidden: Any, indices: Any, batch: int, seqlen: int) -> Any:
        calls.append(("pad", tuple(hidden.shape), indices, (batch, seqlen)))
        return orig_pad(hidden, indices, batch, seqlen)

    def build(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = orig_build(*args, **kwargs)
        meta_time[0] += time.perf_counter() - t0
        return out

    hooks = [(pa, "unpad_rows", gather), (pa, "pad_input", pad), (pm, "build_metadata", build),
             (pmu, "unpad_rows", gather), (pmu, "pad_input", pad), (pmu, "build_metadata", build)]
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
        t0 = time.perf_counter()
        for kind, shape, indices, extra in calls:
            x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
            if kind == "gather":
                y = orig_gather(x, indices)
            else:
                y = orig_pad(x, indices, *extra)
            y.backward(torch.ones_like(y))
        return time.perf_counter() - t0

    replay()
    alloc = time.perf_counter()
    # random inputs cost time that the real step does not spend: subtract their allocation
    for _, shape, _, _ in calls:
        torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    alloc = time.perf_counter() - alloc
    return meta_time[0] + max(0.0, statistics.median(replay() for _ in range(reps)) - alloc)


def worker_throughput(spec: dict[str, Any]) -> dict[str, Any]:
    """Round-robin timed runs of several providers on one workload, in this one process."""
    import torch

    device, dtype = device_and_dtype()
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

    device, dtype = device_and_dtype()
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


# ----------------------------------------------------------------------------------------------------------------
# Orchestration (parent side)


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


def probe_providers() -> tuple[list[str], dict[str, str]]:
    """Which providers can run here: HF flash_attention_2 only if it loads; patchkit backends whose gates pass."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import patchkit
    from patchkit.errors import PatchkitError

    ok, skipped = ["hf_eager", "hf_sdpa"], {}
    try:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          vocab_size=16, attn_implementation="flash_attention_2")
        LlamaForCausalLM(cfg).to(torch.bfloat16)
        ok.append("hf_flash_attention_2")
    except Exception as exc:  # noqa: BLE001 - any load failure means "not available here"
        skipped["hf_flash_attention_2"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    for backend in ("flash_attn", "sdpa"):
        try:
            patchkit.apply_patch("llama2", backend=backend, strict=True).revert()
            ok.append(f"patchkit_{backend}")
        except PatchkitError as exc:
            skipped[f"patchkit_{backend}"] = str(exc).splitlines()[0][:200]
    return ok, skipped


class Recorder:
    """Collects CSV rows and keeps medians for the ratio table."""

    def __init__(self, meta: dict[str, str], dtype: str, device: str, mode: str = "default") -> None:
        self.rows: list[dict[str, Any]] = []
        self.raw: dict[tuple[str, str, str, str], list[float]] = {}
        self.meta, self.dtype, self.device, self.mode = meta, dtype, device, mode
        self.stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def add(self, provider: str, workload: str, x: Any, values: list[float], unit: str, note: str = "") -> None:
        row = {
            "provider": provider, "workload": workload, "dtype": self.dtype, "x": x, "unit": unit,
            "median": round(statistics.median(values), 4) if values else "",
            "min": round(min(values), 4) if values else "", "max": round(max(values), 4) if values else "",
            "reps": len(values), "device": self.device, "threads": os.environ.get("OMP_NUM_THREADS", os.cpu_count()),
            "timestamp": self.stamp, "note": note, **self.meta,
        }
        self.rows.append(row)
        self.raw[(provider, workload, str(x), unit)] = list(values)

    def paired(self, a: tuple[str, str], b: tuple[str, str]) -> Optional[float]:
        """Median over rounds of a/b when both were timed round-robin in one worker (robust to load drift)."""
        ka = next((k for k in self.raw if k[:2] == a and k[3] == "tokens/s"), None)
        kb = next((k for k in self.raw if k[:2] == b and k[3] == "tokens/s"), None)
        if ka is None or kb is None:
            return None
        va, vb = self.raw[ka], self.raw[kb]
        if not va or len(va) != len(vb) or ka[2] != kb[2]:
            return None
        return statistics.median(x / y for x, y in zip(va, vb))

    def skip(self, provider: str, workload: str, x: Any, unit: str, why: str) -> None:
        self.add(provider, workload, x, [], unit, note=f"skipped: {why}")

    def get(self, provider: str, workload: str, x: Any = None, unit: Optional[str] = None) -> Optional[float]:
        for r in self.rows:
            if (r["provider"], r["workload"]) == (provider, workload) and r["median"] != "" and (
                x is None or str(r["x"]) == str(x)
            ) and (unit is None or r["unit"] == unit):
                return float(r["median"])
        return None

    def write_csv(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            if new:
                w.writeheader()
            for r in self.rows:
                w.writerow({k: r.get(k, "") for k in CSV_COLUMNS})


def record_throughput(rec: Recorder, result: dict[str, Any], workload: str, x: Any, names: dict[str, str]) -> None:
    """tokens/s rows from a throughput worker (the providers' keys mapped to CSV provider names)."""
    if "error" in result:
        for name in names.values():
            rec.skip(name, workload, x, "tokens/s", result["error"])
        return
    for key, secs in result["times"].items():
        name = names.get(key, key)
        rec.add(name, workload, x, [result["real_tokens"] / s for s in secs], "tokens/s")
        if key in result.get("glue", {}):
            share = 100 * result["glue"][key] / statistics.median(secs)
            rec.add(name, workload + "_glue_share", x, [share], "%")


def predict_quadratic(points: list[tuple[int, float]], n: int) -> Optional[float]:
    """Extrapolate memory from the last measured point, assuming (worst case) quadratic growth in N."""
    if not points:
        return None
    n0, m0 = points[-1]
    return m0 * (n / n0) ** 2


def mem_available_mib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def run_suite(
    mode: str, csv_path: Path, plots: Optional[Path], mem_cap_gib: float, log: Callable[[str], None]
) -> Recorder:
    import torch

    sizes = MODES[mode]
    device, dtype = device_and_dtype()
    rec = Recorder(versions(), str(dtype).replace("torch.", ""), device.type, mode)
    ok, skipped = probe_providers()
    patch_providers = [p for p in ok if p.startswith("patchkit_")]
    hf = [p for p in ok if p.startswith("hf_")]
    log(f"{mode} mode on {device.type} ({dtype}), {torch.get_num_threads()} threads, {platform.processor() or ''}; "
        f"{rec.meta}")
    log(f"providers: {', '.join(ok)}; skipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    for name, why in skipped.items():
        rec.skip(name, "all", "", "", why)

    base = {"model": sizes["model"], "reps": sizes["reps"], "decode_tokens": sizes["decode_tokens"]}
    lengths = lognormal_lengths(sizes["batch"], sizes["scale"])
    pf = padding_fraction(lengths)
    log(f"lognormal batch: lengths {lengths}, {sum(lengths)} real tokens, padding fraction {pf:.1%}")

    kv_list = [sizes["model"]["heads"]] + ([2] if sizes["gqa"] else [])
    for kv in kv_list:
        tag = "" if kv == sizes["model"]["heads"] else f"_gqa{kv}"
        provs = [(p, "padded") for p in hf + patch_providers]
        provs += [(p, "packed_pos") for p in patch_providers] + [(p, "packed_cu") for p in patch_providers]
        provs += [(FLOOR, "packed_pos")]
        if tag and "gqa_providers" in sizes:
            provs = [(p, lay) for p, lay in provs if p in sizes["gqa_providers"] and lay != "packed_cu"]
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

    if sizes["decode"]:
        t0 = time.time()
        provs = [(p, "left") for p in hf + patch_providers]
        res = run_worker({**base, "kind": "throughput", "workload": "decode", "lengths": lengths,
                          "kv_heads": sizes["model"]["heads"], "providers": provs})
        record_throughput(rec, res, "prefill_decode", round(pf, 3), {f"{p}|left": p for p, _ in provs})
        log(f"prefill + {sizes['decode_tokens']}-token greedy decode done in {time.time() - t0:.0f}s")

    t0 = time.time()
    for frac in sizes["pad_fracs"]:
        lens = padded_lengths(sizes["batch"], sizes["pad_len"], frac)
        provs = [(p, "padded") for p in hf + patch_providers]
        res = run_worker({**base, "kind": "throughput", "workload": "train", "lengths": lens,
                          "kv_heads": sizes["model"]["heads"], "providers": provs})
        record_throughput(rec, res, "train_pad_sweep", round(padding_fraction(lens), 3),
                          {f"{p}|padded": p for p, _ in provs})
    log(f"padding sweep (max length {sizes['pad_len']}) done in {time.time() - t0:.0f}s")

    t0 = time.time()
    measured: dict[str, list[tuple[int, float]]] = {}
    for n in sizes["lengths"]:
        for p in hf + patch_providers:
            if p == "hf_flash_attention_2" or p not in sizes.get("mem_providers", [p]):
                continue
            pred = predict_quadratic(measured.get(p, []), n)
            cap = min(mem_cap_gib * 1024, mem_available_mib() - 2048)
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
    log(f"long-sequence memory sweep (batch 2, lengths N and N/2) done in {time.time() - t0:.0f}s")

    rec.write_csv(csv_path)
    if plots is not None:
        draw_plots(rec, plots, log)
    return rec


# ----------------------------------------------------------------------------------------------------------------
# Report


def ratio_table(rec: Recorder) -> list[tuple[str, str, str, str]]:
    """(claim, measured, target, verdict) rows; a target is judged only on the workload it is stated for.

    The throughput and glue targets are stated for the default run's workloads (TARGET_MODES), the memory targets
    for N = 8192: a --quick or smoke run shows what it measured with "not judged" and why, never a MISS it cannot
    have earned.
    """
    rows: list[tuple[str, str, str, str]] = []
    sized = rec.mode in TARGET_MODES
    not_sized = f"not judged ({rec.mode} run; target is for the default run)"

    def ratio(
        label: str, num: Optional[float], den: Optional[float], target: float, higher: bool = True,
        pair: Optional[tuple[tuple[str, str], tuple[str, str]]] = None, judged: bool = True, why: str = not_sized,
    ) -> None:
        """num/den of medians; for a pair timed in the same worker, the median of per-round ratios instead."""
        paired = rec.paired(*pair) if pair else None
        if paired is None and (num is None or den is None or den == 0):
            rows.append((label, "n/a", f"{'>=' if higher else '<='} {target}", "not measured"))
            return
        r = paired if paired is not None else num / den
        ok = r >= target if higher else r <= target
        verdict = ("PASS" if ok else "MISS") if judged else why
        rows.append((label, f"{r:.2f}x", f"{'>=' if higher else '<='} {target}x", verdict))

    patch = next((p for p in ("patchkit_flash_attn", "patchkit_sdpa") if rec.get(p, "train_padded")), "patchkit_sdpa")
    for tag, title in (("", "MHA"), ("_gqa2", "GQA 2 K/V")):
        if rec.get("hf_sdpa", f"train_padded{tag}") is None:
            continue
        pk = rec.get(patch, f"train_padded{tag}")
        sd, ea = ("hf_sdpa", f"train_padded{tag}"), ("hf_eager", f"train_padded{tag}")
        ratio(f"[{title}] padded train: {patch} / hf_sdpa", pk, rec.get(*sd), TARGETS["padded_vs_sdpa"],
              pair=((patch, sd[1]), sd), judged=sized)
        ratio(f"[{title}] padded train: {patch} / hf_eager", pk, rec.get(*ea), TARGETS["padded_vs_eager"],
              pair=((patch, ea[1]), ea), judged=sized)
        floor = (FLOOR, f"train_packed_pos{tag}")
        for lay in ("packed_pos", "packed_cu"):
            mine = (patch, f"train_{lay}{tag}")
            ratio(f"[{title}] {lay} train: {patch} / hf_sdpa padded", rec.get(*mine), rec.get(*sd),
                  TARGETS["packed_vs_sdpa"], pair=(mine, sd), judged=sized)
            ratio(f"[{title}] {lay} train: per-doc SDPA floor / {patch}", rec.get(*floor), rec.get(*mine),
                  TARGETS["floor_vs_packed"], False, pair=(floor, mine), judged=sized)
        for lay in ("padded", "packed_pos"):
            share = rec.get(patch, f"train_{lay}{tag}_glue_share")
            bound = TARGETS["glue_share"]
            verdict = ("not measured" if share is None else not_sized if not sized
                       else "PASS" if share <= bound else "MISS")
            rows.append((f"[{title}] patch glue share of the {lay} step", "n/a" if share is None else f"{share:.1f}%",
                         f"<= {bound:g}%", verdict))
    dec = rec.get(patch, "prefill_decode")
    if dec is not None:
        ratio(f"prefill+decode: {patch} / hf_sdpa", dec, rec.get("hf_sdpa", "prefill_decode"), 1.0,
              pair=((patch, "prefill_decode"), ("hf_sdpa", "prefill_decode")), judged=False, why="info (no target)")
    ns = sorted({int(r["x"]) for r in rec.rows if r["workload"] == "long_peak_mem" and r["median"] != ""})
    n = TARGET_MEM_N if TARGET_MEM_N in ns else (ns[-1] if ns else None)
    if n is not None:
        why = f"not judged (target is for N={TARGET_MEM_N}; this run's largest N is {n})"
        pk = rec.get(patch, "long_peak_mem", n)
        ratio(f"peak step memory N={n}: {patch} / hf_sdpa", pk, rec.get("hf_sdpa", "long_peak_mem", n),
              TARGETS["mem_vs_sdpa"], False, judged=n == TARGET_MEM_N, why=why)
        eager = rec.get("hf_eager", "long_peak_mem", n)
        label = f"peak step memory N={n}: {patch} / hf_eager"
        if eager is None and rec.get("hf_eager", "long_peak_mem_predicted", n) is not None:
            eager = rec.get("hf_eager", "long_peak_mem_predicted", n)
            label += " (eager predicted, not run)"
        ratio(label, pk, eager, TARGETS["mem_vs_eager"], False, judged=n == TARGET_MEM_N, why=why)
    return rows


def print_report(rec: Recorder, log: Callable[[str], None]) -> None:
    log("")
    log(f"{'provider':22s} {'workload':28s} {'x':>7s} {'median':>10s} {'min':>10s} {'max':>10s} unit")
    for r in rec.rows:
        if r["median"] == "":
            log(f"{r['provider']:22s} {r['workload']:28s} {str(r['x']):>7s} {r['note']}")
        else:
            log(f"{r['provider']:22s} {r['workload']:28s} {str(r['x']):>7s} {r['median']:>10.1f} {r['min']:>10.1f} "
                f"{r['max']:>10.1f} {r['unit']}")
    log("")
    table = ratio_table(rec)
    w = max([len(t[0]) for t in table] + [38])
    log(f"{'target (benchmarks/README.md, Targets)':{w}s}  {'measured':>9s}  {'target':>8s}  verdict")
    for label, got, target, verdict in table:
        log(f"{label:{w}s}  {got:>9s}  {target:>8s}  {verdict}")


def draw_plots(rec: Recorder, out: Path, log: Callable[[str], None]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    out.mkdir(parents=True, exist_ok=True)
    specs = [
        ("train_pad_sweep", "tokens/s", "padding fraction", "real tokens / s (train step)",
         "throughput_vs_padding.png"),
        ("long_peak_mem", "MiB", "sequence length N (batch 2: N and N/2)", "peak step memory (MiB)",
         "memory_vs_seqlen.png"),
    ]
    for workload, _, xlabel, ylabel, fname in specs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for prov in sorted({r["provider"] for r in rec.rows if r["workload"] == workload}):
            pts = sorted((float(r["x"]), float(r["median"])) for r in rec.rows
                         if r["workload"] == workload and r["provider"] == prov and r["median"] != "")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
            pred = sorted((float(r["x"]), float(r["median"])) for r in rec.rows
                          if r["workload"] == workload + "_predicted" and r["provider"] == prov)
            if pred and pts:
                ax.plot([pts[-1][0]] + [p[0] for p in pred], [pts[-1][1]] + [p[1] for p in pred], ls=":",
                        color=ax.lines[-1].get_color(), label=f"{prov} (predicted, skipped)")
        if workload == "long_peak_mem":
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{rec.device} {rec.dtype}, torch {rec.meta['torch']}, transformers {rec.meta['transformers']}",
                     fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        log(f"wrote {out / fname}")


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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:  # the benchmark decides per provider what is patched; PATCHKIT_FLASH_ATTN must not patch HF's providers
        from patchkit._autostart import stand_down

        stand_down("benchmarks/bench.py")
    except ImportError:
        pass
    if args.worker:
        spec = json.loads(args.worker)
        fn = worker_throughput if spec["kind"] == "throughput" else worker_memory
        print(json.dumps(fn(spec)))
        return 0
    mode = "full" if args.full else "quick" if args.quick else "smoke" if args.smoke else "default"
    csv_path, plots = output_paths(args.out, args.csv, args.plots, args.no_plots)
    start = time.time()
    rec = run_suite(mode, csv_path, plots, args.mem_cap_gib, lambda s: print(s, flush=True))
    print_report(rec, lambda s: print(s, flush=True))
    print(f"\n{len(rec.rows)} rows appended to {csv_path}; total {time.time() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
