"""gpu-truth's summary.md: the machine, each part's outcome, the issue's goals, the ratio tables and every CSV."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from gpu_truth_goals import goals


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


def summary(out: Path, work: Path, facts: dict[str, str], flash: Any, steps: list[Any], setup: str,
            rehearse: bool, total: float) -> Path:
    lines = [f"# gpu-truth{' (rehearsal on CPU: nothing here is a GPU number)' if rehearse else ''}", "",
             "| fact | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines += [f"| setup | {setup} |", f"| flash-attn | {flash.state} |", f"| wall | {total:.0f} s |", "",
              "| part | status | seconds | budget | result |", "|---|---|---|---|---|"]
    lines += [f"| {p.name} | {p.status} | {p.seconds:.0f} | {p.budget} | {p.result} |" for p in steps]
    lines += ["", "## Goals (issues 44 and 57)", "", *goals(work)]
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
