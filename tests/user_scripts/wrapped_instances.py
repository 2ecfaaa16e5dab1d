"""A tiny LLaMA wrapped by DDP, FSDP2 or FSDP1, then instance-patched (`apply_patch(model=wrapper)`), for tests.

    torchrun --nproc-per-node N wrapped_instances.py OUT.json

gloo ranks on CPU, each given the same whole batch (the gradients averaged over ranks are then one process's). For
each wrapper the same seeded model is built and wrapped three times: one copy trains unpatched, the others are
instance-patched after wrapping, with unpad "model" and "loss"; each trains two SGD steps on a mixed-padded batch
with labels. Rank 0 writes OUT.json: per case the losses, patchkit's counters, the classes whose instance forward the
patch replaced and the modules whose forward `revert()` did not restore, or the traceback of a case that raised;
and OUT.pt: the gradients of both steps and the parameters after them, whole (FSDP's gathered), by their names
without the wrappers' prefixes.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from common import end_process_group, write_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tiny models and batches
from models import labels_for, padded_batch, tiny_model  # noqa: E402

import patchkit  # noqa: E402
from patchkit.errors import PatchTargetError  # noqa: E402

STEPS = 2
PREFIXES = ("_fsdp_wrapped_module.", "module.")  # FSDP1's units (use_orig_params names), DDP's


def ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def fsdp2(model: nn.Module) -> nn.Module:
    """As accelerate's FSDP2 plugin shards a transformers model: each decoder layer, then the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp1(model: nn.Module) -> nn.Module:
    """As the HF Trainer's `--fsdp "full_shard auto_wrap"` wraps it: each decoder layer a unit, the rest the root's."""
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FullyShardedDataParallel(model, auto_wrap_policy=wrap, device_id=torch.device("cpu"), use_orig_params=True)


WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {"ddp": ddp, "fsdp2": fsdp2, "fsdp1": fsdp1}


def bare(name: str) -> str:
    for prefix in PREFIXES:
        name = name.replace(prefix, "")
    return name


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (FSDP2's parameters and gradients; a collective), else the tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def gathered(wrapper: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole, by its bare name: FSDP1 gathers its units' flat parameters."""
    whole = (FullyShardedDataParallel.summon_full_params(wrapper, with_grads=grads)
             if isinstance(wrapper, FullyShardedDataParallel) else contextlib.nullcontext())
    with whole:
        return {bare(n): full(p.grad if grads else p) for n, p in wrapper.named_parameters()
                if p.grad is not None or not grads}


def forwards(wrapper: nn.Module) -> dict[str, tuple[Any, Any]]:
    """Each module's own `forward` attribute (None: the class's) and its class's forward, by module name."""
    return {name: (vars(m).get("forward"), type(m).forward) for name, m in wrapper.named_modules()}


def train(kind: str, unpad: str | None) -> tuple[dict, dict]:
    """Two steps of a fresh wrapped model, instance-patched after wrapping unless `unpad` is None."""
    model = tiny_model(kv_heads=2).train()
    wrapper = WRAPPERS[kind](model)
    before = forwards(wrapper)
    handle = patchkit.apply_patch(model=wrapper, backend="sdpa", unpad=unpad) if unpad else None
    modules = dict(wrapper.named_modules())
    replaced = sorted(type(modules[n]).__name__.removeprefix("FSDP")  # FSDP2's class for FSDPLlamaModel etc.
                      for n, f in forwards(wrapper).items() if f[0] is not before[n][0])
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.5)
    ids, mask = padded_batch("mixed")
    labels = labels_for(ids, mask)
    losses, tensors = [], {}
    for step in range(STEPS):
        out = wrapper(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        losses.append(out.loss.item())
        tensors.update({f"grad{step}.{n}": g for n, g in gathered(wrapper, grads=True).items()})
        optimizer.step()
        optimizer.zero_grad()
    tensors.update({f"param.{n}": p for n, p in gathered(wrapper, grads=False).items()})
    result: dict[str, Any] = {"losses": losses, "sharding": str(getattr(wrapper, "sharding_strategy", None))}
    if handle is not None:
        result.update(calls=handle.calls, layers_patched=handle.layers_patched, check_wrapper=handle.check(wrapper),
                      check_model=handle.check(model), heads=handle.heads, stepped_aside=handle.stepped_aside,
                      replaced=replaced)
        handle.revert()
        result["not_restored"] = sorted(n for n, f in forwards(wrapper).items()
                                        if f[0] is not before[n][0] or f[1] is not before[n][1])
        calls = handle.calls
        with torch.no_grad():
            wrapper(input_ids=ids, attention_mask=mask, use_cache=False)
        result["calls_after_revert"] = handle.calls - calls
        try:
            handle.check(wrapper)
            result["check_after_revert"] = "no error"
        except PatchTargetError as e:
            result["check_after_revert"] = str(e)
    return result, tensors


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    results, tensors = {}, {}
    for kind in WRAPPERS:
        for unpad in (None, "model", "loss"):
            case = f"{kind}-{unpad or 'unpatched'}"
            try:
                results[case], got = train(kind, unpad)
            except Exception:
                results[case] = {"error": traceback.format_exc()}
                continue
            tensors.update({f"{case}/{n}": t for n, t in got.items()})
    if dist.get_rank() == 0:
        write_result("WRAPPED", out, results, tensors)
    end_process_group()


if __name__ == "__main__":
    main()
