"""tools/build_flash_attn.py: trimming flash-attn 2's sdist to some head dims and features, on CPU.

A fake sdist built here (setup.py with the sources list and the commented -D flags, static_switch.h with
upstream's HEADDIM_SWITCH, the generated kernel .cu files, flash_api.cpp's #ifdefs) always exercises the trimming;
the real flash_attn-2.8.3.post2.tar.gz is used when found at $FLASH_ATTN_SDIST or /tmp/fa_sdist/*.tar.gz (nothing
is downloaded). With g++ present, the kept .cu files and the trimmed dispatch are compiled against stub headers
and linked: an undefined kernel symbol fails the link, and a trimmed head dim must raise when called.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "build_flash_attn.py"
_spec = importlib.util.spec_from_file_location("build_flash_attn", TOOL)
bfa = importlib.util.module_from_spec(_spec)
sys.modules["build_flash_attn"] = bfa
_spec.loader.exec_module(bfa)
import flash_attn_sdist as fas  # noqa: E402  (beside the tool, on the path it set)

HDIMS = (32, 64, 96, 128, 192, 256)
KINDS = ("fwd", "bwd", "fwd_split")
VERSION = "2.8.3.post2"


def kernel_name(kind: str, hdim: int, dtype: str, causal: bool) -> str:
    return f"flash_{kind}_hdim{hdim}_{dtype}{'_causal' if causal else ''}_sm80.cu"


def expected_kernels(hdims) -> set[str]:
    """Every fwd / bwd / fwd_split x fp16 / bf16 x causal / not file of the given head dims."""
    return {kernel_name(k, d, t, c) for k, d, t, c in itertools.product(KINDS, hdims, ("fp16", "bf16"), (False, True))}


# ----------------------------------------------------------------------------------------------- a fake sdist

UPSTREAM_HEADDIM_SWITCH = r"""#define HEADDIM_SWITCH(HEADDIM, ...)   \
  [&] {                                    \
    if (HEADDIM <= 32) {                   \
      constexpr static int kHeadDim = 32;  \
      return __VA_ARGS__();                \
    } else if (HEADDIM <= 64) {            \
      constexpr static int kHeadDim = 64;  \
      return __VA_ARGS__();                \
    } else if (HEADDIM <= 96) {            \
      constexpr static int kHeadDim = 96;  \
      return __VA_ARGS__();                \
    } else if (HEADDIM <= 128) {           \
      constexpr static int kHeadDim = 128; \
      return __VA_ARGS__();                \
    } else if (HEADDIM <= 192) {           \
      constexpr static int kHeadDim = 192; \
      return __VA_ARGS__();                \
    } else if (HEADDIM <= 256) {           \
      constexpr static int kHeadDim = 256; \
      return __VA_ARGS__();                \
    }                                      \
  }()
"""

STATIC_SWITCH = (
    r"""#pragma once

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

#ifdef FLASHATTENTION_DISABLE_DROPOUT
  #define DROPOUT_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                         \
    constexpr static bool CONST_NAME = false;   \
    return __VA_ARGS__();                       \
  }()
#else
  #define DROPOUT_SWITCH BOOL_SWITCH
#endif

#define FP16_SWITCH(COND, ...)               \
  [&] {                                      \
    if (COND) {                              \
      using elem_type = cutlass::half_t;     \
      return __VA_ARGS__();                  \
    } else {                                 \
      using elem_type = cutlass::bfloat16_t; \
      return __VA_ARGS__();                  \
    }                                        \
  }()

"""
    + UPSTREAM_HEADDIM_SWITCH
)

FLASH_API = """#include "static_switch.h"
void set_params_fprop() {
    #ifdef FLASHATTENTION_DISABLE_SOFTCAP
        TORCH_CHECK(softcap <= 0.0, "This flash attention build does not support softcap.");
    #endif
    #ifdef FLASHATTENTION_DISABLE_DROPOUT
        TORCH_CHECK(p_dropout == 0.0f, "This flash attention build does not support dropout.");
    #endif
    #ifdef FLASHATTENTION_DISABLE_LOCAL
    #endif
    #ifdef FLASHATTENTION_DISABLE_UNEVEN_K
    #endif
}
#ifdef FLASHATTENTION_DISABLE_ALIBI
#endif
void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream, bool force_split_kernel=false) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream);
            });
        });
    });
}
    #ifdef FLASHATTENTION_DISABLE_BACKWARD
        TORCH_CHECK(false, "This flash attention build does not support backward.");
    #endif
