"""`make gpu-truth`: a lent GPU's one budgeted run: flash-attn built beside the gpu tests, then the CUDA benchmarks.

A GPU machine is lent for minutes (15 of device time in all, at most 10 per command, no network), so everything a
session should learn there is one prepared command. This script:
  1. says what the machine is (GPU, driver, torch, CUDA, Python, transformers, flash-attn);
  2. installs the carried wheels (`--wheels`, default .gpu/: transformers and what it lacks there) into a target
     folder on PYTHONPATH, and patchkit itself (editable, no index, no build isolation);
  3. gets flash-attn: already importable, else a carried wheel (`--flash-wheel`), else it starts
     `tools/build_flash_attn.py` on the carried sdist in the background (sm_90 kernels for head dim 128 only:
     13 objects, one wave of nvcc jobs; head dims 64 and 128 took 6 minutes on 16 cores);
  4. meanwhile runs the parts that need no flash-attn (the `gpu` tests on torch_varlen and sdpa, memory at long N,
     static-cache decode, compiled steps), then, once flash-attn imports, the rest (the flash_attn `gpu` tests, the
     training and decode benchmark against HF flash_attention_2 and its padding-free rows, the family groups);
  5. writes under OUT ($OUT on the device, else gpu-truth-out/): summary.md (the table to paste into a note),
     log.txt (every part's output), truth.tar.gz (every CSV, plot and log, gathered in /tmp/gpu-truth-work) and
     the flash-attn wheel it built (about 11 MB: a later run carries it with --flash-wheel and skips the build).
Each part has a time budget (seconds) and is stopped at it; a part that does not fit in what is left of the whole
budget is not started and is listed as such. Without CUDA, or with --dry-run, it rehearses: the same parts in the
same order, each benchmark in its smallest CPU form, the build as `--dry-run` (the trim is checked on the real
sdist), the tests collected and skipped, the summary and archive written: what CI and a CPU session can check.

    python tools/gpu_truth.py --fetch          # here, once: the carried files into .gpu/ (git-ignored, ~23 MB)
    python tools/gpu_truth.py [--out DIR] [--budget-s 560] [--dry-run] [--only PART,...]

The device call: `run(command="make gpu-truth", carry=[".gpu"], timeout_s=600)`.
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
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from build_flash_attn import read_status  # noqa: E402
from gpu_truth_report import summary  # noqa: E402

PY = sys.executable
BENCH = ROOT / "benchmarks"
SITE = Path("/tmp/patchkit-site")  # the carried wheels' target folder, first on PYTHONPATH
FLASH_OUT = Path("/tmp/patchkit-flash-build")
WORK = Path("/tmp/gpu-truth-work")  # every part's CSVs, plots and logs; archived into OUT/truth.tar.gz
# the build's local version (+pk.sm90...) as it leaves the device and comes back: no '+' in a returned file's name
CARRIED = ("+pk.", "_pk.")
FLASH_ATTN = "2.8.3.post2"  # the sdist carried and built (tools/build_flash_attn.py knows its layout)
FLASH_IMPORTS = "import flash_attn, flash_attn_2_cuda; print(flash_attn.__version__)"
FLASH_BUILD = ["--head-dims", "128", "--disable", "dropout,alibi,uneven_k", "--jobs", "14", "--nvcc-threads", "1"]
RESERVE_S = 15  # kept back for the summary and the archive
GRACE_S = 10  # after a part's budget, SIGINT, then this long before SIGKILL
REHEARSAL_SLACK = 4  # a rehearsal part may take this many times its budget (2 shared cores, no GPU); no deadline
ENV_CODE = """
import json, platform, torch, transformers
import patchkit
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
cc = ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else ""
print(json.dumps(dict(gpu=gpu, cc=cc, torch=torch.__version__, cuda=torch.version.cuda,
                      python=platform.python_version(), transformers=transformers.__version__,
                      patchkit=patchkit.__version__)))
"""


@dataclass
class Part:
    """One step of the run: its command on the GPU, its smallest CPU form for the rehearsal, its time budget."""

    name: str
    budget: int
    cmd: list[str]
    rehearsal: list[str]
    needs_flash: bool = False  # waits for the flash-attn build (or runs without it once the build failed)
    status: str = "not run"
    seconds: float = 0.0
    result: str = ""
    outputs: list[str] = field(default_factory=list)


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` tests: only these are collected there, since a test module that imports what
    the GPU machine lacks (TRL, DeepSpeed) must not stop the collection."""
    return sorted(str(f) for f in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in f.read_text())


def pytest_cmd(select: str, junit: str) -> list[str]:
    """The `gpu` tests whose names match `select`."""
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", "-k", select,
            f"--junitxml={junit}", *gpu_test_files()]


