"""`make gpu-truth`: a lent GPU's one budgeted run: flash-attn built beside the gpu tests, then the CUDA benchmarks.

What each call does, in which order and within which limits: docs/testing.md ("The lent GPU's run"). Without CUDA,
or with --dry-run, it rehearses the same parts in their smallest CPU form (what CI and a CPU session can check).

    python tools/gpu_truth.py --fetch          # here, once: .gpu1/ and .gpu/ (git-ignored); prints the two calls
    python tools/gpu_truth.py --stage 1        # call 1 on the device
    python tools/gpu_truth.py [--out DIR] [--budget-s 560] [--dry-run] [--only PART,...]     # call 2

The device calls: `run(command="make gpu-truth-stage1", carry=[".gpu1"], timeout_s=120)`, then within 30 s
`run(command="make gpu-truth", carry=[".gpu"], timeout_s=600)` (alone it runs everything but flash-attn 4).
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
import gpu_carry  # noqa: E402
from build_flash_attn import pid_alive, read_status  # noqa: E402
from gpu_truth_report import summary  # noqa: E402

PY = sys.executable
BENCH = ROOT / "benchmarks"
SITE = Path("/tmp/patchkit-site")  # the carried wheels' target folder, first on PYTHONPATH
FLASH_OUT = Path("/tmp/patchkit-flash-build")
FA4_CACHE = Path("/tmp/patchkit-fa4-cache")  # flash-attn 4's compiled kernels, shared by every part's processes
WORK = Path("/tmp/gpu-truth-work")  # every part's CSVs, plots and logs; archived into OUT/truth.tar.gz
# the build's local version (+pk.sm90...) as it leaves the device and comes back: no '+' in a returned file's name
CARRIED = ("+pk.", "_pk.")
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
from patchkit.gates import probe_flash_attn_4
v4, why4 = probe_flash_attn_4(torch.cuda.is_available())  # imports flash_attn.cute on a GPU
print(json.dumps(dict(gpu=gpu, cc=cc, torch=torch.__version__, cuda=torch.version.cuda,
                      python=platform.python_version(), transformers=transformers.__version__,
                      patchkit=patchkit.__version__, flash_attn_4=why4 or v4 or "not installed")))
"""


