"""Run transformers' own modeling tests plain and under PATCHKIT_FLASH_ATTN=1; print the tests whose outcome changes.

Run by hand, never in CI (it takes tens of minutes and needs transformers' test files, which the wheel lacks).

Step 1, assemble a tests tree once (the installed transformers' sdist `tests/*.py`, plus `tests/models/<family>/`,
`tests/generation/`, `tests/utils/` and `utils/test_module/` from a git checkout or mirror of transformers, e.g.
zucchini-nlp/transformers, whose `tests/` has what the sdist leaves out):

    git clone --depth 1 https://github.com/zucchini-nlp/transformers /tmp/hf-transformers   # or a bare mirror
    .venv/bin/python tools/hf_modeling_tests.py --prepare --tests-dir /tmp/hf_tests \\
        --mirror /tmp/hf-transformers              # [--sdist transformers-X.tar.gz] to skip the pip download
        [--families gpt2 jamba ...]                # other tests/models folders than the patch modules' families

`--prepare` downloads the sdist of the installed version (`pip download --no-deps --no-binary :all:`), copies the
mirror's files first and the sdist's over them, and writes what neither has: `tests/distributed_testing_utils.py`
(a stub whose helpers skip the test: only the tensor-parallel, expert-parallel and FSDP mixins use it), a minimal
root `conftest.py` (transformers' own registers an xdist-only hook and fails without pytest-xdist), `pytest.ini`
(markers and warning filters from the sdist's pyproject.toml) and `src/transformers`, a link to the installed
package (`test_pipeline_mixin.py` imports it from there, as in a transformers checkout). Where the mirror's testers
import a constant from `transformers.testing_utils` that the installed version lacks (2026-08's
`_TEXT_MODEL_TESTER_DEFAULTS`, absent from 5.24.0), the conftest copies it from the mirror's testing_utils.
PROVENANCE.json says which file came from where. The test files import `parameterized`, `httpx` and (the VL
families) `requests`, and OPT's `timeout_decorator`: pip install them into the venv (`pip install parameterized
httpx requests timeout-decorator`). A test file that does not import is reported by name, never as "nothing changed".

Step 2, compare (each family's test file is run twice, plain then patched; --jobs N runs N families at once, each
pytest on one thread):

    .venv/bin/python tools/hf_modeling_tests.py --tests-dir /tmp/hf_tests --jobs 2         # every family
    .venv/bin/python tools/hf_modeling_tests.py --tests-dir /tmp/hf_tests --families llama mistral qwen2
    .venv/bin/python tools/hf_modeling_tests.py --report /tmp/hf_modeling_tests/*/results.json   # re-print

Plain runs have no PATCHKIT_* variable; patched runs set PATCHKIT_FLASH_ATTN=1 PATCHKIT_BACKEND=sdpa. Both set
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 (hub tests fail or skip alike in both). `-k "not test_training_overfit"`
is the default (that one test takes 4 minutes a run on 2 CPU cores; `-k ""` keeps it). Tests whose outcome
changed are run once more in both modes (`--no-confirm` skips it) and marked flaky if the change does not repeat.
A small pytest plugin, written next to the results, records per test how many attention calls went through the
patch and how many forwards stepped aside (patchkit.active_patches() counters before and after each test), and
the `patchkit:` warnings. Results (JSON, CSV, junit XML, logs) go to --out, under /tmp by default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tests_report import print_report, write_results  # noqa: E402
from hf_tests_tree import FAMILIES, installed_transformers, prepare  # noqa: E402

DEFAULT_K = "not test_training_overfit"
PATCHED_ENV = {"PATCHKIT_FLASH_ATTN": "1", "PATCHKIT_BACKEND": "sdpa"}
COMMON_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
EXIT_LINE = re.compile(r"^patchkit \(PATCHKIT_FLASH_ATTN\):.*$", re.M)
# a traceback frame in patchkit's own code, in pytest's format (path:line: in f) or Python's (File "path", line n)
PATCHKIT_FRAME = re.compile(r"((?:patchkit|patches)/[\w/]+\.py)(?::|\", line )(\d+)")
PROBE = "hfmt_probe"
COLLECTING = re.compile(r"^_+ ERROR collecting \S+ _+$", re.M)
# a test that compares two attention implementations (test_eager_matches_sdpa_inference, ..._generate,
# test_sdpa_matches_eager_sliding_window, test_flash_attn_2_inference_equivalence): under PATCHKIT_FLASH_ATTN=1 the
# class patch serves every model of the family whatever its config names, so both sides run patchkit's attention
COMPARES = re.compile(r"(eager|sdpa|flex|fa\d|flash_attn(_\d)?)_matches_|_matches_(eager|sdpa|flex|fa\d)|"
                      r"flash_attn\w*_inference_equivalence")


# ---------------------------------------------------------------------------------------------------- running


def run_pytest(args: argparse.Namespace, targets: list[str], mode: str, out: Path, stem: str, k: str
               ) -> dict[str, Any]:
    """One pytest subprocess (plain or patched); returns its paths, exit code, seconds and timeout flag."""
    python, tests_dir, timeout = args.python, args.tests_dir, args.timeout
    env = {key: value for key, value in os.environ.items() if not key.startswith("PATCHKIT_")}
    env.update(COMMON_ENV)
    if args.jobs > 1:  # one thread each: N runs' OpenMP pools spinning on N cores made every run 3-4x slower
        env.setdefault("OMP_NUM_THREADS", "1")
    if mode == "patched":
        env.update(PATCHED_ENV)
    probe_out, junit, log = out / f"{stem}.probe.jsonl", out / f"{stem}.xml", out / f"{stem}.log"
    for path in (probe_out, junit):
        path.unlink(missing_ok=True)
    env["HFMT_PROBE_OUT"] = str(probe_out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(out), env.get("PYTHONPATH", "")) if p)
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", PROBE,
           "-c", str(tests_dir / "pytest.ini"), "--rootdir", str(tests_dir), f"--junitxml={junit}",
           "-q", "-rfE"]
    if k:
        cmd += ["-k", k]
    cmd += targets
    start = time.monotonic()
    timed_out = False
    with open(log, "w", encoding="utf-8") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)  # the session this Popen started: pytest and its children only
                    proc.wait(timeout=30)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            if proc.returncode is None:
                proc.wait(timeout=30)
    return {"mode": mode, "rc": proc.returncode, "seconds": round(time.monotonic() - start, 1),
            "timed_out": timed_out, "junit": str(junit), "probe": str(probe_out), "log": str(log)}


def junit_outcomes(path: Path, target: str) -> dict[str, dict[str, str]]:
    """Per test id (`file::Class::test`), outcome and the first line of its failure, from a junit XML file."""
    out: dict[str, dict[str, str]] = {}
    if not path.exists():
        return out
    module = target[:-3].replace("/", ".")
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        # a test in a class: "module.Class"; a module-level test function: the module alone
        inner = classname[len(module) + 1:] if classname.startswith(module + ".") else (
            "" if classname == module else classname)
        test_id = "::".join(p for p in (target, inner, name) if p)
        bad = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        if bad:
            message = bad[0].get("message") or (bad[0].text or "")
            frames = PATCHKIT_FRAME.findall(bad[0].text or "")
            entry = {"outcome": "failed", "message": first_line(message),
                     "patchkit_frame": ":".join(frames[-1]) if frames else ""}
        elif skipped:
            entry = {"outcome": "skipped", "message": first_line(skipped[0].get("message") or "")}
        else:
            entry = {"outcome": "passed", "message": ""}
        # a test id met twice (subtests): failed wins, then passed
        if test_id not in out or RANK[entry["outcome"]] > RANK[out[test_id]["outcome"]]:
            out[test_id] = entry
    return out


RANK = {"skipped": 0, "passed": 1, "failed": 2}


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def probe_records(path: Path) -> dict[str, dict[str, Any]]:
    """The probe plugin's JSON lines, by node id (written per test, so they survive a timeout)."""
    records: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["nodeid"]] = record
    return records


