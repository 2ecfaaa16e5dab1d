"""The report of tools/hf_modeling_tests.py: its table, the changed tests grouped by cause, and its CSV/JSON files."""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

DATA = re.compile(r"\s*[\[({<].*$")  # an assertion's data, from its first bracket on
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def cause_of(message: str) -> str:
    """The grouping key for an error's first line: its data (from the first bracket on) and numbers masked, so
    `Lists differ: [[70, ...]] != [[70, ...]]` from two tests is one cause. The exact line stays in the results."""
    key = NUMBER.sub("N", DATA.sub(" ...", message)).strip()
    return key or "(no message)"


def print_report(families: list[dict[str, Any]]) -> None:
    """The table, then the changed tests grouped by the first line of their error (the cause)."""
    header = ("family", "tests", "run", "pass plain", "pass patched", "pass->fail", "fail->pass", "other",
              "patched attn", "stepped aside", "vacuous", "s plain", "s patched")
    table = []
    for f in families:
        if "error" in f:
            print(f"{f['family']}: not run: {f['error']}")
            continue
        table.append((f["family"], f["tests"], f["run_plain"], f["passed_plain"], f["passed_patched"],
                      f["pass_to_fail"], f["fail_to_pass"], f["other_changes"], f["patched_attention_tests"],
                      f["stepped_aside_tests"], len(f.get("vacuous_comparisons", [])),
                      f["runs"]["plain"]["seconds"], f["runs"]["patched"]["seconds"]))
    widths = [max(len(str(row[i])) for row in (header, *table)) for i in range(len(header))]
    print()
    for row in (header, *table):
        print("  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    print("\n(run: not skipped in the plain run; patched attn / stepped aside: tests of the patched run in which "
          "at least one attention call went through the patch / at least one forward stepped aside; vacuous: passed "
          "tests comparing two attention implementations where both ran patchkit, listed below: no evidence)")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for f in families:
        for row in f.get("changed", []):
            direction = f"{row['plain']} plain -> {row['patched']} patched"
            message = row["patched_message"] if row["patched"] == "failed" else row["plain_message"]
            groups[(direction, cause_of(message))].append(row)
    if groups:
        print("\nChanged tests, by cause (first line of the failing run's error; data and numbers masked):")
    for (direction, cause), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
        print(f"\n[{direction}] x{len(rows)}: {cause}")
        for row in rows:
            notes = []
            if row["repeats_on_rerun"] is not None:
                notes.append("repeats on re-run" if row["repeats_on_rerun"] else "FLAKY: did not repeat on re-run")
            if row["patchkit_frame"]:
                notes.append(f"last patchkit frame {row['patchkit_frame']}")
            if row["stepped_aside"]:
                notes.append("stepped aside: " + ", ".join(f"{n} {c}" for c, n in row["stepped_aside"].items()))
            if row["patched_calls"] is not None:
                notes.append(f"{row['patched_calls']} patched attention calls")
            print(f"    {row['id']}" + (f"  ({'; '.join(notes)})" if notes else ""))
    vacuous = [(f["family"], i) for f in families for i in f.get("vacuous_comparisons", [])]
    if vacuous:
        print("\nPassed, but vacuous: they compare two attention implementations, and under the class patch both "
              "sides ran patchkit (compare patchkit with transformers' eager instead: `patchkit verify`):")
    for family, test_id in vacuous:
        print(f"    {family}: {test_id}")
    print("\npatchkit at exit (patched runs):")
    for f in (f for f in families if "error" not in f):
        for line in f.get("exit_lines", []) or ["(no patchkit exit line: was the startup hook active?)"]:
            print(f"  {f['family']}: {line}")
        for warning in f.get("patchkit_warnings", []):
            print(f"  {f['family']}: warned: {warning[:200]}")


def write_results(families: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """results.json (everything), summary.csv (the table) and changed.csv (one row per changed test)."""
    (out / "results.json").write_text(json.dumps({"meta": meta, "families": families}, indent=1))
    with open(out / "changed.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["family", "id", "plain", "patched", "plain_message", "patched_message", "patchkit_frame",
                         "patched_calls", "stepped_aside", "repeats_on_rerun"])
        for f in families:
            for r in f.get("changed", []):
                writer.writerow([r["family"], r["id"], r["plain"], r["patched"], r["plain_message"],
                                 r["patched_message"], r["patchkit_frame"], r["patched_calls"],
                                 json.dumps(r["stepped_aside"]), r["repeats_on_rerun"]])
    with open(out / "summary.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        keys = ["family", "tests", "run_plain", "passed_plain", "passed_patched", "pass_to_fail", "fail_to_pass",
                "other_changes", "patched_attention_tests", "stepped_aside_tests", "patched_calls"]
        writer.writerow([*keys, "vacuous_comparisons"])
        for f in families:
            writer.writerow([*(f.get(k, "") for k in keys), len(f.get("vacuous_comparisons", []))])
