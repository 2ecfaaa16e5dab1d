"""The varlen attention every patch runs: its state, which backend serves a layer, what it refuses; the kernel
calls themselves (unpad, kernel, repad; the padded cache in place) are `attend.py`'s."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from patchkit.backends import Backend
from patchkit.dtypes import autocast_dtype
from patchkit.errors import PatchGateError, PatchInputError, PatchStateError
from patchkit.forward.in_graph import GraphMask
from patchkit.forward.inputs.arguments import check_call, model_label, model_type_of, part_of_multimodal
from patchkit.forward.inputs.rope_rows import text_positions
from patchkit.forward.liveness import is_compiling, record_call
from patchkit.forward.masks import VarlenMask, as_varlen_mask
from patchkit.forward.metadata import VarlenMetadata
from patchkit.gates import HALF_DTYPES, dtype_gate
from patchkit.hooks.attention.attend import (
    KernelOptions,
    attend_in_graph,
    attend_unpadded,
    attend_with_cache,
    attend_with_sinks,
    kernel_head_size,
    kvcache_call,
    one_head_size,
)
from patchkit.hooks.attention.compressed_kv import Entries, check_documents, entries_merge, split_entries
from patchkit.hooks.attention.dropout_draws import say_attention_dropout
from patchkit.hooks.attention.lanes import Lane, lane_for, lane_key, may_settle, settle
from patchkit.hooks.attention.sparse_indexer import chosen_by, selected_keys
from patchkit.hooks.install.state import PatchState
from patchkit.names import UNPAD_MODES  # noqa: F401 - re-exported

QKV_PACKED = "qkv"  # LLaMA-1 (FastChat's qkvpacked patch): as many K/V heads as query heads, no past
KV_PACKED = "kv"  # LLaMA-2 and every family: KV cache (decode on the padded cache) and GQA


def half_dtype(device_type: str, *candidates: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The half dtype to run flash kernels in: autocast's, else the first half candidate; None for a model whose
    compute is fp32 throughout (no autocast, no half weights): no cast keeps its numbers."""
    return autocast_dtype(device_type) or next((c for c in candidates if c in HALF_DTYPES), None)


def _matrix(param: torch.Tensor) -> bool:
    """A weight matrix, also while DeepSpeed ZeRO-3 holds it partitioned (shape (0,), its own in `ds_shape`)."""
    return param.dim() > 1 or len(getattr(param, "ds_shape", ())) > 1


def compute_dtype(module: nn.Module, device_type: str) -> Optional[torch.dtype]:
    """A LLaMA layer's half compute dtype: autocast's, else pre-quantization, else the weights' (the config's where
    it holds none); None where that is not half (an fp32 model's, whatever dtype its checkpoint's config names)."""
    weight = next((p for p in module.parameters() if _matrix(p)), None)  # q_proj, or a fused qkv_proj (Phi3)
    return half_dtype(
        device_type,
        getattr(module.config, "_pre_quantization_dtype", None),
        getattr(module.config, "torch_dtype", None) if weight is None else weight.dtype,
    )


def to_half(
    tensors: tuple[torch.Tensor, ...], target: Callable[[], Optional[torch.dtype]], strict: bool, who: str,
    warn_once: Callable[[str, str], None], backend: Backend, fallback: Backend,
) -> tuple[tuple[torch.Tensor, ...], Backend]:
    """flash kernels take fp16/bf16: fp32 q/k/v of a half compute dtype (`target()`: autocast's, a quantized or
    LoRA model's half weights) are cast to it with one warning; those of a model fp32 throughout run on the exact
    `fallback`, with one warning, as no cast keeps their numbers. Strict mode refuses both."""
    gate = dtype_gate(tensors[0].dtype)
    if gate.passed:
        return tensors, backend
    if strict:
        raise PatchGateError(f"{who} on a flash kernel backend: {gate.describe()}")
    dtype = target()
    if dtype is None:
        warn_once("dtype_exact", f"patchkit: q/k/v are {tensors[0].dtype}, with no autocast and no half weights, "
                                 f"and the {backend.name} kernels take fp16/bf16 only: these layers run on the exact "
                                 f"{fallback.name} backend in {tensors[0].dtype}. Load the model in bf16/fp16 or run "
                                 "under torch.autocast (the Trainer's bf16=True) to run the kernels.")
        return tensors, fallback
    warn_once(
        "dtype",
        f"patchkit: q/k/v are {tensors[0].dtype} but the {backend.name} kernels take fp16/bf16; casting to {dtype} "
        "for the attention kernel (output cast back). Load the model in half precision or run under torch.autocast "
        "to avoid the cast.",
    )
    return tuple(t.to(dtype) for t in tensors), backend


