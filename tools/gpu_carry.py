"""What `make gpu-truth` carries to the GPU machine (no network, 64 MiB a call): fetched here, packed into two calls.

flash-attn 4's CUTLASS DSL library wheel (nvidia-cutlass-dsl-libs-cu13) is 92 MB, more than one call may carry. It
travels repacked: its member files as one xz stream (75 MB at preset 1, 237 MB unpacked), split in two parts.

  call 1 carries .gpu1/ (the xz's first part, flash-attn 2's sdist): `--stage 1` leaves the part in /tmp on the
         machine, which stays warm 30 s after a call, and starts the flash-attn 2 build there in the background;
  call 2 carries .gpu/ (transformers, the other wheels, the second part and the manifest): `make gpu-truth` joins the
         parts, rebuilds the wheel (Python's zipfile with each member's original header fields and zlib level 6: the
         original's bytes where the machine's zlib is the one here, else a valid wheel of the same member bytes,
         which xz's CRC64 vouches for), then installs everything.
Each call's size counts the repo's files that travel (tracked and untracked-not-ignored) besides its carried folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu"  # call 2 (`make gpu-truth`)
STAGE1 = ROOT / ".gpu1"  # call 1 (`make gpu-truth-stage1`)
PARTS_AT = Path("/tmp/patchkit-carried")  # where call 1 leaves its part and call 2 rebuilds the wheel
LIMIT = 64 * 2**20  # the working tree that travels in one call, carried paths included
MARGIN = 2**20  # left free in call 1 by --fetch: the repo may grow this much before the parts stop fitting
XZ_PRESET = 1  # 75 MB in ~40 s of one core here; preset 6 gives 65 MB in ~3 min
FLASH_ATTN = "2.8.3.post2"  # flash-attn 2's sdist (tools/build_flash_attn.py knows its layout)
# flash-attn 4 and what it needs that the device's image (torch 2.11+cu130, Python 3.12) lacks, pinned together:
# each wheel's Requires-Dist read (cuda-bindings, protobuf, einops, typing-extensions are in the image). The CUDA 13
# flavour of the DSL only (`flash-attn-4[cu13]`): installed with --no-deps, the cu12 flavour nvidia-cutlass-dsl names
# is not needed (the DSL picks the newest flavour the driver runs).
FLASH_ATTN_4 = ("flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1",
                "apache-tvm-ffi==0.1.15.post2", "quack-kernels==0.6.5", "torch-c-dlpack-ext==0.1.5")
BIG = "nvidia_cutlass_dsl_libs_cu13-"  # the wheel that is split
FLASH_ATTN_4_WHEELS = ("flash_attn_4-", "nvidia_cutlass_dsl", "apache_tvm_ffi-", "quack_kernels-",
                       "torch_c_dlpack_ext-")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
ZIP_FIELDS = ("compress_type", "external_attr", "create_system", "create_version", "extract_version", "flag_bits",
              "internal_attr")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def repo_bytes(root: Path = ROOT) -> int:
    """The repo's share of every call: tracked and untracked-not-ignored files, as the device counts them."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    paths = (root / p for p in out.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def pack(wheel: Path, part1: Path, part2: Path, first: int, preset: int = XZ_PRESET) -> dict:
    """`wheel`'s members as one xz stream, its first `first` bytes in folder `part1`, the rest in `part2`, and the
    manifest (every member's zip header fields, the parts' and the wheel's sha256) beside each part."""
    stem = wheel.name.removesuffix(".whl")
    xz = part2 / f"{stem}.xz.tmp"
    members = []
    comp = lzma.LZMACompressor(preset=preset)
    with zipfile.ZipFile(wheel) as z, xz.open("wb") as out:
        for info in z.infolist():
            data = z.read(info)
            out.write(comp.compress(data))
            members.append({"name": info.filename, "date_time": list(info.date_time), "size": len(data),
                            "extra": info.extra.hex(), "comment": info.comment.hex(),
                            **{k: getattr(info, k) for k in ZIP_FIELDS}})
        out.write(comp.flush())
        zip_comment = z.comment.hex()
    total = xz.stat().st_size
    first = max(0, min(first, total))
    names = [part1 / f"{stem}.xz.1", part2 / f"{stem}.xz.2"]
    with xz.open("rb") as src:
        for name, n in zip(names, (first, total - first)):
            name.write_bytes(src.read(n))
    xz.unlink()
    manifest = {"wheel": wheel.name, "sha256": sha256(wheel), "size": wheel.stat().st_size, "xz_size": total,
                "comment": zip_comment, "members": members,
                "parts": [{"name": p.name, "size": p.stat().st_size, "sha256": sha256(p)} for p in names]}
    for folder in (part1, part2):
        (folder / f"{stem}.json").write_text(json.dumps(manifest))
    return manifest


