"""How one attention call reaches a backend: q/k/v unpadded to the varlen kernel and repadded, a decode step on the
padded cache in place (`forward/decode.py` plans it), or the exact path for attention sinks. The kernel contract is
the backend's (`backends/`); what runs is decided before (`varlen.py`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from patchkit.backends import Backend, sdpa
from patchkit.backends.padded_decode import attend_padded_cache_lse
from patchkit.errors import PatchStateError
from patchkit.forward.decode import decode_plan, is_decode_step
from patchkit.forward.decode_plan import DecodePlan
from patchkit.forward.in_graph import GraphMask, back_in_rows, flat_in_layout
from patchkit.forward.metadata import BlockQueries, VarlenMetadata
from patchkit.forward.padding import pad_input, unpad_rows


class KernelOptions(NamedTuple):
    """What one attention call asks of the kernel, beside q/k/v and the metadata (a tuple: built per layer call)."""

    dropout: float
    scaling: float
    window: tuple[int, int]
    softcap: float
    warn_once: Callable[[str, str], None]
    sinks: Optional[torch.Tensor] = None  # (H,) learned logits, only for a backend that `takes_sinks` (flash_attn_4)

    def sink_kwargs(self) -> dict:
        """`learnable_sink` for a kernel that takes it, nothing otherwise (the other backends' signatures lack it)."""
        return {} if self.sinks is None else {"learnable_sink": self.sinks}


def kernel_head_size(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head size a kernel call takes: the widest of queries (and keys) and values (`one_head_size`)."""
    return max(q.shape[-1], v.shape[-1])


def one_head_size(attend: Callable[..., torch.Tensor], backend: Backend, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, layout: Any, options: KernelOptions) -> torch.Tensor:
    """`attend(backend, q, k, v, layout, options)`; where values are narrower than queries and keys (multi-head
    latent attention), zero columns give all three one head size for the kernels, dropped from the output (the scale
    is explicit: zeros add nothing to the scores). A decode step on a backend whose kernels take values of their own
    width (`values_apart`: SDPA's) gets them as they are, since padding its keys copies the whole cache per layer; a
    prompt's stay padded, so that the exact backend rounds as the kernels do (`tests/test_kernel_census.py`)."""
    v_dim, width = v.shape[-1], kernel_head_size(q, v)
    apart = getattr(backend, "values_apart", False) and isinstance(layout, VarlenMetadata) and is_decode_step(layout)
    if v_dim != q.shape[-1] and not apart:
        q, k, v = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    out = attend(backend, q, k, v, layout, options)
    return out if out.shape[-1] == v_dim else out[..., :v_dim]


def repad(out: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
    """A kernel's (nnz, H, D) output as (B, S, H, D), zeros at padding."""
    if meta.indices_q is None:
        return out.view(meta.batch, meta.q_len, *out.shape[1:])
    return pad_input(out, meta.indices_q, meta.batch, meta.q_len)


def attend_unpadded(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata,
                    o: KernelOptions) -> torch.Tensor:
    """q, k, v (B, H, S, D) gathered to their real tokens, the backend's varlen kernel, repadded (B, S, H, D)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, S, H, D): rows of tokens to gather
    q, k, v = unpad_rows(q, meta.indices_q), unpad_rows(k, meta.indices_k), unpad_rows(v, meta.indices_k)
    out = backend.varlen(q, k, v, meta, dropout_p=o.dropout, softmax_scale=o.scaling, causal=True,
                         window_size=o.window, softcap=o.softcap, **o.sink_kwargs())
    if meta.blocks is not None and meta.blocks.for_window(o.window):
        out = attend_blocks(backend, q, k, v, out, meta.blocks.on(out.device), o)
    return repad(out, meta)


def attend_blocks(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  blocks: BlockQueries, o: KernelOptions) -> torch.Tensor:
    """The causal pass's output `out` (nnz, H, D) with each block query's row replaced by its block's own pass:
    non-causal over the keys from its row's first token to the block's last, a window's left edge kept where the
    masks keep it (`forward/metadata.py`). q, k, v: the unpadded rows."""
    left = o.window[0] if blocks.windowed else -1
    picked = backend.varlen(q.index_select(0, blocks.q_index), k.index_select(0, blocks.k_index),
                            v.index_select(0, blocks.k_index), blocks.meta, dropout_p=o.dropout,
                            softmax_scale=o.scaling, causal=False, window_size=(left, -1), softcap=o.softcap,
                            **o.sink_kwargs())
    return out.index_copy(0, blocks.q_index, picked.to(out.dtype))


def attend_with_cache(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata,
                      o: KernelOptions) -> torch.Tensor:
    """LLaMA-2 and every family: a decode step on the padded cache in place when the backend can (`decode.py`),
    else the varlen kernel on the real tokens. q, k, v: (B, H, S, D)."""
    out = decode_attention(backend, q, k, v, meta, dropout=o.dropout, scaling=o.scaling, window=o.window,
                           softcap=o.softcap, warn_once=o.warn_once, extra=o.sink_kwargs())
    return out if out is not None else attend_unpadded(backend, q, k, v, meta, o)


def attend_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, o: KernelOptions,
    sinks: Optional[torch.Tensor], merge: Optional[Callable[[torch.Tensor, torch.Tensor], tuple]] = None,
) -> torch.Tensor:
    """q, k, v (B, H, S, D) -> (B, S, H, D): a softmax over the visible keys and one learned logit per head (the
    sink, which takes weight but adds no value) is the plain attention times sigmoid(lse - sink). The sdpa
    backend's math path returns the log-sum-exp with its gradient; a decode step whose queries are all real runs it
    on the cache in place (`attend_padded_cache_lse`), else the cache's real keys are gathered.
    `merge`: (out, lse) of the real tokens (tokens, H, D), (tokens, H) -> the same over more keys than k's
    (DeepSeek-V4's compressed entries, `compressed_kv.entries_merge`), before the sinks."""
    if meta.blocks is not None and meta.blocks.for_window(o.window):
        raise PatchStateError("a forward with bidirectional blocks reached attention sinks: no path serves both")
    plan = decode_plan(meta, q.device) if not o.dropout and is_decode_step(meta) else None
    if plan is not None and plan.real_q is None:
        # a decode step whose every query is real: on the cache in place, every row at once, no gathered keys
        batch, heads, q_len, _ = q.shape
        out, lse = attend_padded_cache_lse(q, k, v, plan.mask(o.window), softmax_scale=o.scaling, softcap=o.softcap)
        out, lse = out.reshape(batch * q_len, heads, -1), lse.reshape(batch * q_len, heads)  # indices_q's order
        return _sunk(out, lse, merge, sinks).view(batch, q_len, heads, -1)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = sdpa.varlen_attention(
        unpad_rows(q, meta.indices_q), unpad_rows(k, meta.indices_k), unpad_rows(v, meta.indices_k), meta.seqlens_q,
        meta.seqlens_k, o.dropout, o.scaling, True, o.window, o.softcap, return_lse=True,
    )
    return repad(_sunk(out, lse.transpose(0, 1), merge, sinks), meta)  # lse as (tokens, H)


def _sunk(out: torch.Tensor, lse: torch.Tensor, merge: Optional[Callable[[torch.Tensor, torch.Tensor], tuple]],
          sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """out (tokens, H, D) of a softmax whose log-sum-exp is lse (tokens, H), `merge`d with more logits (V4's
    entries) and then one more logit per head (the sink) that takes weight but adds no value."""
    if merge is not None:
        out, lse = merge(out, lse)
    return out if sinks is None else out * torch.sigmoid(lse - sinks.float()).unsqueeze(-1).to(out.dtype)


def decode_attention(
    backend: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata, *,
    dropout: float, scaling: float, window: tuple[int, int], softcap: float, warn_once: Callable[[str, str], None],
    extra: Optional[dict] = None,
) -> Optional[torch.Tensor]:
    """A decode step on the padded cache: q (B, H, q_len, D), k/v (B, Hk, K, D) as transformers keeps them ->
    (B, q_len, H, D), padding zero; None where `kvcache_call` finds none (the caller runs the varlen path)."""
    call = kvcache_call(backend, meta, q.device, warn_once)
    if call is None:
        return None
    return attend_on_cache(*call, q, k, v, scaling=scaling, dropout=dropout, window=window, softcap=softcap,
                           extra=extra)


def attend_on_cache(
    attend: Callable[..., Optional[torch.Tensor]], plan: DecodePlan, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, *, scaling: float, dropout: float, window: tuple[int, int], softcap: float,
    extra: Optional[dict] = None,
) -> Optional[torch.Tensor]:
    """`kvcache_call`'s kernel on the padded cache, its padding queries zeroed; None where it declines the layout."""
    out = attend(q, k, v, plan, softmax_scale=scaling, dropout_p=dropout, window_size=window, softcap=softcap,
                 **(extra or {}))
    if out is None or plan.real_q is None:
        return out
    return out.where(plan.real_q, out.new_zeros(()))


def kvcache_call(backend: object, meta: VarlenMetadata, device: torch.device, warn_once: Callable[[str, str], None],
                 ) -> Optional[tuple[Callable[..., Optional[torch.Tensor]], DecodePlan]]:
    """The backend's kernel on the padded cache (`attend_kvcache`) and the forward's decode plan, for a decode step.

    None when this is no decode step or the backend cannot serve it in place (no `attend_kvcache`, or a layout its
    kernel cannot express): the caller runs the varlen path, which is exact too. A backend whose kernel is too old
    for this step (`kvcache_missing`) warns once and gathers, in strict mode too: that is the same kernel, and exact,
    on a copy of the cache (slower), not a fallback to another backend.
    """
    attend = getattr(backend, "attend_kvcache", None)
    if attend is None or not is_decode_step(meta):
        return None
    plan = decode_plan(meta, device)
    missing = getattr(backend, "kvcache_missing", None)
    reason = missing(plan) if missing is not None else None
    if reason is not None:
        warn_once(reason, f"patchkit: {reason}; decode steps gather the KV cache for the varlen kernel instead")
        return None
    return attend, plan


def attend_in_graph(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gmask: GraphMask,
                    position_ids: Optional[torch.Tensor], cu_seq_lens: Optional[torch.Tensor],
                    options: KernelOptions) -> torch.Tensor:
    """Inside one compiled graph, no past: q, k, v (B, H, S, D) -> (B, S, H, Dv), zeros at padding, the backend's
    varlen entry on the flat batch in the mask's layout (`forward/in_graph.py`)."""
    batch, _, q_len, _ = q.shape
    q, k, v, meta, lay = flat_in_layout(q, k, v, gmask, position_ids, cu_seq_lens)
    out = backend.varlen(q, k, v, meta, dropout_p=options.dropout, softmax_scale=options.scaling, causal=True,
                         window_size=options.window, softcap=options.softcap)
    return back_in_rows(out, lay, batch, q_len)
