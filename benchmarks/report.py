"""The benchmark's results: CSV rows, the ratio table against the targets, and the plots."""

from __future__ import annotations

import csv
import os
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

from workloads import FLOOR

PATCHKIT_ORDER = ("patchkit_flash_attn", "patchkit_torch_varlen", "patchkit_sdpa")  # the first measured is judged

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


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """A script's rows as one CSV (the first row's keys as columns), its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


class Recorder:
    """Collects CSV rows and keeps medians for the ratio table."""

    def __init__(self, meta: dict[str, str], dtype: str, device: str, mode: str = "default") -> None:
        self.rows: list[dict[str, Any]] = []
        self.written = 0  # rows already in the CSV: a run writes each part's rows when the part ends
        self.raw: dict[tuple[str, str, str, str], list[float]] = {}
        self.meta, self.dtype, self.device, self.mode = meta, dtype, device, mode
        self.stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def add(self, provider: str, workload: str, x: Any, values: list[float], unit: str, note: str = "") -> None:
        row = {
            "provider": provider, "workload": workload, "dtype": self.dtype, "x": x, "unit": unit,
            "median": _rounded(statistics.median(values)) if values else "",
            "min": _rounded(min(values)) if values else "", "max": _rounded(max(values)) if values else "",
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
        """Append the rows not written yet (a run cut short keeps the parts it finished)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            if new:
                w.writeheader()
            for r in self.rows[self.written:]:
                w.writerow({k: r.get(k, "") for k in CSV_COLUMNS})
        self.written = len(self.rows)


def _rounded(value: float) -> float:
    """Four decimals, or three significant figures where those would round a small share (a glue share) to zero."""
    return round(value, 4) if abs(value) >= 0.01 or value == 0 else float(f"{value:.3g}")


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


def ratio_table(rec: Recorder) -> list[tuple[str, str, str, str]]:
    """(claim, measured, target, verdict) rows; a target is judged only on the workload it is stated for.

    The throughput and glue targets are stated for the default run's workloads (TARGET_MODES), the memory targets
    for N = 8192: a --quick or smoke run shows what it measured with "not judged" and why, never a MISS it cannot
    have earned.
    """
    rows: list[tuple[str, str, str, str]] = []
    sized = rec.mode in TARGET_MODES and rec.device == "cpu"
    not_sized = (f"not judged ({rec.mode} run; target is for the default run)" if rec.device == "cpu"
                 else f"not judged ({rec.device} run; targets are for the CPU default run)")

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

    patch = next((p for p in PATCHKIT_ORDER if rec.get(p, "train_padded")), "patchkit_sdpa")
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
    rows += gpu_comparisons(rec, patch)
    dec = rec.get(patch, "prefill_decode")
    if dec is not None:
        ratio(f"prefill+decode: {patch} / hf_sdpa", dec, rec.get("hf_sdpa", "prefill_decode"), 1.0,
              pair=((patch, "prefill_decode"), ("hf_sdpa", "prefill_decode")), judged=False, why="info (no target)")
    ns = sorted({int(r["x"]) for r in rec.rows if r["workload"] == "long_peak_mem" and r["median"] != ""})
    n = TARGET_MEM_N if TARGET_MEM_N in ns else (ns[-1] if ns else None)
    if n is not None:
        why = (f"not judged (target is for N={TARGET_MEM_N}; this run's largest N is {n})" if rec.device == "cpu"
               else not_sized)
        pk = rec.get(patch, "long_peak_mem", n)
        ratio(f"peak step memory N={n}: {patch} / hf_sdpa", pk, rec.get("hf_sdpa", "long_peak_mem", n),
              TARGETS["mem_vs_sdpa"], False, judged=n == TARGET_MEM_N and rec.device == "cpu", why=why)
        eager = rec.get("hf_eager", "long_peak_mem", n)
        label = f"peak step memory N={n}: {patch} / hf_eager"
        if eager is None and rec.get("hf_eager", "long_peak_mem_predicted", n) is not None:
            eager = rec.get("hf_eager", "long_peak_mem_predicted", n)
            label += " (eager predicted, not run)"
        ratio(label, pk, eager, TARGETS["mem_vs_eager"], False, judged=n == TARGET_MEM_N and rec.device == "cpu",
              why=why)
    return rows


def gpu_comparisons(rec: Recorder, judged: str) -> list[tuple[str, str, str, str]]:
    """On CUDA, every patchkit backend that ran against HF's flash_attention_2 and sdpa on the padded step, and
    its packed rows against HF's padding-free path (flash_attention_2 on the same packed rows): info, no target; the
    `judged` backend's padded row against hf_sdpa is the target row above."""
    rows = []
    for tag, title in (("", "MHA"), ("_gqa2", "GQA 2 K/V")):
        for lay in ("padded", "packed_pos", "packed_cu"):
            work = f"train_{lay}{tag}"
            refs = ("hf_flash_attention_2", "hf_sdpa") if lay == "padded" else ("hf_flash_attention_2",)
            for ref in refs:
                den = rec.get(ref, work)
                for mine in PATCHKIT_ORDER:
                    num = rec.get(mine, work)
                    if rec.device == "cuda" and num is not None and den and (mine, ref, lay) != (
                            judged, "hf_sdpa", "padded"):
                        paired = rec.paired((mine, work), (ref, work))
                        r = paired if paired is not None else num / den
                        same = "" if lay == "padded" else " on the same rows"
                        rows.append((f"[{title}] {lay} train: {mine} / {ref}{same}", f"{r:.2f}x", "-",
                                     "info (no target)"))
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
