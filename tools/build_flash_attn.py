"""Build flash-attn 2 offline from its source distribution, compiling only the kernels that will run.

flash-attn 2.8.3.post2 is on the package index only as a source distribution whose setup.py compiles 72 kernel files
for four architectures by default (hours); a model runs one or two head dims on one GPU. This tool unpacks the sdist,
trims the kernel list and the head-dim dispatch together, can switch on upstream's FLASHATTENTION_DISABLE_* macros,
checks that the kept .cu files define every specialisation the trimmed dispatch instantiates, and builds a wheel
with pip, recording what was built (build_config.json beside the wheel, the wheel's local version, and
flash_attn/_patchkit_build.py inside it) so that patchkit's gate can say "this flash-attn build lacks head dim 96 /
dropout". What it changes in the unpacked copy and why each change is safe: docs/testing.md ("What the build tool
changes"); the diff is kept as WORK/patchkit_trim.diff. --archs takes compute capabilities (90, 8.6, sm_90) and maps
each to the entry setup.py knows for its major version (8.6 -> 80: sm_80 cubins run on 8.6 and 8.9); --disable also
knows "backward" (FLASHATTENTION_DISABLE_BACKWARD).

Usage:
  python tools/build_flash_attn.py --sdist flash_attn-2.8.3.post2.tar.gz --out OUT [--archs 90]
      [--head-dims 64,128] [--disable dropout,alibi] [--jobs N] [--nvcc-threads N] [--dry-run | --background]
  python tools/build_flash_attn.py --status OUT     # prints OUT/build_status.json; exit 0 running/done, 1 failed

Only the standard library and packaging are imported at module level; torch is imported for the default --archs
(the local GPU) and by the preflight of a real build.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # flash_attn_sdist, beside this file
from flash_attn_sdist import FEATURES, BuildError, prepare  # noqa: E402
from packaging.version import Version

STATUS_FILE = "build_status.json"
CONFIG_FILE = "build_config.json"
LOG_FILE = "build.log"
SETUP_ARCHS = {"80": Version("11.7"), "90": Version("11.8"), "100": Version("12.8"), "120": Version("12.8")}

def parse_list(text: Optional[str]) -> list[str]:
    """'a, b;c' -> ['a', 'b', 'c']."""
    return [t.strip() for t in re.split(r"[,;]", text or "") if t.strip()]


def normalize_arch(token: str) -> str:
    """'90', '9.0', 'sm_90', '86', '8.6' -> the FLASH_ATTN_CUDA_ARCHS entry setup.py knows for that major version.
    sm_80 cubins run on 8.6/8.9 (same major, higher minor), and so on for 9.x, 10.x, 12.x."""
    t = token.lower().removeprefix("sm_").removeprefix("sm")
    m = re.fullmatch(r"(\d+)\.(\d)", t) or re.fullmatch(r"(\d+)(\d)", t)
    if not m:
        raise BuildError(f"--archs: cannot read {token!r}; give compute capabilities like 90 or 8.6")
    major = int(m.group(1))
    arch = f"{major}0"
    if arch not in SETUP_ARCHS:
        raise BuildError(
            f"--archs: compute capability {token} has no flash-attn 2 build (setup.py knows {sorted(SETUP_ARCHS)}; "
            "flash-attn 2 needs Ampere (8.0) or newer)"
        )
    return arch


def parse_archs(text: str) -> list[str]:
    archs = []
    for token in parse_list(text):
        arch = normalize_arch(token)
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise BuildError("--archs is empty")
    return archs


def local_arch() -> Optional[str]:
    """The visible GPU's compute capability, as an --archs entry, or None without a CUDA torch and device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return normalize_arch(f"{major}.{minor}")


def parse_disable(text: Optional[str]) -> list[str]:
    names = []
    for name in parse_list(text):
        key = name.lower().replace("-", "_")
        if key not in FEATURES:
            raise BuildError(f"--disable: unknown feature {name!r}; known: {', '.join(FEATURES)}")
        if key not in names:
            names.append(key)
    return names


