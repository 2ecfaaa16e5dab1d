"""The flash-attn sdist, trimmed: unpack it, keep the kernels of some head dims, switch features off, record it.

The editing half of `build_flash_attn.py` (which see for what is changed and why); pure file work, no compiler."""

from __future__ import annotations

import difflib
import hashlib
import itertools
import re
import shutil
import tarfile
from pathlib import Path
from typing import Optional

DIFF_FILE = "patchkit_trim.diff"
SWITCH_PATH = "csrc/flash_attn/src/static_switch.h"
API_PATH = "csrc/flash_attn/flash_api.cpp"
BUILD_INFO_PATH = "flash_attn/_patchkit_build.py"

# --disable names -> the macros flash-attn 2.8.3 honours (static_switch.h, flash_api.cpp, flash_bwd_launch_template.h)
FEATURES = {
    "dropout": "FLASHATTENTION_DISABLE_DROPOUT",
    "alibi": "FLASHATTENTION_DISABLE_ALIBI",
    "uneven_k": "FLASHATTENTION_DISABLE_UNEVEN_K",
    "softcap": "FLASHATTENTION_DISABLE_SOFTCAP",
    "local": "FLASHATTENTION_DISABLE_LOCAL",
    "backward": "FLASHATTENTION_DISABLE_BACKWARD",
}

# setup.py emits -gencode only for these FLASH_ATTN_CUDA_ARCHS entries, each from an nvcc version on.

KERNEL_RE = re.compile(
    r'^\s*"(?P<path>csrc/flash_attn/src/flash_(?P<kind>fwd_split|fwd|bwd)_hdim(?P<hdim>\d+)'
    r'_(?P<dtype>fp16|bf16)(?P<causal>_causal)?_sm80\.cu)",\s*$'
)
INSTANCE_RE = re.compile(
    r"\b(run_mha_fwd_splitkv_dispatch|run_mha_fwd_|run_mha_bwd_)<cutlass::(half_t|bfloat16_t),\s*(\d+),\s*(true|false)>"
)
DISABLE_LINE_RE = re.compile(r'^(?P<indent>\s*)#\s*"-D(?P<macro>FLASHATTENTION_DISABLE_\w+)",\s*$')


class BuildError(RuntimeError):
    """A build that cannot go on: the message says why and what to do."""


# ----------------------------------------------------------------------------------------------- arguments


def unpack(sdist: Path, work: Path) -> Path:
    """Unpacks the sdist into a fresh WORK/src and returns the source root (the folder holding setup.py)."""
    dest = work / "src"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # Python without extraction filters: refuse members that leave dest
            for member in tar.getmembers():
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise BuildError(f"{sdist}: unsafe member {member.name!r}")
            tar.extractall(dest)
    roots = [p.parent for p in dest.glob("*/setup.py")]
    if len(roots) != 1:
        raise BuildError(f"{sdist}: expected one top folder with setup.py, found {len(roots)}")
    return roots[0]


def package_version(src: Path) -> str:
    text = (src / "flash_attn" / "__init__.py").read_text()
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if not m:
        raise BuildError(f"{src}/flash_attn/__init__.py: no __version__")
    return m.group(1)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- kernels


def kernel_sources(setup_text: str) -> list[dict]:
    """The kernel .cu entries of setup.py's sources list: path, kind (fwd/fwd_split/bwd), hdim, dtype, causal."""
    found = []
    for line in setup_text.splitlines():
        m = KERNEL_RE.match(line)
        if m:
            found.append(
                {
                    "path": m["path"],
                    "kind": m["kind"],
                    "hdim": int(m["hdim"]),
                    "dtype": m["dtype"],
                    "causal": bool(m["causal"]),
                }
            )
    if not found:
        raise BuildError("setup.py lists no csrc/flash_attn/src/flash_*_hdim*_sm80.cu: not a flash-attn 2 sdist?")
    return found


def trim_sources(setup_text: str, keep: set[int]) -> str:
    """setup.py without the source lines of head dims not in keep."""
    out = []
    for line in setup_text.splitlines(keepends=True):
        m = KERNEL_RE.match(line.rstrip("\n"))
        if m and int(m["hdim"]) not in keep:
            continue
        out.append(line)
    return "".join(out)


