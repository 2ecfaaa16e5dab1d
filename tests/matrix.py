"""Run patchkit's core tests under every era of the transformers range it supports.

    python tests/matrix.py [--versions 4.48.3,5.0.0] [--tests PATH ...] [--cache-dir DIR] [-- PYTEST ARGS]

Each version is installed once, with those of its dependencies the interpreter's environment lacks or has at
another release (tokenizers, huggingface_hub, ...: pip resolves against that environment), into
`<cache-dir>/<version>` by `pip install --target` and put first on PYTHONPATH over the running interpreter,
which provides torch and pytest. transformers does not depend on torch, so pip never pulls one; if a torch
ever lands in a target dir it is deleted, so every version runs against the same torch. The version the
running interpreter already has is run from the interpreter itself (no install). A summary table is printed
at the end; the exit status is non-zero if any version failed to install, failed a test, or ran no test.
Run by `make matrix`, never by the default `pytest` run (this file is not a test module).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from matrix_plan import (  # noqa: E402  (tests/ is this script's directory, first on sys.path)
    DEFAULT_TESTS,
    ROTATING,
    default_versions,
    era_extras,
    rotating_minor,
    tests_for,
    workers_for,
)

from patchkit.eras import ERAS  # noqa: E402  (the era table only; tests run in child processes)

MARKER = ".patchkit-matrix-installed"
FORBIDDEN = ("torch", "nvidia", "triton")  # must come from the running interpreter, never from a target dir


@dataclasses.dataclass
class Result:
    version: str
    source: str = ""
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problem: str = ""
    log: Optional[Path] = None

    @property
    def ok(self) -> bool:
        return not self.problem and self.failed == 0 and self.errors == 0 and self.passed > 0


HYPOTHESIS_ENV, ERA_EXAMPLES = "PATCHKIT_HYPOTHESIS_EXAMPLES", "50"  # tests/conftest.py: 200 in make test
NEWEST = "newest"  # --versions newest: the newest transformers release the package index has now
# patchkit/hooks/decide/self_check.py: a newer release verified, no self-check
TESTED_ENV = "PATCHKIT_TESTED_TRANSFORMERS"


def newest_release(python: str) -> tuple[Optional[str], str]:
    """(the newest transformers release on the package index, problem) by `pip index versions`."""
    cmd = [python, "-m", "pip", "index", "versions", "transformers", "--disable-pip-version-check"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    first = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode != 0 or "(" not in first:
        return None, f"could not ask the package index for transformers' releases: {proc.stderr.strip()[-200:]}"
    return first.split("(", 1)[1].split(")", 1)[0], ""


def current_transformers() -> Optional[str]:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def remove_forbidden(target: Path) -> list[str]:
    """Delete any torch (or its CUDA companions) pip put into a target dir; return what was removed."""
    removed = []
    for entry in sorted(target.iterdir()):
        base = entry.name.split("-")[0].lower()
        if base in FORBIDDEN or any(base.startswith(f"{name}_") for name in ("nvidia",)):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
    return removed


DATASETS_STUB = '''"""Stand-in for `datasets` where its era's huggingface_hub cannot import a real one (old eras).

transformers' Trainer imports datasets when it is installed and only tests isinstance against these classes; the
tests hand it lists.
"""

__version__ = "0.0.0"


class Dataset:
    pass


class IterableDataset:
    pass
'''


KERNELS_STUB = '''"""Stand-in for `kernels` where its era's huggingface_hub cannot import the venv's (0.19: hub 1.32+).

