"""The `patchkit` command: dispatch, usage errors, `run`, and `bench` forwarding to benchmarks/bench.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from entrypoints import REPO, patchkit_cli, run

import patchkit
from patchkit.entry import cli


@pytest.fixture(autouse=True)
def reverted(monkeypatch):
    for var in ("PATCHKIT_FLASH_ATTN", "PATCHKIT_PATCH", "PATCHKIT_BACKEND", "PATCHKIT_STRICT", "PATCHKIT_UNPAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    patchkit.revert_patch()


def test_help_lists_every_command_in_a_real_run():
    proc = patchkit_cli("--help")
    assert proc.returncode == 0
    for command in ("run", "doctor", "verify", "bench"):
        assert f"\n  {command} " in proc.stdout
    run_usage = proc.stdout.split("\n  run ")[1].split("\n  doctor ")[0]
    for option in ("--patch NAME", "--backend B", "--unpad model|attention", "--strict", "--no-patch",
                   "(SCRIPT.py | -m MODULE)"):
        assert option in run_usage, option


def test_help_lists_every_launcher_option():
    """The summary in `patchkit --help` names each option `patchkit run --help` has."""
    from patchkit.entry.launch import build_parser

    options = {s for a in build_parser("x")._actions for s in a.option_strings if s not in ("-h", "--help")}
    for option in options - {"--no-strict"}:  # --no-strict only undoes PATCHKIT_STRICT
        assert option in cli.USAGE, option


def test_usage_errors(capsys):
    assert cli.main([]) == 2 and "usage: patchkit" in capsys.readouterr().err
    assert cli.main(["train"]) == 2
    assert "unknown command 'train'; choose one of run, doctor, verify, bench" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"patchkit {patchkit.__version__}"


def test_console_script_is_installed_and_dispatches():
    script = Path(sys.executable).parent / "patchkit"
    if not script.exists():
        pytest.skip("console script not installed (pip install -e . creates it from [project.scripts])")
    proc = run([script, "--version"])
    assert proc.returncode == 0 and proc.stdout.strip() == f"patchkit {patchkit.__version__}"


def test_python_dash_m_patchkit_is_the_command(monkeypatch, capsys):
    """`python -m patchkit --version`, as `python -m pip` (a venv whose bin/ is not on PATH, a notebook's `!`)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["patchkit", "--version"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("patchkit", run_name="__main__")
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"patchkit {patchkit.__version__}"


def test_run_applies_the_patch_then_runs_the_script(tmp_path, capsys):
    probe, out = tmp_path / "probe.py", tmp_path / "out.json"
    probe.write_text(
        "import json, sys, patchkit\n"
        "json.dump({'argv': sys.argv, 'patches': [[h.name, h.backend] for h in patchkit.active_patches()]}, "
        "open(sys.argv[1], 'w'))\n"
    )
    assert cli.main(["run", "--backend", "sdpa", "--patch", "llama", str(probe), str(out), "--strict"]) == 0
    assert json.loads(out.read_text()) == {"argv": [str(probe), str(out), "--strict"], "patches": [["llama2", "sdpa"]]}
    assert "patch 'llama2' applied, backend 'sdpa'" in capsys.readouterr().err


def test_bench_without_the_source_checkout_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_script", lambda: tmp_path / "benchmarks" / "bench.py")
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'benchmarks' / 'bench.py'} not found" in err and "pip install -e ." in err


def test_bench_forwards_every_argument_to_main(tmp_path, monkeypatch):
    bench = tmp_path / "benchmarks" / "bench.py"
    bench.parent.mkdir()
    (bench.parent / "helper_for_bench.py").write_text("VALUE = 41\n")
    bench.write_text(
        "import json\nfrom helper_for_bench import VALUE\n"  # a sibling module: benchmarks/ is on sys.path
        f"def main(argv):\n    json.dump(argv, open({str(tmp_path / 'argv.json')!r}, 'w'))\n    return VALUE + 1\n"
    )
    monkeypatch.setattr(cli, "bench_script", lambda: bench)
    assert cli.main(["bench", "--seq", "128", "--backend", "sdpa", "-o", "x.csv"]) == 42
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--seq", "128", "--backend", "sdpa", "-o", "x.csv"]


def test_bench_gets_its_command_name_when_main_takes_prog(tmp_path, monkeypatch):
    bench = tmp_path / "bench.py"
    out = str(tmp_path / "p.json")
    bench.write_text(f"import json\ndef main(argv, prog=None):\n    json.dump(prog, open({out!r}, 'w'))\n")
    monkeypatch.setattr(cli, "bench_script", lambda: bench)
    assert cli.main(["bench"]) == 0
    assert json.loads((tmp_path / "p.json").read_text()) == "patchkit bench"


def test_bench_script_is_found_relative_to_the_repo():
    assert cli.bench_script() == REPO / "benchmarks" / "bench.py"


def test_real_bench_help_in_a_real_run():
    if not (REPO / "benchmarks" / "bench.py").is_file():
        pytest.skip("benchmarks/bench.py not written yet")
    proc = patchkit_cli("bench", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: patchkit bench [-h]")
    assert "--out OUT" in proc.stdout and "benchmarks/runs/<date-time>" in proc.stdout