# ----------------------------------------------------------------------------------------------- dispatch


def find_headdim_switch(text: str) -> tuple[int, int]:
    """(start, end) offsets of the `#define HEADDIM_SWITCH` macro, continuation lines included."""
    start = text.find("#define HEADDIM_SWITCH(")
    if start < 0:
        raise BuildError(f"{SWITCH_PATH}: no `#define HEADDIM_SWITCH(`")
    end = start
    while True:
        nl = text.find("\n", end)
        if nl < 0:
            return start, len(text)
        if not text[end:nl].rstrip().endswith("\\"):
            return start, nl + 1
        end = nl + 1


def switch_buckets(macro: str) -> list[int]:
    """The head-dim buckets of an upstream HEADDIM_SWITCH: `HEADDIM <= D` each followed by `kHeadDim = D`."""
    bounds = [int(d) for d in re.findall(r"HEADDIM\s*<=\s*(\d+)", macro)]
    dims = [int(d) for d in re.findall(r"kHeadDim\s*=\s*(\d+)", macro)]
    if not bounds or bounds != dims or bounds != sorted(set(bounds)):
        raise BuildError(
            f"{SWITCH_PATH}: HEADDIM_SWITCH is not the `if (HEADDIM <= D) {{ kHeadDim = D; ... }}` chain this tool "
            "knows (flash-attn 2.8.x); refusing to trim it"
        )
    return bounds


def trimmed_switch(buckets: list[int], keep: set[int]) -> str:
    """A HEADDIM_SWITCH with upstream's buckets whose trimmed buckets raise instead of instantiating kernels."""
    kept = ",".join(str(d) for d in buckets if d in keep)
    lines = [
        f"// patchkit tools/build_flash_attn.py --head-dims {kept}: only these head-dim buckets were compiled.",
        "// A trimmed bucket raises (TORCH_CHECK) instead of instantiating its kernels: no missing one is referenced.",
        "#define HEADDIM_SWITCH(HEADDIM, ...)",
        "  [&] {",
    ]
    # The message is one string literal: streaming the int HEADDIM into it crashed the process (SIGSEGV inside
    # std::ostream's int formatting in the extension; seen on an H100, torch 2.11+cu130, nvcc 13.0, g++ 13).
    for i, d in enumerate(buckets):
        lines.append(f"    {'if' if i == 0 else '} else if'} (HEADDIM <= {d}) {{")
        if d in keep:
            lines += [f"      constexpr static int kHeadDim = {d};", "      return __VA_ARGS__();"]
        else:
            low = buckets[i - 1] + 1 if i else 1
            lines.append(
                f'      TORCH_CHECK(false, "This flash attention build has no kernels for head dims {low}-{d} '
                f'(kernel bucket {d}); it was built for head-dim buckets {kept} only '
                f'(patchkit tools/build_flash_attn.py --head-dims).");'
            )
    lines += ["    }", "  }()"]
    width = max(len(line) for line in lines[2:] if "TORCH_CHECK" not in line)
    body = [line.ljust(width) + " \\" for line in lines[2:-1]] + [lines[-1]]
    return "\n".join(lines[:2] + body) + "\n"


def trim_switch(text: str, keep: set[int]) -> tuple[str, list[int]]:
    """static_switch.h with HEADDIM_SWITCH trimmed to keep, and upstream's buckets."""
    start, end = find_headdim_switch(text)
    buckets = switch_buckets(text[start:end])
    return text[:start] + trimmed_switch(buckets, keep) + text[end:], buckets


def instantiations(cu_texts: list[str]) -> set[tuple[str, str, int, bool]]:
    """(function, element type, head dim, causal) of the run_mha_* templates the given .cu files define."""
    found = set()
    for text in cu_texts:
        for fn, dtype, hdim, causal in INSTANCE_RE.findall(text):
            found.add((fn, dtype, int(hdim), causal == "true"))
    return found