def _zeros_on_graph(out: torch.Tensor, *inputs: Optional[torch.Tensor]) -> torch.Tensor:
    """`out` (zeros) tied to `inputs` by a zero product: backward reaches every parameter behind q, k, v (and the
    sinks) with a zero gradient, as unpatched attention's does, so DDP and weight decay see a gradient, not None."""
    tie = sum(x.sum() for x in inputs if x is not None and x.requires_grad)
    return out if isinstance(tie, int) else out + tie * 0


def varlen_core(
    state: PatchState,
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: Any,
    position_ids: Optional[torch.Tensor],
    kwargs: dict,
    *,
    dropout: float,
    scaling: float,
    fixed_cache: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    entries: Optional[Entries] = None,
    lane: Optional[tuple] = None,
) -> torch.Tensor:
    """Attention on real tokens only (and `entries`, DeepSeek-V4's compressed ones, under their own bias). q (B, H, S,
    D), k/v (B, Hk, Skv, D), transformers' layout (the KV cache's) -> (B, S, H, D), padding zero.

    A decode step (a few new tokens behind a cache) attends to the padded cache in place when the backend can
    (`attend.py`, planned by `decode.py`); everything else unpads, runs the varlen kernel and repads.

    The caller has checked `kwargs` against what patchkit honours (`arguments.check_call`). `lane`: this call's
    `lanes.lane_key` (made only for a call with no dropout and no gradients), under which a decode step's kernel call
    is kept for the forward's later layers.
    """
    batch, heads, q_len, _ = q.shape
    packing = PACKINGS[state.packing]
    packing.check_heads(heads, k.shape[1])
    vmask = as_varlen_mask(attention_mask, fixed_cache)
    kv_len = vmask.keys_in_use(q_len, k.shape[2], fixed_cache)
    if kv_len != k.shape[2]:  # a static cache returns all its slots; the unfilled ones are never seen
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
    packing.check_keys(q_len, kv_len)
    if position_ids is not None and vmask.mask is None and vmask.pending(batch, q_len, kv_len):
        position_ids = text_positions(module, position_ids)  # documents by position: never a time row's
    meta: VarlenMetadata = vmask.metadata(batch, q_len, kv_len, q.device, position_ids, kwargs)
    record_call(state, module)
    if meta.nnz_q == 0:  # an all-padding batch: nothing attends, the output is zero
        return _zeros_on_graph(q.new_zeros(batch, q_len, heads, v.shape[-1]), q, k, v, sinks,
                               *(entries[:2] if entries is not None else ()))
    bites = window[0] >= 0 and window[0] + 1 < kv_len  # a window as long as the keys in use never bites
    if bites and (vmask.fixed_cache or fixed_cache) and kv_len > q_len:
        raise PatchInputError(
            f"{type(module).__name__} uses a sliding window and the KV cache is a static kind, whose sliding layers "
            "keep a rolling buffer patchkit does not place; use the default dynamic cache with patchkit."
        )
    if bites and meta.holes:
        raise PatchInputError(
            f"{type(module).__name__} uses a sliding window, and a row of this batch has padding between real "
            "tokens. transformers counts padding columns inside the window; varlen kernels count real tokens only, "
            "so the result would differ. Pad on one side only (left or right), or pack documents with position_ids."
        )
    say_attention_dropout(dropout)
    exact = KernelOptions(dropout, scaling, window, softcap, state.warn_once)  # the sdpa path's, with the sinks
    if entries is not None:  # one softmax over the window's keys, the entries and the sinks: the exact sdpa path
        check_documents(entries, meta, state.warn_once)
        return attend_with_sinks(q, k, v, meta, exact, sinks, entries_merge(q, meta, dropout, scaling, entries))
    kernel_sinks = getattr(state.backend, "takes_sinks", False)
    if sinks is not None and not kernel_sinks:  # gpt-oss's attention sinks: the exact sdpa path on these backends
        if state.backend.half_only:
            state.warn_once("sinks", f"patchkit: {type(module).__name__} adds attention sinks (a learned logit per "
                                     f"head in every softmax), which the {state.backend.name} kernels do not; "
                                     "those layers run on patchkit's exact sdpa backend.")
        return attend_with_sinks(q, k, v, meta, exact, sinks)
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    backend = state.backend_for(kernel_head_size(q, v), window, softcap, dropout, backward=backward,
                                sinks=sinks is not None)
    if sinks is not None and not getattr(backend, "takes_sinks", False):  # this call fell back to sdpa: exact sinks
        return attend_with_sinks(q, k, v, meta, exact, sinks)
    q_in = q
    if backend.half_only:
        (q, k, v), backend = to_half(
            (q, k, v), lambda: compute_dtype(module, q.device.type), state.strict, f"patch {state.patch!r}",
            state.warn_once, backend, state.fallback,
        )
    options = KernelOptions(dropout, scaling, window, softcap, state.warn_once, sinks)
    out = one_head_size(packing.attend, backend, q, k, v, meta, options)
    if lane is not None and sinks is None and packing.attend is attend_with_cache and may_settle(backend, q_in, q, v):
        call = kvcache_call(backend, meta, q.device, state.warn_once)
        if call is not None:
            settle(vmask, lane, Lane(call[0], call[1], kv_len, window, softcap))
    return out if out.dtype == q_in.dtype else out.to(q_in.dtype)