def outcomes(run: dict[str, Any], target: str) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
    """Outcomes from the junit XML (the probe's when the run left no XML, e.g. a timeout), and the probe records."""
    probe = probe_records(Path(run["probe"]))
    result = junit_outcomes(Path(run["junit"]), target)
    if not result:
        result = {i: {"outcome": r["outcome"], "message": r["message"]} for i, r in probe.items()}
    return result, probe


def exit_lines(log: Path) -> list[str]:
    """patchkit's at-exit line(s) from a patched run's output (stderr is merged into the log)."""
    return EXIT_LINE.findall(log.read_text(encoding="utf-8", errors="replace")) if log.exists() else []


def collection_error(log: Path) -> str:
    """The exception that stopped pytest collecting a test file ("" if it collected): `E   ModuleNotFoundError: ...`."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    block = COLLECTING.search(text)
    if block is None:
        return ""
    errors = re.findall(r"^E {3}(.+)$", text[block.end():], re.M)
    return errors[-1].strip() if errors else "(no exception line in the log)"


def folder_of(family: str) -> str:
    """A family's folder under transformers' tests/models: a model_type spells words with hyphens
    (`modernbert-decoder`), transformers' folders and modules with underscores."""
    return family.replace("-", "_")


def run_family(family: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Plain, then patched, then (for changed tests) both once more; the family's comparison."""
    target = f"tests/models/{family}/test_modeling_{family}.py"
    if not (args.tests_dir / target).exists():
        return {"family": family, "error": f"{target} is not in {args.tests_dir}"}
    runs = {}
    results = {}
    probes = {}
    for mode in ("plain", "patched"):
        print(f"[{time.strftime('%H:%M:%S')}] {family}: {mode} run ...", flush=True)
        runs[mode] = run_pytest(args, [target], mode, out, f"{family}.{mode}", args.k)
        results[mode], probes[mode] = outcomes(runs[mode], target)
        print(f"    {family}: {len(results[mode])} tests, rc {runs[mode]['rc']}, {runs[mode]['seconds']} s"
              + (" (TIMED OUT)" if runs[mode]["timed_out"] else ""), flush=True)
    for mode in ("plain", "patched"):
        # a test file that does not import runs nothing in either mode, and "nothing changed" would say nothing
        error = collection_error(Path(runs[mode]["log"]))
        if error:
            where = "in both runs" if mode == "plain" else "in the patched run only"
            return {"family": family, "runs": runs,
                    "error": f"{target} did not import {where}: {error} (see {runs[mode]['log']})"}
    plain, patched = results["plain"], results["patched"]
    ids = sorted(set(plain) | set(patched))
    changed = [i for i in ids if plain.get(i, {}).get("outcome") != patched.get(i, {}).get("outcome")]
    confirm: dict[str, dict[str, dict[str, str]]] = {}
    if changed and args.confirm:
        print(f"    {family}: re-running {len(changed)} changed tests in both modes ...", flush=True)
        for mode in ("plain", "patched"):
            rerun = run_pytest(args, changed, mode, out, f"{family}.{mode}.rerun", "")
            confirm[mode], _ = outcomes(rerun, target)
    probe_patched = probes["patched"]
    rows = []
    for test_id in changed:
        before, after = plain.get(test_id, {}), patched.get(test_id, {})
        record = probe_patched.get(test_id, {})
        stable = None
        if confirm:
            stable = (confirm["plain"].get(test_id, {}).get("outcome") == before.get("outcome")
                      and confirm["patched"].get(test_id, {}).get("outcome") == after.get("outcome"))
        rows.append({
            "family": family, "id": test_id, "plain": before.get("outcome", "absent"),
            "patched": after.get("outcome", "absent"), "plain_message": before.get("message", ""),
            "patched_message": after.get("message", ""),
            "patchkit_frame": (after if after.get("outcome") == "failed" else before).get("patchkit_frame", ""),
            "patched_calls": record.get("patched_calls"),
            "stepped_aside": record.get("stepped_aside", {}), "warnings": record.get("warnings", []),
            "repeats_on_rerun": stable,
        })

    def count(res: dict[str, dict[str, str]], outcome: str) -> int:
        return sum(1 for r in res.values() if r["outcome"] == outcome)

    pass_to_fail = sum(1 for r in rows if r["plain"] == "passed" and r["patched"] == "failed")
    vacuous = sorted(i for i, r in patched.items() if r["outcome"] == "passed" and compared_patchkit_with_itself(
        i, probe_patched))
    fail_to_pass = sum(1 for r in rows if r["plain"] == "failed" and r["patched"] == "passed")
    return {
        "family": family,
        "tests": len(ids),
        "run_plain": len(plain) - count(plain, "skipped"),
        "passed_plain": count(plain, "passed"),
        "passed_patched": count(patched, "passed"),
        "pass_to_fail": pass_to_fail,
        "fail_to_pass": fail_to_pass,
        "other_changes": len(rows) - pass_to_fail - fail_to_pass,  # skipped or absent on one side
        "patched_attention_tests": sum(1 for r in probe_patched.values() if r.get("patched_calls")),
        "stepped_aside_tests": sum(1 for r in probe_patched.values() if r.get("stepped_aside")),
        "vacuous_comparisons": vacuous,
        "patched_calls": sum(r.get("patched_calls") or 0 for r in probe_patched.values()),
        "stepped_aside": merge_counts(r.get("stepped_aside", {}) for r in probe_patched.values()),
        "patchkit_warnings": sorted({w for r in probe_patched.values() for w in r.get("warnings", [])}),
        "exit_lines": exit_lines(Path(runs["patched"]["log"])),
        "runs": runs,
        "changed": rows,
    }


def compared_patchkit_with_itself(test_id: str, probe: dict[str, dict[str, Any]]) -> bool:
    """A test comparing two attention implementations whose patched run sent attention through the patch and
    stepped nothing aside: both sides ran patchkit, so its passing says nothing about patchkit's numbers."""
    record = probe.get(test_id, {})
    compares = COMPARES.search(test_id.rsplit("::", 1)[-1])
    return bool(compares and record.get("patched_calls") and not record.get("stepped_aside"))


def merge_counts(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Sum per-cause counts."""
    total: dict[str, int] = defaultdict(int)
    for d in dicts:
        for key, n in d.items():
            total[key] += n
    return dict(total)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    """--prepare assembles the tests tree; otherwise run the families and print the comparison."""
    venv_python = REPO / ".venv/bin/python"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests-dir", type=Path, help="the assembled tests tree (see --prepare)")
    parser.add_argument("--prepare", action="store_true", help="assemble --tests-dir, then stop")
    parser.add_argument("--mirror", type=Path, help="--prepare: a transformers checkout or bare mirror")
    parser.add_argument("--rev", default="HEAD", help="--prepare: the mirror's revision (default HEAD)")
    parser.add_argument("--sdist", type=Path, help="--prepare: a transformers sdist (default: pip download it)")
    parser.add_argument("--python", default=str(venv_python if venv_python.exists() else sys.executable),
                        help="the interpreter whose environment has transformers and patchkit (default: .venv)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), metavar="FAMILY", type=folder_of,
                        help=f"any folder name under transformers' tests/models, or a model_type (with --prepare: "
                             f"the folders to "
                             f"take from the mirror, added to the default); default: all of {' '.join(FAMILIES)}")
    parser.add_argument("-k", default=DEFAULT_K, help=f"pytest -k expression (default {DEFAULT_K!r}; '' for none)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (default 1800)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="families run at once, each pytest on one thread (default 1; 2 on 2 cores ran "
                             "the 51 families of 2026-11-29 in 28 minutes)")
    parser.add_argument("--no-confirm", dest="confirm", action="store_false",
                        help="do not re-run the changed tests to tell stable changes from flaky ones")
    parser.add_argument("--out", type=Path, help="results folder (default /tmp/hf_modeling_tests/<time>)")
    parser.add_argument("--report", type=Path, nargs="+", metavar="RESULTS_JSON",
                        help="print the report of earlier runs' results.json (several are merged), run nothing")
    args = parser.parse_args(argv)
    if args.report:
        print_report([f for path in args.report for f in json.loads(path.read_text())["families"]])
        return 0
    if args.tests_dir is None:
        parser.error("--tests-dir is required")
    args.tests_dir = args.tests_dir.resolve()
    if args.prepare:
        if args.mirror is None:
            parser.error("--prepare needs --mirror (a git checkout or bare mirror of transformers)")
        prepare(args.tests_dir, args.mirror.resolve(), args.rev, args.sdist, args.python,
                tuple(dict.fromkeys([*FAMILIES, *args.families])))
        return 0
    if not (args.tests_dir / "pytest.ini").exists():
        parser.error(f"{args.tests_dir} is not an assembled tests tree: run --prepare first")
    version, package = installed_transformers(args.python)
    link = args.tests_dir / "src/transformers"  # --prepare's link to the installed package, absolute
    if link.is_symlink() and link.resolve() != Path(package).resolve():
        # a tree assembled from another environment (a removed worktree's .venv): every test file would fail
        # to import, the same in both modes, and the comparison would report nothing changed
        parser.error(f"{link} points at {os.readlink(link)}, not at the transformers of {args.python} ({package}): "
                     f"run --prepare again with this --python, or relink it")
    out = (args.out or Path(tempfile.gettempdir()) / "hf_modeling_tests" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if REPO in out.parents or out == REPO:
        parser.error("--out must be outside the repository")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).resolve().parent / f"{PROBE}.py", out / f"{PROBE}.py")
    meta = {"transformers": version, "python": args.python, "tests_dir": str(args.tests_dir), "k": args.k,
            "families": args.families, "patched_env": PATCHED_ENV, "common_env": COMMON_ENV,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"transformers {version}; results in {out}", flush=True)
    done: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def run_one(family: str) -> None:
        result = run_family(family, args, out)
        with lock:  # after every family: a long run can be read while it goes on
            done[family] = result
            write_results([done[f] for f in args.families if f in done], out, meta)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(run_one, args.families))
    families = [done[f] for f in args.families]
    print_report(families)
    print(f"\nresults: {out / 'results.json'}, {out / 'summary.csv'}, {out / 'changed.csv'}; logs and junit XML "
          f"in {out}")
    shutil.rmtree(out / "__pycache__", ignore_errors=True)
    return 1 if any("error" in f for f in families) else 0


if __name__ == "__main__":
    sys.exit(main())
