"""tools/build_flash_attn.py's edits of flash-attn 2's sdist, on CPU: the kernels and head dims it keeps.

Also the disable flags it passes and the build config and wheel it names, on the fake sdist of tests/flash_sdist.py
and, where it is here, the real one."""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

import pytest
from flash_sdist import (  # noqa: F401 (fixtures)
    FLASH_API,
    HDIMS,
    STATIC_SWITCH,
    VERSION,
    bfa,
    expected_kernels,
    fake_files,
    fake_sdist_fixture,
    fas,
    headdim_switch,
    kernel_name,
    prepared,
    real_sdist,
    sdist_fixture,
    setup_values,
    write_tar,
)

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