def manifests(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{BIG}*.json")) if folder.is_dir() else []


def find_part(name: str, digest: str, folders: list[Path]) -> Optional[Path]:
    return next((f / name for f in folders if (f / name).is_file() and sha256(f / name) == digest), None)


def assemble(manifest_path: Path, folders: list[Path], into: Path) -> tuple[Optional[Path], str]:
    """The wheel rebuilt from its parts (looked for in `folders`, each checked against its sha256) into `into`:
    (its path, what happened) or (None, why not)."""
    m = json.loads(manifest_path.read_text())
    parts = [find_part(p["name"], p["sha256"], folders) for p in m["parts"]]
    if None in parts:
        missing = [p["name"] for p, at in zip(m["parts"], parts) if at is None]
        return None, f"{m['wheel']}: part {', '.join(missing)} not found (call 1 not run on this machine?)"
    into.mkdir(parents=True, exist_ok=True)
    target = into / m["wheel"]
    stream = lzma.open(io.BytesIO(b"".join(p.read_bytes() for p in parts)))  # type: ignore[union-attr]
    with zipfile.ZipFile(target, "w") as z:
        for e in m["members"]:
            info = zipfile.ZipInfo(e["name"], tuple(e["date_time"]))
            for k in ZIP_FIELDS:
                setattr(info, k, e[k])
            info.extra, info.comment = bytes.fromhex(e["extra"]), bytes.fromhex(e["comment"])
            data = stream.read(e["size"])
            if len(data) != e["size"]:
                return None, f"{m['wheel']}: the xz stream ended inside {e['name']}"
            z.writestr(info, data, compresslevel=6 if info.compress_type else None)
        z.comment = bytes.fromhex(m["comment"])
    exact = sha256(target) == m["sha256"]
    return target, f"{m['wheel']} rebuilt from {len(parts)} parts" + (
        " (the original's sha256)" if exact else " (same members; this zlib deflates otherwise: other bytes)")


def stage1(into: Path = PARTS_AT, folder: Path = STAGE1) -> str:
    """Call 1 on the device: the carried part(s), each checked, copied where call 2 finds them."""
    into.mkdir(parents=True, exist_ok=True)
    said = []
    for man in manifests(folder):
        for p in json.loads(man.read_text())["parts"]:
            if (folder / p["name"]).is_file():
                ok = sha256(folder / p["name"]) == p["sha256"]
                if ok:
                    shutil.copy2(folder / p["name"], into / p["name"])
                said.append(f"{p['name']} ({p['size']} bytes, {'sha256 ok' if ok else 'SHA256 MISMATCH'})")
    return "; ".join(said) or f"no part in {folder}"


def split_for_install(wheels: list[Path], flash4: Optional[Path]) -> list[Path]:
    """The wheels to install: flash-attn 4's set only where its big wheel was rebuilt (`flash4`), with it."""
    if flash4 is None:
        return [w for w in wheels if not w.name.startswith(FLASH_ATTN_4_WHEELS)]
    return sorted([*wheels, flash4], key=lambda w: w.name)


def download(names: list[str], into: Path) -> int:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return subprocess.call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(into),
                            *names])


def fetch_sdist(into: Path) -> Optional[str]:
    """flash-attn 2's sdist from PyPI (pip download of it runs its setup.py, which needs CUDA); None, or why not."""
    if list(into.glob(f"flash_attn-{FLASH_ATTN}.tar.gz")):
        return None
    from urllib.request import urlopen

    page = urlopen("https://pypi.org/simple/flash-attn/", timeout=60).read().decode()
    link = re.search(rf'href="(https://[^"#]*flash_attn-{re.escape(FLASH_ATTN)}\.tar\.gz)', page)
    if link is None:
        return f"flash_attn-{FLASH_ATTN}.tar.gz is not on PyPI's index page"
    (into / f"flash_attn-{FLASH_ATTN}.tar.gz").write_bytes(urlopen(link.group(1), timeout=300).read())
    return None


