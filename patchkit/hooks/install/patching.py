"""Replace attributes all or nothing, and put the exact original objects back on revert."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
import weakref
from typing import Any, Callable, Optional

import torch  # noqa: F401 (torch 2.6's dynamo names `torch` in the code it writes for BoundPatch.__call__'s frame)

from patchkit.errors import PatchStateError, PatchTargetError

_MISSING = object()
_FROM_CLASS = object()  # an instance attribute that was not there: revert deletes ours, the class's shows again


@dataclasses.dataclass
class Replacement:
    """One attribute to replace: `owner.attr = new`, remembering what was there."""

    owner: Any
    attr: str
    new: Any
    label: str = ""
    original: Any = dataclasses.field(default=_MISSING, repr=False)
    had_own: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        # A loaded model's modules are held weakly: a handle must not keep a model alive after its user drops it.
        if isinstance(self.new, BoundPatch):
            self.owner = weakref.ref(self.owner)

    def target(self) -> Any:
        """The object whose attribute is replaced (None once a weakly held module is gone)."""
        return self.owner() if isinstance(self.owner, weakref.ref) else self.owner

    def describe(self) -> str:
        if self.label:
            return self.label
        owner = self.target()
        name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None)
        return f"{name or type(owner).__name__}.{self.attr}"


class BoundPatch:
    """A patched method bound to one module instance, set as that instance's attribute.

    Unlike a bound method, it follows the module through `copy.deepcopy` *and* tells `on_copy`, so the patch's
    revert reaches the copy too; and it pickles as the module's own original method, so a saved model loads and
    runs unpatched where patchkit is not installed.
    """

    __slots__ = ("__func__", "__self__", "attr", "on_copy", "__weakref__")

    def __init__(self, func: Callable, module: Any, attr: str, on_copy: Callable[[Any, str], None]) -> None:
        self.__func__ = func
        self.__self__ = module
        self.attr = attr
        self.on_copy = on_copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and args[0] is self.__self__:  # bound again, as a method of its module: its own module as input
            raise PatchStateError(
                f"{type(self.__self__).__name__}.{self.attr}: patchkit's patch of this instance was bound to it "
                "again as a method (accelerate's unwrap_model(model, keep_fp32_wrapper=False) after apply_patch("
                "model=...) strips the forwards it knows and binds what is left), so the module would be passed "
                "as its own input. Call apply_patch(model=...) after unwrapping, or before accelerator.prepare()")
        return self.__func__(self.__self__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """What a bound method shows of its function (`__name__`, `__annotations__`, a framework's own attributes)."""
        if name.startswith("__") and name not in SHOWN:
            raise AttributeError(name)
        return getattr(self.__func__, name)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.__func__)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __deepcopy__(self, memo: dict) -> BoundPatch:
        module = copy.deepcopy(self.__self__, memo)  # the copy under construction (already in memo)
        new = BoundPatch(self.__func__, module, self.attr, self.on_copy)
        self.on_copy(module, self.attr)
        return new

    def __reduce__(self) -> tuple:
        """Pickled as the class's own method bound to the module, found at load by builtins alone (a saved model needs
        no patchkit to load): `getattr(cls, attr)`, unwrapped of a class patch of patchkit's active while it loads
        (`__wrapped_original__`; bound as it was, the loaded model kept that wrapper past its revert), then its
        `__get__(module)`."""
        found = _Load(getattr, type(self.__self__), self.attr)
        original = _Load(getattr, found, "__wrapped_original__", found)
        return _Load(getattr, original, "__get__"), (self.__self__,)


