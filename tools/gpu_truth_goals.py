"""gpu-truth's goals (issues 44 and 57), each read from the CSVs the parts wrote: met, MISSED, or not measured, why.

Where a goal sets patchkit against an HF kernel, patchkit on the same kernel is judged (flash_attn against HF
flash_attention_2, flash_attn_4 against flash_attention_4: like for like), else the first of its kernel backends that
ran, in backend="auto"'s order; every other kernel backend that ran is shown beside it as info. A goal whose numbers
are missing is never met: its row says "not measured" and why (the file not written, the provider skipped by
bench.py's probe and its reason, the rows the part left).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FA2, FA4 = "hf_flash_attention_2", "hf_flash_attention_4"
KERNELS = ("patchkit_flash_attn_4", "patchkit_flash_attn", "patchkit_torch_varlen")  # backend="auto"'s order (sm90)
SAME_KERNEL = {FA2: "patchkit_flash_attn", FA4: "patchkit_flash_attn_4"}
GLUE_BOUND = 5.0  # % of the padded step (issue 57)
SWEEP = (0.25, 0.5, 0.75)  # the padding sweep's fractions; 50% carries the bound


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


@dataclass
class Goal:
    """One row of the goals table: a measured ratio (or share) against its bound, or why it was not measured."""

    label: str
    value: Optional[float]
    bound: Optional[float] = None  # None: info, no bound
    why: str = ""  # when value is None
    higher: bool = True  # the bound is a floor (ratios), else a ceiling (the glue share)
    unit: str = "x"

    @property
    def verdict(self) -> str:
        if self.value is None:
            return f"not measured: {self.why or 'no numbers'}"
        if self.bound is None:
            return "info"
        return "met" if (self.value >= self.bound if self.higher else self.value <= self.bound) else "MISSED"

    def row(self) -> str:
        def fmt(v: float) -> str:
            return f"{v:.2f}x" if self.unit == "x" else f"{v:.1f}%"
        bound = "-" if self.bound is None else f"{'>=' if self.higher else '<='} {fmt(self.bound)}"
        return f"| {self.label} | {'-' if self.value is None else fmt(self.value)} | {bound} | {self.verdict} |"


class Run:
    """One gpu-truth run's CSVs: train/results.csv, pad/results.csv (bench.py), decode.csv, families.csv."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.train = read_csv(work / "train" / "results.csv")
        self.pad = read_csv(work / "pad" / "results.csv")
        self.decode = read_csv(work / "decode.csv")
        self.families = read_csv(work / "families.csv")

    def skipped(self, provider: str) -> Optional[str]:
        """Why bench.py's probe left `provider` out (its skipped row's note), from either bench part's CSV."""
        for r in self.train + self.pad:
            if r["provider"] == provider and r.get("note", "").startswith("skipped:"):
                return r["note"][len("skipped:"):].strip()[:160]
        return None

    def missing(self, name: str, rows: list[dict[str, str]], provider: str, workload: str,
                x: Optional[float] = None) -> str:
        """Why `rows` (the CSV `name`) has no median of `provider` on `workload` (near `x`)."""
        if not rows:
            return f"{name} not written (its part did not run, or stopped before its first rows)"
        why = self.skipped(provider)
        if why:
            return f"{provider} skipped: {why}"
        if x is None:
            return f"no {provider} {workload} row in {name}"
        seen = sorted({r["x"] for r in rows if r["workload"] == workload and r.get("median")}, key=float)
        return (f"no {provider} {workload} row near {x:.0%} in {name}"
                + (f" (rows at x = {', '.join(seen)} only)" if seen else ""))

    def ratio(self, label: str, name: str, rows: list[dict[str, str]], mine: str, ref: str, workload: str,
              bound: Optional[float], x: Optional[float] = None) -> Goal:
        """mine / ref of bench.py medians (tokens/s: higher is faster)."""
        num, den = median(rows, mine, workload, x), median(rows, ref, workload, x)
        if num is None:
            return Goal(label, None, bound, why=self.missing(name, rows, mine, workload, x))
        if not den:
            return Goal(label, None, bound, why=self.missing(name, rows, ref, workload, x))
        return Goal(label, num / den, bound)

    def versus(self, title: str, name: str, rows: list[dict[str, str]], ref: str, workload: str,
               bound: Optional[float], x: Optional[float] = None, suffix: str = "") -> list[Goal]:
        """patchkit against HF's `ref` on `workload`: the judged backend's row; with a bound and `ref` measured, the
        other backends' rows as info."""
        ran = [p for p in KERNELS if median(rows, p, workload, x) is not None]
        mine = judged(ran, ref)
        others = [p for p in ran if p != mine] if bound is not None and median(rows, ref, workload, x) else []
        return [self.ratio(f"{title}: {p} / {ref}{suffix}", name, rows, p, ref, workload,
                           bound if p == mine else None, x) for p in [mine, *others]]

    def decode_vs(self, ref: str, bound: float) -> list[Goal]:
        """decode.csv (prefill + greedy decode, dynamic cache): ref's median seconds / patchkit's, per kv_heads."""
        label = f"decode, dynamic cache: patchkit / {ref}"
        if not self.decode:
            return [Goal(label, None, bound, why=self.missing("decode.csv", [], ref, "decode"))]
        out = []
        for kv, window in dict.fromkeys((r["kv_heads"], r.get("window", "")) for r in self.decode):
            seconds = {r["provider"]: float(r["median_s"]) for r in self.decode
                       if (r["kv_heads"], r.get("window", "")) == (kv, window) and r.get("median_s")}
            ran = [p for p in KERNELS if p in seconds]
            mine = judged(ran, ref)
            where = f"kv {kv}" + (f", window {window}" if window else "")
            for p in [mine, *[q for q in ran if q != mine and ref in seconds]]:
                label, b = f"decode, dynamic cache, {where}: {p} / {ref}", bound if p == mine else None
                if p in seconds and seconds.get(ref):
                    out.append(Goal(label, seconds[ref] / seconds[p], b))
                    continue
                gone = ref if p in seconds else p
                why = self.skipped(gone)
                out.append(Goal(label, None, b, why=f"{gone} skipped: {why}" if why
                                else f"no {gone} row for {where} in decode.csv"))
        return out

    def gpt_oss(self, bound: float = 1.5) -> Goal:
        """families.csv: GPT-OSS's padded step on patchkit against the fastest HF provider that ran for it."""
        label = "GPT-OSS padded step (sinks): patchkit / HF's best GPT-OSS path"
        if not self.families:
            return Goal(label, None, bound, why="families.csv not written (its part did not run, or no family ended)")
        rows = [r for r in self.families if r["family"] == "gpt_oss"]
        if not rows:
            ran = ", ".join(dict.fromkeys(r["family"] for r in self.families))
            return Goal(label, None, bound, why=f"no gpt_oss rows in families.csv (families measured: {ran}; "
                        f"{self.family_log('gpt_oss') or 'not in the run'})")
        mine = next((r for r in rows if r["provider"] == "patchkit padded" and r.get("median_s")), None)
        hf = [r for r in rows if r["provider"].startswith("hf_") and r["provider"].endswith(" padded")
              and r.get("median_s")]
        skipped = [f"{r['provider'].split()[0]} skipped: {r['note'][len('skipped:'):].strip()[:80]}" for r in rows
                   if r.get("note", "").startswith("skipped:")]
        if mine is None or not hf:
            what = "no patchkit padded row" if mine is None else "no HF provider ran"
            return Goal(label, None, bound, why="; ".join([f"{what} for gpt_oss in families.csv", *skipped]))
        best = min(hf, key=lambda r: float(r["median_s"]))
        ran = ", ".join(r["provider"].split()[0] for r in hf)
        label = (f"GPT-OSS padded step (sinks): patchkit ({mine.get('backend') or '?'}) / HF's best, "
                 f"{best['provider'].split()[0]} (of {ran}{'; ' + '; '.join(skipped) if skipped else ''})")
        return Goal(label, float(best["median_s"]) / float(mine["median_s"]), bound)

    def family_log(self, family: str) -> str:
        """The family groups part's line about `family` failing or being left out by its budget ("" if none)."""
        log = self.work / "family_groups.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        hit = next((ln for ln in lines if family in ln and ("failed" in ln or "left out" in ln)), "")
        return hit.strip()[:200]

    def glue(self, tag: str, title: str) -> list[Goal]:
        """The patch glue's share of the padded step (bench.py's train part times it for each patchkit backend)."""
        workload = f"train_padded{tag}_glue_share"
        ran = [p for p in KERNELS if median(self.train, p, workload) is not None]
        mine = ran[0] if ran else KERNELS[0]
        out = []
        for p in [mine, *ran[1:]]:
            value, b = median(self.train, p, workload), GLUE_BOUND if p == mine else None
            why = "" if value is not None else self.missing("train/results.csv", self.train, p, workload)
            out.append(Goal(f"{title} glue share of the padded step: {p}", value, b, why=why, higher=False, unit="%"))
        return out


