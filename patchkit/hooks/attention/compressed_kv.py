"""DeepSeek-V4's compressed KV entries in a served forward: the bias its compressor makes for them reaches patchkit's
attention, which attends to the sliding window's keys on real tokens and to the entries under that bias.

A V4 layer's keys are its sliding window's (K = V) followed by T compressed entries, each pooled from a window of
`compress_rate` source tokens by the layer's compressor (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor`). Which
entries a query sees is the compressor's `block_bias` (B, 1, S, T): -inf at a window the query has not reached the
end of, and, in a CSA layer, at every entry its indexer did not keep. transformers appends that bias to a 4D mask only
(`isinstance(attention_mask, torch.Tensor)`); patchkit's 2D mask is none, so the layer drops it and every query
would see every entry. Here the compressor's forward keeps its entries' count and bias for its layer's next attention
call (`make_compressor_forward`), which takes them back (`split_entries`): the window's keys run through the
varlen path with their log-sum-exp, the entries under their bias are merged into it (`entries_merge`), then the sinks.

transformers' compressor pools a row by column. In a packed row (the batch unpadded at the model, or documents packed
by the caller) it runs once per document instead, each in a row of its own (`documents`): the entries of a
right-padded row, or of a document run alone, as transformers makes them. A packed row with a cache runs as
transformers runs it (one state a row), its entries pooled across its documents, said once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from patchkit.errors import PatchInputError, PatchStateError
from patchkit.forward.context import current
from patchkit.forward.documents import Rows, documents
from patchkit.forward.metadata import VarlenMetadata
from patchkit.forward.padding import pad_input, unpad_rows

PACKED_ENTRIES = ("patchkit: DeepSeek-V4's compressors pool a packed row with a cache by column, across its "
                  "documents: a query sees entries pooled from the documents before its own, in transformers as here "
                  "(its sliding window stays within the document). Pass use_cache=False to keep documents apart.")
JOINED_DOCUMENTS = ("DeepSeek-V4: this row's position_ids restart (packed documents) but its attention mask joins "
                    "them (a mask of ones): its compressors pool each document alone, its attention would not. Pass "
                    "no attention_mask to keep the documents apart (padding-free), or position_ids that count through "
                    "the row to join them.")
ENTRIES = "patchkit_entries"  # a compressor's last forward's (entry count, bias), taken by its layer's attention


class Entries(NamedTuple):
    """A layer's compressed entries: keys and values (B, Hk, T, D), the bias of each query's view of them
    (B, 1, S, T) or None where every query sees every entry (a decode step's), and for a packed row the documents'
    rows they were pooled in (`Rows`: keys and values then (1, Hk, count * T, D), the bias (count, 1, length, T))."""

    key: torch.Tensor
    value: torch.Tensor
    bias: Optional[torch.Tensor]
    rows: Optional[Rows] = None


def in_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """(1, N, F) tokens of a packed row -> (count, length, F), each document in a row of its own, zeros after it."""
    return pad_input(x[0], rows.indices, rows.count, rows.length)


def make_compressor_forward(original: Callable, like: Optional[Callable] = None) -> Callable:
    """The compressor's forward: transformers' own, its entries' count and bias kept on the module for its layer's
    attention call; in a packed row without a cache, once per document (`documents`), its entries handed to the layer
    as one row (1, 1, count * T, D) and their bias kept. `like`: the forward whose parameters `original` takes."""
    signature = inspect.signature(like or original)

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        given = dict(list(signature.bind(self, *args, **kwargs).arguments.items())[1:])  # after self
        cache = given.get("cache", given.get("past_key_values"))
        hidden = given["hidden_states"]
        context = current()
        aside = context.lm_cause is not None or context.plan.aside is not None  # transformers' own forward
        rows = documents(given.get("position_ids")) if cache is None and hidden.shape[0] == 1 and not aside else None
        if rows is None:
            out = original(self, *args, **kwargs)
            self.__dict__[ENTRIES] = (out[0].shape[-2], out[1], None)
            return out
        positions = torch.arange(rows.length, device=hidden.device).expand(rows.count, -1)
        laid = {"hidden_states": in_rows(hidden, rows), "q_residual": in_rows(given["q_residual"], rows),
                "position_ids": positions}
        compressed, bias = original(self, **{**given, **laid})
        self.__dict__[ENTRIES] = (compressed.shape[0] * compressed.shape[-2], bias, rows)
        return compressed.transpose(0, 1).reshape(1, compressed.shape[1], -1, compressed.shape[-1]), None

    return forward


def split_entries(module: nn.Module, key: torch.Tensor, value: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Optional[Entries]]:
    """A layer's keys and values without its compressed entries, and the entries with their bias (None for a layer
    without a compressor). The layer's compressor ran just before its attention call, in the forward and in a
    checkpointed recompute alike; keys without their bias are never attended to."""
    compressor = module._modules.get("compressor")  # a submodule, if any: no nn.Module.__getattr__ miss per call
    if not isinstance(compressor, nn.Module):
        return key, value, None
    kept = compressor.__dict__.pop(ENTRIES, None)
    if kept is None:
        raise PatchStateError(
            f"{type(module).__name__}'s compressed KV entries reached patchkit's attention without the bias its "
            f"compressor ({type(compressor).__name__}) made for them: a patchkit bug (report the model type); "
            "meanwhile run this model without patchkit"
        )
    count, bias, rows = kept
    raw = key.shape[-2] - count
    return key[:, :, :raw], value[:, :, :raw], Entries(key[:, :, raw:], value[:, :, raw:], bias, rows)


def appended_cause(module: nn.Module) -> Optional[str]:
    """The step-aside cause a compressed layer's mask was made for, in a forward its causal LM or base model told
    (`lm_cause`): the layer appends its entries' bias to transformers' 4D mask as a new tensor, which carries no tag.
    The entries its compressor kept for patchkit's attention are dropped: transformers' attention reads the bias."""
    compressor = getattr(module, "compressor", None)
    if not isinstance(compressor, nn.Module):
        return None
    compressor.__dict__.pop(ENTRIES, None)
    return current().lm_cause


def check_documents(entries: Entries, meta: VarlenMetadata, warn_once: Callable[[str, str], None]) -> None:
    """The entries' documents against attention's (`meta`): pooled across a packed row's documents (a cache's one
    state a row) is said once; pooled per document where attention joins them (a mask of ones) is refused."""
    if entries.rows is None and len(meta.seqlens_q) > meta.batch:
        warn_once("compressed_documents", PACKED_ENTRIES)
    if entries.rows is not None and len(meta.seqlens_q) != entries.rows.count:
        raise PatchInputError(JOINED_DOCUMENTS)


def entries_merge(q: torch.Tensor, meta: VarlenMetadata, dropout: float, scaling: float, entries: Entries
                  ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The merge `attend.attend_with_sinks` runs on the window's attention of the real queries of q (B, H, S, D): its
    (out, lse) and the entries each query's bias leaves it (on the padded layout, or the documents' rows, as
    transformers computes them), one softmax over both (log-sum-exp), before the sinks."""
    if dropout:
        raise PatchInputError("patchkit serves DeepSeek-V4's compressed attention without attention dropout; set "
                              "config.attention_dropout = 0.0 (the checkpoints' value)")

    def merge(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = lse.float()
        if not entries.key.shape[-2]:
            return out, lse
        heads = q.shape[1] // entries.key.shape[1]
        ek, ev = (t.repeat_interleave(heads, dim=1) if heads > 1 else t for t in (entries.key, entries.value))
        rows, laid, indices = entries.rows, q, meta.indices_q
        if rows is not None:  # each document's queries and entries in a row of their own
            ek, ev = (t.reshape(t.shape[1], rows.count, -1, t.shape[-1]).transpose(0, 1) for t in (ek, ev))
            tokens = unpad_rows(q.transpose(1, 2), meta.indices_q)
            laid = pad_input(tokens, rows.indices, rows.count, rows.length).transpose(1, 2)
            indices = rows.indices
        scores = torch.matmul(laid, ek.transpose(-1, -2)).float() * scaling  # (B, H, S, T)
        if entries.bias is not None:
            scores = scores + entries.bias.float()
        top = scores.amax(-1, keepdim=True)
        top = top.masked_fill(torch.isinf(top), 0.0)  # a query that sees no entry: its weights are all zero
        weights = torch.exp(scores - top)
        total = weights.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        seen = torch.matmul((weights / total).to(ev.dtype), ev)  # (B, H, S, D)
        seen_lse = (total.log() + top).squeeze(-1)  # (B, H, S): about -87 where no entry is seen
        seen, seen_lse = unpad_rows(seen.transpose(1, 2), indices), unpad_rows(seen_lse.transpose(1, 2), indices)
        both = torch.logaddexp(lse, seen_lse)
        out = (out.float() * torch.exp(lse - both).unsqueeze(-1)
               + seen.float() * torch.exp(seen_lse - both).unsqueeze(-1)).to(out.dtype)
        return out, both

    return merge
