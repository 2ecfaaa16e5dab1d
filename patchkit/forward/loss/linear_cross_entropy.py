"""The LM head fused with transformers' causal-LM loss: chunks of logits, never the (n, V) logits (unpad="loss").

`linear_cross_entropy` computes `ForCausalLMLoss(transform(hidden @ W.T + b), labels)` as transformers' own code does
(the head in the weights' dtype, or autocast's, the family's logit transform in that dtype, the loss in float32),
one chunk at a time, so no tensor of the logits' size ever exists. The gradients are written one of two ways, by
the dtype the head runs in:

- **In the forward** (a head that trains in float32; a frozen one, as LoRA leaves it, except in float16), as
  Liger's fused linear cross-entropy does: row chunk by row chunk, the hidden rows' gradient and a float32 weight
  gradient are written as the loss is, and the backward scales them by the one number it receives. In float32 that
  buffer is the weight's gradient itself, which autograd would write at the same point of the step; three matmuls,
  as unfused.
- **In the backward** (a head that trains in bfloat16 or float16, autocast's included; any float16 head, whose
  loss a gradient scaler multiplies past float16's range), as Apple's Cut Cross-Entropy does: the forward keeps each
  row's log-sum-exp; the backward computes the logits again, a vocabulary slice at a time over every row, applies
  the upstream gradient before the cast to the head's dtype, as autograd does, and writes each slice's rows of the
  weight's gradient with one matmul in that dtype. A float32 buffer there would hold twice a bfloat16 gradient's
  memory and run its matmul at float32 speed (a fraction of a GPU's bfloat16 rate); the price is one more matmul.

A head with a learned scale per vocabulary entry (Dory's `logit_scale`: the head's output in float32 times a (V,)
vector) passes that vector as `column_scale`; its gradient is written beside the weight's.

A LoRA head (PEFT's `lora.Linear` on the head, as continued pretraining trains it) adds `LowRank` terms: the rows'
(n, r) products with each adapter's A, made outside by autograd, and B's (V, r) weight, a slice of whose logits adds
to the head's as PEFT's forward adds them; their gradients are written beside the head's, each of B's a (V, r) one.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from patchkit.dtypes import autocast_dtype
from patchkit.errors import PatchkitError
from patchkit.forward.loss.cross_entropy import IGNORE_INDEX, loss_denominator

CHUNK_ELEMENTS = 1 << 24  # elements of one chunk's logits (64 MiB in float32) at least
BALANCE_ELEMENTS = 1 << 26  # ... and up to H rows within this many (256 MiB): see chunk_rows
CACHE_ELEMENTS = 1 << 20  # on a CPU a vocabulary slice of about this many logits stays in cache: see chunk_columns
MIN_ROWS = 16
MIN_COLUMNS = 256  # a vocabulary slice narrower than this leaves its matmuls memory-bound
HOLD_DTYPES = (torch.float32, torch.float64)  # a head that trains in these gets its gradients in the forward
# float16 training scales its loss (GradScaler: 65536, beyond float16's range) so that the logits' gradient survives
# its cast: the factor reaches it before the cast only in the backward, so a float16 head always recomputes there
SCALED_DTYPES = (torch.float16,)


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk where the forward writes the gradients. Each chunk reads the weight and reads and writes the
    float32 (V, H) weight gradient once: with fewer than H rows that traffic, not the matmuls, dominates (measured on
    a CPU at V = 262144, H = 256: 64 rows a chunk 1.35x slower than 512). So H rows where that stays within
    BALANCE_ELEMENTS, at least CHUNK_ELEMENTS of logits, and at least as many elements as the hidden states have
    (Liger's rule: about V / H chunks)."""
    vocab = max(vocab, 1)
    return max(MIN_ROWS, CHUNK_ELEMENTS // vocab, min(hidden, BALANCE_ELEMENTS // vocab), -(-rows * hidden // vocab))


def chunk_columns(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary columns per slice, each run over every row: about CHUNK_ELEMENTS logits a slice, CACHE_ELEMENTS
    on a CPU (measured at 1809 rows, H = 256, V = 128256: 512-column slices ran the forward 1.4x and 256-column ones
    the backward 1.4x faster than 9274-column ones, and than row chunks)."""
    elements = CACHE_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS
    return min(max(vocab, 1), max(MIN_COLUMNS, elements // max(rows, 1)))


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


PLAIN = LogitTransform()  # a head whose logits go to the loss as they are (LLaMA, Qwen, Mistral, ...)


class LowRank(NamedTuple):
    """One LoRA adapter's term of a head's logits, `F.linear(rows, weight, bias) * scale` added to the head's:
    `rows` the hidden rows' (n, r) product with its A (after its dropout), `weight` (and `bias`) its B's."""

    rows: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float

    def cols(self, cols: slice) -> LowRank:
        return self._replace(weight=self.weight[cols], bias=None if self.bias is None else self.bias[cols])


def logits_of(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              transform: LogitTransform, terms: Sequence[LowRank] = (),
              column_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The family's logits of `hidden` rows, as its forward computes them (the head, then its transform); with LoRA
    `terms`, each added as PEFT's forward adds it (in the promoted dtype, cast back to the head's); with a
    `column_scale`, the head's output in float32 times it, before the transform."""
    return transform.apply(column_scaled(head_of(hidden, weight, bias, terms), column_scale))


def column_scaled(z: torch.Tensor, column_scale: Optional[torch.Tensor]) -> torch.Tensor:
    return z if column_scale is None else z.float() * column_scale


def head_of(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            terms: Sequence[LowRank] = ()) -> torch.Tensor:
    """The head's output of `hidden` rows, its LoRA `terms` added (`logits_of` before any scale or transform)."""
    z = F.linear(hidden, weight, bias)
    if terms:
        dtype = z.dtype
        for term in terms:  # the same roundings, in place: the term scaled, then the sum in the promoted dtype
            low = F.linear(term.rows, term.weight, term.bias).mul_(term.scale)
            z = low.add_(z) if low.dtype == torch.promote_types(z.dtype, low.dtype) else z.add_(low)
        z = z.to(dtype)
    return z


def through_scale(g: torch.Tensor, z: torch.Tensor, column_scale: Optional[torch.Tensor],
                  grad_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """d loss / d z from d loss / d (z * column_scale) `g`, in z's dtype as autograd casts it; the scale's gradient
    (the sum over rows of `g` times z, in float32) added into `grad_scale` where it is needed."""
    if column_scale is None:
        return g
    if grad_scale is not None:
        grad_scale.add_((g * z.float()).sum(0))
    return (g * column_scale).to(z.dtype)


SECOND_ORDER = (
    "patchkit: {what} through the LM head fused with its loss, which keeps no graph of its gradients (it writes them "
    "in one pass: no (n, V) logits are ever held). A forward gets it where its caller reads nothing of the output "
    "but the loss. Fix: apply the patch with unpad='attention' for such a loop (the head and loss run as "
    "transformers' do), or read outputs.logits there too."
)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                column_scale: Optional[torch.Tensor], labels: torch.Tensor, transform: LogitTransform,
                ignore_index: int, denominator: Optional[torch.Tensor], scales: tuple[float, ...],
                *flat: Optional[torch.Tensor]) -> torch.Tensor:
        device = hidden.device.type
        autocast = autocast_dtype(device)
        dtype = autocast or weight.dtype  # the head's dtype, as nn.Linear runs here
        h, w, b = (_as(t, dtype) for t in (hidden, weight, bias))
        terms = [LowRank(*(_as(t, autocast or term.weight.dtype) for t in term[:3]), term.scale)
                 for term in _terms(flat, scales)]  # each adapter's in its own dtype, or autocast's
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        scale = valid.float() / (valid.sum() if denominator is None else denominator).float()  # a row's share
        ctx.transform, ctx.device, ctx.scales = transform, device, scales
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias, column_scale, *flat))
        ctx.grads = None
        needs = ctx.needs_input_grad[:4] + ctx.needs_input_grad[9:]
        c = None if column_scale is None else column_scale.float()
        with torch.autocast(device, enabled=False):
            trains = needs[1] or needs[2]
            scaled = dtype in SCALED_DTYPES or any(t.weight.dtype in SCALED_DTYPES for t in terms)
            if (trains and dtype not in HOLD_DTYPES) or scaled:
                nll, lse = _nll(h, w, b, c, safe, transform, terms)  # the gradients are computed in the backward
                ctx.save_for_backward(h, w, b, c, safe, scale, lse, *(t for term in terms for t in term[:3]))
                return (nll * scale).sum()
            total, ctx.grads = _nll_and_grads(h, w, b, c, safe, scale, transform, needs, terms)
            return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if torch.is_grad_enabled():  # create_graph=True: its gradients are not computed by differentiable ops
            raise PatchkitError(SECOND_ORDER.format(what="a gradient of its gradient (create_graph=True)"))
        if not ctx.saved_tensors:  # the gradients were written in the forward, for an upstream gradient of 1
            if ctx.grads is None:
                raise PatchkitError(SECOND_ORDER.format(what="a second backward (retain_graph=True)"))
            grads, ctx.grads = ctx.grads, None  # scaled in place and handed on: nothing of the forward's size stays
            grads = tuple(None if t is None else t.mul_(grad.to(t.dtype)) for t in grads)
        else:
            h, w, b, c, safe, scale, lse, *flat = ctx.saved_tensors
            with torch.autocast(ctx.device, enabled=False):
                grads = _recomputed_grads(h, w, b, c, safe, scale * grad.float(), lse, ctx.transform,
                                          ctx.needs_input_grad[:4] + ctx.needs_input_grad[9:], _terms(flat, ctx.scales))
        grads = tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))
        return (*grads[:4], None, None, None, None, None, *grads[4:])