The venv has `kernels` because the pinned transformers (5.25) requires it. transformers 4.53 imports `get_kernel`
unguarded wherever `kernels` is installed, and falls back to its own stubs where the other names fail to import, as
without `kernels`.
"""


def get_kernel(*args, **kwargs):
    raise RuntimeError("kernels is a stand-in in this matrix version's target dir")
'''


def loadable(target: Path, python: str, module: str, stub: str) -> bool:
    """Whether `import module` works beside this target dir's huggingface_hub; if not, a stand-in replaces it."""
    env = dict(os.environ, PYTHONPATH=str(target), PYTHONNOUSERSITE="1")
    if subprocess.run([python, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0:
        return True
    for entry in target.glob(f"{module}*"):
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    (target / module).mkdir()
    (target / module / "__init__.py").write_text(stub)
    return False


def pip_install(python: str, log: Path, *args: str) -> int:
    """`pip install -q ARGS`, quietly and without asking, its output appended to `log`; its exit status."""
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input", *args]
    with open(log, "a") as fh:
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode


def resolve(version: str, python: str, log: Path) -> list[str]:
    """The pins of what transformers==version needs that the interpreter's environment lacks (itself, its tokenizers
    and huggingface_hub, what else differs), resolved by pip against that environment; [] where pip cannot say.

    `pip install --target` resolves as if nothing were installed: every version took its own numpy, requests, regex,
    ... (about 215 MB and 34 CPU-seconds a version, 13 versions beside the first versions' tests on 2 cores), the same
    releases the environment has. Only what differs goes into the target, which shadows the environment."""
    report = log.with_suffix(".json")
    failed = pip_install(python, log, "--dry-run", "--report", str(report), f"transformers=={version}")
    if failed or not report.exists():
        return []  # the full install below says what is wrong
    items = json.loads(report.read_text()).get("install", [])
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    return pins if any(p.lower() == f"transformers=={version}" for p in pins) else []


def install(version: str, cache: Path, python: str) -> tuple[Optional[Path], str]:
    """Install transformers==version with its dependencies into cache/version (once). Returns (dir, problem)."""
    target = cache / version
    if (target / MARKER).exists():
        return target, ""
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=cache))
    log = cache / f"install-{version}.log"
    log.write_text("")  # this install's output alone
    pins = resolve(version, python, log)
    status = pip_install(python, log, "--target", str(staging),
                         *(["--no-deps", *pins] if pins else [f"transformers=={version}"]))
    missing = unavailable(log) if status else []
    if missing and not any(m.lower() == "transformers" for m in missing):
        # a dependency this machine's index lacks (5.25 requires `kernels` >=0.19.1, hub kernels for CUDA): the
        # release alone, over the environment's other dependencies, said aloud; its tests say whether it runs
        print(f"[matrix] {version}: the package index has no {', '.join(missing)} it requires: installed without "
              "(--no-deps), over the environment's other dependencies; its tests run with USE_HUB_KERNELS=NO "
              "(5.25's from_pretrained kernelizes by default and refuses without `kernels`)")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        status = pip_install(python, log, "--no-deps", "--target", str(staging), f"transformers=={version}")
        (staging / WITHOUT_DEPS).write_text(" ".join(missing) + "\n")
    if status:
        shutil.rmtree(staging, ignore_errors=True)
        return None, f"pip install failed (exit {status}); see {log}"
    extras = era_extras(version)
    if extras:
        status = pip_install(python, log, "--no-deps", "--target", str(staging), *extras)
        if status:
            shutil.rmtree(staging, ignore_errors=True)
            return None, f"pip install of {' '.join(extras)} failed (exit {status}); see {log}"
    if extras and not loadable(staging, python, "datasets", DATASETS_STUB):
        print(f"[matrix] {version}: its huggingface_hub cannot import datasets; a stand-in takes its place")
    if importlib.util.find_spec("kernels") is not None and not loadable(staging, python, "kernels", KERNELS_STUB):
        print(f"[matrix] {version}: its huggingface_hub cannot import the venv's kernels; a stand-in takes its place")
    removed = remove_forbidden(staging)
    if removed:
        print(f"[matrix] {version}: removed {', '.join(removed)} from the target dir (torch comes from the venv)")
    (staging / MARKER).write_text(f"transformers=={version}\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target, ""


WITHOUT_DEPS = ".patchkit-without-deps"  # in a target dir: the requirements the index lacked, installed without


def unavailable(log: Path) -> list[str]:
    """The requirements pip found no distribution for, from an install's log."""
    return sorted(set(re.findall(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", log.read_text())))


def environment(target: Optional[Path], trusted: Optional[str] = None) -> dict[str, str]:
    env = dict(os.environ)
    if trusted:
        env[TESTED_ENV] = trusted  # the newest release under test runs as tested (its self-check has tests of its own)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
        if (target / WITHOUT_DEPS).exists():  # installed without `kernels`: transformers' hub kernels off
            env["USE_HUB_KERNELS"] = "NO"
    env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.setdefault(HYPOTHESIS_ENV, ERA_EXAMPLES)  # each era draws a quarter of the pinned version's property cases
    return env


# Read from the packages' metadata and import specs, which a child finds on its sys.path in the order an import searches
# it: importing them to ask took about 4 s a version (13 versions: a minute of CI), and a version that does not import
# fails its pytest run anyway.
PROBE = """import importlib.metadata as m, importlib.util as u, os
d = m.distribution("transformers")
beside = os.path.samefile(d.locate_file("transformers/__init__.py"), u.find_spec("transformers").origin)
print(d.version if beside else "(a module whose metadata is elsewhere)")
print(m.version("torch"), u.find_spec("torch").origin)"""


def probe(python: str, env: dict[str, str]) -> tuple[str, str]:
    """The transformers version a child process would import, and its torch (version and file)."""
    proc = subprocess.run([python, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return "", proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    lines = proc.stdout.strip().splitlines()
    return lines[0], lines[1]


def count_junit(path: Path, result: Result) -> None:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        tests = int(suite.get("tests", 0))
        result.failed += int(suite.get("failures", 0))
        result.errors += int(suite.get("errors", 0))
        result.skipped += int(suite.get("skipped", 0))
        result.passed += tests - int(suite.get("failures", 0)) - int(suite.get("errors", 0)) - int(
            suite.get("skipped", 0)
        )


def run_version(version: str, target: Optional[Path], args: argparse.Namespace, logs: Path) -> Result:
    result = Result(version, source="interpreter" if target is None else str(target))
    env = environment(target, version if args.newest == version else None)
    found, torch_info = probe(args.python, env)
    if found != version:
        result.problem = f"imports transformers {found or '(failed: ' + torch_info + ')'}, expected {version}"
        return result
    junit = logs / f"junit-{version}.xml"
    result.log = logs / f"pytest-{version}.log"
    tests = tests_for(version, args.tests)
    cmd = [args.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *tests, *args.pytest_args, *workers_for(version, args.tests)]
    start = time.monotonic()
    with open(result.log, "w") as fh:
        fh.write(f"# transformers {found}; torch {torch_info}\n# {' '.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            result.problem = f"timed out after {args.timeout}s"
            proc = None
    result.seconds = time.monotonic() - start
    if junit.exists():
        count_junit(junit, result)
    if proc is not None and proc.returncode not in (0, 1) and not result.problem:
        result.problem = f"pytest exit {proc.returncode}"  # 2: interrupted/collection error, 5: no tests
    return result


def era_of(version: str) -> str:
    """The LLaMA patch's era (patchkit/eras) that serves `version`, as the summary names it."""
    return next((f"era {e.name}" for e in ERAS if version in e), "outside every era")


def print_table(results: list[Result]) -> None:
    rows = [("transformers", "llama2 patch", "passed", "failed", "skipped", "seconds", "status")]
    for r in results:
        status = "ok" if r.ok else (r.problem or "FAILED")
        rows.append((r.version, era_of(r.version), str(r.passed), str(r.failed + r.errors), str(r.skipped),
                     f"{r.seconds:.1f}", status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i in (0, 1, 6) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", help="comma-separated transformers versions, `newest` or `rotating` (default: "
                                           "one per era boundary and today's minor between them)")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="test paths, relative to the repo")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".matrix", help="install cache (default .matrix/)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch and pytest")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per version's test run")
    parser.add_argument("--install-jobs", type=int, default=2, help="parallel pip installs")
    parser.add_argument("--reinstall", action="store_true", help="ignore cached installs")
    args = parser.parse_args(argv)
    args.minor = None  # the rotating minor the default versions took (decided once, so a run over midnight agrees)
    if args.versions is None:
        today = datetime.datetime.now(datetime.timezone.utc).date()
        args.minor, args.versions = rotating_minor(today), ",".join(default_versions(today))
    # "rotating": every minor that CI runs one a day of (a change that passes today's may fail tomorrow's)
    args.versions = [w for v in args.versions.split(",") if v.strip()
                     for w in (ROTATING if v.strip() == "rotating" else [v.strip()])]
    args.newest = None
    args.pytest_args = extra
    args.cache_dir = args.cache_dir.resolve()
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.reinstall:
        for version in args.versions:
            shutil.rmtree(args.cache_dir / version, ignore_errors=True)
    here = current_transformers() if args.python == sys.executable else None
    if NEWEST in args.versions:
        newest, problem = newest_release(args.python)
        if newest is None:
            print(f"[matrix] newest: FAILED {problem}")
            return 1
        print(f"[matrix] newest: the package index's newest transformers is {newest}", flush=True)
        if newest == here:
            print(f"[matrix] newest: {newest} is the pinned version, which make test and test-heavy ran whole: "
                  "nothing more to run")
            args.versions = [v for v in args.versions if v != NEWEST]
            if not args.versions:
                return 0
        else:
            args.versions = [newest if v == NEWEST else v for v in args.versions]
            args.newest = newest
    to_install = [v for v in args.versions if v != here]
    logs = args.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[matrix] versions: {', '.join(args.versions)}; cache {args.cache_dir}")
    if args.minor is not None:
        print(f"[matrix] today's minor between the boundaries: {args.minor} (one of {len(ROTATING)} in turn, "
              "tests/matrix_plan.py ROTATING; --versions X runs any)")
    targets: dict[str, tuple[Optional[Path], str]] = {v: (None, "") for v in args.versions if v == here}
    with ThreadPoolExecutor(max(1, args.install_jobs)) as pool:
        futures = {v: pool.submit(install, v, args.cache_dir, args.python) for v in to_install}
        results = []
        for version in args.versions:  # test each version as soon as its install is done
            target, problem = futures[version].result() if version in futures else targets[version]
            if problem:
                result = Result(version, problem=problem)
            else:
                print(f"[matrix] {version}: running its tests ...", flush=True)
                result = run_version(version, target, args, logs)
            status = "ok" if result.ok else f"FAILED {result.problem}".strip()
            print(f"[matrix] {version}: {result.passed} passed, {result.failed + result.errors} failed, "
                  f"{result.skipped} skipped in {result.seconds:.1f}s: {status}"
                  + (f" (log {result.log})" if result.log and not result.ok else ""), flush=True)
            results.append(result)
    print_table(results)
    bad = [r.version for r in results if not r.ok]
    if args.newest:
        print(f"\n[matrix] the newest release, transformers {args.newest}: "
              + ("FAILED" if args.newest in bad else "passed; move the Makefile's pin and "
                 "patchkit/hooks/decide/self_check.py's TESTED_TRANSFORMERS to it"))
    if bad:
        print(f"\n[matrix] FAILED on: {', '.join(bad)} (logs in {logs})")
        return 1
    print(f"\n[matrix] all {len(results)} versions passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
