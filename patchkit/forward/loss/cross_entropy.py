"""transformers' causal-LM loss in row chunks, so no float32 (n, V) copy of the logits is ever held (unpad="loss").

transformers' `ForCausalLMLoss` upcasts every logit to float32 and `cross_entropy` keeps a float32 log-softmax of
them for the backward: at a 128k-262k vocabulary these copies, not the model, are a training step's memory peak.
Here the forward keeps one float per row (its log-sum-exp) and the backward writes the logits' gradient chunk by
chunk (softmax minus one-hot, in float32, cast to the logits' dtype), as Liger's and TRL's chunked losses do. The
numbers are transformers': the mean over labelled tokens, or the sum over `num_items_in_batch`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # transformers' label of a token with no loss term (`ForCausalLMLoss`'s ignore_index)
CHUNK_ELEMENTS = 1 << 24  # float32 elements of one chunk (64 MiB): rows = this // V
CACHE_ELEMENTS = 1 << 18  # on a CPU the forward's chunks stay in cache at this size (measured 2.5x faster)


def chunk_rows(vocab: int, elements: int) -> int:
    """Rows of a (rows, vocab) chunk of about `elements` elements (one at least)."""
    return max(1, elements // max(vocab, 1))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[label], rows with `ignore_index` skipped, divided by `denominator`."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                denominator: Optional[torch.Tensor]) -> torch.Tensor:
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        nll = torch.empty_like(lse)
        step = chunk_rows(logits.shape[1], CACHE_ELEMENTS if logits.device.type == "cpu" else CHUNK_ELEMENTS)
        for start in range(0, logits.shape[0], step):
            rows, label = slice(start, start + step), safe[start:start + step, None]
            part = logits[rows].float()
            log_probs = torch.log_softmax(part, dim=-1)  # one fused pass; the chunk's alone, never (n, V)
            nll[rows] = log_probs.gather(1, label).squeeze(1).neg_()
            lse[rows] = part.gather(1, label).squeeze(1).add_(nll[rows])  # logit + nll = log-sum-exp
        count = valid.sum() if denominator is None else denominator
        ctx.save_for_backward(logits, safe, valid, lse, count)
        return (nll * valid).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        """d loss / d logits = (softmax - one-hot) * g for a labelled row, 0 for an ignored one (even where no row is
        labelled, as torch's), g = grad / count: softmax * |g| as one exp(logits - (lse - log |g|)) written where
        the gradient goes, the one-hot's -|g| added at each label, the sign last."""
        logits, safe, valid, lse, count = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the same gradient by differentiable ops (the (n, V) probs)
            probs = torch.softmax(logits.float(), dim=-1) - F.one_hot(safe, logits.shape[1])
            return (probs * (valid[:, None] * (grad / count).float())).to(logits.dtype), None, None, None
        g = (grad / count).float()
        magnitude = torch.where(valid, g.abs(), 0.0)  # (n,)
        shift = lse - magnitude.log()  # +inf on ignored rows: exp gives 0 there
        out = torch.empty_like(logits)
        in_place = logits.dtype == torch.float32
        step = chunk_rows(logits.shape[1], CHUNK_ELEMENTS)
        for start in range(0, logits.shape[0], step):
            rows = slice(start, start + step)
            part = out[rows] if in_place else torch.empty(out[rows].shape, device=out.device)
            torch.sub(logits[rows], shift[rows, None], out=part).exp_()
            part.scatter_add_(1, safe[rows, None], -magnitude[rows, None])
            if not in_place:
                out[rows] = part
        if bool(g < 0):  # a loss scaled by a negative number (rare): one more pass
            out.neg_()
        return out, None, None, None


def loss_denominator(labels: torch.Tensor, vocab: int, ignore_index: int,
                     num_items_in_batch: Optional[Union[torch.Tensor, int]], device: torch.device,
                     ) -> Optional[torch.Tensor]:
    """`fixed_cross_entropy`'s denominator (None: the labelled rows' count), once the labels are found in the
    vocabulary: one outside it that is not `ignore_index` raises as `cross_entropy` does."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise IndexError(f"Target {int(labels[bad][0])} is out of bounds (vocabulary of {vocab}).")
    if num_items_in_batch is None:
        return None
    return torch.as_tensor(num_items_in_batch, device=device).float()


def chunked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                          num_items_in_batch: Optional[Union[torch.Tensor, int]] = None) -> torch.Tensor:
    """`fixed_cross_entropy` of transformers (cross-entropy, mean over labelled rows or sum over
    `num_items_in_batch`) over (n, V) logits and (n,) labels, in row chunks. A label outside the vocabulary that is
    not `ignore_index` raises as `cross_entropy` does."""
    denominator = loss_denominator(labels, logits.shape[-1], ignore_index, num_items_in_batch, logits.device)
    return _ChunkedCrossEntropy.apply(logits, labels, ignore_index, denominator)


def shifted_labels(labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor] = None,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The labels each position predicts, as `ForCausalLMLoss` shifts them (a row's last position predicts nothing),
    or the caller's own `shift_labels` where given."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def chunked_causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                           num_items_in_batch: Optional[Union[torch.Tensor, int]] = None,
                           ignore_index: int = IGNORE_INDEX, shift_labels: Optional[torch.Tensor] = None,
                           **kwargs: Any) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` (same arguments, same numbers), chunked."""
    shift_labels = shifted_labels(labels, shift_labels, ignore_index)
    return chunked_cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                                 ignore_index, num_items_in_batch)