"""


def cu_text(kind: str, hdim: int, dtype: str, causal: bool) -> str:
    """The generated kernel file, as generate_kernels.py writes it in 2.8.3."""
    t = "cutlass::half_t" if dtype == "fp16" else "cutlass::bfloat16_t"
    c = "true" if causal else "false"
    head = '#include "namespace_config.h"\n'
    if kind == "fwd_split":
        return head + (
            '#include "flash_fwd_launch_template.h"\n\nnamespace FLASH_NAMESPACE {\n\n'
            f"template void run_mha_fwd_splitkv_dispatch<{t}, {hdim}, {c}>(Flash_fwd_params &params, "
            "cudaStream_t stream);\n\n} // namespace FLASH_NAMESPACE"
        )
    direction = "fwd" if kind == "fwd" else "bwd"
    return head + (
        f'#include "flash_{direction}_launch_template.h"\n\nnamespace FLASH_NAMESPACE {{\n\ntemplate<>\n'
        f"void run_mha_{direction}_<{t}, {hdim}, {c}>(Flash_{direction}_params &params, cudaStream_t stream) {{\n"
        f"    run_mha_{direction}_hdim{hdim}<{t}, {c}>(params, stream);\n}}\n\n}} // namespace FLASH_NAMESPACE"
    )


def fake_setup_py() -> str:
    """setup.py's shape around what the tool edits: nvcc_flags with the commented -D flags, compiler_c17_flag, the
    Windows reassignment, the CUDAExtension sources list (upstream order), and the ROCm branch's own comment."""
    order = [(k, c, d, t) for k in KINDS for c in (False, True) for d in HDIMS for t in ("fp16", "bf16")]
    sources = "".join(f'                "csrc/flash_attn/src/{kernel_name(k, d, t, c)}",\n' for k, c, d, t in order)
    disable = "".join(
        f'    # "-DFLASHATTENTION_DISABLE_{m}",\n'
        for m in ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL")
    )
    return (
        "import sys, os\nSKIP_CUDA_BUILD = False\nIS_ROCM = False\next_modules = []\n"
        "if not SKIP_CUDA_BUILD and not IS_ROCM:\n"
        '    cc_flag = []\n    nvcc_flags = [\n    "-O3",\n    "--use_fast_math",\n    # "-lineinfo",\n'
        + disable
        + '    ]\n\n    compiler_c17_flag=["-O3", "-std=c++17"]\n'
        "    if sys.platform == \"win32\" and os.getenv('DISTUTILS_USE_SDK') == '1':\n"
        '        compiler_c17_flag=["-O2", "/std:c++17", "/Zc:__cplusplus"]\n\n'
        "    ext_modules.append(\n        CUDAExtension(\n"
        '            name="flash_attn_2_cuda",\n            sources=[\n'
        '                "csrc/flash_attn/flash_api.cpp",\n'
        + sources
        + '            ],\n            extra_compile_args={"cxx": compiler_c17_flag, "nvcc": nvcc_flags + cc_flag},\n'
        "        )\n    )\n"
        "elif not SKIP_CUDA_BUILD and IS_ROCM:\n"
        '    cc_flag = ["-O3",\n'
        '                    # "-DFLASHATTENTION_DISABLE_BACKWARD",\n                    "-DX"]\n'
        "    ext_modules.append(\n        CUDAExtension(\n"
        '            name="flash_attn_2_cuda",\n            sources=[],\n        )\n    )\n'
    )


def fake_files() -> dict[str, str]:
    files = {
        "setup.py": fake_setup_py(),
        "flash_attn/__init__.py": f'__version__ = "{VERSION}"\n',
        "csrc/flash_attn/src/static_switch.h": STATIC_SWITCH,
        "csrc/flash_attn/flash_api.cpp": FLASH_API,
        "csrc/flash_attn/src/flash_bwd_launch_template.h": "#ifndef FLASHATTENTION_DISABLE_BACKWARD\n#endif\n",
    }
    for k, d, t, c in itertools.product(KINDS, HDIMS, ("fp16", "bf16"), (False, True)):
        files[f"csrc/flash_attn/src/{kernel_name(k, d, t, c)}"] = cu_text(k, d, t, c)
    return files