def check_symbols(src: Path, kept_paths: list[str], switch_text: str, keep: set[int]) -> None:
    """Fails unless the kept .cu files define every template the trimmed dispatch instantiates, and the
    dispatch (and flash_api.cpp) instantiate no trimmed head dim: the extension then has no undefined symbol."""
    start, end = find_headdim_switch(switch_text)
    dispatched = {int(d) for d in re.findall(r"kHeadDim\s*=\s*(\d+)", switch_text[start:end])}
    if dispatched != keep:
        raise BuildError(f"trimmed HEADDIM_SWITCH dispatches head dims {sorted(dispatched)}, expected {sorted(keep)}")
    fns = ("run_mha_fwd_", "run_mha_fwd_splitkv_dispatch", "run_mha_bwd_")
    needed = set(itertools.product(fns, ("half_t", "bfloat16_t"), sorted(keep), (False, True)))
    defined = instantiations([(src / p).read_text() for p in kept_paths])
    missing = needed - defined
    if missing:
        raise BuildError(f"kept kernel files do not define {sorted(missing)[:4]}... ({len(missing)} missing)")
    api = src / API_PATH
    if api.exists():
        literal = {h for _, _, h, _ in instantiations([api.read_text()])} - keep
        if literal:
            raise BuildError(f"{API_PATH} instantiates trimmed head dims {sorted(literal)} directly")


# ----------------------------------------------------------------------------------------------- disable flags


def honoured_macros(src: Path) -> set[str]:
    """FLASHATTENTION_DISABLE_* macros the C++/CUDA sources test."""
    found = set()
    for path in (src / "csrc" / "flash_attn").rglob("*"):
        if path.suffix in (".h", ".cpp", ".cu", ".cuh") and path.is_file():
            text = path.read_text(errors="replace")
            found.update(re.findall(r"#\s*if(?:n?def)?\s+(FLASHATTENTION_DISABLE_\w+)", text))
    return found


def apply_disable(setup_text: str, macros: list[str], honoured: set[str]) -> str:
    """setup.py with macros defined for nvcc (commented lines uncommented, else added after --use_fast_math) and
    for the host compiler (appended to compiler_c17_flag, where flash_api.cpp's TORCH_CHECKs see them)."""
    if not macros:
        return setup_text
    unknown = [m for m in macros if m not in honoured]
    if unknown:
        raise BuildError(f"this sdist's csrc/flash_attn never tests {unknown}; disabling them would do nothing")
    lines = setup_text.splitlines(keepends=True)
    pending = list(macros)
    for i, line in enumerate(lines):
        m = DISABLE_LINE_RE.match(line.rstrip("\n"))
        if m and m["macro"] in pending:
            lines[i] = f'{m["indent"]}"-D{m["macro"]}",\n'
            pending.remove(m["macro"])
    if pending:
        at = next((i for i, line in enumerate(lines) if line.strip() == '"--use_fast_math",'), None)
        if at is None:
            raise BuildError('setup.py: no `"--use_fast_math",` in nvcc_flags to add the disable flags after')
        indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
        lines[at + 1 : at + 1] = [f'{indent}"-D{m}",  # patchkit\n' for m in pending]
    return add_host_flags("".join(lines), macros)


def add_host_flags(setup_text: str, macros: list[str]) -> str:
    """Appends the -D flags to compiler_c17_flag just before the CUDA extension is declared."""
    pattern = r'^(?P<indent>[ \t]*)ext_modules\.append\(\s*\n\s*CUDAExtension\(\s*\n\s*name="flash_attn_2_cuda"'
    anchor = re.search(pattern, setup_text, re.MULTILINE)
    if not anchor:
        raise BuildError('setup.py: no `ext_modules.append(CUDAExtension(name="flash_attn_2_cuda"` for the host flags')
    indent = anchor["indent"]
    flags = ", ".join(f'"-D{m}"' for m in macros)
    block = (
        f"{indent}# patchkit tools/build_flash_attn.py: flash_api.cpp (host compiler) holds the TORCH_CHECKs that\n"
        f"{indent}# refuse a disabled feature, so the macros must reach it too, not nvcc alone.\n"
        f"{indent}compiler_c17_flag = compiler_c17_flag + [{flags}]\n\n"
    )
    return setup_text[: anchor.start()] + block + setup_text[anchor.start() :]


