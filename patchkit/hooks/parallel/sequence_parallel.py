"""DeepSpeed Ulysses sequence parallelism: patchkit's attention runs as the core of its wrapper, never around it.

`UlyssesSPAttentionHF.register_with_transformers(..., core_attn_implementation=NAME)` (DeepSpeed >= 0.19) puts a
wrapper under NAME in transformers' attention interface: it all-to-alls q/k/v from sequence shards to head shards,
drops the shard's mask, gathers `position_ids` and calls the function it wrapped on the whole sequence. A class
patch routes a model's attention to patchkit's own name, which would go round that wrapper and attend within each
rank's shard, silently. So a route remembers the wrapper under the model's name and calls it with patchkit's
attention as its core (documents from the gathered `position_ids`), and the model-level unpad stands aside: every
rank must keep its equal-length shard. Nothing here imports DeepSpeed: a wrapper exists only once it is imported.

torch's `context_parallel` (accelerate's `cp_size`) shards the sequence too, but only torch's SDPA op is made
ring attention: patchkit's kernels would attend within each shard. So does ring-flash-attn (axolotl's
`context_parallel_size`), whose `substitute_hf_flash_attn` makes only transformers' "flash_attention_2" ring
attention. A route refuses to run while either is active; both are found in sys.modules, never imported.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from patchkit.errors import PatchInputError

try:  # transformers' attention interface, where Ulysses registers its wrapper (from 4.48)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as ATTENTION_FUNCTIONS
except ImportError:  # no interface, so no wrapper either
    ATTENTION_FUNCTIONS = None

ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
SHARD_LOCAL = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")  # sliced per rank by the data adapter: not global


def ulysses_of(function: Any, depth: int = 4) -> Optional[Any]:
    """The `UlyssesSPAttentionHF` that `function` (a registered attention function) wraps, or None; found in its
    closure, also through a few layers of a caller's own wrappers (closures, `__wrapped__`)."""
    cls = getattr(sys.modules.get(ULYSSES_MODULE), "UlyssesSPAttentionHF", None)
    if cls is None or depth == 0 or not callable(function):
        return None
    inner = [c.cell_contents for c in getattr(function, "__closure__", None) or () if _filled(c)]
    inner += [getattr(function, "__wrapped__", None)]
    found = next((x for x in inner if isinstance(x, cls)), None)
    if found is not None:
        return found
    return next((u for u in (ulysses_of(x, depth - 1) for x in inner if callable(x)) if u is not None), None)


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


# registered attention function -> whether it is a Ulysses wrapper. A plain dict read, never sys.modules: inside a
# compiled forward dynamo guards a read of sys.modules on its length, so every later import anywhere recompiled it.
# A function seen before DeepSpeed loaded is never a wrapper (wrappers are made when Ulysses registers).
_IS_ULYSSES: dict[Callable, bool] = {}


def ulysses_wrapper(name: Optional[str]) -> Optional[Callable]:
    """The Ulysses wrapper registered under attention name `name`, or None (always None before DeepSpeed loads)."""
    function = ATTENTION_FUNCTIONS.get(name) if name and ATTENTION_FUNCTIONS is not None else None
    if function is None:
        return None
    if function not in _IS_ULYSSES:
        _IS_ULYSSES[function] = ulysses_of(function) is not None
    return function if _IS_ULYSSES[function] else None


def ulysses_active() -> bool:
    """DeepSpeed's sequence-parallel group is set up (register_with_transformers ran in this process)."""
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    return getattr(state, "_SEQUENCE_PARALLEL_GROUP", None) is not None


def refuse_unfound(name: str) -> PatchInputError:
    return PatchInputError(
        f"DeepSpeed Ulysses sequence parallelism is set up in this process, but the attention function registered "
        f"under this model's implementation {name!r} is not its wrapper (nor wraps it through __wrapped__ or a "
        "closure), so patchkit cannot run inside it and would attend within each rank's shard only. Register "
        "Ulysses with core_attn_implementation equal to the model's attn_implementation, and wrap its function, "
        "if at all, with functools.wraps."
    )