def write_tar(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"flash_attn-{VERSION}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_sdist(tmp_path: Path) -> Path:
    return write_tar(tmp_path / f"flash_attn-{VERSION}.tar.gz", fake_files())


def real_sdist() -> Path | None:
    env = os.environ.get("FLASH_ATTN_SDIST")
    if env and Path(env).is_file():
        return Path(env)
    found = sorted(glob.glob("/tmp/fa_sdist/flash_attn-*.tar.gz"))
    return Path(found[-1]) if found else None


@pytest.fixture(params=["fake", "real"])
def sdist(request, tmp_path: Path) -> Path:
    """Both sdists: the fake one always, the real one when it is here (never downloaded)."""
    if request.param == "fake":
        return write_tar(tmp_path / f"flash_attn-{VERSION}.tar.gz", fake_files())
    path = real_sdist()
    if path is None:
        pytest.skip("no real flash-attn sdist at $FLASH_ATTN_SDIST or /tmp/fa_sdist/*.tar.gz")
    return path


# ----------------------------------------------------------------------------------------------- reading setup.py


def setup_values(setup_text: str) -> dict:
    """What the patched setup.py would hand the compiler, read from its syntax tree (so it must still parse): the
    CUDA branch's nvcc_flags, the extra host flags, and the first CUDAExtension's sources."""
    tree = ast.parse(setup_text)
    found: dict = {"host_extra": []}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name == "nvcc_flags" and "nvcc_flags" not in found:
                found["nvcc_flags"] = ast.literal_eval(node.value)
            if name == "compiler_c17_flag" and isinstance(node.value, ast.BinOp):
                found["host_extra"] = ast.literal_eval(node.value.right)
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "CUDAExtension"
            and "sources" not in found
        ):
            sources = next(k.value for k in node.keywords if k.arg == "sources")
            found["sources"] = ast.literal_eval(sources)
    return found


def headdim_switch(src: Path) -> str:
    text = (src / fas.SWITCH_PATH).read_text()
    start, end = fas.find_headdim_switch(text)
    return text[start:end]


def prepared(sdist: Path, tmp_path: Path, head_dims=None, disabled=(), archs=("90",)) -> dict:
    return fas.prepare(sdist, tmp_path / "work", list(archs), head_dims, list(disabled))


# ----------------------------------------------------------------------------------------------- trimming


def test_kernel_list_of_the_sdist(sdist: Path, tmp_path: Path) -> None:
    plan = prepared(sdist, tmp_path)
    names = {Path(k["path"]).name for k in plan["kept"]}
    assert names == expected_kernels(HDIMS) and len(names) == 72
    assert plan["config"]["head_dims_trimmed"] == []
    assert plan["config"]["local_version"] == "pk.sm90.hdall"


def test_head_dims_keep_exactly_their_kernels(sdist: Path, tmp_path: Path) -> None:
    plan = prepared(sdist, tmp_path, head_dims=[64, 128])
    want = expected_kernels((64, 128))
    assert len(want) == 24
    assert {Path(k["path"]).name for k in plan["kept"]} == want
    sources = setup_values((plan["src"] / "setup.py").read_text())["sources"]
    assert sources[0] == "csrc/flash_attn/flash_api.cpp"
    assert {Path(s).name for s in sources[1:]} == want  # what setuptools compiles, not only what the tool printed
    for name in want:
        assert (plan["src"] / "csrc/flash_attn/src" / name).is_file()
    config = plan["config"]
    assert (config["head_dims"], config["head_dims_trimmed"]) == ([64, 128], [32, 96, 192, 256])
    assert (config["kernels_total"], config["kernels_kept"]) == (72, 24)