# ----------------------------------------------------------------------------------------------- plan


def local_version(archs: list[str], head_dims: list[int], trimmed: bool, disabled: list[str]) -> str:
    """The wheel's PEP 440 local version: pk.sm90.hd64.hd128.nodropout (hdall when no head dim is trimmed)."""
    parts = ["pk"] + [f"sm{a}" for a in archs]
    parts += [f"hd{d}" for d in head_dims] if trimmed else ["hdall"]
    parts += ["no" + name.replace("_", "") for name in disabled]
    return ".".join(parts)


def diff_text(name: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{name}", f"b/{name}"))


def prepare(sdist: Path, work: Path, archs: list[str], head_dims: Optional[list[int]], disabled: list[str]) -> dict:
    """Unpacks and patches the sdist in WORK; returns the plan (config, kept kernels, diffs). No compiler needed."""
    src = unpack(sdist, work)
    setup_path, switch_path = src / "setup.py", src / SWITCH_PATH
    setup_before, switch_before = setup_path.read_text(), switch_path.read_text()
    kernels = kernel_sources(setup_before)
    start, end = find_headdim_switch(switch_before)
    buckets = switch_buckets(switch_before[start:end])
    keep = resolve_head_dims(head_dims, buckets, {k["hdim"] for k in kernels})
    trimmed = keep != set(buckets)
    setup_after, switch_after = setup_before, switch_before
    if trimmed:
        setup_after = trim_sources(setup_before, keep)
        switch_after, _ = trim_switch(switch_before, keep)
    macros = [FEATURES[name] for name in disabled]
    setup_after = apply_disable(setup_after, macros, honoured_macros(src))
    kept = [k for k in kernels if k["hdim"] in keep]
    check_symbols(src, [k["path"] for k in kept], switch_after, keep)
    setup_path.write_text(setup_after)
    switch_path.write_text(switch_after)
    version = package_version(src)
    config = {
        "flash_attn_version": version,
        "local_version": local_version(archs, sorted(keep), trimmed, disabled),
        "sdist": str(sdist),
        "sdist_sha256": sha256(sdist),
        "archs": archs,
        "head_dims": sorted(keep),
        "head_dims_trimmed": sorted(set(buckets) - keep),
        "head_dim_buckets": buckets,
        "disabled": disabled,
        "disable_macros": macros,
        "kernels_total": len(kernels),
        "kernels_kept": len(kept),
    }
    (src / BUILD_INFO_PATH).write_text(build_info_source(config))
    diff = diff_text("setup.py", setup_before, setup_after) + diff_text(SWITCH_PATH, switch_before, switch_after)
    (work / DIFF_FILE).write_text(diff)
    return {"src": src, "config": config, "kept": kept, "diff_path": work / DIFF_FILE}


def build_info_source(config: dict) -> str:
    """flash_attn/_patchkit_build.py: the build's config as a literal, read by patchkit's flash_attn backend."""
    return ('"""Written by patchkit tools/build_flash_attn.py: what this flash-attn build was compiled with."""\n\n'
            f"BUILD_CONFIG = {config!r}\n")


def resolve_head_dims(head_dims: Optional[list[int]], buckets: list[int], compiled: set[int]) -> set[int]:
    """The kernel buckets to keep: every bucket without --head-dims; else each requested head dim's bucket
    (d <= bucket, as HEADDIM_SWITCH maps it)."""
    if set(buckets) != compiled:
        raise BuildError(f"setup.py compiles head dims {sorted(compiled)} but HEADDIM_SWITCH dispatches {buckets}")
    if not head_dims:
        return set(buckets)
    keep = set()
    for d in head_dims:
        bucket = next((b for b in buckets if d <= b), None)
        if d <= 0 or bucket is None:
            raise BuildError(f"--head-dims: {d} is outside flash-attn's head dims (1..{buckets[-1]})")
        if bucket != d:
            print(f"note: head dim {d} runs on the hdim{bucket} kernels; keeping bucket {bucket}")
        keep.add(bucket)
    return keep
