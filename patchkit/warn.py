"""patchkit's warnings point at the user's own line: the first frame outside installed packages and the stdlib.

Frameworks (TRL, accelerate, the HF Trainer) are installed packages too: a warning raised while TRL's trainer runs
the model names the user's `trainer.train()` line, not TRL's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
import warnings
from types import FrameType
from typing import Iterator, Optional

# Frames of these modules are never the user's: the warning is attributed further out.
INTERNAL_MODULES = ("patchkit", "patchkit.patches", "transformers", "torch", "_patchkit_startup")
_where: list[tuple[str, int]] = []  # an explicit call site, set by the launcher (the user's script, line 1)
_registry: dict = {}  # warn_explicit's once-per-location registry for explicit call sites


@functools.lru_cache(maxsize=4096)
def real_path(filename: str) -> str:
    """`filename` with every symlink resolved: a package reached through a link (a linked checkout, a venv's lib64)
    names its files by the link in `__file__` and by the target in its code objects, or the other way round."""
    return os.path.realpath(filename)


def _module_root(name: str) -> Optional[str]:
    """The folder of a package (or the file of a plain module) that is already imported, by its real path, else
    None."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    path = real_path(path)
    return os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path


def package_home(name: str) -> Optional[str]:
    """The real folder of an imported package, ending in a separator (compare with `real_path` of a code's file)."""
    root = _module_root(name)
    return None if root is None or root.endswith(".py") else root + os.sep


def _internal_prefixes() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(internal package roots and the stdlib, site-packages folders: installed packages, frameworks included)."""
    roots = [r for r in map(_module_root, INTERNAL_MODULES) if r]
    paths = sysconfig.get_paths()
    stdlib = {real_path(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    sites = {real_path(paths[k]) for k in ("purelib", "platlib") if paths.get(k)}
    prefixes = tuple(r if r.endswith(".py") else r + os.sep for r in roots) + tuple(s + os.sep for s in stdlib)
    return prefixes, tuple(s + os.sep for s in sites)


def is_internal(filename: str, prefixes: tuple[str, ...], sites: tuple[str, ...]) -> bool:
    """True for patchkit's, transformers', torch's, any installed package's (a framework's) and the standard
    library's frames (importlib's frozen ones too)."""
    if filename.startswith("<frozen "):
        return True
    path = real_path(os.path.abspath(filename))
    if any(path.startswith(s) for s in sites):
        return True
    return any(path == p or path.startswith(p) for p in prefixes)


def user_frame(start: FrameType) -> Optional[FrameType]:
    """The first frame from `start` outwards that is not internal (None when every frame is)."""
    prefixes, sites = _internal_prefixes()
    frame: Optional[FrameType] = start
    while frame is not None and is_internal(frame.f_code.co_filename, prefixes, sites):
        frame = frame.f_back
    return frame


@contextlib.contextmanager
def attributed_to(filename: str, lineno: int = 1) -> Iterator[None]:
    """Attribute patchkit's warnings inside the block to `filename:lineno` (the launcher: the user's script)."""
    _where.append((filename, lineno))
    try:
        yield
    finally:
        _where.pop()


def _main_thread_user_frame() -> Optional[FrameType]:
    """In a worker thread (transformers' continuous batching) no frame is the user's: the main thread's user line."""
    main = threading.main_thread()
    if threading.current_thread() is main:
        return None
    frame = sys._current_frames().get(main.ident)
    return None if frame is None else user_frame(frame)


MAX_FRAMES = 64  # the call's frames read at most, from the LM's forward up to the Trainer's compute_loss


def trainers(frame: FrameType, name: str) -> bool:
    """`frame` runs the HF Trainer's own method `name` (transformers/trainer.py's)."""
    home = package_home("transformers") if "transformers.trainer" in sys.modules else None
    code = frame.f_code
    return home is not None and code.co_name == name and real_path(code.co_filename) == home + "trainer.py"


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn at the user's call site: the first stack frame outside patchkit, transformers, torch and the stdlib."""
    if _where:
        filename, lineno = _where[-1]
        warnings.warn_explicit(message, category, filename, lineno, module="__main__", registry=_registry)
        return
    caller = sys._getframe(1)
    frame = user_frame(caller) or _main_thread_user_frame() or caller
    globs = frame.f_globals
    warnings.warn_explicit(
        message, category, frame.f_code.co_filename, frame.f_lineno, module=globs.get("__name__", "<string>"),
        registry=globs.setdefault("__warningregistry__", {}),
    )