def _terms(flat: Sequence[Optional[torch.Tensor]], scales: Sequence[float]) -> list[LowRank]:
    """The `LowRank` terms of the autograd function's flat inputs: (rows, weight, bias) per scale."""
    return [LowRank(*flat[3 * i:3 * i + 3], scale) for i, scale in enumerate(scales)]


def _as(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _term_grads(terms: Sequence[LowRank], needs: tuple, rows: int) -> list[Optional[torch.Tensor]]:
    """Zeroed float32 buffers for each term's rows' gradient, and its B's weight and bias gradients, where needed."""
    out: list[Optional[torch.Tensor]] = []
    for i, term in enumerate(terms):
        for j, t in enumerate(term[:3]):
            needed = t is not None and needs[4 + 3 * i + j]
            out.append(torch.zeros(t.shape if j else (rows, t.shape[1]), dtype=torch.float32, device=t.device)
                       if needed else None)
    return out


def _add_term_grads(out: list[Optional[torch.Tensor]], terms: Sequence[LowRank], g: torch.Tensor,
                    rows: slice, cols: slice) -> None:
    """Add a chunk's share to the terms' gradients: `g` is d loss / d logits of `rows` x `cols`, in the head's dtype;
    each term gets it cast to its own dtype, as autograd hands it on through PEFT's sum, and its scale on the (n, r)
    and (V, r) products (no second chunk-sized tensor)."""
    for i, term in enumerate(terms):
        grad_rows, grad_weight, grad_bias = out[3 * i:3 * i + 3]
        gi = g.to(term.weight.dtype)
        if grad_rows is not None:
            grad_rows[rows].add_(gi @ term.weight[cols], alpha=term.scale)
        if grad_weight is not None:
            grad_weight[cols].add_(gi.t() @ term.rows[rows], alpha=term.scale)
        if grad_bias is not None:
            grad_bias[cols].add_(gi.sum(0), alpha=term.scale)


def _nll(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], c: Optional[torch.Tensor], safe: torch.Tensor,
         transform: LogitTransform, terms: Sequence[LowRank] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's -log softmax at its label, and its log-sum-exp, in float32: a vocabulary slice at a time over
    every row, the log-sum-exp kept running (the slice's maximum, the sum of exp below it, rescaled as the maximum
    grows), as the backward walks the same slices."""
    top = torch.full((h.shape[0],), float("-inf"), dtype=torch.float32, device=h.device)
    below, picked = torch.zeros_like(top), torch.zeros_like(top)
    step = chunk_columns(h.shape[0], w.shape[0], h.device)
    for start in range(0, w.shape[0], step):
        cols = slice(start, start + step)
        t = logits_of(h, w[cols], None if b is None else b[cols], transform, [term.cols(cols) for term in terms],
                      None if c is None else c[cols])
        t = t.float()
        local, inside = _in_slice(safe, start, t.shape[1])
        picked += torch.where(inside, t.gather(1, local[:, None]).squeeze(1), 0.0)
        grown = torch.maximum(top, t.amax(1))
        below = below * (top - grown).exp_() + t.sub_(grown[:, None]).exp_().sum(1)
        top = grown
    lse = below.log_().add_(top)
    return lse - picked, lse


def _in_slice(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as columns of the vocabulary slice from `start` (clamped into it), and which fall inside it."""
    local = labels - start
    inside = (local >= 0) & (local < width)
    return local.clamp_(0, width - 1), inside


def _recomputed_grads(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], c: Optional[torch.Tensor],
                      safe: torch.Tensor,
                      row_grad: torch.Tensor, lse: torch.Tensor, transform: LogitTransform,
                      needs: tuple, terms: Sequence[LowRank] = ()) -> tuple[Optional[torch.Tensor], ...]:
    """The gradients of the hidden rows, the weight and the bias (then the terms'), a vocabulary slice at a time over
    every row: the slice's logits again, d loss / d logits = (softmax - one-hot) * the row's gradient (softmax * |g|
    as one exp(t - (lse - log |g|)), zero on ignored rows), cast to the logits' dtype and through the transform; then
    the slice's rows of the weight's and bias's gradients whole, and its share of the hidden rows' gradient."""
    magnitude = row_grad.abs()
    shift = lse - magnitude.log()  # +inf where a row has no gradient: exp gives 0 there
    grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if needs[0] else None
    grad_w = torch.empty_like(w) if needs[1] else None
    grad_b = torch.empty_like(b) if b is not None and needs[2] else None
    grad_c = torch.zeros_like(c) if c is not None and needs[3] else None
    term_grads = _term_grads(terms, needs, h.shape[0])
    every = slice(None)
    step = chunk_columns(h.shape[0], w.shape[0], h.device)
    for start in range(0, w.shape[0], step):
        cols = slice(start, start + step)
        w_c, c_c = w[cols], None if c is None else c[cols]
        z = head_of(h, w_c, None if b is None else b[cols], [term.cols(cols) for term in terms])
        t = transform.apply(column_scaled(z, c_c))
        g = torch.sub(t.float(), shift[:, None]).exp_()
        local, inside = _in_slice(safe, start, g.shape[1])
        g.scatter_add_(1, local[:, None], torch.where(inside, -magnitude, 0.0)[:, None])
        g = through_scale(transform.grad(g.to(t.dtype), t), z, c_c, None if grad_c is None else grad_c[cols])
        if grad_h is not None:
            grad_h.add_(g @ w_c)
        if grad_w is not None:
            torch.mm(g.t(), h, out=grad_w[cols])
        if grad_b is not None:
            torch.sum(g, 0, out=grad_b[cols])
        _add_term_grads(term_grads, terms, g, every, cols)
    grads = (grad_h, grad_w, grad_b, grad_c, *term_grads)
    if bool((row_grad < 0).any()):  # a loss scaled by a negative number (rare): the sign, last
        for t in grads:
            if t is not None:
                t.neg_()
    return grads