def test_dispatch_no_longer_reaches_trimmed_kernels(sdist: Path, tmp_path: Path) -> None:
    plan = prepared(sdist, tmp_path, head_dims=[64, 128])
    macro = headdim_switch(plan["src"])
    assert sorted(int(d) for d in re.findall(r"kHeadDim = (\d+)", macro)) == [64, 128]
    assert macro.count("return __VA_ARGS__();") == 2
    # upstream's buckets stay: a head dim maps to the same kernels as before, or raises
    assert [int(d) for d in re.findall(r"HEADDIM <= (\d+)", macro)] == list(HDIMS)
    for d in (32, 96, 192, 256):
        branch = re.search(rf"HEADDIM <= {d}\) \{{(.*?)\}}", macro, re.DOTALL).group(1)
        assert "TORCH_CHECK(false" in branch and f"kernel bucket {d}" in branch and "kHeadDim" not in branch
    for line in macro.splitlines()[:-1]:
        assert line.endswith(" \\"), line  # still one macro
    rest = (plan["src"] / fas.SWITCH_PATH).read_text().replace(macro, "")
    assert "DROPOUT_SWITCH" in rest and "FP16_SWITCH" in rest  # the other switches are untouched


def test_head_dim_maps_to_its_bucket(fake_sdist: Path, tmp_path: Path, capsys) -> None:
    plan = prepared(fake_sdist, tmp_path, head_dims=[80])
    assert plan["config"]["head_dims"] == [96]
    assert "head dim 80 runs on the hdim96 kernels" in capsys.readouterr().out
    with pytest.raises(bfa.BuildError, match="outside"):
        prepared(fake_sdist, tmp_path, head_dims=[320])


def test_missing_kernel_instantiation_is_caught(tmp_path: Path) -> None:
    files = fake_files()
    files["csrc/flash_attn/src/" + kernel_name("fwd_split", 64, "bf16", True)] = "// emptied\n"
    sdist = write_tar(tmp_path / "broken.tar.gz", files)
    with pytest.raises(bfa.BuildError, match="do not define"):
        prepared(sdist, tmp_path, head_dims=[64])
    prepared(sdist, tmp_path, head_dims=[128])  # the emptied file is trimmed away: fine


def test_unknown_switch_shape_is_refused(tmp_path: Path) -> None:
    files = fake_files()
    files["csrc/flash_attn/src/static_switch.h"] = STATIC_SWITCH.replace("kHeadDim = 96", "kHeadDim = 100")
    with pytest.raises(bfa.BuildError, match="refusing to trim"):
        prepared(write_tar(tmp_path / "odd.tar.gz", files), tmp_path, head_dims=[64])


# ----------------------------------------------------------------------------------------------- disable flags


def test_disable_flags_reach_nvcc_and_host_compiler(sdist: Path, tmp_path: Path) -> None:
    names = ["dropout", "alibi", "uneven_k", "softcap", "local"]
    plan = prepared(sdist, tmp_path, head_dims=[128], disabled=names)
    text = (plan["src"] / "setup.py").read_text()
    values = setup_values(text)
    macros = [f"-D{fas.FEATURES[n]}" for n in names]
    assert set(macros) <= set(values["nvcc_flags"])
    assert "-DFLASHATTENTION_DISABLE_BACKWARD" not in values["nvcc_flags"]  # not asked: stays commented
    assert '# "-DFLASHATTENTION_DISABLE_BACKWARD",' in text
    assert values["host_extra"] == macros  # flash_api.cpp's TORCH_CHECKs see them too
    for m in macros:
        assert f'# "{m}"' not in text
    assert plan["config"]["local_version"] == "pk.sm90.hd128.nodropout.noalibi.nounevenk.nosoftcap.nolocal"


def test_disable_backward_leaves_the_rocm_branch(fake_sdist: Path, tmp_path: Path) -> None:
    plan = prepared(fake_sdist, tmp_path, disabled=["backward"])
    text = (plan["src"] / "setup.py").read_text()
    assert setup_values(text)["nvcc_flags"].count("-DFLASHATTENTION_DISABLE_BACKWARD") == 1
    assert '                    # "-DFLASHATTENTION_DISABLE_BACKWARD",' in text


def test_disable_flag_missing_from_setup_is_added(tmp_path: Path) -> None:
    files = fake_files()
    files["setup.py"] = files["setup.py"].replace('    # "-DFLASHATTENTION_DISABLE_LOCAL",\n', "")
    plan = prepared(write_tar(tmp_path / "s.tar.gz", files), tmp_path, disabled=["local"])
    values = setup_values((plan["src"] / "setup.py").read_text())
    assert "-DFLASHATTENTION_DISABLE_LOCAL" in values["nvcc_flags"]
    assert values["host_extra"] == ["-DFLASHATTENTION_DISABLE_LOCAL"]