@dataclass
class Part:
    """One step of the run: its command on the GPU, its smallest CPU form for the rehearsal, its time budget."""

    name: str
    budget: int
    cmd: list[str]
    rehearsal: list[str]
    needs_flash: bool = False  # waits for the flash-attn build (or runs without it once the build failed)
    timed: bool = False  # times something: waits for the build too, which holds 14 cores while it runs
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
    """The run, in order: what times nothing while flash-attn 2 builds (the H100 built it in 3 min 23 s; call 1
    starts it), then, the build done, the comparisons with HF flash_attention_2 and _4, most telling first. Budgets
    are maxima; what does not fit is listed."""
    w = str(work)
    bench = [PY, str(BENCH / "bench.py"), "--device", "cuda"]
    rehearse_bench = [PY, str(BENCH / "bench.py"), "--smoke", "--device", "cpu"]
    static = [PY, str(BENCH / "static_decode.py")]
    flash2 = "flash_attn and not flash_attn_4 and not flash_attn4"  # the test names: flash_attn4_contract's module
    return [
        Part("gpu tests, torch_varlen and sdpa", 100, pytest_cmd("not flash_attn", f"{w}/tests_varlen.xml"),
             pytest_cmd("not flash_attn", f"{w}/tests_varlen.xml")),
        # 7 tests whose first calls compile flash-attn 4's kernels (MHA, GQA, window, softcap, sinks; forward and
        # backward) into FA4_CACHE, which the timed parts then find compiled; all while flash-attn 2 builds
        Part("gpu tests, flash-attn 4", 120, pytest_cmd("flash_attn_4 or flash_attn4", f"{w}/tests_flash4.xml"),
             pytest_cmd("flash_attn_4 or flash_attn4", f"{w}/tests_flash4.xml")),
        Part("gpu tests, flash_attn", 60, pytest_cmd(flash2, f"{w}/tests_flash.xml"),
             pytest_cmd(flash2, f"{w}/tests_flash.xml"), needs_flash=True),
        Part("train step vs HF flash_attention_2 and _4", 120,
             bench + ["--parts", "train", "--out", f"{w}/train", "--no-plots"],
             rehearse_bench + ["--parts", "train", "--out", f"{w}/train", "--no-plots"], needs_flash=True, timed=True),
        Part("padding sweep vs HF flash_attention_2 and _4", 100,
             bench + ["--parts", "pad", "--out", f"{w}/pad"],
             rehearse_bench + ["--parts", "pad", "--out", f"{w}/pad"], needs_flash=True, timed=True),
        Part("decode vs HF flash_attention_2 and _4", 50,
             [PY, str(BENCH / "decode.py"), "--device", "cuda", "--reps", "3", "--new-tokens", "32",
              "--csv", f"{w}/decode.csv"],
             [PY, str(BENCH / "decode.py"), "--reps", "1", "--scale", "0.1", "--new-tokens", "4",
              "--csv", f"{w}/decode.csv"], needs_flash=True, timed=True),
        # the LM head and loss at 32k-262k vocabularies (bench.py's CUDA layers), patchkit with its logits and with
        # the loss alone (unpad="loss") against HF sdpa, flash_attention_2 and _4: speed and peak memory
        Part("LM head and loss at large vocabularies", 70,
             [PY, str(BENCH / "vocab.py"), "--device", "cuda", "--reps", "3", "--layouts", "right", "packed",
              "--budget-s", "55", "--csv", f"{w}/vocab.csv"],
             [PY, str(BENCH / "vocab.py"), "--vocabs", "512", "--layouts", "right", "--reps", "1", "--no-memory",
              "--scale", "0.1", "--csv", f"{w}/vocab.csv"], needs_flash=True, timed=True),
        Part("family groups", 70,
             # the families the last run's budget cut first (GPT-OSS's goal against HF's best among them), then
             # the ones it measured: a budget spent drops the last
             [PY, str(BENCH / "families.py"), "--device", "cuda", "--reps", "3", "--budget-s", "50", "--families",
              "gpt_oss", "llama4_text", "gpt_bigcode", "qwen2_vl", "llama", "mistral", "qwen3_moe",
              "--csv", f"{w}/families.csv"],
             [PY, str(BENCH / "families.py"), "--reps", "1", "--scale", "0.1", "--families", "llama",
              "--csv", f"{w}/families.csv"], needs_flash=True, timed=True),
        Part("static-cache decode", 75,
             static + ["--device", "cuda", "--reps", "3", "--new-tokens", "32", "--budget-s", "50",
                       "--csv", f"{w}/static_decode.csv"],
             static + ["--reps", "1", "--scale", "0.1", "--new-tokens", "4", "--compile-backend", "eager",
                       "--csv", f"{w}/static_decode.csv"], timed=True),
        Part("compiled training step", 80,
             [PY, str(BENCH / "compiled.py"), "--device", "cuda", "--reps", "3", "--budget-s", "60",
              "--csv", f"{w}/compiled.csv"],
             [PY, str(BENCH / "compiled.py"), "--reps", "1", "--scale", "0.1", "--backend", "eager",
              "--csv", f"{w}/compiled.csv"], timed=True),
        Part("memory at N = 8192, 16384", 60,
             bench + ["--parts", "mem", "--mem-lengths", "8192,16384", "--out", f"{w}/mem", "--mem-cap-gib", "60"],
             rehearse_bench + ["--parts", "mem", "--out", f"{w}/mem"], needs_flash=True, timed=True),
        # the fused head and loss apart from the model: gradients written in the forward (a float32 weight gradient,
        # its matmul in float32) against computed again in the backward (bfloat16 matmuls), at a 1B model's head
        Part("fused head and loss: held against recomputed", 30,
             [PY, str(BENCH / "fused_loss.py"), "--device", "cuda", "--vocabs", "128256", "--dtypes", "bfloat16",
              "float32", "--rows", "8192", "--hidden", "2048", "--reps", "3", "--csv", f"{w}/fused_loss.csv"],
             [PY, str(BENCH / "fused_loss.py"), "--vocabs", "512", "--rows", "64", "--hidden", "16", "--reps", "1",
              "--no-memory", "--csv", f"{w}/fused_loss.csv"], timed=True),
        # a hybrid's mixers on the packed row: how many rows a call should take on CUDA (mixer_rows.CALL_TOKENS, a
        # guess there until this runs), Qwen3.5's gated delta rule on the lognormal batch and on 64 short rows
        Part("hybrid mixer groups (CALL_TOKENS)", 45,
             [PY, str(BENCH / "mixer_groups.py"), "--device", "cuda", "--reps", "3", "--budget-s", "40",
              "--calls", "0", "128", "512", "2048", "8192", "1000000000", "--csv", f"{w}/mixer_groups.csv"],
             [PY, str(BENCH / "mixer_groups.py"), "--reps", "1", "--scale", "0.1", "--calls", "0", "1000000000",
              "--csv", f"{w}/mixer_groups.csv"], timed=True),
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
        if self.version:  # its own flash_attn/cute (an older flash-attn 4) would hide the carried one
            where = subprocess.run([PY, "-c", "import flash_attn; print(flash_attn.__path__[0])"], capture_output=True,
                                   text=True, env=self.env).stdout.strip()
            self.state += "; " + gpu_carry.overlay_cute(Path(where), SITE) if where else ""

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
        status = read_status(FLASH_OUT) or {}  # call 1 started it on this machine: its build is adopted
        if status.get("state") == "running" and (status.get("pid") is None or pid_alive(status["pid"])):
            self.building, self.state = True, f"building (started {status.get('started', '?')} by call 1)"
            return
        if status.get("state") == "done" and status.get("wheel") and Path(status["wheel"]).is_file():
            self.building = True  # wait() installs it
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
    """The environment every part runs in: carried wheels first on PYTHONPATH (flash-attn 4's set only where its DSL
    wheel was rebuilt from the two calls' parts), patchkit installed editable."""
    # Hub kernels off: from transformers 5.25 `from_pretrained` kernelizes by default, which needs the `kernels`
    # package and the hub (the GPU machine has neither); every row, HF's and patchkit's, runs transformers' modules
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", USE_HUB_KERNELS="NO",
               FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(FA4_CACHE))
    env.pop("PATCHKIT_FLASH_ATTN", None)
    found = sorted(w for w in wheels.glob("*.whl") if not w.name.startswith("flash_attn-")) if wheels.is_dir() else []
    said, flash4 = [], None
    for man in gpu_carry.manifests(wheels):
        folders = [gpu_carry.PARTS_AT, wheels, gpu_carry.STAGE1]
        if rehearse:
            parts = [gpu_carry.find_part(p["name"], p["sha256"], folders) for p in json.loads(man.read_text())["parts"]]
            said.append(f"{man.stem}: {sum(p is not None for p in parts)} of {len(parts)} parts here (not rebuilt)")
            continue
        flash4, what = gpu_carry.assemble(man, folders, gpu_carry.PARTS_AT)
        said.append(what if flash4 else f"no flash-attn 4: {what}")
    found = gpu_carry.split_for_install(found, flash4) if not rehearse else found
    if found and not rehearse:
        code, _ = run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                       "--target", str(SITE), *map(str, found)], 180, log, env)
        said.append(f"{len(found)} carried wheels ({'installed' if code == 0 else f'pip exit {code}'})")
        # the DSL's .pth puts its dsl_packages on sys.path: a --target folder on PYTHONPATH reads no .pth
        paths = [SITE, *[d for d in (SITE / "nvidia_cutlass_dsl" / "dsl_packages",) if d.is_dir()]]
        env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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