def varlen_in_graph(state: PatchState, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    gmask: GraphMask, kwargs: dict, options: KernelOptions) -> torch.Tensor:
    """Inside a graph that may not break (the base model's forward planned it, `hooks/decide/graph_plan.py`): the
    patch's backend on the padded layout (`in_graph.py`). q (B, H, S, D), k/v (B, Hk, S, D), no past ->
    (B, S, H, Dv)."""
    if k.shape[2] != q.shape[2]:
        raise PatchStateError(
            f"{type(module).__name__}: a compiled graph planned without a past was handled {k.shape[2] - q.shape[2]} "
            "cached keys; compile without fullgraph=True for generation with a cache"
        )
    record_call(state, module)
    cu, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")

    def attend(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: GraphMask,
               o: KernelOptions) -> torch.Tensor:
        return attend_in_graph(backend, q, k, v, mask, positions, cu, o)

    return one_head_size(attend, state.backend, q, k, v, gmask, options)


def refuse_gqa_for_qkv(heads: int, kv_heads: int) -> None:
    if kv_heads != heads:
        raise PatchGateError(
            f"patch 'llama1' packs q, k and v with the same head count, but this model has {heads} query "
            f"heads and {kv_heads} key/value heads (grouped-query attention). Use apply_patch('llama2'), "
            "which supports GQA."
        )


def refuse_past_for_qkv(q_len: int, kv_len: int) -> None:
    if kv_len != q_len:
        raise PatchInputError(
            f"patch 'llama1' is for training and prefill only: this call brings {kv_len - q_len} past "
            "tokens from a KV cache. Use apply_patch('llama2') for generation with a cache, or use_cache=False."
        )


@dataclasses.dataclass(frozen=True)
class Packing:
    """What a patch accepts of q/k/v (LLaMA-1 refuses GQA and a past), and how it attends."""

    check_heads: Callable[[int, int], None]
    check_keys: Callable[[int, int], None]
    attend: Callable[..., torch.Tensor]


def _accept(*_: Any) -> None:
    return None


PACKINGS = {
    QKV_PACKED: Packing(refuse_gqa_for_qkv, refuse_past_for_qkv, attend_unpadded),
    KV_PACKED: Packing(_accept, _accept, attend_with_cache),
}


def family_rule(model_types: Iterable[str], family_of: Optional[Callable[[type], Any]] = None
                ) -> Callable[[type, Optional[str]], bool]:
    """Whether a layer of this class under this `model_type` is served: a served `model_type`, or (`family_of` a
    class) a served family's attention layer under a model_type of its own. Built once, outside any graph; in a
    compiled graph it is answered while dynamo traces (it imports, may raise) and takes only a class and a string,
    which every torch's `assume_constant_result` takes (2.6's refuses a `ServedTypes` argument)."""
    if isinstance(model_types, (list, tuple)):
        model_types = frozenset(model_types)  # read per layer call (a registry's ServedTypes answers `in` itself)

    @torch._dynamo.assume_constant_result
    def serves(cls: type, model_type: Optional[str]) -> bool:
        return model_type in model_types or (family_of is not None and family_of(cls) is not None)

    serves.model_types = model_types  # for the refusal's message
    return serves


