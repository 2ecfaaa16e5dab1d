"""dtype helpers for half-precision training: flash kernels need fp16/bf16 q/k/v, and fp32 islands break that."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Union

import torch
from torch import nn

logger = logging.getLogger("patchkit")

DEFAULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_ALIASES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}
# Sub-module names of PEFT adapters: trainable weights that casting must not turn into half precision.
ADAPTER_MARKERS = ("lora_", "modules_to_save")

DTypeLike = Union[torch.dtype, str]


def autocast_dtype(device: str) -> Optional[torch.dtype]:
    """The dtype autocast runs a linear layer in on `device`, or None where autocast is off."""
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except (AttributeError, TypeError):  # torch < 2.4: one function per device kind
        if device == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    except RuntimeError:  # a device autocast knows nothing of (meta): none runs there
        return None


def resolve_dtype(dtype: DTypeLike) -> torch.dtype:
    """A torch float dtype from a dtype or a name ("bf16", "fp16", ...); anything else is a TypeError."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in DTYPE_ALIASES:
            raise TypeError(f"unknown dtype name {dtype!r}; use one of {', '.join(sorted(DTYPE_ALIASES))}")
        return DTYPE_ALIASES[key]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype or a dtype name, got {type(dtype).__name__} {dtype!r}")
    if dtype not in DEFAULT_DTYPES:
        raise TypeError(
            f"{dtype} cannot be torch's default dtype: it must be a floating point type "
            "(torch.float16, torch.bfloat16, torch.float32 or torch.float64)"
        )
    return dtype


@contextlib.contextmanager
def default_dtype(dtype: DTypeLike) -> Iterator[torch.dtype]:
    """Set torch's default dtype (e.g. bf16 while building or wrapping a model) and always restore it.

    ColossalAI's practice: parameters and buffers created inside come out in half precision. The previous
    default dtype is restored on exit, also when the body raises.

    Example:
        >>> with default_dtype(torch.bfloat16):
        ...     layer = torch.nn.Linear(4, 4)  # bf16 weights
    """
    target = resolve_dtype(dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target)
    try:
        yield target
    finally:
        torch.set_default_dtype(previous)


def _is_adapter(name: str) -> bool:
    return any(marker in part for part in name.split(".") for marker in ADAPTER_MARKERS)


def _base_linear_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype the frozen linear layers compute in: a LoRA layer's base layer, else any non-adapter Linear."""
    fallback = None
    for name, module in model.named_modules():
        if _is_adapter(name):
            continue
        compute = getattr(module, "compute_dtype", None)  # bitsandbytes 4-bit layers keep it here
        if isinstance(compute, torch.dtype) and compute.is_floating_point:
            return compute
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight.dtype
        if fallback is None and isinstance(module, nn.Linear) and module.weight.is_floating_point():
            fallback = module.weight.dtype
    return fallback


def training_compute_dtype(model: nn.Module) -> torch.dtype:
    """The compute dtype of a (PEFT) model: pre-quantization dtype, else the base linear weights', else bf16."""
    config = getattr(model, "config", None)
    pre_quantization = getattr(config, "_pre_quantization_dtype", None)
    if isinstance(pre_quantization, torch.dtype) and pre_quantization.is_floating_point:
        return pre_quantization
    return _base_linear_dtype(model) or torch.bfloat16


def _wants_cast(name: str, module: nn.Module) -> bool:
    """FastChat's rule: every module named *norm*, and lm_head / embed_tokens when they hold a weight."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in leaf:
        return True
    return leaf in ("lm_head", "embed_tokens") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _cast_module(module: nn.Module, dtype: torch.dtype) -> set[torch.dtype]:
    """Cast the floating tensors of `module`, leaving PEFT adapter sub-modules alone; return the old dtypes."""
    before: set[torch.dtype] = set()
    for sub_name, sub in module.named_modules():
        if _is_adapter(sub_name):
            continue
        for tensors in (sub._parameters, sub._buffers):
            for key, tensor in tensors.items():
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                before.add(tensor.dtype)
                if isinstance(tensor, nn.Parameter):
                    tensor.data = tensor.data.to(dtype)  # keeps the Parameter object (optimizer references)
                else:
                    tensors[key] = tensor.to(dtype)
    return before


def cast_for_training(model: nn.Module, dtype: Optional[DTypeLike] = None) -> list[str]:
    """Cast norm layers, `lm_head` and `embed_tokens` to the compute dtype, as FastChat's LoRA training does.

    Call it after `peft.get_peft_model` (or `prepare_model_for_kbit_training`, which upcasts norms to fp32): fp32
    norms feed fp32 activations into attention, which flash kernels cannot take. PEFT adapter weights
    (`lora_*`, `modules_to_save`) keep their dtype so that the trainable parameters stay in full precision.

    Args:
        model: the model, PEFT-wrapped or not.
        dtype: the compute dtype; default None reads it from the model: the pre-quantization dtype, else the
            dtype of the base (LoRA-wrapped) linear weights, else bfloat16.

    Returns:
        The qualified names of the modules now in the compute dtype (also logged, with what changed).
    """
    target = resolve_dtype(dtype) if dtype is not None else training_compute_dtype(model)
    cast: list[str] = []
    for name, module in model.named_modules():
        if not name or _is_adapter(name) or any(name.startswith(done + ".") for done in cast):
            continue
        if not _wants_cast(name, module):
            continue
        changed = _cast_module(module, target)
        cast.append(name)
        if changed:
            logger.info("patchkit: cast %s from %s to %s", name, ", ".join(sorted(map(str, changed))), target)
    logger.info("patchkit: %d modules (norms, lm_head, embed_tokens) are now %s", len(cast), target)
    return cast