def parts(work: Path) -> list[Part]:
    """The run, in order: what needs no flash-attn while it builds (the H100 built it in 3 min 23 s), then the
    comparisons with HF flash_attention_2, most telling first. Budgets are maxima; what does not fit is listed."""
    w = str(work)
    bench = [PY, str(BENCH / "bench.py"), "--device", "cuda"]
    rehearse_bench = [PY, str(BENCH / "bench.py"), "--smoke", "--device", "cpu"]
    static = [PY, str(BENCH / "static_decode.py")]
    return [
        Part("gpu tests, torch_varlen and sdpa", 100, pytest_cmd("not flash_attn", f"{w}/tests_varlen.xml"),
             pytest_cmd("not flash_attn", f"{w}/tests_varlen.xml")),
        Part("static-cache decode", 75,
             static + ["--device", "cuda", "--reps", "3", "--new-tokens", "32", "--budget-s", "50",
                       "--csv", f"{w}/static_decode.csv"],
             static + ["--reps", "1", "--scale", "0.1", "--new-tokens", "4", "--compile-backend", "eager",
                       "--csv", f"{w}/static_decode.csv"]),
        Part("compiled training step", 80,
             [PY, str(BENCH / "compiled.py"), "--device", "cuda", "--reps", "3", "--budget-s", "60",
              "--csv", f"{w}/compiled.csv"],
             [PY, str(BENCH / "compiled.py"), "--reps", "1", "--scale", "0.1", "--backend", "eager",
              "--csv", f"{w}/compiled.csv"]),
        Part("gpu tests, flash_attn", 60, pytest_cmd("flash_attn", f"{w}/tests_flash.xml"),
             pytest_cmd("flash_attn", f"{w}/tests_flash.xml"), needs_flash=True),
        Part("train step vs HF flash_attention_2", 90,
             bench + ["--parts", "train", "--out", f"{w}/train", "--no-plots"],
             rehearse_bench + ["--parts", "train", "--out", f"{w}/train", "--no-plots"], needs_flash=True),
        Part("padding sweep vs HF flash_attention_2", 90,
             bench + ["--parts", "pad", "--out", f"{w}/pad"],
             rehearse_bench + ["--parts", "pad", "--out", f"{w}/pad"], needs_flash=True),
        Part("decode vs HF flash_attention_2", 45,
             [PY, str(BENCH / "decode.py"), "--device", "cuda", "--reps", "3", "--new-tokens", "32",
              "--csv", f"{w}/decode.csv"],
             [PY, str(BENCH / "decode.py"), "--reps", "1", "--scale", "0.1", "--new-tokens", "4",
              "--csv", f"{w}/decode.csv"], needs_flash=True),
        Part("family groups", 70,
             [PY, str(BENCH / "families.py"), "--device", "cuda", "--reps", "3", "--budget-s", "50", "--families",
              "llama", "mistral", "qwen3_moe", "qwen2_vl", "gpt_bigcode", "llama4_text", "gpt_oss",
              "--csv", f"{w}/families.csv"],
             [PY, str(BENCH / "families.py"), "--reps", "1", "--scale", "0.1", "--families", "llama",
              "--csv", f"{w}/families.csv"], needs_flash=True),
        Part("memory at N = 8192, 16384", 60,
             bench + ["--parts", "mem", "--mem-lengths", "8192,16384", "--out", f"{w}/mem", "--mem-cap-gib", "60"],
             rehearse_bench + ["--parts", "mem", "--out", f"{w}/mem"], needs_flash=True),
    ]


def run(cmd: list[str], budget: float, log: Path, env: dict[str, str]) -> tuple[Optional[int], float]:
    """Run `cmd` (its own process group, output to `log`) for at most `budget` s; (exit status or None, seconds)."""
    t0 = time.time()
    with log.open("ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=max(1.0, budget))
        except subprocess.TimeoutExpired:  # SIGINT first: a benchmark's `finally` writes the rows it measured
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    return code, time.time() - t0


def last_line(log: Path, pattern: str = r".") -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(pattern, ln)]
    return lines[-1].strip()[:200] if lines else ""


