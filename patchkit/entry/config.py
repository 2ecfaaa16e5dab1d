"""Opt in by configuration: a dataclass for HfArgumentParser and PATCHKIT_* environment variables, one call each."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from torch import nn

from patchkit.api import PatchHandle, apply_patch
from patchkit.env import (  # noqa: F401 - re-exported: the variables' names and checks live in entry.env
    ENV_BACKEND,
    ENV_FLASH_ATTN,
    ENV_PATCH,
    ENV_STRICT,
    ENV_UNPAD,
    FALSE_VALUES,
    TRUE_VALUES,
    check_choice,
    check_patch,
    parse_bool,
    read_env,
)
from patchkit.handles import PatchGroup
from patchkit.names import BACKEND_NAMES, GROUP_NAME, UNPAD_MODES


def _flash_attn_field() -> Any:
    return dataclasses.field(
        default=False,
        metadata={"help": "Patch LLaMA attention with patchkit's varlen (FlashAttention-style) kernels. Default off."},
    )


def _patch_field() -> Any:
    return dataclasses.field(
        default=GROUP_NAME,
        metadata={"help": "Which patchkit patch to apply: all (every family patchkit serves; default), a family by "
                          "model_type (llama2 for LLaMA, mistral, qwen2, gpt_oss, ...), or llama1 (LLaMA, training "
                          "only)."},
    )


def _attn_backend_field() -> Any:
    return dataclasses.field(
        default="auto",
        metadata={"help": "patchkit backend: auto (flash_attn when its gates pass, else torch_varlen, else sdpa, "
                          "with a warning; flash_attn_4 where installed, first on sm90/sm100), flash_attn, "
                          "flash_attn_4, torch_varlen, or sdpa. Default auto.",
                  "choices": list(BACKEND_NAMES)},
    )


def _patch_strict_field() -> Any:
    return dataclasses.field(
        default=False,
        metadata={"help": "Raise instead of falling back when a kernel backend's gate fails (auto: when neither "
                          "flash_attn nor torch_varlen passes). Default off."},
    )


def _patch_unpad_field() -> Any:
    return dataclasses.field(
        default="model",
        metadata={"help": "Where padding is removed: model (once per forward; the decoder, the LM head and the "
                          "loss run on real tokens only; default), attention (inside each attention layer) or loss "
                          "(as model, and a training forward with labels returns its loss alone, no logits).",
                  "choices": list(UNPAD_MODES)},
    )


@dataclasses.dataclass
class PatchOptions:
    """PatchArguments without the on-switch, for scripts whose own arguments already define `--flash_attn`.

    FastChat's `train_lora.py` (and many scripts modelled on it) has a `flash_attn` field in its TrainingArguments;
    two `--flash_attn` options in one HfArgumentParser fail at parser build. Parse these options next to the
    script's own flag, and give both to `apply_from_args`, which takes `flash_attn` from the script's arguments.

    Example:
        parser = HfArgumentParser((ModelArguments, TrainingArguments, PatchOptions))  # TrainingArguments.flash_attn
        model_args, training_args, patch_opts = parser.parse_args_into_dataclasses()
        patchkit.apply_from_args(training_args, patch_opts)  # before from_pretrained
    """

    patch: str = _patch_field()
    attn_backend: str = _attn_backend_field()
    patch_strict: bool = _patch_strict_field()
    patch_unpad: str = _patch_unpad_field()

    def __post_init__(self) -> None:
        self.patch_strict = parse_bool("patch_strict", self.patch_strict)
        self.patch = check_patch("patch", self.patch)
        self.attn_backend = check_choice("attn_backend", self.attn_backend, BACKEND_NAMES)
        self.patch_unpad = check_choice("patch_unpad", self.patch_unpad, UNPAD_MODES)


@dataclasses.dataclass
class PatchArguments:
    """patchkit's options as a dataclass that merges into `HfArgumentParser` next to `TrainingArguments`.

    A script whose own arguments define `flash_attn` uses `PatchOptions` instead (the same options, no on-switch).

    Example:
        parser = HfArgumentParser((ModelArguments, PatchArguments, TrainingArguments))
        model_args, patch_args, training_args = parser.parse_args_into_dataclasses()
        patchkit.entry.config.apply_from_args(patch_args)  # before from_pretrained
    """

    flash_attn: bool = _flash_attn_field()
    patch: str = _patch_field()
    attn_backend: str = _attn_backend_field()
    patch_strict: bool = _patch_strict_field()
    patch_unpad: str = _patch_unpad_field()

    def __post_init__(self) -> None:
        self.flash_attn = parse_bool("flash_attn", self.flash_attn)
        self.patch_strict = parse_bool("patch_strict", self.patch_strict)
        self.patch = check_patch("patch", self.patch)
        self.attn_backend = check_choice("attn_backend", self.attn_backend, BACKEND_NAMES)
        self.patch_unpad = check_choice("patch_unpad", self.patch_unpad, UNPAD_MODES)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **defaults: Any) -> PatchArguments:
        """Read PATCHKIT_FLASH_ATTN, PATCHKIT_PATCH, PATCHKIT_BACKEND, PATCHKIT_STRICT, PATCHKIT_UNPAD over `defaults`.

        A bad value raises ValueError naming the variable and its allowed values.
        """
        return cls(**{**defaults, **read_env(environ)})

    def to_env(self) -> dict[str, str]:
        """These options as the PATCHKIT_* variables `from_env` reads back: what a child process inherits."""
        return {ENV_FLASH_ATTN: "1" if self.flash_attn else "0", ENV_PATCH: self.patch, ENV_BACKEND: self.attn_backend,
                ENV_STRICT: "1" if self.patch_strict else "0", ENV_UNPAD: self.patch_unpad}


def apply_from_args(
    args: Any, *more: Any, model: Optional[nn.Module] = None
) -> Optional[PatchHandle | PatchGroup]:
    """Apply the patch the arguments ask for; None when `flash_attn` is off.

    Each field of PatchArguments is read from the first of `args, *more` that has it: a PatchArguments, the
    script's own arguments with a `flash_attn` field plus a PatchOptions, or any namespace. `model=` patches that
    loaded instance only, as in `apply_patch`; default None patches the classes, so call it before the model is
    loaded. (A module given positionally, as `apply_from_args(args, model)` did before, is taken as `model=`.)
    """
    sources = [s for s in (args, *more) if not isinstance(s, nn.Module)]
    modules = [s for s in (args, *more) if isinstance(s, nn.Module)]
    if modules:
        if model is not None or len(modules) > 1 or not sources:
            raise TypeError("apply_from_args takes argument objects positionally and one model, as model=")
        model = modules[0]
    if len(sources) == 1 and isinstance(sources[0], PatchArguments):
        opts = sources[0]
    else:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(PatchArguments):
            holder = next((s for s in sources if hasattr(s, f.name)), None)
            if holder is not None:
                values[f.name] = getattr(holder, f.name)
        opts = PatchArguments(**values)
    if not opts.flash_attn:
        return None
    return apply_patch(
        opts.patch, backend=opts.attn_backend, strict=opts.patch_strict, model=model, unpad=opts.patch_unpad,
    )


def apply_from_env(
    environ: Optional[Mapping[str, str]] = None, model: Optional[nn.Module] = None
) -> Optional[PatchHandle | PatchGroup]:
    """Apply the patch when PATCHKIT_FLASH_ATTN is on (with PATCHKIT_PATCH/BACKEND/STRICT/UNPAD); else None."""
    return apply_from_args(PatchArguments.from_env(environ), model=model)