def default_jobs() -> int:
    """setup.py's own rule for MAX_JOBS: half the cores, at most one job per ~9 GB of free memory."""
    jobs = max(1, (os.cpu_count() or 2) // 2)
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        jobs = min(jobs, int(avail_kb / 1024**2 / 9))
    except (OSError, StopIteration, ValueError):
        pass
    return max(1, jobs)


# ----------------------------------------------------------------------------------------------- unpacking


def build_env(archs: list[str], jobs: int, nvcc_threads: int, config: dict) -> dict[str, str]:
    """The environment setup.py reads (names as in 2.8.3's setup.py)."""
    return {
        "FLASH_ATTN_CUDA_ARCHS": ";".join(archs),
        "MAX_JOBS": str(jobs),
        "NVCC_THREADS": str(nvcc_threads),
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",  # build here; never try the prebuilt-wheel URL (no network)
        "FLASH_ATTENTION_SKIP_CUDA_BUILD": "FALSE",  # the sdist download recipe sets TRUE; it would build no kernel
        "BUILD_TARGET": "cuda",
        "FLASH_ATTN_LOCAL_VERSION": config["local_version"],
    }


def process_env(env: dict[str, str]) -> dict[str, str]:
    """The build's whole environment: this one, setup.py's variables, and this interpreter's bin folder first on
    PATH (where a virtual environment's ninja is)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, **env, "PATH": path}


def pip_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            "--disable-pip-version-check", "-v", "-w", str(out), "."]


def print_plan(plan: dict, env: dict[str, str], out: Path) -> None:
    config = plan["config"]
    print(f"flash-attn {config['flash_attn_version']} from {config['sdist']}")
    print(f"source (patched): {plan['src']}")
    print(f"archs: {','.join(config['archs'])}")
    print(f"head dims kept: {config['head_dims']}  trimmed: {config['head_dims_trimmed']}")
    print(f"disabled: {config['disabled'] or 'none'}  macros: {config['disable_macros'] or 'none'}")
    print(f"kernels: kept {config['kernels_kept']} of {config['kernels_total']}")
    for k in plan["kept"]:
        print(f"  {k['path']}")
    print(f"edits: {plan['diff_path']}")
    print("env: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print(f"command (in {plan['src']}): " + " ".join(pip_command(out)))


# ----------------------------------------------------------------------------------------------- build


def nvcc_version(nvcc: Path) -> Optional[Version]:
    try:
        text = subprocess.run([str(nvcc), "-V"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+\.\d+)", text)
    return Version(m.group(1)) if m else None


def preflight(archs: list[str], env: dict[str, str]) -> dict:
    """What a build needs from this machine; raises BuildError listing every missing piece."""
    problems, found = [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as e:
        raise BuildError(f"the build needs torch with CUDA in this interpreter: {e}") from e
    found["torch"] = torch.__version__
    found["torch_cuda"] = torch.version.cuda
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU build; flash-attn compiles against a CUDA torch")
    nvcc = Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
    version = nvcc_version(nvcc)
    found["nvcc"] = str(version) if version else None
    if version is None:
        problems.append(f"no working nvcc (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to the CUDA toolkit")
    else:
        for arch in archs:
            if version < SETUP_ARCHS[arch]:
                need = SETUP_ARCHS[arch]
                problems.append(f"sm_{arch} needs nvcc >= {need} (setup.py silently skips it), have {version}")
    if not shutil.which("ninja", path=env["PATH"]):
        problems.append("ninja is not on PATH (torch's BuildExtension needs it): pip install ninja, or apt ninja-build")
    for module in ("wheel.bdist_wheel", "setuptools", "packaging"):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"setup.py imports {module}, missing here (--no-build-isolation uses this interpreter)")
    if problems:
        raise BuildError("preflight failed:\n  - " + "\n  - ".join(problems))
    return found


def run_logged(cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path, echo: bool) -> int:
    """Runs cmd, appending its output to log_path (and echoing it when asked); returns the exit status."""
    with open(log_path, "a", buffering=1) as log:
        log.write(f"$ {' '.join(cmd)}  (in {cwd})\n")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if echo:
                sys.stdout.write(line)
        return proc.wait()


def find_wheel(out: Path, local: str) -> Path:
    """The newest wheel of this configuration in out, checked to hold the compiled extension."""
    wheels = sorted(out.glob(f"flash_attn-*+{local}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise BuildError(f"pip reported success but no flash_attn wheel is in {out}")
    wheel = wheels[-1]
    with zipfile.ZipFile(wheel) as z:
        if not any(Path(n).name.startswith("flash_attn_2_cuda") and n.endswith(".so") for n in z.namelist()):
            raise BuildError(f"{wheel.name} holds no flash_attn_2_cuda extension (was the CUDA build skipped?)")
    return wheel


def compile_wheel(plan: dict, env: dict[str, str], out: Path, log_path: Path, echo: bool) -> Path:
    rc = run_logged(pip_command(out), plan["src"], env, log_path, echo)
    if rc != 0:
        raise BuildError(f"pip wheel exited {rc}; see {log_path}")
    return find_wheel(out, plan["config"]["local_version"])


# ----------------------------------------------------------------------------------------------- status


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_status(out: Path, **fields) -> dict:
    """Merges fields into OUT/build_status.json (atomic replace) and returns it."""
    path = out / STATUS_FILE
    status = read_status(out) or {}
    status.update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return status


def read_status(out: Path) -> Optional[dict]:
    try:
        return json.loads((out / STATUS_FILE).read_text())
    except FileNotFoundError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def show_status(out: Path) -> int:
    """Prints the status; a 'running' build whose process is gone is reported as failed. Exit 0/1/2: running or
    done / failed / no status."""
    status = read_status(out)
    if status is None:
        print(json.dumps({"state": "missing", "error": f"no {STATUS_FILE} in {out}"}))
        return 2
    if status.get("state") == "running" and status.get("pid") and not pid_alive(status["pid"]):
        status.update(state="failed", error=f"build process {status['pid']} ended without recording a result")
    print(json.dumps(status, indent=2, sort_keys=True))
    return 1 if status.get("state") == "failed" else 0


# ----------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", type=Path, help="flash_attn-<version>.tar.gz")
    p.add_argument("--out", type=Path, help="where the wheel, build_config.json, build.log and build_status.json go")
    p.add_argument("--archs", help="compute capabilities, e.g. 90 or 80,90 (default: the local GPU's)")
    p.add_argument("--head-dims", help="kernel head dims to compile, e.g. 64,128 (default: all)")
    p.add_argument("--disable", help=f"features to compile out: {','.join(FEATURES)}")
    p.add_argument("--jobs", type=int, help="MAX_JOBS (default: setup.py's rule, cores/2 capped by memory/9GB)")
    p.add_argument("--nvcc-threads", type=int, default=4, help="NVCC_THREADS (default 4, as setup.py)")
    p.add_argument("--work-dir", type=Path, help="where the sdist is unpacked and patched (default OUT/work)")
    p.add_argument("--dry-run", action="store_true", help="unpack, trim, check and print the plan; compile nothing")
    p.add_argument("--background", action="store_true", help="start the build detached; poll with --status OUT")
    p.add_argument("--status", type=Path, metavar="OUT", help="print OUT/build_status.json and exit")
    p.add_argument("--quiet-build", action="store_true", help=argparse.SUPPRESS)  # the detached child: log only
    return p


def start_background(argv: list[str], out: Path, config: dict) -> int:
    """Re-runs this command without --background (with the archs resolved here), detached, its output appended
    to OUT/build.log."""
    log_path = out / LOG_FILE
    write_status(out, state="running", started=now(), finished=None, wheel=None, log=str(log_path),
                 config=config, pid=None, error=None)
    child = [sys.executable, os.path.abspath(__file__)] + [a for a in argv if a != "--background"]
    child += ["--archs", ",".join(config["archs"]), "--quiet-build"]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(child, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    print(f"build started in the background (pid {proc.pid}); log {log_path}")
    print(f"poll: {sys.executable} {os.path.abspath(__file__)} --status {out}")
    return 0


def run(args: argparse.Namespace, argv: list[str]) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    archs = parse_archs(args.archs) if args.archs else None
    if archs is None:
        detected = local_arch()
        if detected is None:
            raise BuildError("--archs is required: torch sees no CUDA device here to read the compute capability from")
        archs = [detected]
    head_dims = [int(d) for d in parse_list(args.head_dims)] if args.head_dims else None
    disabled = parse_disable(args.disable)
    request = {"archs": archs, "head_dims": head_dims, "disabled": disabled, "jobs": args.jobs or default_jobs(),
               "nvcc_threads": args.nvcc_threads, "dry_run": args.dry_run}
    if args.background:
        return start_background(argv, out, request)
    log_path = out / LOG_FILE
    if not args.quiet_build:
        log_path.write_text("")  # a foreground build starts a fresh log; a detached one appends to its launcher's
    write_status(out, state="running", started=now(), finished=None, wheel=None, log=str(log_path),
                 config=request, pid=os.getpid(), error=None)
    try:
        wheel, config = build(args, out, archs, head_dims, disabled, request, log_path)
    except BaseException as e:  # an interrupt too: the status must not stay "running"
        if args.quiet_build:  # the detached child: its error in the log before the status says failed (a poller
            with open(log_path, "a") as log:  # reads the log as soon as it does)
                log.write(f"build_flash_attn: {e}\n")
        write_status(out, state="failed", finished=now(), error=f"{type(e).__name__}: {e}")
        raise
    write_status(out, state="done", finished=now(), wheel=str(wheel) if wheel else None, config=config)
    return 0


def build(args, out, archs, head_dims, disabled, request, log_path) -> tuple[Optional[Path], dict]:
    work = (args.work_dir or out / "work").resolve()
    plan = prepare(args.sdist.resolve(), work, archs, head_dims, disabled)
    config = {**plan["config"], "jobs": request["jobs"], "nvcc_threads": request["nvcc_threads"]}
    env = build_env(archs, request["jobs"], request["nvcc_threads"], config)
    print_plan(plan, env, out)
    if args.dry_run:
        return None, {**config, "dry_run": True}
    env = process_env(env)
    config.update(preflight(archs, env))
    with open(log_path, "a") as log:
        log.write(json.dumps(config, indent=2) + "\n")
    wheel = compile_wheel(plan, env, out, log_path, echo=not args.quiet_build)
    config["wheel"] = wheel.name
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"built {wheel}\nconfig {out / CONFIG_FILE}")
    return wheel, config


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.status is not None:
            return show_status(args.status.resolve())
        if args.sdist is None or args.out is None:
            raise BuildError("--sdist and --out are required (or --status OUT)")
        if not args.sdist.is_file():
            raise BuildError(f"--sdist {args.sdist}: no such file")
        return run(args, argv)
    except BuildError as e:
        if not args.quiet_build:  # the detached child wrote it to its log already
            print(f"build_flash_attn: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