def check_family(module: nn.Module, serves: Callable[[type, Optional[str]], bool]) -> None:
    """The registered name serves only the families patchkit has a patch for (`serves`, a `family_rule`): any other
    model is refused."""
    if not serves(type(module), model_type_of(module)):
        allowed = sorted(set(serves.model_types))
        raise PatchInputError(
            f"attn_implementation='patchkit' was given to {model_label(module)}, a model family patchkit has no "
            f"patch for (it serves {', '.join(allowed)}). Its attention may differ from LLaMA's in ways the "
            "arguments do not show, so patchkit refuses rather than guess."
            + (part_of_multimodal(module) or " Load it with attn_implementation='sdpa'.")
        )


def make_attention_function(
    state: PatchState, model_types: Iterable[str], family_of: Optional[Callable[[type], Any]] = None,
) -> Callable:
    """The same attention in transformers' `AttentionInterface` signature (q/k/v as (B, H, S, D)).

    transformers hands a registered name to any model that asks: families other than `model_types` (or, by
    `family_of`, a served family's attention class) are refused.
    """
    serves = family_rule(model_types, family_of)

    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
        dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        sliding = kwargs.pop("sliding_window", None)
        if isinstance(attention_mask, VarlenMask) and attention_mask.window is not None and (
                sliding is None or attention_mask.chunk is None):  # the window transformers built this layer's
            sliding = attention_mask.window  # mask with, which eager and sdpa attend within (0: none): a layer's
            # own `sliding_window` is the one it was built with (a config changed since, a layer moved), and a
            # layer may leave its window to the mask (Qwen2-MoE in 5.x)
        window = sliding_window_size(sliding)
        softcap = float(kwargs.pop("softcap", None) or 0.0)
        sinks = kwargs.pop("s_aux", None)
        key, value, entries = split_entries(module, key, value)  # DeepSeek-V4's compressed entries, and their bias
        indices = kwargs.pop("indices", None)  # a sparse attention's top-k: none dropped, or a decode step's own
        if isinstance(indices, torch.Tensor) and indices.shape[-1]:
            key, value, attention_mask = selected_keys(key, value, attention_mask, chosen_by(indices, attention_mask))
        elif getattr(attention_mask, "selection", None) is not None:  # Kolibri-1.1's, in its mask
            key, value, attention_mask = selected_keys(key, value, attention_mask, attention_mask.selection)
        decides = getattr(attention_mask, "mask_decides", False)  # a non-causal layer's mask, read back
        check_call(module, kwargs, decides)  # first: an argument names the problem more precisely than the family
        check_family(module, serves)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if isinstance(attention_mask, GraphMask):
            if sinks is not None or entries is not None:  # the graph's plan steps such a model aside; never drop
                # the sinks or the entries' bias silently
                raise PatchStateError(f"{type(module).__name__} passes attention sinks inside a compiled graph that "
                                      "patchkit planned without them; compile without fullgraph=True")
            options = KernelOptions(dropout, scale, window, softcap, state.warn_once)
            return varlen_in_graph(state, module, query, key, value, attention_mask, kwargs, options).contiguous(), None
        lane = None
        if sinks is None and entries is None and not dropout and not is_compiling() and not torch.is_grad_enabled():
            lane = lane_key(state, module, query, key, value, window, softcap)  # a decode step's later layers
            settled = lane_for(attention_mask, lane)  # take the kernel call its first layer settled on
            out = settled(query, key, value, scale) if settled is not None else None
            if out is not None:  # None: the kernel declined this layout (flash-attn's, a hole): the varlen path
                record_call(state, module)
                return out.contiguous(), None
        out = varlen_core(
            state, module, query, key, value, attention_mask, kwargs.get("position_ids"), kwargs, dropout=dropout,
            scaling=scale, window=window, softcap=softcap, sinks=sinks, entries=entries, lane=lane,
        )
        return out.contiguous(), None  # as transformers' own attention functions return it: a layer may view it

    return attention


def sliding_window_size(sliding_window: Optional[int]) -> tuple[int, int]:
    """transformers' `sliding_window=w` (a query sees keys less than w positions back) as flash-attn's window."""
    return (-1, -1) if not sliding_window else (int(sliding_window) - 1, 0)
