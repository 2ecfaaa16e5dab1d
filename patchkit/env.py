"""PATCHKIT_* environment variables: their names, allowed values and a one-line check, without torch."""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

from packaging.version import InvalidVersion, Version

from patchkit.names import BACKEND_NAMES, UNPAD_MODES, patch_names

ENV_FLASH_ATTN = "PATCHKIT_FLASH_ATTN"
ENV_PATCH = "PATCHKIT_PATCH"
ENV_BACKEND = "PATCHKIT_BACKEND"
ENV_STRICT = "PATCHKIT_STRICT"
ENV_UNPAD = "PATCHKIT_UNPAD"
ENV_TESTED = "PATCHKIT_TESTED_TRANSFORMERS"  # patchkit.hooks.decide.self_check.TESTED_ENV

MODEL_TYPE = re.compile(r"[a-z][a-z0-9_-]*")  # the shape of a transformers model_type (`gpt_oss`, `qwen3_next`)
TRUE_VALUES = ("1", "true", "yes", "on")
FALSE_VALUES = ("0", "false", "no", "off", "")


class EnvValueError(ValueError):
    """A PATCHKIT_* variable (or an option) holds a value that is not one of its allowed values."""


def check_choice(where: str, value: Any, allowed: list[str] | tuple[str, ...]) -> str:
    """`value` if it is one of `allowed` (case-insensitive), else an EnvValueError naming `where` and the choices."""
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    raise EnvValueError(f"{where}={value!r} is not valid; allowed values: {', '.join(allowed)}")


def check_patch(where: str, value: Any) -> str:
    """A patch name: a registered one or alias (`llama2`, `all`), or a model type the table may serve (`gpt_oss`),
    which `resolve` checks when the patch is applied (that needs transformers); else an EnvValueError."""
    if isinstance(value, str) and MODEL_TYPE.fullmatch(value.strip().lower()):  # every registered name is one too
        return value.strip().lower()
    raise EnvValueError(f"{where}={value!r} is not valid; allowed values: {', '.join(patch_names())}, or a served "
                        "model_type such as gpt_oss (patchkit doctor lists them)")


def parse_bool(where: str, value: Any) -> bool:
    """A boolean from a bool or a string such as "1"/"0", "true"/"false", "yes"/"no", "on"/"off"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_VALUES + FALSE_VALUES:
        return value.strip().lower() in TRUE_VALUES
    raise EnvValueError(
        f"{where}={value!r} is not valid; allowed values: {', '.join(TRUE_VALUES)} (on) or "
        f"{', '.join(v for v in FALSE_VALUES if v)} or empty (off)"
    )


def _version(where: str, value: str) -> str:
    """A transformers version such as "5.25.0" (empty: none named)."""
    if value.strip():
        try:
            Version(value.strip())
        except InvalidVersion:
            raise EnvValueError(f"{where}={value!r} is not valid; allowed values: a transformers version such as "
                                "5.25.0, or empty") from None
    return value.strip()


def read_env(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The PatchArguments fields the PATCHKIT_* variables set; a bad value raises EnvValueError (one line)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if ENV_FLASH_ATTN in env:
        values["flash_attn"] = parse_bool(ENV_FLASH_ATTN, env[ENV_FLASH_ATTN])
    if ENV_PATCH in env:
        values["patch"] = check_patch(ENV_PATCH, env[ENV_PATCH])
    if ENV_BACKEND in env:
        values["attn_backend"] = check_choice(ENV_BACKEND, env[ENV_BACKEND], BACKEND_NAMES)
    if ENV_STRICT in env:
        values["patch_strict"] = parse_bool(ENV_STRICT, env[ENV_STRICT])
    if ENV_UNPAD in env:
        values["patch_unpad"] = check_choice(ENV_UNPAD, env[ENV_UNPAD], UNPAD_MODES)
    if ENV_TESTED in env:
        _version(ENV_TESTED, env[ENV_TESTED])
    return values


def check_env(environ: Optional[Mapping[str, str]] = None, where: str = "") -> None:
    """End the process with one line naming the variable, its value and the allowed values when one is bad.

    Run at `import patchkit` and by the startup hook, so a typo fails whether or not PATCHKIT_FLASH_ATTN is on.
    """
    try:
        read_env(environ)
    except EnvValueError as exc:
        raise SystemExit(f"patchkit: {exc}{where}. Fix or unset it.") from None
