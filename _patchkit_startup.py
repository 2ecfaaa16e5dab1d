"""patchkit's interpreter-start hook (patchkit-startup.pth): opt in without `import patchkit`, free otherwise.

The .pth file calls `install()` in every interpreter of the environment patchkit is installed in. It imports only
the standard library and puts one finder on `sys.meta_path` that watches transformers modules and runs a
callback right after each has executed:

- `transformers.modeling_utils` and `transformers.masking_utils` (once both exist, transformers >= 4.53): register
  `attn_implementation="patchkit"` as two small stubs that import patchkit on first use, so the name works in a
  process that never imports patchkit (a TRL config, a config.json).
- the modeling module of every family patchkit has a module for (`FAMILY_MODULES`,
  `transformers.models.llama.modeling_llama` and the others): when PATCHKIT_FLASH_ATTN is on ("1", "true",
  "yes", "on"), apply patchkit's class patch
  (`patchkit.entry.autostart`) before any model can be built from the module. A process that never imports such a
  module never imports torch or patchkit for it.
- any other family's modeling module (the families patchkit serves from data, `patchkit.patches.table`): with
  PATCHKIT_FLASH_ATTN on, the same patch at the first model built (`_apply_at_first_model`), which then patches
  that model's family too.

It lives outside the `patchkit` package because importing `patchkit` imports torch and transformers.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing would double this module's cost at startup
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any, Callable, Optional

ENV = "PATCHKIT_FLASH_ATTN"
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")
NAME = "patchkit"  # patchkit.hooks.name.attention_interface.ATTENTION_NAME
MODELING_UTILS = "transformers.modeling_utils"
MASKING_UTILS = "transformers.masking_utils"
MODELING_LLAMA = "transformers.models.llama.modeling_llama"
# The modeling modules of the families patchkit serves (registry.PATCH_MODULES; a test keeps the two lists equal).
FAMILY_MODULES = (MODELING_LLAMA, *(f"transformers.models.{m}.modeling_{m}" for m in (
    "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "granite", "starcoder2", "olmo2", "smollm3",
    "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "phi", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
    "glm4v", "glm4v_moe",
)))

_owner: Optional[str] = None  # who decides about patching in this process instead of PATCHKIT_FLASH_ATTN


def requested(environ: Optional[dict] = None) -> Optional[bool]:
    """PATCHKIT_FLASH_ATTN as on (True) or off (False, also when unset); None for a value that is neither."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    return True if value in ON else False if value in OFF else None


def stand_down(owner: str) -> None:
    """`owner` (the launcher, patchkit's own commands) decides about patching here: the LLaMA hook applies nothing."""
    global _owner
    _owner = owner


def _attention(*args: Any, **kwargs: Any) -> Any:
    """attn_implementation="patchkit" before patchkit was imported: importing it registers the real functions."""
    from patchkit.hooks.name import attention_interface

    return attention_interface._attention(*args, **kwargs)