class _Load:
    """Pickles as `fn(*args)` (pickle's own reconstruction, by builtins): a step of `BoundPatch.__reduce__`."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args

    def value(self) -> Any:
        """What it loads as."""
        return self.fn(*(a.value() if isinstance(a, _Load) else a for a in self.args))

    def __call__(self, *args: Any) -> Any:  # pickle asks a reconstruction's first item to be callable
        return self.value()(*args)


# What introspection reads of a function: transformers' own tests read a forward's return type from its annotations
DRESS = ("__module__", "__name__", "__qualname__", "__doc__", "__annotations__")


def dressed_as(wrapper: Callable, original: Callable, signature: Optional[inspect.Signature] = None) -> Callable:
    """`wrapper` as introspection sees `original` (its name, docstring, annotations and signature), with `original` at
    hand as `__wrapped_original__` for whoever inspects a patched class (revert keeps its own record). No
    `__wrapped__`: frameworks follow it to strip wrappers (accelerate's unwrapping of a mixed-precision forward),
    which would drop the patch silently."""
    for name in DRESS:
        value = getattr(original, name, None)
        if value is not None:
            setattr(wrapper, name, dict(value) if name == "__annotations__" else value)
    wrapper.__signature__ = inspect.signature(original) if signature is None else signature  # type: ignore
    wrapper.__wrapped_original__ = original  # type: ignore[attr-defined]
    return wrapper


def unpatched(function: Any) -> Any:
    """The function that patchkit's wrappers (`dressed_as`, one or a chain of them) stand for: `function` itself where
    no patch of ours wraps it."""
    while hasattr(function, "__wrapped_original__"):
        function = function.__wrapped_original__
    return function


# a BoundPatch's, from its function (`__code__` as a bound method shows it: torch.export reads it)
SHOWN = ("__name__", "__qualname__", "__annotations__", "__wrapped_original__", "__code__")


def bound_replacement(
    func: Callable, module: Any, attr: str, label: str, on_copy: Callable[[Any, str], None]
) -> Replacement:
    """Replace `module.attr` on this instance only by `func` bound to it (a `BoundPatch`)."""
    return Replacement(module, attr, BoundPatch(func, module, attr, on_copy), label)


def _is_data_descriptor(owner: Any, attr: str) -> bool:
    cls_attr = getattr(type(owner), attr, None)
    return hasattr(cls_attr, "__set__")


def apply_replacements(replacements: list[Replacement]) -> None:
    """Check every target exists, then set them all; on any failure undo what was set and re-raise."""
    missing = [r.describe() for r in replacements if not hasattr(r.target(), r.attr)]
    if missing:
        raise PatchTargetError(
            f"patch targets not found: {', '.join(missing)}. This transformers build does not have them; "
            "nothing was patched. Check `patchkit.available_patches()` for the supported versions."
        )
    done: list[Replacement] = []
    try:
        for r in replacements:
            owner = r.target()
            own = vars(owner) if hasattr(owner, "__dict__") else {}
            r.had_own = r.attr in own
            if r.had_own:
                r.original = own[r.attr]
            elif isinstance(r.owner, weakref.ref) and not _is_data_descriptor(owner, r.attr):
                r.original = _FROM_CLASS  # a bound method would hold the module the handle must not keep alive
            else:
                r.original = getattr(owner, r.attr)
            setattr(owner, r.attr, r.new)
            if isinstance(r.owner, weakref.ref):
                r.new = None  # the module holds its patched method; the handle must not hold the module
            done.append(r)
    except BaseException:
        restore_replacements(done)
        raise


def restore_replacements(replacements: list[Replacement]) -> None:
    """Undo in reverse order: the original object goes back (identity), or the instance attribute goes away. What
    someone else set there since (Liger's forward, set on the model or its class after the patch) stays."""
    for r in reversed(replacements):
        owner = r.target()
        if r.original is _MISSING or owner is None:
            continue
        if _replaced_since(r, owner):
            r.original = _MISSING
            continue
        if r.had_own and isinstance(vars(owner).get(r.attr), types.MethodType):  # ours, bound again by accelerate's
            _unwrapped(owner, r)  # unwrap_model(keep_fp32_wrapper=False): what that unwrap would have left
        elif r.had_own or _is_data_descriptor(owner, r.attr):
            setattr(owner, r.attr, r.original)
        else:
            delattr(owner, r.attr)
        r.original = _MISSING


def _unwrapped(owner: Any, r: Replacement) -> None:
    """Give `owner` the forward its own one wraps (accelerate's mixed-precision wrappers followed by `__wrapped__` to
    the function, as accelerate's unwrapping does, up to the class's own): the class's, else bound to `owner`."""
    own = getattr(type(owner), r.attr, None)
    function = inspect.unwrap(getattr(r.original, "__func__", r.original), stop=lambda f: f is own)
    if function is own:
        delattr(owner, r.attr)
    else:
        setattr(owner, r.attr, types.MethodType(function, owner))


def _replaced_since(r: Replacement, owner: Any) -> bool:
    """`owner.attr` now holds neither this replacement nor another patch's: someone else's, set after it."""
    now = vars(owner).get(r.attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    if now is _MISSING:
        return False
    if isinstance(r.owner, weakref.ref):  # an instance's: patchkit's are BoundPatches (bound again as a method by
        now = now.__func__ if isinstance(now, types.MethodType) else now  # accelerate's unwrapping: still ours)
        return not isinstance(now, BoundPatch)
    return now is not r.new and not hasattr(now, "__wrapped_original__")


class SharedInstall:
    """Replacements installed once while any class patch is active and removed with the last (both idempotent)."""

    def __init__(self) -> None:
        self.replacements: list[Replacement] | None = None

    def attach(self, build: Callable[[], list[Replacement]]) -> None:
        if self.replacements is None:
            self.replacements = build()
            apply_replacements(self.replacements)

    def detach(self) -> None:
        if self.replacements is not None:
            restore_replacements(self.replacements)
            self.replacements = None
