"""The `patchkit` command: run a script patched, diagnose this machine, verify a patch, or run the benchmarks."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

from patchkit.errors import PatchkitError
from patchkit.names import BACKEND_NAMES

USAGE = """usage: patchkit {run,doctor,verify,bench} ...

  run     [--patch NAME] [--backend B] [--unpad model|attention|loss] [--strict] [--no-patch]
          (SCRIPT.py | -m MODULE) [args...]                      apply the patch, then run the script or module
  doctor  [--json] [--verbose]                                   versions, GPU, flash-attn, which patch applies
  verify  [--patch NAME] [--dtype fp32|bf16|fp16] [--model PATH] patched vs unpatched logits and gradients
  bench   [--quick | --full] [--out DIR] [...]                   benchmarks/bench.py (source checkout only)

`patchkit COMMAND --help` for each command's options.
"""


def cmd_run(argv: list[str]) -> int:
    """`patchkit run`: the launcher (`python -m patchkit.launch`) under the patchkit command."""
    from patchkit.entry.launch import main as launch_main

    return launch_main(argv, prog="patchkit run")


def cmd_doctor(argv: list[str]) -> int:
    """`patchkit doctor`: print (or --json) `patchkit.entry.doctor.doctor()`; exit 1 when no patch applies here."""
    parser = argparse.ArgumentParser(prog="patchkit doctor", description="Versions, GPU, flash-attn and, for each "
                                     "patch, whether it would apply here and with which backend. Patches nothing.")
    parser.add_argument("--json", action="store_true", help="print the same data as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="every gate of every patch, with its fix (default: one line per patch)")
    ns = parser.parse_args(argv)
    from patchkit.entry.doctor import doctor, exit_code, format_report  # torch: after --help has answered

    data = doctor()
    print(json.dumps(data, indent=2) if ns.json else format_report(data, verbose=ns.verbose))
    return exit_code(data)


def cmd_verify(argv: list[str]) -> int:
    """`patchkit verify`: the table of `patchkit.entry.verify.verify()`; exit 1 when a tolerance is exceeded."""
    parser = argparse.ArgumentParser(prog="patchkit verify", description="Run padded batches and a short greedy "
                                     "generation through patched and unpatched (eager) attention; print the largest "
                                     "differences of logits and gradients against tolerances.")
    parser.add_argument("--patch", default=None, help="the family: a patch name (llama2, mistral, ...) or a "
                        "model_type served from data (default: the --model checkpoint's model_type, else llama2)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])  # verify.DTYPES
    parser.add_argument("--model", default=None, metavar="PATH", help="local checkpoint (default: tiny random LLaMA)")
    parser.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    parser.add_argument("--strict", action="store_true", help="raise instead of falling back when a gate fails")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    ns = parser.parse_args(argv)
    from patchkit.entry.verify import verify  # torch: after --help has answered

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            result = verify(ns.patch, ns.dtype, ns.model, ns.backend, ns.strict, ns.seed)
        except (PatchkitError, ValueError, OSError) as exc:
            print(f"patchkit verify: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    for w in {str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)}:
        print(f"warning: {w}", file=sys.stderr)
    print(result.to_json() if ns.json else result.table())
    return 0 if result.passed else 1


def bench_script() -> Path:
    """benchmarks/bench.py of the source checkout patchkit is installed from (editable installs only)."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def cmd_bench(argv: list[str]) -> int:
    """`patchkit bench`: forward every argument to benchmarks/bench.py's main(argv)."""
    path = bench_script()
    if not path.is_file():
        print(
            f"patchkit bench: {path} not found. The benchmarks ship with the source repository, not the wheel: "
            "clone the repository and `pip install -e .` from it, then run `patchkit bench` again.",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("patchkit_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if not hasattr(module, "main"):
        print(f"patchkit bench: {path} has no main(argv) function", file=sys.stderr)
        return 2
    takes_prog = "prog" in inspect.signature(module.main).parameters
    code = module.main(argv, prog="patchkit bench") if takes_prog else module.main(argv)
    return code if isinstance(code, int) else 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": cmd_run, "doctor": cmd_doctor, "verify": cmd_verify, "bench": cmd_bench,
}


def package_version() -> str:
    """The installed distribution's version (what `pip show patchkit` says), read without importing the package."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("patchkit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: Optional[list[str]] = None) -> int:
    """Dispatch `patchkit COMMAND ...`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"patchkit {package_version()}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"patchkit: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    from patchkit.entry.autostart import stand_down

    stand_down(f"patchkit {argv[0]}")  # each command decides about patching itself (verify compares unpatched)
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

