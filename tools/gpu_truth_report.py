"""gpu-truth's summary.md: the machine, each part's outcome, the issue's goals, the ratio tables and every CSV."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional


def csv_table(path: Path, limit: int = 60) -> list[str]:
    """A CSV's measured rows as a markdown table (the columns that say what was measured)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    keep = [c for c in rows[0] if c not in ("dtype", "device", "torch", "transformers", "patchkit", "threads",
                                            "timestamp", "min", "max", "reps")]
    out = ["| " + " | ".join(keep) + " |", "|" + "---|" * len(keep)]
    for r in rows[:limit]:
        out.append("| " + " | ".join(str(r.get(c, ""))[:70] for c in keep) + " |")
    if len(rows) > limit:
        out.append(f"| ... {len(rows) - limit} more rows in truth.tar.gz | " + " |" * (len(keep) - 1))
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def median(rows: list[dict[str, str]], provider: str, workload: str, x: Optional[float] = None) -> Optional[float]:
    """A bench.py row's median (the row whose x is nearest `x`, if given)."""
    found = [r for r in rows if r["provider"] == provider and r["workload"] == workload and r.get("median")]
    if x is not None:  # a padding sweep's x is the measured fraction, near the asked one; a part cut short has none
        found = sorted((r for r in found if abs(float(r["x"] or 0) - x) <= 0.05), key=lambda r: abs(float(r["x"]) - x))
    return float(found[0]["median"]) if found else None


def goals(work: Path) -> list[str]:
    """The issue's goals, each measured ratio against its bound: packed rows within 5% of HF's padding-free path,
    >= 1.5x HF flash_attention_2 at 50% padding, decode >= 1.2x HF with the same cache."""
    train, pad = read_csv(work / "train" / "results.csv"), read_csv(work / "pad" / "results.csv")
    mine = next((p for p in ("patchkit_flash_attn", "patchkit_torch_varlen") if median(train + pad, p, "train_padded")
                 or median(pad, p, "train_pad_sweep")), "patchkit_flash_attn")
    fa2 = "hf_flash_attention_2"
    out = ["| goal | measured | bound | verdict |", "|---|---|---|---|"]

    def add(label: str, num: Optional[float], den: Optional[float], bound: Optional[float]) -> None:
        if num is None or not den:
            out.append(f"| {label} | not measured | {f'>= {bound:.2f}x' if bound else '-'} | - |")
            return
        r = num / den
        verdict = "info" if bound is None else "met" if r >= bound else "MISSED"
        out.append(f"| {label} | {r:.2f}x | {f'>= {bound:.2f}x' if bound else '-'} | {verdict} |")

    for tag, title in (("", "MHA"), ("_gqa2", "GQA")):
        add(f"{title} padded step: {mine} / {fa2}", median(train, mine, f"train_padded{tag}"),
            median(train, fa2, f"train_padded{tag}"), None)
        for lay in ("packed_pos", "packed_cu"):
            add(f"{title} {lay} rows: {mine} / {fa2} on the same rows (HF padding-free)",
                median(train, mine, f"train_{lay}{tag}"), median(train, fa2, f"train_{lay}{tag}"), 0.95)
    for x in (0.25, 0.5, 0.75):
        add(f"padding sweep ~{x:.0%}: {mine} / {fa2}", median(pad, mine, "train_pad_sweep", x),
            median(pad, fa2, "train_pad_sweep", x), 1.5 if x == 0.5 else None)
    for r in read_csv(work / "decode.csv"):
        if r.get("provider", "").startswith("patchkit") and r.get("vs_hf_fa2"):
            add(f"decode, dynamic cache, kv {r.get('kv_heads')}: {r['provider']} / {fa2}", float(r["vs_hf_fa2"]), 1.0,
                1.2)
    return out


def summary(out: Path, work: Path, facts: dict[str, str], flash: Any, steps: list[Any], setup: str,
            rehearse: bool, total: float) -> Path:
    lines = [f"# gpu-truth{' (rehearsal on CPU: nothing here is a GPU number)' if rehearse else ''}", "",
             "| fact | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += [f"| setup | {setup} |", f"| flash-attn | {flash.state} |", f"| wall | {total:.0f} s |", "",
              "| part | status | seconds | budget | result |", "|---|---|---|---|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.budget} | {p.result} |" for p in steps]
    lines += ["", "## Goals (issue 44)", "", *goals(work)]
    ratio_lines = []
    for log in sorted(work.glob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        start = next((i for i, ln in enumerate(text) if ln.startswith("target (benchmarks/README.md")), None)
        if start is not None:
            ratio_lines += ["", f"## {log.stem}: ratios", "", "```", *text[start:start + 40], "```"]
    lines += ratio_lines
    for path in sorted(work.rglob("*.csv")):
        table = csv_table(path)
        if table:
            lines += ["", f"## {path.relative_to(work)}", "", *table]
    target = out / "summary.md"
    target.write_text("\n".join(lines) + "\n")
    return target