def _nll_and_grads(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], c: Optional[torch.Tensor],
                   safe: torch.Tensor,
                   scale: torch.Tensor, transform: LogitTransform, needs: tuple, terms: Sequence[LowRank] = (),
                   ) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], ...]]:
    """The loss, and the gradients of the hidden rows, the weight (float32) and the bias (float32), then the terms'
    (float32), for an upstream gradient of 1, where each is needed, in row chunks."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if needs[0] else None
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if needs[1] else None
    grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if b is not None and needs[2] else None
    grad_c = torch.zeros_like(c) if c is not None and needs[3] else None
    term_grads = _term_grads(terms, needs, h.shape[0])
    every = slice(None)
    step = chunk_rows(h.shape[0], w.shape[0], w.shape[1])
    for start in range(0, h.shape[0], step):
        rows, label = slice(start, start + step), safe[start:start + step, None]
        z = head_of(h[rows], w, b, [term._replace(rows=term.rows[rows]) for term in terms])
        t = transform.apply(column_scaled(z, c))
        logp = torch.log_softmax(t.float(), dim=-1)
        total += (logp.gather(1, label).squeeze(1) * scale[rows]).sum().neg()
        if all(g is None for g in (grad_h, grad_w, grad_b, grad_c, *term_grads)):
            continue
        g = logp.exp_()  # softmax - one-hot, times the row's share: d loss / d t in float32
        g.scatter_add_(1, label, torch.full_like(g[:, :1], -1.0)).mul_(scale[rows, None])
        g = transform.grad(g.to(t.dtype), t)  # as autograd: cast to t's dtype, then through the transform
        g = through_scale(g, z, c, grad_c)
        if grad_h is not None:
            grad_h[rows] = g @ w
        if grad_w is not None:
            grad_w.addmm_(g.t().float(), h[rows].float())
        if grad_b is not None:
            grad_b += g.float().sum(0)
        _add_term_grads(term_grads, terms, g, rows, every)
    return total, (grad_h, grad_w, grad_b, grad_c, *term_grads)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, transform: LogitTransform = PLAIN, ignore_index: int = IGNORE_INDEX,
                         num_items_in_batch: Optional[Union[torch.Tensor, int]] = None,
                         terms: Sequence[LowRank] = (), column_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' `fixed_cross_entropy` of the family's logits of (n, H) `hidden` against (n,) labels (already
    shifted): the mean over labelled rows, or the sum over `num_items_in_batch`. A label outside the vocabulary that
    is not `ignore_index` raises as `cross_entropy` does. `terms`: a LoRA head's adapters (`LowRank`);
    `column_scale`: a (V,) factor of the head's float32 output (`logits_of`)."""
    denominator = loss_denominator(labels, weight.shape[0], ignore_index, num_items_in_batch, hidden.device)
    flat = [t for term in terms for t in term[:3]]
    return _LinearCrossEntropy.apply(hidden, weight, bias, column_scale, labels.to(hidden.device), transform,
                                     ignore_index, denominator, tuple(float(term.scale) for term in terms), *flat)