def test_disable_of_a_macro_the_sources_never_test_is_refused(tmp_path: Path) -> None:
    files = fake_files()
    files["csrc/flash_attn/flash_api.cpp"] = FLASH_API.replace("FLASHATTENTION_DISABLE_ALIBI", "SOMETHING_ELSE")
    with pytest.raises(bfa.BuildError, match="never tests"):
        prepared(write_tar(tmp_path / "s.tar.gz", files), tmp_path, disabled=["alibi"])
    with pytest.raises(bfa.BuildError, match="unknown feature"):
        bfa.parse_disable("dropout,rotary")


# ----------------------------------------------------------------------------------------------- config


def test_archs_map_to_what_setup_py_knows() -> None:
    assert bfa.parse_archs("90") == ["90"]
    assert bfa.parse_archs("8.6;sm_90,80") == ["80", "90"]
    assert bfa.parse_archs("10.3,12.0") == ["100", "120"]
    for bad in ("75", "7.5", "foo", ""):
        with pytest.raises(bfa.BuildError):
            bfa.parse_archs(bad)


def test_local_version_is_a_pep440_local_label() -> None:
    from packaging.version import Version

    local = fas.local_version(["80", "90"], [64, 128], True, ["dropout", "uneven_k"])
    assert local == "pk.sm80.sm90.hd64.hd128.nodropout.nounevenk"
    assert Version(f"{VERSION}+{local}").local == local


def test_build_config_ships_in_the_package(sdist: Path, tmp_path: Path) -> None:
    plan = prepared(sdist, tmp_path, head_dims=[64], disabled=["dropout"])
    text = (plan["src"] / fas.BUILD_INFO_PATH).read_text()
    literal = ast.literal_eval(next(n for n in ast.parse(text).body if isinstance(n, ast.Assign)).value)
    assert literal == plan["config"]
    assert literal["head_dims_trimmed"] == [32, 96, 128, 192, 256] and literal["disabled"] == ["dropout"]


def test_build_env_names_setup_py_reads(tmp_path: Path) -> None:
    sdist = real_sdist()
    if sdist is None:
        pytest.skip("no real flash-attn sdist at $FLASH_ATTN_SDIST or /tmp/fa_sdist/*.tar.gz")
    plan = prepared(sdist, tmp_path, head_dims=[64], archs=("80", "90"))
    env = bfa.build_env(["80", "90"], 3, 2, plan["config"])
    assert env["FLASH_ATTN_CUDA_ARCHS"] == "80;90" and env["MAX_JOBS"] == "3" and env["NVCC_THREADS"] == "2"
    assert env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE" and env["FLASH_ATTENTION_SKIP_CUDA_BUILD"] == "FALSE"
    setup_text = (plan["src"] / "setup.py").read_text()
    for name in env:
        assert re.search(rf"""(getenv|environ\.get|environ\[)\(?["']{name}["']""", setup_text), name


def test_find_wheel_wants_the_extension(tmp_path: Path) -> None:
    local = "pk.sm90.hd64"
    wheel = tmp_path / f"flash_attn-{VERSION}+{local}-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("flash_attn/__init__.py", "")
    with pytest.raises(bfa.BuildError, match="no flash_attn_2_cuda"):
        bfa.find_wheel(tmp_path, local)
    with zipfile.ZipFile(wheel, "a") as z:
        z.writestr("flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so", "")
    assert bfa.find_wheel(tmp_path, local) == wheel
    with pytest.raises(bfa.BuildError, match="no flash_attn wheel"):
        bfa.find_wheel(tmp_path, "pk.sm80.hdall")


