"""The fake flash-attn 2 sdist that tools/build_flash_attn.py's tests trim, and the tool itself, loaded once.

The fake sdist (setup.py with the sources list and the commented -D flags, static_switch.h with upstream's
HEADDIM_SWITCH, the generated kernel .cu files, flash_api.cpp's #ifdefs) always exercises the trimming; the real
flash_attn-2.8.3.post2.tar.gz is used when found at $FLASH_ATTN_SDIST or /tmp/fa_sdist/*.tar.gz (nothing is
downloaded). Shared by tests/test_build_flash_attn_trim.py, _cli.py and _link.py.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import io
import itertools
import os
import sys
import tarfile
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


# The fixtures, named apart from their functions: a test file imports these names, and its tests' arguments
# `fake_sdist` and `sdist` shadow nothing.
@pytest.fixture(name="fake_sdist")
def fake_sdist_fixture(tmp_path: Path) -> Path:
    return write_tar(tmp_path / f"flash_attn-{VERSION}.tar.gz", fake_files())


def real_sdist() -> Path | None:
    env = os.environ.get("FLASH_ATTN_SDIST")
    if env and Path(env).is_file():
        return Path(env)
    found = sorted(glob.glob("/tmp/fa_sdist/flash_attn-*.tar.gz"))
    return Path(found[-1]) if found else None


@pytest.fixture(name="sdist", params=["fake", "real"])
def sdist_fixture(request, tmp_path: Path) -> Path:
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