# Where torch's context_parallel keeps the functions it replaced: its package now, and the module it moved from
# (torch 2.6 keeps them there; from the move that module re-exports the package without them)
CONTEXT_PARALLEL_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
                            "torch.distributed.tensor.experimental._attention")


def context_parallel_active() -> bool:
    """torch's `context_parallel` is in effect (its default dispatch: F.scaled_dot_product_attention replaced)."""
    import torch.nn.functional as F

    return any(F.scaled_dot_product_attention in getattr(sys.modules.get(name), "_replaced_functions", {})
               for name in CONTEXT_PARALLEL_MODULES)


def refuse_context_parallel() -> PatchInputError:
    return PatchInputError(
        "torch's context_parallel (accelerate's cp_size) is active: it shards each sequence across ranks and turns "
        "only torch's scaled_dot_product_attention into ring attention, so patchkit's varlen attention would attend "
        "within each rank's shard. Run this model unpatched under context_parallel (revert the patch, or "
        "PATCHKIT_FLASH_ATTN=0), or shard with DeepSpeed Ulysses, which patchkit serves."
    )


RING_ADAPTER = "ring_flash_attn.adapters.hf_adapter"
FLASH_NAME = "flash_attention_2"


def ring_flash_attn_active() -> bool:
    """ring-flash-attn's `substitute_hf_flash_attn` ran here and its ring attention is on (one dict lookup if not).

    It replaces `transformers.modeling_flash_attention_utils._flash_attention_forward` (with a lambda of its
    adapter that runs ring attention while `RING_ATTN_SWITCH` is on, or axolotl's own function) and, from
    transformers 4.48, `ALL_ATTENTION_FUNCTIONS["flash_attention_2"]` (its `flash_attention_forward`).
    """
    adapter = sys.modules.get(RING_ADAPTER)
    if adapter is None:
        return False
    utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    forward = getattr(utils, "_flash_attention_forward", None)
    if getattr(forward, "__module__", None) == RING_ADAPTER:  # its switchable lambda (use_ring_attn)
        return bool(getattr(adapter, "RING_ATTN_SWITCH", True))
    functions = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    ring = getattr(adapter, "flash_attention_forward", None)
    return ring is not None and functions is not None and functions.get(FLASH_NAME) is ring


def refuse_ring_flash_attn() -> PatchInputError:
    return PatchInputError(
        "ring-flash-attn is active (its substitute_hf_flash_attn ran: axolotl's context_parallel_size, or your "
        "own call): it shards each sequence across ranks and makes only transformers' 'flash_attention_2' "
        "attention ring attention, so patchkit's patched attention would go round it and attend within each "
        "rank's shard. Run this model unpatched under ring-flash-attn (revert the patch, or PATCHKIT_FLASH_ATTN=0, "
        "and load it with attn_implementation='flash_attention_2'), or shard with DeepSpeed Ulysses, which "
        "patchkit serves."
    )


def refuse_shard_local() -> None:
    """Raise while sequence sharding is active that makes only other attention ring attention (torch's
    context_parallel: SDPA's op; ring-flash-attn: flash_attention_2): patchkit's would attend within each shard."""
    if context_parallel_active():
        raise refuse_context_parallel()
    if ring_flash_attn_active():
        raise refuse_ring_flash_attn()


def through_ulysses(wrapper: Callable, core: Callable, module: Any, *args: Any, **kwargs: Any) -> Any:
    """Call `wrapper` (its all-to-alls, on every rank) with `core` as the attention it wraps, for this call only."""
    given = [k for k in SHARD_LOCAL if kwargs.get(k) is not None]
    if given:
        raise PatchInputError(
            f"{', '.join(given)} reached attention under DeepSpeed Ulysses sequence parallelism, where they describe "
            "one rank's shard, not the gathered sequence. Pack documents with position_ids restarting at 0 "
            "(Ulysses gathers them) and leave cu_seq_lens out."
        )
    uattn = ulysses_of(wrapper)
    wrapped = uattn.attn
    uattn.attn = core
    try:
        return wrapper(module, *args, **kwargs)
    finally:
        uattn.attn = wrapped