def _mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function for the same name, loaded the same way."""
    from patchkit.hooks.name import attention_interface

    return attention_interface.mask_function(*args, **kwargs)


def _register_name(_module: ModuleType) -> None:
    """Register the name once both interfaces exist; "register both or neither", and never over patchkit's own."""
    utils, masking = sys.modules.get(MODELING_UTILS), sys.modules.get(MASKING_UTILS)
    if utils is None or masking is None or "patchkit.hooks.name.attention_interface" in sys.modules:
        return  # not both yet, or patchkit is imported (or importing) and registers the real functions itself
    if sys.modules.get("patchkit") is not None:  # `import patchkit` came first, left registering to this hook
        try:  # importing patchkit's attention registers it (a partial import registers as it completes)
            __import__("patchkit.hooks.name.attention_interface")
        except Exception as exc:  # noqa: BLE001 - as below: say why, never break `import transformers`
            print(f"patchkit: could not register attn_implementation={NAME!r}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        return
    attention_interface = getattr(utils, "AttentionInterface", None)
    mask_interface = getattr(masking, "AttentionMaskInterface", None)
    if attention_interface is None or mask_interface is None:
        return  # transformers < 4.53, or modeling_utils still executing (its own hook comes later)
    try:
        attention_interface.register(NAME, _attention)
        mask_interface.register(NAME, _mask)
        _watch_names(utils.PreTrainedModel)
    except Exception as exc:  # noqa: BLE001 - a hook must never break `import transformers`; it says why instead
        print(f"patchkit: could not register attn_implementation={NAME!r}: {type(exc).__name__}: {exc}",
              file=sys.stderr)


def _names(config: Any) -> bool:
    """`config` (or its text part) resolves attention to patchkit's name."""
    get_text = getattr(config, "get_text_config", None)
    for part in (config, get_text() if callable(get_text) else None):
        name = getattr(part, "_attn_implementation", None)
        if name == NAME or (isinstance(name, dict) and NAME in name.values()):
            return True
    return False


def _adopt(model: Any) -> None:
    """A model got patchkit's name: import patchkit, which adopts it (`hooks/name/named.py`) and watches from now."""
    from patchkit.hooks.name import attention_interface, named  # noqa: F401 - importing registers the name and watches

    named.adopt(model)


def _watch_names(pretrained: type) -> None:
    """Until patchkit is imported, a model built with patchkit's name, or given it by `set_attn_implementation`,
    imports patchkit to be adopted (its mask function then reads the model's calls, not the stack)."""

    def watched(original: Callable, named_after: Callable[[Any], bool]) -> Callable:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if "patchkit.hooks.name.named" not in sys.modules and named_after(self):  # else patchkit's own watch adopts
                _adopt(self)
            return out

        method.__name__, method.__doc__ = original.__name__, original.__doc__
        return method

    post_init = pretrained.__dict__.get("post_init")
    if post_init is not None:
        pretrained.post_init = watched(post_init, lambda model: _names(getattr(model, "config", None)))
    setter = pretrained.__dict__.get("set_attn_implementation")  # transformers 4.54+
    if setter is not None:
        pretrained.set_attn_implementation = watched(setter, lambda model: any(
            _names(getattr(m, "config", None)) for m in model.modules()))


def _apply_from_env(_module: ModuleType) -> None:
    """PATCHKIT_FLASH_ATTN on: apply the class patch now. Errors (a bad value, a strict gate) fail this import."""
    if _owner is not None or requested() is False:
        return
    from patchkit.entry import autostart

    autostart.apply_at_import()


def is_modeling_module(name: str) -> bool:
    """Any family's modeling module (`transformers.models.olmo.modeling_olmo`, not the auto classes): the families
    served from data (patchkit.patches.table) are applied as their first model is built, under the patch this
    import applies."""
    return (name.startswith("transformers.models.") and not name.startswith("transformers.models.auto.")
            and name.rpartition(".")[2].startswith("modeling_"))


def _apply_at_first_model(_module: ModuleType) -> None:
    """PATCHKIT_FLASH_ATTN on, after any other family's modeling module: apply at the first model built, not at the
    import (a library that imports a modeling module of its own, as peft imports BLOOM's, must not apply the patch
    before the script's own apply_patch). One wrapper on `PreTrainedModel.post_init`, gone at its first call."""
    if _owner is not None or requested() is False:
        return
    pretrained = getattr(sys.modules.get(MODELING_UTILS), "PreTrainedModel", None)
    original = getattr(pretrained, "__dict__", {}).get("post_init")
    if original is None or getattr(original, "_patchkit_at_first_model", False):
        return

    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if pretrained.__dict__.get("post_init") is not post_init:  # under patchkit's own hook (a script's apply_patch
            return original(self, *args, **kwargs)  # came first): that hook judges the model; nothing to apply
        pretrained.post_init = original
        _apply_from_env(_module)
        return pretrained.post_init(self, *args, **kwargs)  # patchkit's own hook, if the patch installed it

    post_init._patchkit_at_first_model = True  # type: ignore[attr-defined]
    pretrained.post_init = post_init


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    MODELING_UTILS: _register_name,
    MASKING_UTILS: _register_name,
    **{module: _apply_from_env for module in FAMILY_MODULES},
}


def _wrap_exec(loader: Any, callback: Callable[[ModuleType], None]) -> bool:
    """Run `callback(module)` after `loader` executes the module; the loader's own method is back afterwards."""
    if "exec_module" in getattr(loader, "__dict__", {}):
        return True  # already wrapped (the same loader found twice)
    original = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        try:
            original(module)
        finally:
            vars(loader).pop("exec_module", None)
        callback(module)

    try:
        loader.exec_module = exec_module
    except (AttributeError, TypeError):
        return False
    return True


class PostImportFinder:
    """A meta-path finder that finds nothing itself: other finders find a watched module, this one adds the callback."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        callback = HOOKS.get(fullname) or (_apply_at_first_model if is_modeling_module(fullname) else None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is cls or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module") or not _wrap_exec(spec.loader, callback):
            print(f"patchkit: cannot watch the import of {fullname} (loader {spec.loader!r}); "
                  f"{ENV} and attn_implementation={NAME!r} need `import patchkit` in this process", file=sys.stderr)
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent: a .pth may be processed twice)."""
    if PostImportFinder not in sys.meta_path:
        sys.meta_path.insert(0, PostImportFinder)
