"""The sdpa backend as one torch custom op inside a compiled graph, so the graph is not specialized on document lengths.

The sdpa backend loops over documents on host lengths. Traced by dynamo, that loop becomes part of the layer's graph,
guarded on every length: each batch with other lengths compiled the layer again, until dynamo's recompile limit ran
it eagerly. As an opaque op (`patchkit::varlen_sdpa`, torch >= 2.4) the graph sees only q, k, v and `cu_seqlens`
tensors; the op reads the lengths itself (one host read per layer call: free on CPU). Its backward is the exact
attention gradient per document, written out (autograd does not run inside an op's kernel). Attention dropout is not
served here: a compiled call with dropout keeps the traced loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from patchkit.backends import sdpa

OP_NAME = "patchkit::varlen_sdpa"


def _lengths(cu: torch.Tensor) -> list[int]:
    return cu.diff().tolist()


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float,
             causal: bool, left: int, right: int, softcap: float) -> torch.Tensor:
    out, _ = sdpa.varlen_attention(q, k, v, _lengths(cu_q), _lengths(cu_k), 0.0, scale, causal, (left, right), softcap)
    return out.contiguous()


def _document_grads(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    window: tuple[int, int], softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One document, heads first: dO, q (H, sq, D), k/v (Hk, sk, D) -> dq, dk, dv, in fp32 or wider."""
    heads, groups = q.shape[0], q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    scores = sdpa.masked_scores(q, k, scale, causal, window, softcap)  # the forward's own logits
    qc, kc, vc, gc = (t.to(scores.dtype) for t in (q, k, v, g))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # a query that sees no key: zeros
    dv = torch.matmul(probs.transpose(-1, -2), gc)
    dp = torch.matmul(gc, vc.transpose(-1, -2))
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    if softcap > 0:
        ds = ds * (1 - (scores.masked_fill(probs == 0, 0.0) / softcap) ** 2)
    dq = torch.matmul(ds, kc) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qc) * scale
    if groups > 1:  # grouped-query attention: each K/V head's gradient sums its query heads'
        dk = dk.view(heads // groups, groups, *dk.shape[1:]).sum(1)
        dv = dv.view(heads // groups, groups, *dv.shape[1:]).sum(1)
    return dq, dk, dv


def _backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, scale: float, causal: bool, left: int, right: int,
              softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Tq, H, D) dO -> dq (Tq, H, D), dk, dv (Tk, Hk, D); tokens past the last document get zeros."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    start_q = start_k = 0
    for sq, sk in zip(_lengths(cu_q), _lengths(cu_k)):
        if sq and sk:
            rows_q, rows_k = slice(start_q, start_q + sq), slice(start_k, start_k + sk)
            grads = _document_grads(g[rows_q].transpose(0, 1), q[rows_q].transpose(0, 1), k[rows_k].transpose(0, 1),
                                    v[rows_k].transpose(0, 1), scale, causal, (left, right), softcap)
            for full, part, rows in zip((dq, dk, dv), grads, (rows_q, rows_k, rows_k)):
                full[rows] = part.transpose(0, 1).to(full.dtype)
        start_q, start_k = start_q + sq, start_k + sk
    return dq, dk, dv


def _register() -> Optional[object]:
    """The custom op with its fake and its autograd (registered at import, outside any trace), or None where torch
    has no `torch.library.custom_op` (< 2.4)."""
    custom_op = getattr(getattr(torch, "library", None), "custom_op", None)
    if custom_op is None:
        return None
    forward = custom_op(OP_NAME, mutates_args=())(_forward)
    backward = custom_op(OP_NAME + "_backward", mutates_args=())(_backward)

    @forward.register_fake
    def _(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap):
        return q.new_empty(q.shape[0], q.shape[1], v.shape[2])

    @backward.register_fake
    def _(g, q, k, v, cu_q, cu_k, scale, causal, left, right, softcap):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.options = inputs[5:]

    def gradient(ctx, g):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        return (*backward(g.contiguous(), q, k, v, cu_q, cu_k, *ctx.options), None, None, None, None, None, None, None)

    forward.register_autograd(gradient, setup_context=setup_context)
    return forward


try:
    _OP = _register()
except RuntimeError:  # already registered (a second copy of patchkit in this process): the traced loop serves
    _OP = None


def served(dropout_p: float) -> bool:
    """Whether the op can serve a call (it has no attention dropout; torch >= 2.4)."""
    return _OP is not None and dropout_p == 0


def varlen_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                scale: float, causal: bool, window: tuple[int, int], softcap: float) -> torch.Tensor:
    """q (Tq, H, D), k/v (Tk, Hk, D), int32 cu_seqlens -> out (Tq, H, D): the sdpa backend's varlen attention."""
    return _OP(q, k, v, cu_q, cu_k, float(scale), bool(causal), int(window[0]), int(window[1]), float(softcap))
