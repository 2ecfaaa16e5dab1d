"""The LM head fused with transformers' causal-LM loss: row chunks of logits, never the (n, V) logits (unpad="loss").

`linear_cross_entropy` computes `ForCausalLMLoss(transform(hidden @ W.T + b), labels)` as transformers' own code does
(the head in the weights' dtype, the family's logit transform in that dtype, the loss in float32), one chunk of rows
at a time, and writes the gradients of `hidden`, `W` and `b` in the same pass, as Liger's fused linear cross-entropy
does: no tensor of the logits' size outlives its chunk. The backward scales the stored gradients by the one number
it receives. What it holds from the forward to the backward is the gradient of `hidden` and a float32 gradient of
`W` (V x H), so it pays where the logits it saves are larger (`saves_memory`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from patchkit.forward.loss.cross_entropy import loss_denominator

CHUNK_ELEMENTS = 1 << 24  # elements of one chunk's logits (64 MiB in float32) at least
BALANCE_ELEMENTS = 1 << 26  # ... and up to H rows within this many (256 MiB): see chunk_rows
MIN_ROWS = 16


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk. Each chunk reads and writes the float32 (V, H) weight gradient once: with fewer than H rows
    that traffic, not the matmuls, dominates the chunk (measured on a CPU at V = 262144, H = 256: 64 rows a chunk
    1.35x slower than 512). So H rows where that stays within BALANCE_ELEMENTS, at least CHUNK_ELEMENTS of logits,
    and at least as many elements as the hidden states have (Liger's rule: about V / H chunks)."""
    vocab = max(vocab, 1)
    return max(MIN_ROWS, CHUNK_ELEMENTS // vocab, min(hidden, BALANCE_ELEMENTS // vocab), -(-rows * hidden // vocab))


class LogitTransform(NamedTuple):
    """What a family's causal LM does to its head's output before the loss, in this order: a multiplier or a divisor
    (Cohere's `logit_scale`, Falcon-H1's `lm_head_multiplier`, Granite's `logits_scaling`), then a tanh softcap
    (Gemma's `final_logit_softcapping`: / cap, tanh, * cap)."""

    multiply: Optional[float] = None
    divide: Optional[float] = None
    softcap: Optional[float] = None

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def grad(self, g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """d loss / d z from d loss / d t, where t = apply(z) (in place on `g`)."""
        if self.softcap is not None:
            g.mul_(1 - (t / self.softcap).square())
        if self.divide is not None:
            g.div_(self.divide)
        if self.multiply is not None:
            g.mul_(self.multiply)
        return g


def logits_of(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              transform: LogitTransform) -> torch.Tensor:
    """The family's logits of `hidden` rows, as its forward computes them (the head, then its transform)."""
    return transform.apply(F.linear(hidden, weight, bias))


def saves_memory(rows: int, vocab: int, hidden: int, dtype: torch.dtype) -> bool:
    """The fused loss holds a float32 (V, H) weight gradient from the forward to the backward; the unfused one holds
    the (rows, V) logits and, in the backward, their float32 gradient: fused where that is more."""
    return rows * (torch.finfo(dtype).bits // 8 + 4) > hidden * 4


PLAIN = LogitTransform()  # a head whose logits go to the loss as they are (LLaMA, Qwen, Mistral, ...)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, transform: LogitTransform, ignore_index: int,
                denominator: Optional[torch.Tensor]) -> torch.Tensor:
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        count = (valid.sum() if denominator is None else denominator).float()
        scale = valid.float() / count  # each row's share of the loss
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if (
            ctx.needs_input_grad[1]) else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if (
            bias is not None and ctx.needs_input_grad[2]) else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = chunk_rows(hidden.shape[0], weight.shape[0], weight.shape[1])
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            h, label = hidden[rows], safe[rows, None]
            t = logits_of(h, weight, bias, transform)
            logp = torch.log_softmax(t.float(), dim=-1)
            total += (logp.gather(1, label).squeeze(1) * scale[rows]).sum().neg()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            g = logp.exp_()  # softmax - one-hot, times the row's share: d loss / d t in float32
            g.scatter_add_(1, label, torch.full_like(g[:, :1], -1.0)).mul_(scale[rows, None])
            g = transform.grad(g.to(t.dtype), t)  # as autograd: cast to t's dtype, then through the transform
            if grad_hidden is not None:
                grad_hidden[rows] = g @ weight
            if grad_weight is not None:
                grad_weight.addmm_(g.t().float(), h.float())
            if grad_bias is not None:
                grad_bias += g.float().sum(0)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.grads is None:
            raise RuntimeError(
                "patchkit: a second backward through the same fused head-and-loss (retain_graph=True): its gradients "
                "were scaled in place by the first. Apply the patch with unpad='model' for such a loop."
            )
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # scaled in place and handed on: nothing of the forward's size stays
        weight_dtype, bias_dtype = ctx.dtypes
        out_h = None if grad_hidden is None else grad_hidden.mul_(grad.to(grad_hidden.dtype))
        out_w = None if grad_weight is None else grad_weight.mul_(grad.float()).to(weight_dtype)
        out_b = None if grad_bias is None else grad_bias.mul_(grad.float()).to(bias_dtype)
        return out_h, out_w, out_b, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, transform: LogitTransform = PLAIN, ignore_index: int = -100,
                         num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
    """transformers' `fixed_cross_entropy` of the family's logits of (n, H) `hidden` against (n,) labels (already
    shifted): the mean over labelled rows, or the sum over `num_items_in_batch`. A label outside the vocabulary that
    is not `ignore_index` raises as `cross_entropy` does."""
    denominator = loss_denominator(labels, weight.shape[0], ignore_index, num_items_in_batch, hidden.device)
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels.to(hidden.device), transform, ignore_index,
                                     denominator)
