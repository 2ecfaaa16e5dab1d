"""Run patchkit's entry points as a user would: a subprocess of this interpreter with no stray PATCHKIT_* variables."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def benchmarks_importable() -> Iterator[None]:
    """benchmarks/ on sys.path, and what was imported from it forgotten after: its `families`, `models` and the like
    would otherwise stand in for tests/' modules of those names in a later import."""
    folder, path, before = str(REPO / "benchmarks"), list(sys.path), set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path[:] = path  # the benchmarks' own scripts put their folder first too
        for name in set(sys.modules) - before:
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(folder):
                del sys.modules[name]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without PATCHKIT_* (so the caller's shell cannot change a test), one thread per process, a
    Python traceback on a fatal signal (an abort in a rank says where it was), + extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    env.update(extra)
    return env


def run(args: list[str], cwd: Optional[Path] = None, env: Optional[dict[str, str]] = None,
        timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a command, capture text output, never raise on a non-zero exit (tests assert the code)."""
    return subprocess.run(
        [str(a) for a in args], cwd=cwd or REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


def patchkit_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """`patchkit ARGS...`, spelled `python -m patchkit.entry.cli` so it works before the console script is installed."""
    return run([sys.executable, "-m", "patchkit.entry.cli", *args], **kw)


def launch(*args: str, **kw) -> subprocess.CompletedProcess:
    """`python -m patchkit.launch ARGS...`."""
    return run([sys.executable, "-m", "patchkit.launch", *args], **kw)


def tagged(stdout: str, tag: str) -> Any:
    """The JSON a script printed after `TAG ` at the start of a line (the first such line), read to its own end: the
    ranks of a process group share stdout, unbuffered (`clean_env`), so another rank's line may run on into it."""
    found = re.search(rf"(?m)^{re.escape(tag)} ", stdout)
    assert found is not None, f"no {tag} line in the output:\n{stdout[-2000:]}"
    return json.JSONDecoder().raw_decode(stdout, found.end())[0]


def run_loaded(code: str, **kw) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`code` in a fresh interpreter (`run`'s keywords), and the names in its sys.modules at exit, its `sys.exit` too:
    printed on stderr after `LOADED ` (transformers loads its model modules by exec_module, which -X importtime does
    not list). [] where it printed none."""
    probe = ("import atexit, json, sys\n"
             "atexit.register(lambda: print('LOADED ' + json.dumps(sorted(sys.modules)), file=sys.stderr))\n" + code)
    proc = run([sys.executable, "-c", probe], **kw)
    return proc, tagged(proc.stderr, "LOADED") if re.search(r"(?m)^LOADED ", proc.stderr) else []


def spy_of(proc: subprocess.CompletedProcess) -> dict:
    """The SPY line a user script prints through `attention_spy.report()`; the script must have succeeded."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tagged(proc.stdout, "SPY")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous port for a process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int, *args) -> list:
    """`python -m torch.distributed.run` with `world` ranks on this host and a free port, then ARGS."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]


def run_group(args: list, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout end that group (torchrun and its ranks) and fail."""
    proc = subprocess.Popen([str(a) for a in args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} ran past {timeout} s\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
