"""tools/build_flash_attn.py's trimmed sources compiled and linked against stub headers, on CPU, where g++ is here.

An undefined kernel symbol fails the link, and a trimmed head dim must raise when called; with the real sdist, CUDA
headers and nm, the real flash_api.cpp references exactly the kept kernels.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from flash_sdist import (  # noqa: F401 (fixtures)
    HDIMS,
    STATIC_SWITCH,
    fake_sdist_fixture,
    fas,
    prepared,
    real_sdist,
    sdist_fixture,
    setup_values,
)

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