def stage_one(out: Path, rehearse: bool, folder: Path = gpu_carry.STAGE1, parts_at: Path = gpu_carry.PARTS_AT) -> int:
    """Call 1: its part of flash-attn 4's DSL wheel left where call 2 looks (/tmp survives while the machine is
    warm), and the flash-attn 2 build started in the background on the sdist it carries (rehearsed without CUDA)."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-truth stage 1: {gpu_carry.stage1(parts_at, folder)}", flush=True)
    flash = Flash(dict(os.environ, PYTHONUNBUFFERED="1"), rehearse, out / "stage1.log")
    flash.start(next(iter(sorted(folder.glob("flash_attn-*.tar.gz"))), None), None)
    print(f"gpu-truth stage 1: flash-attn: {flash.state}. Next, within 30 s: "
          f'run(command="make gpu-truth", carry=["{gpu_carry.CARRY.name}"], timeout_s=600)', flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-truth-out"))
    ap.add_argument("--budget-s", type=float, default=560, help="the whole run's wall-clock budget")
    ap.add_argument("--dry-run", action="store_true", help="rehearse on this machine (the default without CUDA)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu", help="carried wheels to install first")
    ap.add_argument("--sdist", type=Path, default=None, help="flash-attn sdist (default: the one in --wheels)")
    ap.add_argument("--flash-wheel", type=Path, default=None, help="a flash-attn wheel to install instead of a build")
    ap.add_argument("--only", default="", help="comma-separated words; run only the parts whose name has one")
    ap.add_argument("--fetch", action="store_true", help="here: download the carried files into --wheels and "
                    ".gpu1/, pack flash-attn 4's DSL wheel across the two calls, print the calls, then exit")
    ap.add_argument("--xz-preset", type=int, default=gpu_carry.XZ_PRESET, help="--fetch: the xz preset (0-9)")
    ap.add_argument("--stage", type=int, choices=(1,), help="1: the first device call (see the module's help)")
    args = ap.parse_args(argv)
    if args.fetch:
        return gpu_carry.fetch(args.wheels, preset=args.xz_preset)
    cuda = subprocess.run([PY, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
    rehearse = args.dry_run or cuda.returncode != 0
    if args.stage == 1:
        return stage_one(args.out.resolve(), rehearse)
    t0 = time.time()
    deadline = t0 + args.budget_s - RESERVE_S
    out, work = args.out.resolve(), WORK  # OUT holds the three files (the device returns at most 8 files)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    log.write_text("")
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
        if (part.needs_flash or part.timed) and flash.building:  # no timing while the build holds the cores
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