def plan(repo: int, call1: int, call2: int) -> list[str]:
    """The two device calls, with what each carries; a call over the limit is said."""
    lines = []
    for n, (cmd, carry, size, timeout) in enumerate(((
            "make gpu-truth-stage1", STAGE1.name, call1, 120), ("make gpu-truth", CARRY.name, call2, 600)), 1):
        total = repo + size
        over = "" if total <= LIMIT else f"  OVER THE LIMIT by {(total - LIMIT) / 2**20:.1f} MiB"
        lines.append(f'call {n}: run(command="{cmd}", carry=["{carry}"], timeout_s={timeout})  '
                     f"# {total / 2**20:.1f} MiB: repo {repo / 2**20:.1f} + {carry} {size / 2**20:.1f}{over}")
    lines.append("call 2 must start within 30 s of call 1's end (the machine is given back after 30 s idle); "
                 "call 2 alone runs everything but flash-attn 4")
    return lines


def fetch(into: Path = CARRY, stage1_dir: Path = STAGE1, preset: int = XZ_PRESET) -> int:
    """Download what the GPU machine lacks into `into` and `stage1_dir` (the pinned transformers, regex, flash-attn
    2's sdist, flash-attn 4's wheels), pack the big wheel across the two calls, print the calls."""
    for folder in (into, stage1_dir):
        folder.mkdir(parents=True, exist_ok=True)
    pinned = re.search(r"^TRANSFORMERS \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    code = download([pinned.group(1) if pinned else "transformers", "regex", "accelerate", "psutil", *FLASH_ATTN_4],
                    into)
    why = fetch_sdist(into) if code == 0 else "pip download failed"
    if why is not None:
        print(f"fetch: {why}")
        return 1
    shutil.copy2(into / f"flash_attn-{FLASH_ATTN}.tar.gz", stage1_dir)  # call 1 starts the build; call 2 can too
    odd = [f.name for f in into.iterdir() if "+" in f.name]
    big = next(iter(sorted(into.glob(f"{BIG}*.whl"))), None)
    if big is None or odd:
        print(f"fetch: {'no ' + BIG + '*.whl' if big is None else 'a name with +: ' + ', '.join(odd)}")
        return 1
    repo = repo_bytes()
    first = LIMIT - MARGIN - repo - folder_bytes(stage1_dir) - 8192  # the manifest beside the part
    for old in [*stage1_dir.glob(f"{BIG}*"), *into.glob(f"{BIG}*.xz.*"), *into.glob(f"{BIG}*.json")]:
        old.unlink()
    m = pack(big, stage1_dir, into, first, preset)
    big.unlink()  # it travels as its parts
    print(f"fetch: {m['wheel']} ({m['size'] / 2**20:.1f} MiB) packed as xz ({m['xz_size'] / 2**20:.1f} MiB): "
          + ", ".join(f"{p['name']} {p['size'] / 2**20:.1f} MiB" for p in m["parts"]))
    print("fetch: " + ", ".join(sorted(f.name for f in into.iterdir())))
    lines = plan(repo, folder_bytes(stage1_dir), folder_bytes(into))
    print("\n".join(lines))
    return 1 if any("OVER THE LIMIT" in ln for ln in lines) else 0


def overlay_cute(fa2: Path, site: Path) -> str:
    """flash-attn 2's package folder `fa2` ships a `cute` folder of its own (an older flash-attn 4): where flash-attn
    4 was installed into `site`, its `flash_attn/cute` replaces that one, as `pip install flash-attn-4` after
    flash-attn would. The regular package flash_attn (flash-attn 2's) wins the import over the namespace folder
    `site`/flash_attn, so without this `flash_attn.cute` would be flash-attn 2's copy."""
    carried = site / "flash_attn" / "cute"
    if not carried.is_dir() or fa2.resolve() == (site / "flash_attn").resolve():
        return "no flash-attn 4 to overlay"
    shutil.rmtree(fa2 / "cute", ignore_errors=True)
    shutil.copytree(carried, fa2 / "cute")
    return f"flash-attn 4's flash_attn/cute copied into {fa2}"