class Flash:
    """flash-attn for the parts that need it: importable, a carried wheel, or a build in the background."""

    def __init__(self, env: dict[str, str], rehearse: bool, log: Path) -> None:
        self.env, self.rehearse, self.log = env, rehearse, log
        self.version = self.imports()
        self.state = f"flash-attn {self.version} already installed" if self.version else "not installed"
        self.building = False
        self.wheel: Optional[Path] = None

    def imports(self) -> Optional[str]:
        proc = subprocess.run([PY, "-c", FLASH_IMPORTS], capture_output=True, text=True, env=self.env)
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    def install(self, wheel: Path) -> None:
        if CARRIED[1] in wheel.name:  # as it came back from a run: its local version's '+' restored
            named = Path("/tmp") / wheel.name.replace(CARRIED[1], CARRIED[0], 1)
            shutil.copy2(wheel, named)
            wheel = named
        pip = [PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
        code, _ = run(pip, 120, self.log, self.env)
        self.version = self.imports() if code == 0 else None
        self.state = f"flash-attn {self.version} from {wheel.name}" if self.version else f"{wheel.name} did not install"

    def start(self, sdist: Optional[Path], wheel: Optional[Path]) -> None:
        if self.version:
            return
        if wheel is not None and not self.rehearse:
            self.install(wheel)
            return
        if sdist is None:
            self.state = "no flash-attn: no wheel or sdist carried (see --sdist, --flash-wheel)"
            return
        cmd = [PY, str(ROOT / "tools" / "build_flash_attn.py"), "--sdist", str(sdist), "--out", str(FLASH_OUT),
               *FLASH_BUILD]
        if self.rehearse:
            code, _ = run([*cmd, "--archs", "90", "--dry-run"], 120, self.log, self.env)
            self.state = f"build rehearsed (--dry-run, exit {code})"
            return
        code, _ = run([*cmd, "--background"], 60, self.log, self.env)
        self.building = code == 0
        self.state = "building" if self.building else f"build did not start (exit {code})"

    def wait(self, until: float) -> None:
        """Until the background build is done, failed, or the clock reaches `until` (the status is read at least
        once, so `until` = now asks whether it is done); then install its wheel."""
        t0 = time.time()
        while self.building:
            status = read_status(FLASH_OUT) or {}
            if status.get("state") == "done" and status.get("wheel"):
                self.building = False
                self.install(Path(status["wheel"]))
                self.wheel = Path(status["wheel"])  # brought back beside the summary: a later run carries it
                self.state += f" (built in {status.get('started', '?')} .. {status.get('finished', '?')})"
            elif status.get("state") == "failed":
                self.building = False
                self.state = f"build failed: {str(status.get('error', '?'))[:160]}"
            elif time.time() < until:
                time.sleep(5)
            else:
                break
        if self.building:
            self.state = f"build not done after waiting {time.time() - t0:.0f} s"


def setup_env(wheels: Path, rehearse: bool, log: Path) -> tuple[dict[str, str], str]:
    """The environment every part runs in: carried wheels first on PYTHONPATH, patchkit installed editable."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error")
    env.pop("PATCHKIT_FLASH_ATTN", None)
    found = sorted(w for w in wheels.glob("*.whl") if not w.name.startswith("flash_attn-")) if wheels.is_dir() else []
    said = []
    if found and not rehearse:
        code, _ = run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                       "--target", str(SITE), *map(str, found)], 180, log, env)
        said.append(f"{len(found)} carried wheels ({'installed' if code == 0 else f'pip exit {code}'})")
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    elif found:
        said.append(f"{len(found)} carried wheels: {', '.join(w.name.split('-')[0] for w in found)} (not installed)")
    probe = subprocess.run([PY, "-c", "import patchkit.patches"], capture_output=True, env=env, cwd="/")
    if probe.returncode != 0 and not rehearse:
        code, _ = run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e",
                       str(ROOT)], 180, log, env)
        said.append(f"patchkit installed editable (exit {code})")
    return env, "; ".join(said) or "nothing to install"


def describe(env: dict[str, str]) -> dict[str, str]:
    proc = subprocess.run([PY, "-c", ENV_CODE], capture_output=True, text=True, env=env)
    try:
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if facts.get("gpu") != "none" else None
    if smi is not None and smi.returncode == 0:
        facts["nvidia-smi"] = smi.stdout.strip()
    return facts


def fetch(into: Path) -> int:
    """Download what the GPU machine lacks into `into`: transformers at the pinned version and regex as Python 3.12
    x86-64 wheels (its image has transformers 5.17), and flash-attn's sdist (PyPI has no wheel of it)."""
    into.mkdir(parents=True, exist_ok=True)
    pinned = re.search(r"^TRANSFORMERS \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    wheels = [pinned.group(1) if pinned else "transformers", "regex"]
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                 for a in ("--platform", p)]
    code = subprocess.call([PY, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                            "3.12", "--implementation", "cp", *platforms, "-d", str(into), *wheels])
    if code == 0 and not list(into.glob(f"flash_attn-{FLASH_ATTN}.tar.gz")):
        from urllib.request import urlopen  # pip download of this sdist runs its setup.py, which needs CUDA

        page = urlopen("https://pypi.org/simple/flash-attn/", timeout=60).read().decode()
        link = re.search(rf'href="(https://[^"#]*flash_attn-{re.escape(FLASH_ATTN)}\.tar\.gz)', page)
        if link is None:
            print(f"fetch: flash_attn-{FLASH_ATTN}.tar.gz is not on PyPI's index page")
            return 1
        (into / f"flash_attn-{FLASH_ATTN}.tar.gz").write_bytes(urlopen(link.group(1), timeout=300).read())
    print(f"fetch: {code == 0 and 'ok' or 'pip failed'}: " + ", ".join(sorted(f.name for f in into.iterdir())))
    return code


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-truth-out"))
    ap.add_argument("--budget-s", type=float, default=560, help="the whole run's wall-clock budget")
    ap.add_argument("--dry-run", action="store_true", help="rehearse on this machine (the default without CUDA)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu", help="carried wheels to install first")
    ap.add_argument("--sdist", type=Path, default=None, help="flash-attn sdist (default: the one in --wheels)")
    ap.add_argument("--flash-wheel", type=Path, default=None, help="a flash-attn wheel to install instead of a build")
    ap.add_argument("--only", default="", help="comma-separated words; run only the parts whose name has one")
    ap.add_argument("--fetch", action="store_true", help="download the carried files into --wheels, then exit")
    args = ap.parse_args(argv)
    if args.fetch:
        return fetch(args.wheels)
    t0 = time.time()
    deadline = t0 + args.budget_s - RESERVE_S
    out, work = args.out.resolve(), WORK  # OUT holds the three files (the device returns at most 8 files)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    log.write_text("")
    cuda = subprocess.run([PY, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
    rehearse = args.dry_run or cuda.returncode != 0
    if rehearse:
        print("gpu-truth: rehearsal (" + ("--dry-run" if args.dry_run else "no CUDA device here") + "): the GPU run's "
              "parts in their smallest CPU form", flush=True)
    env, setup = setup_env(args.wheels, rehearse, log)
    facts = describe(env)
    print(f"gpu-truth: {json.dumps(facts)}; {setup}", flush=True)
    sdist = args.sdist or next(iter(sorted(args.wheels.glob("flash_attn-*.tar.gz"))), None)
    flash = Flash(env, rehearse, log)
    flash.start(sdist, args.flash_wheel or next(iter(sorted(args.wheels.glob("flash_attn-*.whl"))), None))
    print(f"gpu-truth: flash-attn: {flash.state}", flush=True)
    steps = parts(work)
    words = [w for w in args.only.split(",") if w]
    for part in steps:
        if words and not any(w in part.name for w in words):
            part.status = "left out (--only)"
            continue
        if part.needs_flash and flash.building:
            flash.wait(deadline - part.budget)
            print(f"gpu-truth: flash-attn: {flash.state} ({time.time() - t0:.0f} s)", flush=True)
        left = deadline - time.time() if not rehearse else REHEARSAL_SLACK * part.budget
        if left < min(part.budget, 30):
            part.status = f"not run (budget: {left:.0f} s left)"
            continue
        part_log = work / (re.sub(r"\W+", "_", part.name).strip("_") + ".log")
        budget = REHEARSAL_SLACK * part.budget if rehearse else min(part.budget, left)
        code, part.seconds = run(part.rehearsal if rehearse else part.cmd, budget, part_log, env)
        part.status = "ok" if code == 0 else "stopped at its budget" if code is None else f"exit {code}"
        part.result = last_line(part_log, r"passed|failed|skipped|wrote|rows|error|Error") or last_line(part_log)
        with log.open("a") as f:
            f.write(f"\n===== {part.name}: {part.status}, {part.seconds:.0f} s\n{part_log.read_text(errors='replace')}")
        print(f"gpu-truth: {part.name}: {part.status} in {part.seconds:.0f} s: {part.result}", flush=True)
    if flash.building:
        flash.wait(time.time())
    target = summary(out, work, facts, flash, steps, setup, rehearse, time.time() - t0)
    if (FLASH_OUT / "build.log").exists():
        (work / "flash_build.log").write_text((FLASH_OUT / "build.log").read_text(errors="replace")[-200_000:])
    if flash.wheel is not None and flash.version:  # the device returns no file named with '+': carried as '_'
        shutil.copy2(flash.wheel, out / flash.wheel.name.replace(CARRIED[0], CARRIED[1], 1))
    with tarfile.open(out / "truth.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="gpu-truth")
    ran = [p for p in steps if p.status != "left out (--only)"]
    bad = [p for p in ran if p.status != "ok"]
    print(f"gpu-truth: {len(ran) - len(bad)} of {len(ran)} parts ok in {time.time() - t0:.0f} s; {target}", flush=True)
    return 1 if any(p.status.startswith("exit") for p in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