# ----------------------------------------------------------------------------------------------- the command


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_plan(sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(sdist), "--out", str(out), "--archs", "9.0", "--head-dims", "64,128",
            "--disable", "dropout", "--jobs", "2", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "kernels: kept 24 of 72" in r.stdout
    assert "head dims kept: [64, 128]  trimmed: [32, 96, 192, 256]" in r.stdout
    for name in expected_kernels((64, 128)):
        assert f"csrc/flash_attn/src/{name}" in r.stdout
    assert "hdim96" not in r.stdout
    assert "FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS=2" in r.stdout and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in r.stdout
    assert "pip wheel --no-deps --no-build-isolation" in r.stdout
    assert not list(out.glob("*.whl")) and not (out / bfa.CONFIG_FILE).exists()
    status = json.loads((out / bfa.STATUS_FILE).read_text())
    assert status["state"] == "done" and status["wheel"] is None and status["config"]["dry_run"] is True
    assert "patchkit tools/build_flash_attn.py" in (out / "work" / fas.DIFF_FILE).read_text()


def test_cli_errors_are_one_line(fake_sdist: Path, tmp_path: Path) -> None:
    r = cli("--sdist", str(fake_sdist), "--out", str(tmp_path / "o"), "--archs", "75", "--dry-run")
    assert r.returncode == 1 and "compute capability 75" in r.stderr and "Traceback" not in r.stderr
    r = cli("--sdist", str(tmp_path / "nope.tar.gz"), "--out", str(tmp_path / "o"), "--archs", "90", "--dry-run")
    assert r.returncode == 1 and "no such file" in r.stderr


def test_status_round_trips(tmp_path: Path, capsys) -> None:
    assert bfa.show_status(tmp_path) == 2
    config = {"archs": ["90"], "head_dims": [64, 128], "disabled": ["dropout"]}
    bfa.write_status(tmp_path, state="running", started="t0", finished=None, wheel=None, log="l", config=config,
                     pid=os.getpid(), error=None)
    written = bfa.read_status(tmp_path)
    assert written == {"state": "running", "started": "t0", "finished": None, "wheel": None, "log": "l",
                       "config": config, "pid": os.getpid(), "error": None}
    capsys.readouterr()
    assert bfa.show_status(tmp_path) == 0
    assert json.loads(capsys.readouterr().out) == written
    bfa.write_status(tmp_path, state="done", finished="t1", wheel="w.whl")
    assert bfa.read_status(tmp_path) == {**written, "state": "done", "finished": "t1", "wheel": "w.whl"}
    r = cli("--status", str(tmp_path))
    assert r.returncode == 0 and json.loads(r.stdout)["wheel"] == "w.whl"


def test_status_of_a_vanished_build_is_failed(tmp_path: Path, capsys) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    bfa.write_status(tmp_path, state="running", pid=proc.pid)
    assert bfa.show_status(tmp_path) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["state"] == "failed" and "ended without recording" in shown["error"]


def wait_for_end(out: Path, seconds: float = 120) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = bfa.read_status(out) or {}
        if status.get("state") in ("done", "failed"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"build still running after {seconds}s: {bfa.read_status(out)}")


def test_background_dry_run(fake_sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(fake_sdist), "--out", str(out), "--archs", "90", "--head-dims", "64", "--dry-run",
            "--background")
    assert r.returncode == 0, r.stderr
    assert "started in the background" in r.stdout
    status = wait_for_end(out)
    assert status["state"] == "done", status
    assert status["config"]["head_dims"] == [64] and status["config"]["kernels_kept"] == 12
    assert "kernels: kept 12 of 72" in Path(status["log"]).read_text()


def _cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


@pytest.mark.skipif(_cuda_torch(), reason="a CUDA torch: this machine might really start compiling")
def test_background_build_with_a_cpu_torch_fails_in_preflight(fake_sdist: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = cli("--sdist", str(fake_sdist), "--out", str(out), "--archs", "90", "--head-dims", "64", "--background")
    assert r.returncode == 0, r.stderr
    status = wait_for_end(out, 300)
    assert status["state"] == "failed" and "preflight failed" in status["error"], status
    assert "is a CPU build" in status["error"]
    assert "preflight failed" in Path(status["log"]).read_text()
    assert not (out / bfa.CONFIG_FILE).exists()


# ----------------------------------------------------------------------------------------------- link check

STUB_FLASH_H = """#pragma once
namespace cutlass { struct half_t {}; struct bfloat16_t {}; }
typedef struct CUstream_st *cudaStream_t;
namespace FLASH_NAMESPACE {
struct Flash_fwd_params { int d; bool is_bf16; bool is_causal; int num_splits; int ran; };
struct Flash_bwd_params : Flash_fwd_params {};
template<typename T, int Headdim, bool Is_causal> void run_mha_fwd_(Flash_fwd_params &params, cudaStream_t stream);
template<typename T, int Headdim, bool Is_causal>
void run_mha_fwd_splitkv_dispatch(Flash_fwd_params &params, cudaStream_t stream);
template<typename T, int Headdim, bool Is_causal> void run_mha_bwd_(Flash_bwd_params &params, cudaStream_t stream);
}
"""

STUB_API = r"""#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include "namespace_config.h"
#include "flash.h"
template <typename... A> std::string pk_cat(const A &...a) { std::ostringstream s; (s << ... << a); return s.str(); }
#define TORCH_CHECK(COND, ...) do { if (!(COND)) throw std::runtime_error(pk_cat(__VA_ARGS__)); } while (0)
#include "static_switch.h"
using namespace FLASH_NAMESPACE;
// flash_api.cpp's two dispatchers, as in 2.8.3
void run_mha_fwd(Flash_fwd_params &params, cudaStream_t stream, bool force_split_kernel) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                if (params.num_splits <= 1 && !force_split_kernel) {
                    run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream);
                } else {
                    run_mha_fwd_splitkv_dispatch<elem_type, kHeadDim, Is_causal>(params, stream);
                }
            });
        });
    });
}
void run_mha_bwd(Flash_bwd_params &params, cudaStream_t stream) {
    FP16_SWITCH(!params.is_bf16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(params.is_causal, Is_causal, [&] {
                run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream);
            });
        });
    });
}
int main(int argc, char **argv) {
    int d = std::atoi(argv[1]), ran = -1;
    try {
        for (int bf16 = 0; bf16 < 2; ++bf16)
        for (int causal = 0; causal < 2; ++causal)
        for (int split = 0; split < 2; ++split) {
            Flash_bwd_params p{};
            p.d = d; p.is_bf16 = bf16; p.is_causal = causal; p.num_splits = 1; p.ran = -1;
            run_mha_fwd(p, nullptr, split);
            if (ran >= 0 && p.ran != ran) { std::printf("mixed %d %d\n", ran, p.ran); return 4; }
            ran = p.ran; p.ran = -1;
            run_mha_bwd(p, nullptr);
            if (p.ran != ran) { std::printf("bwd %d fwd %d\n", p.ran, ran); return 4; }
        }
    } catch (const std::exception &e) {
        std::printf("error: %s\n", e.what());
        return 3;
    }
    std::printf("ok %d\n", ran);
    return 0;
}
"""


def stub_launch_templates() -> dict[str, str]:
    """flash_{fwd,bwd}_launch_template.h stand-ins: every run_mha_*_hdimD records which bucket ran."""
    fwd = ['#pragma once\n#include "flash.h"\nnamespace FLASH_NAMESPACE {']
    bwd = list(fwd)
    for d in HDIMS:
        fwd.append(f"template<typename T, bool C> void run_mha_fwd_hdim{d}(Flash_fwd_params &p, cudaStream_t) "
                   f"{{ p.ran = {d}; }}")
        bwd.append(f"template<typename T, bool C> void run_mha_bwd_hdim{d}(Flash_bwd_params &p, cudaStream_t) "
                   f"{{ p.ran = {d}; }}")
    fwd.append("template<typename T, int D, bool C> void run_mha_fwd_splitkv_dispatch(Flash_fwd_params &p, "
               "cudaStream_t) { p.ran = D; }")
    return {"flash_fwd_launch_template.h": "\n".join(fwd + ["}"]) + "\n",
            "flash_bwd_launch_template.h": "\n".join(bwd + ["}"]) + "\n"}


def link(src: Path, kernel_files: list[str], switch_text: str, where: Path) -> subprocess.CompletedProcess:
    """Compiles the kept kernel files (their real text) and the dispatchers with the given static_switch.h against
    stub headers, and links them. Returns g++'s result; the program is where/prog."""
    where.mkdir(parents=True)
    stubs = {"namespace_config.h": "#pragma once\n#define FLASH_NAMESPACE flash\n", "flash.h": STUB_FLASH_H,
             "static_switch.h": switch_text, "api.cpp": STUB_API, **stub_launch_templates()}
    for name, text in stubs.items():
        (where / name).write_text(text)
    units = ["api.cpp"]
    for path in kernel_files:
        shutil.copy(src / path, where / Path(path).name)  # beside the stubs: its "..." includes find them
    (where / "kernels.cpp").write_text("".join(f'#include "{Path(p).name}"\n' for p in kernel_files))
    units.append("kernels.cpp")
    return subprocess.run(["g++", "-std=c++17", "-O0", "-w", *units, "-o", "prog"], cwd=where, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_trimmed_build_links_and_refuses_trimmed_head_dims_when_called(sdist: Path, tmp_path: Path) -> None:
    plan = prepared(sdist, tmp_path, head_dims=[64, 128])
    kept = [k["path"] for k in plan["kept"]]
    switch_text = (plan["src"] / fas.SWITCH_PATH).read_text()
    r = link(plan["src"], kept, switch_text, tmp_path / "trimmed")
    assert r.returncode == 0, r.stderr  # no undefined symbol: every dispatched kernel is compiled
    prog = str(tmp_path / "trimmed" / "prog")
    for d, bucket in ((64, 64), (40, 64), (128, 128), (100, 128)):
        run = subprocess.run([prog, str(d)], capture_output=True, text=True, timeout=30)
        assert (run.returncode, run.stdout.strip()) == (0, f"ok {bucket}"), run.stdout
    for d, dims in ((32, "1-32"), (80, "65-96"), (96, "65-96"), (160, "129-192"), (256, "193-256")):
        run = subprocess.run([prog, str(d)], capture_output=True, text=True, timeout=30)
        assert run.returncode == 3, run.stdout
        assert f"no kernels for head dims {dims} (kernel bucket {dims.split('-')[1]})" in run.stdout
        assert "head-dim buckets 64,128 only" in run.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_untrimmed_dispatch_with_trimmed_kernels_fails_to_link(fake_sdist: Path, tmp_path: Path) -> None:
    """The link check's control: upstream's HEADDIM_SWITCH needs every head dim's kernels."""
    plan = prepared(fake_sdist, tmp_path, head_dims=[64, 128])
    r = link(plan["src"], [k["path"] for k in plan["kept"]], STATIC_SWITCH, tmp_path / "untrimmed")
    assert r.returncode != 0
    assert re.search(r"undefined reference to .*run_mha_fwd_<cutlass::half_t, 32, (true|false)>", r.stderr)


def _cuda_include() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None, reason="needs g++ and nm")
def test_real_flash_api_references_only_kept_kernels(tmp_path: Path) -> None:
    """The real flash_api.cpp, compiled by the host compiler with the trimmed static_switch.h and the host flags the
    patched setup.py passes: the kernel symbols it leaves undefined are exactly those the kept .cu files define,
    and the disabled features' TORCH_CHECKs are in it (~10 s of g++)."""
    import sysconfig

    sdist, cuda = real_sdist(), _cuda_include()
    torch_spec = importlib.util.find_spec("torch")
    if sdist is None or cuda is None or torch_spec is None:
        pytest.skip("needs the real sdist, CUDA headers and torch's headers")
    torch_inc = Path(torch_spec.submodule_search_locations[0]) / "include"
    plan = prepared(sdist, tmp_path, head_dims=[64, 128], disabled=["dropout", "softcap"])
    src = plan["src"]
    # a CPU torch lacks this generated header; the stub folder is searched after torch's, so a CUDA torch's wins
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    host = setup_values((src / "setup.py").read_text())["host_extra"]
    includes = [src / "csrc/flash_attn", src / "csrc/flash_attn/src", src / "csrc/cutlass/include", torch_inc,
                torch_inc / "torch/csrc/api/include", tmp_path / "stub", sysconfig.get_paths()["include"], cuda]
    obj = tmp_path / "flash_api.o"
    r = subprocess.run(["g++", "-c", "-std=c++17", "-O0", "-w", "-DTORCH_API_INCLUDE_EXTENSION_H",
                        "-DTORCH_EXTENSION_NAME=flash_attn_2_cuda", *host, *(f"-I{i}" for i in includes),
                        str(src / fas.API_PATH), "-o", str(obj)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    symbol = re.compile(r"run_mha\w*<cutlass::\w+, \d+, \w+>")
    undefined = subprocess.run(["nm", "-C", "-u", str(obj)], capture_output=True, text=True, check=True).stdout
    needed = set(symbol.findall(undefined))
    defined = set(symbol.findall("".join((src / k["path"]).read_text() for k in plan["kept"])))
    assert len(needed) == 24 and needed == defined
    strings = obj.read_bytes()
    assert b"does not support dropout" in strings and b"does not support softcap" in strings
    assert b"no kernels for head dim" in strings