def judged(ran: list[str], ref: str) -> str:
    """The patchkit provider a goal against HF's `ref` is judged on: the same kernel's where it ran, else the first
    that ran in auto's order, else the same kernel's (its absence is then the reason given)."""
    like = SAME_KERNEL.get(ref, KERNELS[0])
    return like if like in ran or not ran else ran[0]


def goal_rows(work: Path) -> list[Goal]:
    """Every goal of issues 44 and 57 against the run in `work`, in the table's order."""
    run = Run(work)
    train, pad = ("train/results.csv", run.train), ("pad/results.csv", run.pad)
    out: list[Goal] = []
    for ref in (FA2, FA4):  # issue 44 against flash_attention_2, issue 57 against flash_attention_4 too
        packed_bound = {"packed_pos": 0.95 if ref == FA2 else 1.0, "packed_cu": 1.0}  # issue 57: cu rows >= 1.0x FA2
        for tag, title in (("", "MHA"), ("_gqa2", "GQA")):
            out += run.versus(f"{title} padded step", *train, ref, f"train_padded{tag}", None)
            for lay in ("packed_pos", "packed_cu"):
                out += run.versus(f"{title} {lay} rows", *train, ref, f"train_{lay}{tag}", packed_bound[lay],
                                  suffix=" on the same rows (HF padding-free)")
        for x in SWEEP:
            out += run.versus(f"padding sweep ~{x:.0%}", *pad, ref, "train_pad_sweep", 1.5 if x == 0.5 else None, x)
        out += run.decode_vs(ref, 1.2)
    out.append(run.gpt_oss())
    for tag, title in (("", "MHA"), ("_gqa2", "GQA")):
        out += run.glue(tag, title)
    return out


def goals(work: Path) -> list[str]:
    """The goals table (markdown lines) of the run in `work`."""
    return ["| goal | measured | bound | verdict |", "|---|---|---|---|", *(g.row() for g in goal_rows(work))]
